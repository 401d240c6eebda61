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
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..knobs import Home, Kind, Knob, Memory, register_knobs
from .base import PairTrainer, base_config_keys, register
from .base import field_names as _field_names
from .phases import ClosedForm
from .preference import TOKEN_COLUMNS, PreferenceDataset

if TYPE_CHECKING:
    import torch

    from ..space import Candidate
    from ..workload import GPUSpec, ModelSpec, Workload


class Reference(str, Enum):
    """How the reference model is held during training."""

    SEPARATE_COPY = "separate_copy"  # full fine-tuning: a second model, loaded like the policy
    ADAPTERS_DISABLED = "adapters_disabled"  # LoRA: the policy with its adapters disabled
    PRECOMPUTED = "precomputed"  # precompute_ref_log_probs: log-probs computed before training, no model kept


# the trainers whose config has the reference knobs below (DPOConfig and KTOConfig, the same fields and rules)
REFERENCE_TRAINERS = frozenset({"dpo", "kto"})


def _carried(name: str) -> Callable[[Candidate], Any]:
    return lambda c: c.base.get(name, False)


# DPOConfig's (and KTOConfig's) reference knobs that SFT has no name for, in the knob registry (advisor/knobs.py):
# `--fix`, the default space, the memory order, the report's label and the emitted config key all come from these
# declarations.
KNOBS = register_knobs(
    Knob("precompute_ref_log_probs", Kind.BOOL, False, Home.TRAINER_CONFIG, "precompute_ref_log_probs",
         "DPOTrainer / KTOTrainer computes the reference's log-probs in a no-grad pass over the data before "
         "training and keeps no reference model during it (full fine-tuning; under LoRA the reference is the "
         "policy with its adapters disabled either way)", trainers=REFERENCE_TRAINERS, carried=True,
         search=(False, True),
         # on: no reference copy beside the policy, its gradients and optimizer state; the pass before training
         # holds the weights and one no-grad batch of precompute_ref_batch_size pairs (DPOTrainer.__init__;
         # KTOTrainer's: examples, with their KL batch)
         memory=Memory.SAVES_WHEN_ON, label="precompute_ref_log_probs",
         summary=lambda c: str(_carried("precompute_ref_log_probs")(c)),
         short=lambda c: "ref=precomputed" if _carried("precompute_ref_log_probs")(c) else None),
    Knob("precompute_ref_batch_size", Kind.OPTIONAL_INT, None, Home.TRAINER_CONFIG, "precompute_ref_batch_size",
         "pairs (KTO: examples) per batch of the precompute pass (None: per_device_train_batch_size)", minimum=1,
         trainers=REFERENCE_TRAINERS, carried=True, memory=Memory.GROWS),
    Knob("sync_ref_model", Kind.BOOL, False, Home.TRAINER_CONFIG, "sync_ref_model",
         "TR-DPO: the separate reference copy is updated every ref_model_sync_steps",
         trainers=REFERENCE_TRAINERS, carried=True),
)


class _ReferenceKnobsMethods:
    """A trainer's own memory knobs that SFT has no name for: one field per declaration, read from the candidate's
    base (coerced as declared), written back with the defaults left out."""

    _knobs: tuple[Knob, ...] = ()

    @classmethod
    def of(cls, candidate: Candidate) -> Any:
        b = candidate.base
        return cls(**{k.name: k.coerce(b.get(k.name, k.default))[0] for k in cls._knobs})

    def apply(self, candidate: Candidate) -> Candidate:
        """The candidate with these knobs in its base (defaults left out, so a plain candidate stays plain)."""
        base = candidate.base.as_dict()
        for k in self._knobs:
            value = getattr(self, k.name)
            if value == k.default:
                base.pop(k.name, None)
            else:
                base[k.name] = k.plain(value)
        return candidate.replace(base=base)

    def reference(self, candidate: Candidate) -> Reference:
        if candidate.use_lora:
            return Reference.ADAPTERS_DISABLED
        return Reference.PRECOMPUTED if self.precompute_ref_log_probs else Reference.SEPARATE_COPY

    def precompute_batch(self, candidate: Candidate) -> int:
        return self.precompute_ref_batch_size or candidate.per_device_train_batch_size


