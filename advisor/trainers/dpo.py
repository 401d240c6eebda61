"""DPO: `trl.DPOTrainer` / `trl.DPOConfig`, parsed by `trl dpo`.

DPO's memory is not SFT's: each micro-batch of B pairs runs 2B sequences (prompt + chosen and prompt + rejected,
concatenated, padded to the longest, each truncated to `max_length`) through the policy, and through the
reference under `no_grad`: a second copy of the weights (full fine-tuning), the policy itself with its adapters
disabled (LoRA), or nothing during training with `precompute_ref_log_probs` (a no-grad pass over the data before
training, `precompute_ref_batch_size` pairs at a time). The simulator runs DPOTrainer's own `_compute_loss`, the
reference forward and the precompute pass included, on fake tensors. `padding_free` is accepted and, as TRL 1.16
does, falls back to padding (DPOTrainer warns "temporarily unavailable").

The DPO-only knobs live on `DPOKnobs`, carried in the Candidate's base under their DPOConfig names (so a
Candidate carries them without a field of its own and a YAML reads back to the same candidate).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError
from ..knobs import Home, Kind, Knob, KnobView, Memory, knob_view
from ..modeling import build_model
from ..space import WeightsDtype
from .base import PairTrainer, own_keys, register
from .preference import TOKEN_COLUMNS
from .protocol import StepShape

if TYPE_CHECKING:
    import torch

    from ..space import Candidate
    from ..workload import GPUSpec, ModelSpec, Workload
    from .preference import PreferenceDataset


class Reference(str, Enum):
    """How the reference model is held during training."""

    SEPARATE_COPY = "separate_copy"  # full fine-tuning: a second model, loaded like the policy
    ADAPTERS_DISABLED = "adapters_disabled"  # LoRA: the policy with its adapters disabled
    PRECOMPUTED = "precomputed"  # precompute_ref_log_probs: log-probs computed before training, no model kept


def _carried(name: str) -> Callable[[Candidate], Any]:
    return lambda c: c.base.get(name, False)


# DPOConfig's memory knobs that SFT has no name for (registered in the knob registry with the trainer): `--fix`, the
# default space, the memory order, the report's label and the emitted DPOConfig key all come from these.
KNOBS = (
    Knob("precompute_ref_log_probs", Kind.BOOL, False, Home.TRAINER_CONFIG, "precompute_ref_log_probs",
         "DPOTrainer computes the reference's log-probs in a no-grad pass over the data before training and keeps "
         "no reference model during it (full fine-tuning; under LoRA the reference is the policy with its adapters "
         "disabled either way)", carried=True, search=(False, True),
         # on: no reference copy beside the policy, its gradients and optimizer state; the pass before training
         # holds the weights and one no-grad batch of precompute_ref_batch_size pairs (DPOTrainer.__init__)
         memory=Memory.SAVES_WHEN_ON, label="precompute_ref_log_probs",
         summary=lambda c: str(_carried("precompute_ref_log_probs")(c)),
         short=lambda c: "ref=precomputed" if _carried("precompute_ref_log_probs")(c) else None),
    Knob("precompute_ref_batch_size", Kind.OPTIONAL_INT, None, Home.TRAINER_CONFIG, "precompute_ref_batch_size",
         "pairs per batch of the precompute pass (None: per_device_train_batch_size)", minimum=1, carried=True,
         memory=Memory.GROWS),
    Knob("sync_ref_model", Kind.BOOL, False, Home.TRAINER_CONFIG, "sync_ref_model",
         "TR-DPO: the separate reference copy is updated every ref_model_sync_steps", carried=True),
)


class ReferenceKnobMethods(KnobView):
    """DPOConfig's memory knobs that SFT has no name for: one field per declaration in KNOBS; how the reference is
    held (KTO's view derives from this too: KTOConfig has the same reference knobs and rules)."""

    CONTEXT = "dpo"

    def reference(self, candidate: Candidate) -> Reference:
        if candidate.use_lora:
            return Reference.ADAPTERS_DISABLED
        return Reference.PRECOMPUTED if self.precompute_ref_log_probs else Reference.SEPARATE_COPY

    def precompute_batch(self, candidate: Candidate) -> int:
        return self.precompute_ref_batch_size or candidate.per_device_train_batch_size


DPOKnobs = knob_view("DPOKnobs", KNOBS, ReferenceKnobMethods, __name__)


def prepared_as_is(self, dataset, processing_class, args, dataset_name):
    """DPOTrainer._prepare_dataset for rows already prepared by it (advisor.trainers.preference): only its last
    step, dropping pairs whose prompt alone fills `max_length` under `keep_start` truncation."""
    if args.max_length is not None and args.truncation_mode == "keep_start":
        return dataset.filter(lambda example: len(example["prompt_ids"]) < args.max_length)
    return dataset


class DPO(PairTrainer):
    """Direct preference optimisation on prompt / chosen / rejected pairs (preference.PreferenceDataset)."""

    name = "dpo"
    command = "dpo"
    config_name, trainer_name, config_label = "DPOConfig", "DPOTrainer", "DPO"
    knob_view = DPOKnobs
    # padding_free: DPOConfig has it, but DPOTrainer 1.16 warns and falls back to padding, so searching it measures
    # one run twice; pad_to_multiple_of: DPO concatenates chosen and rejected to the longer
    space_holds = PairTrainer.space_holds | {"padding_free"}

    # ---- rules, config ------------------------------------------------------------------------------------------
    def problems(self, candidate: Candidate, gpu: GPUSpec | None = None, model: ModelSpec | None = None
                 ) -> list[str]:
        """The shared rules (with SFT's packing / padding-free rules left out: DPO has neither rule), then DPO's."""
        c = candidate
        out = c.replace(packing=False, padding_free=False).problems(gpu, model)
        if c.packing:
            out.append("packing=True: `packing` is an SFT-only key (DPOConfig has no packing; DPOTrainer pads each "
                       "batch of pairs); remove it")
        try:
            k = self.knobs(c)
        except ConfigError as exc:
            return out + exc.problems
        return out + reference_problems(k, c, self.trainer_name)

    def candidate_from_run_dict(self, data: Mapping[str, Any], *, source: str = "config") -> Candidate:
        """A `trl dpo` config read into a Candidate: the shared keys as advisor/runconfig reads them, DPO's own keys
        in the base (DPOKnobs among them)."""
        self.check_run_keys(data, source=source)
        dpo_only = own_keys(self)
        cand = self.read_config({k: v for k, v in data.items() if k not in dpo_only},
                                {k: v for k, v in data.items() if k in dpo_only}, source=source)
        try:
            knobs = self.knobs(cand)
        except ConfigError as exc:
            raise ConfigError(exc.problems, context=source) from None
        return knobs.apply(cand)

    # ---- data ----------------------------------------------------------------------------------------------------
    def worst_rows(self, workload: Workload, candidate: Candidate) -> list[dict]:
        """The pairs of the longest micro-batch (enough for the precompute pass's batch too): the longest of
        prompt + chosen and prompt + rejected after truncation, among the pairs TRL keeps."""

        data: PreferenceDataset = workload.dataset
        cap = candidate.max_length
        n = max(candidate.per_device_train_batch_size, self.knobs(candidate).precompute_batch(candidate))
        kept = data.kept(cap)
        longest = data.lengths[kept]
        if cap:
            longest = np.minimum(longest, cap)
        order = [int(kept[i]) for i in np.argsort(-longest, kind="stable")[:n]]
        return [data.rows[i] for i in order]

    def worst_batch(self, trainer: Any, batch_size: int) -> dict[str, torch.Tensor]:
        """The B pairs that pad longest (their longer sequence, truncated), through TRL's own collator."""
        return trainer.data_collator(_longest_pairs(trainer.train_dataset, batch_size, trainer.args.max_length))

    def labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """As DPOTrainer._compute_loss builds them: the completion tokens of chosen and rejected."""
        return batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)

    # ---- the fake step's hooks -------------------------------------------------------------------------------------
    def real_overrides(self) -> dict[str, Callable]:
        return {"_prepare_dataset": prepared_as_is}

    def fake_overrides(self) -> dict[str, Callable]:
        return {
            "create_accelerator_and_postprocess": no_device_placement,
            "_precompute_ref_logps": deferred_precompute(lambda trainer: ("ref_chosen_logps", "ref_rejected_logps")),
        }

    def construction(self, spec: ModelSpec, candidate: Candidate) -> contextlib.AbstractContextManager:
        return meta_construction(spec, candidate, "trl.trainer.dpo_trainer")

    def extra_models(self, trainer: Any) -> list:
        return [trainer.ref_model] if getattr(trainer, "ref_model", None) is not None else []

    def before_train(self, trainer: Any) -> list[tuple[dict, Callable[[dict], None]]]:
        """DPOTrainer's precompute pass (`_precompute_ref_logps`, run by its __init__ before training): the no-grad
        reference forward of its longest batch of `precompute_ref_batch_size` pairs, the log-probs moved to the
        host and concatenated. Its other batches are no longer and are freed in turn (the notes say so)."""
        pending = getattr(trainer, "_advisor_precompute", None)
        if pending is None:
            return []
        trainer._advisor_precompute = None
        dataset, batch_size = pending
        real = trainer.data_collator(_longest_pairs(dataset, batch_size, trainer.args.max_length))

        def run(batch: dict) -> None:
            import torch  # lazy: loads torch

            model = trainer.ref_model or trainer.model
            chosen, rejected = trainer.compute_ref_log_probs(model, batch)
            kept = [(chosen.cpu(), rejected.cpu())]
            torch.cat([c for c, _ in kept]), torch.cat([r for _, r in kept])

        return [(real, run)]

    def step_shape(self, candidate: Candidate) -> StepShape:
        """2B sequences a micro-batch of B pairs; the reference: a separate copy resident and its no-grad forward
        (full fine-tuning), the forward only (LoRA: the policy with its adapters disabled), or neither
        (precompute_ref_log_probs: computed before training)."""
        ref = self.knobs(candidate).reference(candidate)
        return StepShape(sequences_per_row=2, reference_copy=ref is Reference.SEPARATE_COPY,
                         reference_forward=ref is not Reference.PRECOMPUTED,
                         reference_precomputed=ref is Reference.PRECOMPUTED)

    def report_rows(self, candidate: Candidate) -> list[list[str]]:
        """The trainer, and how the reference is held (derived: LoRA, precompute_ref_log_probs)."""
        k = self.knobs(candidate)
        return [*super().report_rows(candidate), ["reference", k.reference(candidate).value.replace("_", " ")]]

    def notes(self, candidate: Candidate, workload: Workload | None = None) -> list[str]:
        k = self.knobs(candidate)
        ref = k.reference(candidate)
        out = [f"dpo: DPOTrainer's own step on fake tensors (2B sequences a micro-batch of B pairs); the reference: "
               f"{ref.value.replace('_', ' ')}; time: the worst batch's step (the batch distribution is modelled "
               "for SFT)"]
        if ref is Reference.PRECOMPUTED:
            out.append(f"precompute_ref_log_probs: TRL's precompute pass simulated on its longest batch of "
                       f"{k.precompute_batch(candidate)} pairs (the others are no longer and are freed in turn)")
        if candidate.padding_free:
            out.append("padding_free=True: DPOTrainer 1.16 warns and falls back to padding; simulated as it runs")
        return out


