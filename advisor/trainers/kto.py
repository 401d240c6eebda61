"""KTO: `trl.KTOTrainer` / `trl.KTOConfig`, parsed by `trl kto`.

KTO trains on unpaired examples (prompt, completion, label: desirable or not; unpaired.UnpairedDataset). Each
micro-batch of B examples runs, in this order (KTOTrainer._compute_loss): the policy under `no_grad` on the KL batch
(the same prompts with the micro-batch's completions rotated by one, built when the data is prepared:
`add_kl_completion_ids`), the policy with gradients on the B examples (prompt + completion, truncated from the right
at `max_length`, padded to the longest, `pad_to_multiple_of` rounding), then the reference under `no_grad` on the KL
batch and on the examples, while the policy's activations are held. The reference is held as DPO's: a separate copy
(full fine-tuning), the policy with its adapters disabled (LoRA), or precomputed (`precompute_ref_log_probs`: a
no-grad pass over the data before training, `precompute_ref_batch_size` examples with their KL batch at a time). With
`loss_type: apo_zero_unpaired` there is no KL term and no KL batch. The simulator runs KTOTrainer's own
`_compute_loss`, the KL and reference forwards and the precompute pass included, on fake tensors.

TRL's rules for loss_type "kto" (KTOTrainer.__init__): `per_device_train_batch_size` > 1 (the KL term comes from
the micro-batch's other examples) and `train_sampling_strategy: sequential` (KTOConfig's default; the KL batch was
built for that order). The reference knobs (precompute_ref_log_probs, precompute_ref_batch_size, sync_ref_model)
are DPO's declarations (advisor/trainers/dpo.py), in both trainers' views; `loss_type` is KTO's own, carried in
the candidate's base under its KTOConfig name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..knobs import Home, Kind, Knob, knob_view
from . import dpo
from .base import PairTrainer, TrlTrainer, own_keys, register
from .dpo import Reference
from .protocol import StepShape
from .unpaired import UnpairedDataset, check_unpaired_rows, load_unpaired, unpaired_length_report

if TYPE_CHECKING:
    import datasets
    import torch

    from ..space import Candidate
    from ..workload import GPUSpec, ModelSpec, Workload


class KTOLoss(str, Enum):
    """KTOConfig `loss_type`."""

    KTO = "kto"  # the KTO loss, with its KL term estimated from the KL batch
    APO_ZERO_UNPAIRED = "apo_zero_unpaired"  # no KL term: no KL batch


# KTOConfig's loss (registered in the knob registry with the trainer); the reference knobs are dpo.KNOBS
KNOBS = (
    Knob("loss_type", Kind.ENUM, KTOLoss.KTO, Home.TRAINER_CONFIG, "loss_type",
         "kto: each step also runs the KL batch (the micro-batch's prompts with its completions rotated by one) "
         "through the policy and the reference under no_grad; apo_zero_unpaired: no KL term, no KL batch (and any "
         "train_sampling_strategy). A choice of loss, never searched: --fix or the config", enum=KTOLoss,
         carried=True, label="loss_type",
         summary=lambda c: str(c.base.get("loss_type", KTOLoss.KTO.value)),
         short=lambda c: None if c.base.get("loss_type", "kto") == "kto" else "apo-zero"),
)


class _KTOKnobsMethods(dpo.ReferenceKnobMethods):
    """KTOConfig's memory knobs that SFT has no name for: the reference knobs (DPO's declarations) and loss_type."""

    CONTEXT = "kto"

    @property
    def kl(self) -> bool:
        """The step runs a KL batch (KTOTrainer.calculate_KL: every loss but apo_zero_unpaired)."""
        return KTOLoss(self.loss_type) is KTOLoss.KTO


KTOKnobs = knob_view("KTOKnobs", (*dpo.KNOBS, *KNOBS), _KTOKnobsMethods, __name__)

_DEFAULT_SAMPLING = "sequential"  # KTOConfig's train_sampling_strategy


def prepared_as_is(self, dataset, processing_class, args, dataset_name):
    """KTOTrainer._prepare_dataset for examples already tokenized by it (advisor.trainers.unpaired): its steps that
    depend on the run's config, as TRL runs them: drop the examples whose prompt alone fills `max_length`, then (a
    KL loss) rotate the completions by one within each batch of `per_device_train_batch_size`."""
    if args.max_length is not None:
        dataset = dataset.filter(lambda example: len(example["prompt_ids"]) < args.max_length)
    if self.calculate_KL:
        def add_kl_completion_ids(examples):
            examples["KL_completion_ids"] = [examples["completion_ids"][-1]] + examples["completion_ids"][:-1]
            return examples

        dataset = dataset.map(add_kl_completion_ids, batched=True, batch_size=args.per_device_train_batch_size)
    return dataset


_BATCH_COLUMNS = ("prompt_ids", "completion_ids", "KL_completion_ids", "label", "ref_logps", "ref_KL_logps")


def _first(dataset: Any, n: int) -> list[dict]:
    """The first `n` examples of a prepared dataset (the advisor orders them longest first), as the collator takes
    them: the first micro-batch of TRL's sequential sampler, its KL completions rotated within it."""
    return [{k: v for k, v in dataset[i].items() if k in _BATCH_COLUMNS} for i in range(min(n, len(dataset)))]