def knob_view(name: str, knobs: tuple[Knob, ...], context: str, module: str, bases: tuple[type, ...] = ()) -> type:
    """A frozen dataclass with one field per declaration in `knobs` (one declaration per knob), validated as they
    are (ConfigError in `context`), with `of` / `apply` / `reference` / `precompute_batch`."""

    def check(self: Any) -> None:
        problems = []
        for k in knobs:
            v = getattr(self, k.name)
            if k.kind is Kind.BOOL and not isinstance(v, bool):
                problems.append(f"{k.name}={v!r}: must be true or false")
            elif k.kind is not Kind.BOOL:
                problems.extend(p for p in [k.coerce(v)[1]] if p)
        if problems:
            raise ConfigError(problems, context=context)

    view = dataclasses.make_dataclass(
        name, [(k.name, k.kind.value, dataclasses.field(default=k.default)) for k in knobs],
        bases=(*bases, _ReferenceKnobsMethods), frozen=True,
        namespace={"__post_init__": check, "__module__": module, "_knobs": knobs})
    view.__doc__ = (bases[0] if bases else _ReferenceKnobsMethods).__doc__
    return view


DPOKnobs = knob_view("DPOKnobs", KNOBS, "dpo", __name__)


def dpo_only_keys() -> set[str]:
    from trl import DPOConfig, SFTConfig

    return _field_names(DPOConfig) - _field_names(SFTConfig)