def reference_problems(k: Any, c: Candidate, trainer_name: str) -> list[str]:
    """TRL's rules on the reference knobs (DPOTrainer's and KTOTrainer's __init__ alike)."""
    out = []
    if k.sync_ref_model and c.use_lora:
        out.append(f"sync_ref_model=True with LoRA: {trainer_name} raises \"sync_ref_model=True while using a PEFT "
                   "model ... not supported\"; set sync_ref_model: false")
    if k.sync_ref_model and k.precompute_ref_log_probs:
        out.append(f"sync_ref_model=True with precompute_ref_log_probs=True: {trainer_name} raises \"You cannot use "
                   "sync_ref_model=True together with precompute_ref_log_probs=True\"; choose one")
    return out


def _longest_pairs(dataset: Any, n: int, max_length: int | None) -> list[dict]:
    lengths = [max(len(p) + len(c), len(p) + len(r)) for p, c, r in
               zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"], strict=True)]
    if max_length:
        lengths = [min(x, max_length) for x in lengths]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:n]

    keep = (*TOKEN_COLUMNS, "ref_chosen_logps", "ref_rejected_logps")
    return [{k: v for k, v in dataset[i].items() if k in keep} for i in order]


def deferred_precompute(columns: Callable[[Any], tuple[str, ...]]) -> Callable:
    """A preference trainer's `_precompute_ref_logps(dataset, name, batch_size)` for the fake run: deferred to
    `before_train` (the weights are meta at construction); the columns TRL adds (`columns(trainer)`) are added with
    the values' type, so the collator builds the same batch."""

    def _precompute_ref_logps(self, dataset, name, batch_size):
        self._advisor_precompute = (dataset, batch_size)
        n = len(dataset)
        for column in columns(self):
            dataset = dataset.add_column(column, [0.0] * n)
        return dataset

    return _precompute_ref_logps


