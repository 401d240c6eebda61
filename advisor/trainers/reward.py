"""Reward models: `trl.RewardTrainer` / `trl.RewardConfig`, parsed by `trl reward`.

A reward model is the base model with a one-output classification head (AutoModelForSequenceClassification,
`num_labels=1`); each micro-batch of B pairs runs 2B sequences (prompt + chosen, then prompt + rejected, padded
to the longest, `pad_to_multiple_of` rounding) through it, and the loss compares the two scores. RewardConfig
does not truncate: `max_length` drops the pairs with a longer sequence (RewardTrainer._prepare_dataset). LoRA
trains adapters plus the score head (PEFT's SEQ_CLS task saves it). The simulator runs RewardTrainer's own step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .base import PairTrainer, base_config_keys, register
from .base import field_names as _field_names
from .phases import ClosedForm
from .preference import PreferenceDataset

if TYPE_CHECKING:
    import datasets
    import torch

    from ..space import Candidate
    from ..workload import GPUSpec, ModelSpec, Workload

# RewardConfig's own keys that reach a measured run as written (the loss)
_OWN_KEYS = frozenset({"center_rewards_coefficient", "disable_dropout"})


class Reward(PairTrainer):
    """Reward modelling on prompt / chosen / rejected pairs (preference.PreferenceDataset)."""

    name = "reward"
    command = "reward"
    config_name, trainer_name, config_label = "RewardConfig", "RewardTrainer", "reward"
    processing_class_loader = "AutoTokenizer"  # RewardTrainer.__init__ with processing_class=None

    # ---- rules, config ------------------------------------------------------------------------------------------
    def problems(self, candidate: Candidate, gpu: GPUSpec | None = None, model: ModelSpec | None = None
                 ) -> list[str]:
        c = candidate
        out = c.replace(packing=False, padding_free=False).problems(gpu, model)
        if c.packing:
            out.append("packing=True: `packing` is an SFT-only key (RewardConfig has none; RewardTrainer pads each "
                       "batch of pairs); remove it")
        if c.padding_free:
            out.append("padding_free=True: RewardConfig has no `padding_free` (RewardTrainer pads each batch of "
                       "pairs); remove it")
        return out

    def config_kwargs(self, candidate: Candidate, workload: Workload | None = None, *,
                      measured: bool = False) -> dict[str, Any]:
        from ..emit import model_init_kwargs
        from ..space import Precision

        c = candidate
        sampling = "group_by_length" if c.group_by_length else c.base.get("train_sampling_strategy", "random")
        out: dict[str, Any] = {
            "max_length": c.max_length,
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
            "model_init_kwargs": model_init_kwargs(c, measured=measured),
        }
        out.update(base_config_keys(c, _field_names(self.config_class()), measured=measured, own=_OWN_KEYS))
        return out

    def run_config_dict(self, candidate: Candidate, *, model_name_or_path: str | None,
                        dataset_name: str | None = None, workload: Workload | None = None) -> dict[str, Any]:
        """The keys `trl reward --config FILE` accepts; LoRA with `lora_task_type: SEQ_CLS` (the score head)."""
        from .base import run_config_for

        return run_config_for(self, candidate, model_name_or_path=model_name_or_path, dataset_name=dataset_name,
                              output_dir="advisor-reward",
                              model_extra={"lora_task_type": "SEQ_CLS"} if candidate.use_lora else None,
                              workload=workload)

    def candidate_from_run_dict(self, data: Mapping[str, Any], *, source: str = "config") -> Candidate:
        """A `trl reward` config read back: the shared keys as advisor.emit reads them, with what this trainer
        emits itself accepted (`lora_task_type: SEQ_CLS` under LoRA, the default output_dir) and its own keys in
        the base. Another LoRA task type is refused by name."""
        from ..emit import candidate_from_run_dict
        from ..errors import ConfigError

        shared = {k: v for k, v in data.items() if k not in _OWN_KEYS}
        own = {k: v for k, v in data.items() if k in _OWN_KEYS}
        task = shared.pop("lora_task_type", None)
        if task not in (None, "SEQ_CLS"):
            raise ConfigError([f"lora_task_type={task!r}: a reward model's LoRA trains the score head with it; set "
                               "lora_task_type: SEQ_CLS"], context=source)
        cand = candidate_from_run_dict(shared, source=source)
        base = cand.base.as_dict()
        if base.get("output_dir") == "advisor-reward":
            base.pop("output_dir")
        base.update(own)
        return cand.replace(base=base) if base != cand.base.as_dict() else cand

    # ---- the model -------------------------------------------------------------------------------------------------
    def build_model(self, spec: ModelSpec, candidate: Candidate, device: str = "cpu") -> Any:
        """What `trl reward` trains: AutoModelForSequenceClassification with one label, random weights."""
        import torch
        from transformers import AutoModelForSequenceClassification

        from ..modeling import default_attention

        config = spec.hf_config()
        config.num_labels = 1
        chosen = candidate.attn_implementation or default_attention(spec)
        # FlashAttention as advisor.modeling.build_model does: built eager, then named flash on meta (the
        # simulator's stand-in kernels), sdpa for real random weights (a real run loads the kernel by name)
        config._attn_implementation = ("eager" if device == "meta" else "sdpa") if chosen.is_flash else chosen.value
        with torch.device(device):
            model = AutoModelForSequenceClassification.from_config(
                config, dtype=getattr(torch, candidate.weights_dtype.value))
        if chosen.is_flash and device == "meta":
            model.config._attn_implementation = chosen.value
        return model

    def peft_config(self, candidate: Candidate, spec: ModelSpec | None = None) -> Any:
        """trl.get_peft_config with `lora_task_type: SEQ_CLS` (as emitted): PEFT then also trains the score head."""
        from ..emit import peft_config

        config = peft_config(candidate, spec)
        if config is not None:
            config.task_type = "SEQ_CLS"
        return config

    # ---- data ----------------------------------------------------------------------------------------------------
    def worst_rows(self, workload: Workload, candidate: Candidate) -> list[dict]:
        """The B pairs with the longest sequence among those RewardTrainer keeps (both within `max_length`)."""
        import numpy as np

        data: PreferenceDataset = workload.dataset
        longest = data.lengths
        keep = np.arange(len(data.rows)) if candidate.max_length is None else np.flatnonzero(
            longest <= candidate.max_length)
        b = candidate.per_device_train_batch_size
        order = [int(keep[i]) for i in np.argsort(-longest[keep], kind="stable")[:b]]
        return [_pair(data.rows[i]) for i in order]

    def train_dataset(self, workload: Workload, rows: list[dict] | None = None) -> datasets.Dataset:
        import datasets

        rows = [_pair(r) for r in workload.dataset.rows] if rows is None else rows
        return datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in ("chosen_ids", "rejected_ids")})

    def worst_batch(self, trainer: Any, batch_size: int) -> dict[str, torch.Tensor]:
        ds = trainer.train_dataset
        lengths = [max(len(c), len(r)) for c, r in zip(ds["chosen_ids"], ds["rejected_ids"], strict=True)]
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:batch_size]
        keep = ("chosen_ids", "rejected_ids", "margin")
        return trainer.data_collator([{k: v for k, v in ds[i].items() if k in keep} for i in order])

    def labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Every real token is scored (no LM head; the score is read at the last one)."""
        return batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)

    closed_form = ClosedForm.PAIRS_SCORED  # the SFT closed form of the 2B sequences, without the LM head's logits

    # ---- the fake step's hooks: none; what the notes say -----------------------------------------------------------
    def notes(self, candidate: Candidate) -> list[str]:
        out = ["reward: RewardTrainer's own step on fake tensors (a one-label sequence classifier; 2B sequences a "
               "micro-batch of B pairs); time: the worst batch's step (the batch distribution is modelled for SFT)"]
        if candidate.max_length is not None:
            out.append(f"max_length={candidate.max_length}: RewardTrainer drops the pairs with a longer sequence "
                       "(it does not truncate)")
        return out


def _pair(row: dict[str, list[int]]) -> dict[str, list[int]]:
    """A prepared preference row as RewardTrainer's prepared dataset holds it (the prompt inside each)."""
    if "chosen_ids" in row and "prompt_ids" not in row:
        return row
    p = row["prompt_ids"]
    return {"chosen_ids": p + row["chosen_ids"], "rejected_ids": p + row["rejected_ids"]}


REWARD_TRAINER = register(Reward())