_KNOB_KEYS = {k.key for k in KNOBS}


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
            k = DPOKnobs.of(c)
        except ConfigError as exc:
            return out + exc.problems
        if k.sync_ref_model and c.use_lora:
            out.append("sync_ref_model=True with LoRA: DPOTrainer raises \"sync_ref_model=True while using a PEFT "
                       "model ... not supported\"; set sync_ref_model: false")
        if k.sync_ref_model and k.precompute_ref_log_probs:
            out.append("sync_ref_model=True with precompute_ref_log_probs=True: DPOTrainer raises \"You cannot use "
                       "sync_ref_model=True together with precompute_ref_log_probs=True\"; choose one")
        return out

    def config_kwargs(self, candidate: Candidate, workload: Workload | None = None, *,
                      measured: bool = False) -> dict[str, Any]:
        """Every memory-relevant DPOConfig field, explicitly; then the base's DPOConfig keys (`measured`: only those
        that reach a measured run: TRL's simulated keys and DPO's loss keys, which the simulator runs as written)."""
        from ..emit import model_init_kwargs
        from ..space import Precision

        c = candidate
        k = DPOKnobs.of(c)
        sampling = "group_by_length" if c.group_by_length else c.base.get("train_sampling_strategy", "random")
        out: dict[str, Any] = {
            "max_length": c.max_length,
            "truncation_mode": "keep_start",
            "padding_free": c.padding_free,
            "pad_to_multiple_of": c.pad_to_multiple_of,
            "per_device_train_batch_size": c.per_device_train_batch_size,
            "gradient_accumulation_steps": c.gradient_accumulation_steps,
            "activation_checkpointing": c.activation_checkpointing,
            "activation_checkpointing_kwargs": c.checkpointing_kwargs,
            "activation_offloading": c.activation_offloading,
            "optim": c.optim.value,
            "bf16": c.precision is Precision.BF16,
            "fp16": c.precision is Precision.FP16,
            "train_sampling_strategy": sampling,
            "use_liger_kernel": False,
            **{kn.key: getattr(k, kn.name) for kn in KNOBS},  # its own knobs, each declared once (KNOBS)
            "model_init_kwargs": model_init_kwargs(c, measured=measured),
        }
        out.update(base_config_keys(c, _field_names(self.config_class()), measured=measured, own=dpo_only_keys(),
                                    skip=_KNOB_KEYS))
        return out

    def run_config_dict(self, candidate: Candidate, *, model_name_or_path: str | None,
                        dataset_name: str | None = None, workload: Workload | None = None) -> dict[str, Any]:
        """The keys `trl dpo --config FILE` accepts: ScriptArguments, DPOConfig and ModelConfig, and `env:`."""
        from .base import run_config_for

        return run_config_for(self, candidate, model_name_or_path=model_name_or_path, dataset_name=dataset_name,
                              output_dir="advisor-dpo", workload=workload)

    def candidate_from_run_dict(self, data: Mapping[str, Any], *, source: str = "config") -> Candidate:
        """A `trl dpo` config read into a Candidate: the shared keys as advisor.emit reads them, DPO's own keys
        in the base (DPOKnobs among them)."""
        from ..emit import candidate_from_run_dict

        self.check_run_keys(data, source=source)
        dpo_only = dpo_only_keys()
        shared = {k: v for k, v in data.items() if k not in dpo_only}
        own = {k: v for k, v in data.items() if k in dpo_only}
        cand = candidate_from_run_dict(shared, source=source)
        if cand.base.get("output_dir") == "advisor-dpo":
            base = cand.base.as_dict()
            base.pop("output_dir")
            cand = cand.replace(base=base)
        cand = cand.replace(base={**cand.base.as_dict(), **own})
        try:
            knobs = DPOKnobs.of(cand)
        except ConfigError as exc:
            raise ConfigError(exc.problems, context=source) from None
        return knobs.apply(cand)

    # ---- data ----------------------------------------------------------------------------------------------------
    def worst_rows(self, workload: Workload, candidate: Candidate) -> list[dict]:
        """The pairs of the longest micro-batch (enough for the precompute pass's batch too): the longest of
        prompt + chosen and prompt + rejected after truncation, among the pairs TRL keeps."""
        import numpy as np

        data: PreferenceDataset = workload.dataset
        cap = candidate.max_length
        n = max(candidate.per_device_train_batch_size, DPOKnobs.of(candidate).precompute_batch(candidate))
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
        def _precompute_ref_logps(self, dataset, name, batch_size):
            # Deferred to the fake run (DPO.before_train): the weights are meta here. The columns TRL adds are added
            # with the values' type, so the collator builds the same batch.
            self._advisor_precompute = (dataset, batch_size)
            n = len(dataset)
            return dataset.add_column("ref_chosen_logps", [0.0] * n).add_column("ref_rejected_logps", [0.0] * n)

        return {
            "create_accelerator_and_postprocess": no_device_placement,
            "_precompute_ref_logps": _precompute_ref_logps,
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
            import torch

            model = trainer.ref_model or trainer.model
            chosen, rejected = trainer.compute_ref_log_probs(model, batch)
            kept = [(chosen.cpu(), rejected.cpu())]
            torch.cat([c for c, _ in kept]), torch.cat([r for _, r in kept])

        return [(real, run)]

    def phases(self, candidate: Candidate) -> tuple:
        """One training phase; the reference resident beside the policy when it is a separate copy (LoRA runs the
        policy with its adapters disabled; precompute_ref_log_probs keeps no model)."""
        from .phases import Resident, training_phase

        ref = DPOKnobs.of(candidate).reference(candidate)
        return (training_phase(Resident.REFERENCE) if ref is Reference.SEPARATE_COPY else training_phase(),)

    closed_form = ClosedForm.PAIRS_WITH_REFERENCE  # the SFT closed form of the 2B sequences, plus the reference

    def report_rows(self, candidate: Candidate) -> list[list[str]]:
        """The trainer, and how the reference is held (derived: LoRA, precompute_ref_log_probs)."""
        k = DPOKnobs.of(candidate)
        return [*super().report_rows(candidate), ["reference", k.reference(candidate).value.replace("_", " ")]]

    def notes(self, candidate: Candidate) -> list[str]:
        k = DPOKnobs.of(candidate)
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


def _longest_pairs(dataset: Any, n: int, max_length: int | None) -> list[dict]:
    lengths = [max(len(p) + len(c), len(p) + len(r)) for p, c, r in
               zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"], strict=True)]
    if max_length:
        lengths = [min(x, max_length) for x in lengths]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:n]
    keep = (*TOKEN_COLUMNS, "ref_chosen_logps", "ref_rejected_logps")
    return [{k: v for k, v in dataset[i].items() if k in keep} for i in order]


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
    import importlib

    import torch

    from ..modeling import build_model
    from ..space import WeightsDtype

    dt = importlib.import_module(module)

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