def no_device_placement(self: Any) -> None:
    """The fake trainer's `create_accelerator_and_postprocess`: the reference is prepared in __init__
    (accelerator.prepare_model), and its meta weights cannot be moved."""
    type(self).__mro__[1].create_accelerator_and_postprocess(self)
    self.accelerator.device_placement = False


@contextlib.contextmanager
def meta_construction(spec: ModelSpec, candidate: Candidate, module: str) -> Iterator[None]:
    """A reference trainer's __init__ (`module`: DPOTrainer's or KTOTrainer's) on a meta policy: its reference is
    built as TRL builds it (`create_model_from_path` with the policy's dtype and attention implementation), on meta;
    `hash_module` (the precompute cache's key) cannot read meta weights."""
    import torch  # lazy: loads torch

    dt = importlib.import_module(module)  # start-up: TRL loaded on first use

    def reference(model_id: str, architecture: Any = None, **kwargs: Any):
        dtype = kwargs.get("dtype", "float32")
        name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else str(dtype)
        changes: dict[str, Any] = {"weights_dtype": WeightsDtype(name)}
        attn = kwargs.get("attn_implementation")
        if attn is not None:
            changes["attn_implementation"] = attn
        return build_model(spec, candidate.replace(**changes), device="meta")

    saved = (dt.create_model_from_path, dt.hash_module)
    dt.create_model_from_path = reference
    dt.hash_module = lambda _module: "advisor-meta"
    try:
        yield
    finally:
        dt.create_model_from_path, dt.hash_module = saved


DPO_TRAINER = register(DPO())