class KTO(PairTrainer):
    """Kahneman-Tversky optimisation on unpaired examples (unpaired.UnpairedDataset)."""

    name = "kto"
    command = "kto"
    config_name, trainer_name, config_label = "KTOConfig", "KTOTrainer", "KTO"
    example_dataset = "trl-lib/kto-mix-14k"
    data_hint = "your prompt/completion/label examples"
    knob_view = KTOKnobs
    space_adds = frozenset()  # no packing: KTOConfig has none

    # ---- rules, config ------------------------------------------------------------------------------------------
    def problems(self, candidate: Candidate, gpu: GPUSpec | None = None, model: ModelSpec | None = None
                 ) -> list[str]:
        """The shared rules (SFT's packing / padding-free rules left out: KTOConfig has neither key), then KTO's."""
        c = candidate
        out = c.replace(packing=False, padding_free=False).problems(gpu, model)
        for key, value in (("packing", c.packing), ("padding_free", c.padding_free)):
            if value:
                out.append(f"{key}=True: `{key}` is an SFT-only key (KTOConfig has none; KTOTrainer pads each "
                           "micro-batch of examples); remove it")
        try:
            k = self.knobs(c)
        except ConfigError as exc:
            return out + exc.problems
        out += dpo.reference_problems(k, c, self.trainer_name)
        if k.kl and c.per_device_train_batch_size <= 1:
            out.append(f"per_device_train_batch_size={c.per_device_train_batch_size} with loss_type=kto: KTOTrainer "
                       "raises \"Actual (not effective) batch size must be > 1\" (the KL term pairs each prompt with "
                       "another example's completion of the micro-batch); use 2 or more, or "
                       "loss_type=apo_zero_unpaired")
        sampling = _sampling(c)
        if k.kl and sampling != _DEFAULT_SAMPLING:
            out.append(f"train_sampling_strategy={sampling} with loss_type=kto: KTOTrainer raises \"requires "
                       "train_sampling_strategy='sequential'\" (each micro-batch's KL completions were built for the "
                       "dataset's order); use sequential (KTOConfig's default)")
        return out

    def config_extras(self, candidate: Candidate, workload: Workload | None, *, measured: bool) -> dict[str, Any]:
        """train_sampling_strategy as KTOConfig defaults it (sequential), not TrainingArguments' random."""
        return {"train_sampling_strategy": _sampling(candidate)}

    def candidate_from_run_dict(self, data: Mapping[str, Any], *, source: str = "config") -> Candidate:
        """A `trl kto` config read into a Candidate: the shared keys as advisor/runconfig reads them, KTO's own keys in
        the base (KTOKnobs among them); `train_sampling_strategy` as KTOConfig defaults it (sequential)."""
        self.check_run_keys(data, source=source)
        kto_only = own_keys(self) | {k.key for k in KNOBS}
        shared = {k: v for k, v in data.items() if k not in kto_only}
        own = {k: v for k, v in data.items() if k in kto_only}
        sampling = shared.get("train_sampling_strategy")
        if sampling is not None and sampling != "group_by_length":  # the shared reader's default is another (random)
            shared.pop("train_sampling_strategy")
            if sampling != _DEFAULT_SAMPLING:
                own["train_sampling_strategy"] = sampling
        cand = self.read_config(shared, own, source=source)
        try:
            knobs = self.knobs(cand)
        except ConfigError as exc:
            raise ConfigError(exc.problems, context=source) from None
        return knobs.apply(cand)

    # ---- data ----------------------------------------------------------------------------------------------------
    def max_length_values(self, workload: Workload) -> tuple[int, ...]:
        return TrlTrainer.max_length_values(self, workload)  # over the examples (not PairTrainer's pairs)

    def load_dataset(self, spec: str | None, model: ModelSpec, tokenizer: str | None = None, *,
                     sample: int | None = None, seed: int = 0, progress: bool = False) -> Any:
        return load_unpaired(spec, model, tokenizer, trainer=self.name, sample=sample, seed=seed)

    def check_dataset(self, workload: Workload) -> None:
        data = workload.dataset
        if not isinstance(data, UnpairedDataset):
            check_unpaired_rows(list(data.rows[:1]), data.name, self.name)

    def dataset_from_rows(self, name: str, source: str, rows: tuple[dict, ...], *, dataset_name: str | None = None,
                          completion_only_loss: bool | None = None) -> Any:
        return UnpairedDataset(name=name, source=source, rows=rows, dataset_name=dataset_name)

    def kept_rows(self, workload: Workload, candidate: Candidate) -> Any:
        """The examples KTOTrainer keeps: not those whose prompt alone fills max_length."""
        return workload.dataset.kept(candidate.max_length)

    def worst_rows(self, workload: Workload, candidate: Candidate) -> list[dict]:
        """The examples of the longest micro-batch, longest first (prompt + completion after truncation, among the
        examples TRL keeps), enough for the precompute pass's batch too. TRL's sequential sampler takes them as one
        micro-batch, and its KL batch rotates their completions, as the probe's first steps run them."""
        data: UnpairedDataset = workload.dataset
        n = max(candidate.per_device_train_batch_size, self.knobs(candidate).precompute_batch(candidate))
        return [data.rows[i] for i in data.longest(n, candidate.max_length)]

    def worst_batch(self, trainer: Any, batch_size: int) -> dict[str, torch.Tensor]:
        """The first micro-batch of the prepared examples (the longest), through TRL's own collator: the examples
        and their KL batch."""
        return trainer.data_collator(_first(trainer.train_dataset, batch_size))

    def train_dataset(self, workload: Workload, rows: list[dict] | None = None) -> datasets.Dataset:
        return workload.dataset.to_hf(rows)

    def labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """As KTOTrainer._compute_loss builds them for the trained forward: the completion tokens."""
        return batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)

    # ---- the step: what the estimate counts, the fake step's hooks ---------------------------------------------------
    def step_shape(self, candidate: Candidate) -> StepShape:
        """B sequences a micro-batch of B examples; with loss_type kto, the KL batch (as many sequences, bounded by
        the same max_length) through the policy under no_grad before its trained forward; the reference: a separate
        copy resident and its no-grad forwards of the examples (and the KL batch) while the policy's activations
        are held (full fine-tuning), the forwards only (LoRA: the adapters disabled), or neither (precomputed)."""
        k = self.knobs(candidate)
        ref = k.reference(candidate)
        return StepShape(reference_copy=ref is Reference.SEPARATE_COPY,
                         reference_forward=ref is not Reference.PRECOMPUTED,
                         reference_precomputed=ref is Reference.PRECOMPUTED,
                         no_grad_batches=int(k.kl), reference_held=True)

    def real_overrides(self) -> dict[str, Callable]:
        return {"_prepare_dataset": prepared_as_is}

    def fake_overrides(self) -> dict[str, Callable]:
        def columns(trainer) -> tuple[str, ...]:
            return ("ref_logps", "ref_KL_logps") if trainer.calculate_KL else ("ref_logps",)

        return {"create_accelerator_and_postprocess": dpo.no_device_placement,
                "_precompute_ref_logps": dpo.deferred_precompute(columns)}

    def construction(self, spec: ModelSpec, candidate: Candidate) -> contextlib.AbstractContextManager:
        return dpo.meta_construction(spec, candidate, "trl.trainer.kto_trainer")

    def extra_models(self, trainer: Any) -> list:
        return [trainer.ref_model] if getattr(trainer, "ref_model", None) is not None else []

    def before_train(self, trainer: Any) -> list[tuple[dict, Callable[[dict], None]]]:
        """KTOTrainer's precompute pass (`_precompute_ref_logps`, run by its __init__ before training): the no-grad
        reference forwards (examples and KL batch) of its first batch of `precompute_ref_batch_size` examples (the
        longest), the log-probs moved to the host and concatenated. Its other batches are no longer and are freed
        in turn (the notes say so)."""
        pending = getattr(trainer, "_advisor_precompute", None)
        if pending is None:
            return []
        trainer._advisor_precompute = None
        dataset, batch_size = pending
        real = trainer.data_collator(_first(dataset, batch_size))

        def run(batch: dict) -> None:
            import torch  # lazy: loads torch

            model = trainer.ref_model or trainer.model
            ref_logps, ref_kl_logps = [], []
            logps, kl_logps = trainer.compute_ref_log_probs(model, batch)
            if kl_logps is not None:
                ref_kl_logps.append(kl_logps.cpu())
            ref_logps.append(logps.cpu())
            torch.cat(ref_logps)
            if ref_kl_logps:
                torch.cat(ref_kl_logps)

        return [(real, run)]

    # ---- the notes and the report ------------------------------------------------------------------------------------
    def length_report(self, data: Any, request: Any) -> Any:
        """The examples' lengths, the label balance, and for each max_length the completion tokens it cuts off and
        the examples it drops (advisor/trainers/unpaired.py)."""
        return unpaired_length_report(data, request)

    def report_rows(self, candidate: Candidate) -> list[list[str]]:
        """The trainer, its own knobs, and how the reference is held (derived: LoRA, precompute_ref_log_probs)."""
        k = self.knobs(candidate)
        return [*super().report_rows(candidate), ["reference", k.reference(candidate).value.replace("_", " ")]]

    def notes(self, candidate: Candidate, workload: Workload | None = None) -> list[str]:
        k = self.knobs(candidate)
        ref = k.reference(candidate)
        kl = ("the KL batch (its completions rotated by one) through the policy and the reference under no_grad"
              if k.kl else "no KL batch (loss_type apo_zero_unpaired)")
        out = [f"kto: KTOTrainer's own step on fake tensors (a micro-batch of B examples, {kl}); the reference: "
               f"{ref.value.replace('_', ' ')}; the micro-batch: the longest examples, as TRL's sequential sampler "
               "takes them in one batch; time: the worst batch's step (the batch distribution is modelled for SFT)"]
        if ref is Reference.PRECOMPUTED:
            out.append(f"precompute_ref_log_probs: TRL's precompute pass simulated on its longest batch of "
                       f"{k.precompute_batch(candidate)} examples (the others are no longer and are freed in turn)")
        return out


def _sampling(c: Candidate) -> str:
    return "group_by_length" if c.group_by_length else c.base.get("train_sampling_strategy", _DEFAULT_SAMPLING)


KTO_TRAINER = register(KTO())
