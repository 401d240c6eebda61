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

import numpy as np

from ..errors import ConfigError
from ..modeling import default_attention
from ..runconfig import peft_config
from .base import PairTrainer, own_keys, register
from .protocol import StepShape

if TYPE_CHECKING:
    import datasets
    import torch

    from ..space import Candidate
    from ..workload import GPUSpec, ModelSpec, Workload
    from .preference import PreferenceDataset


class Reward(PairTrainer):
    """Reward modelling on prompt / chosen / rejected pairs (preference.PreferenceDataset)."""

    name = "reward"
    command = "reward"
    config_name, trainer_name, config_label = "RewardConfig", "RewardTrainer", "reward"
    processing_class_loader = "AutoTokenizer"  # RewardTrainer.__init__ with processing_class=None
    # pad_to_multiple_of: RewardConfig's padding rounding, searched; group_by_length held (timed on the worst batch)
    space_holds = frozenset({"group_by_length"})

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

    def model_extras(self, candidate: Candidate) -> dict[str, Any]:
        """`lora_task_type: SEQ_CLS` under LoRA: PEFT then trains the score head with the adapters."""
        return {"lora_task_type": "SEQ_CLS"} if candidate.use_lora else {}

    def candidate_from_run_dict(self, data: Mapping[str, Any], *, source: str = "config") -> Candidate:
        """A `trl reward` config read back: the shared keys as advisor/runconfig reads them, with what this trainer
        emits itself accepted (`lora_task_type: SEQ_CLS` under LoRA, the default output_dir) and its own keys in
        the base. Another LoRA task type is refused by name."""

        mine = own_keys(self)
        shared = {k: v for k, v in data.items() if k not in mine}
        own = {k: v for k, v in data.items() if k in mine}
        task = shared.pop("lora_task_type", None)
        if task not in (None, "SEQ_CLS"):
            raise ConfigError([f"lora_task_type={task!r}: a reward model's LoRA trains the score head with it; set "
                               "lora_task_type: SEQ_CLS"], context=source)
        return self.read_config(shared, own, source=source)

    # ---- the model -------------------------------------------------------------------------------------------------
    def build_model(self, spec: ModelSpec, candidate: Candidate, device: str = "cpu") -> Any:
        """What `trl reward` trains: AutoModelForSequenceClassification with one label, random weights."""
        import torch  # lazy: loads torch
        from transformers import AutoModelForSequenceClassification  # lazy: loads transformers

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

        config = peft_config(candidate, spec)
        if config is not None:
            config.task_type = "SEQ_CLS"
        return config

    # ---- data ----------------------------------------------------------------------------------------------------
    def worst_rows(self, workload: Workload, candidate: Candidate) -> list[dict]:
        """The B pairs with the longest sequence among those RewardTrainer keeps (both within `max_length`)."""

        data: PreferenceDataset = workload.dataset
        longest = data.lengths
        keep = np.arange(len(data.rows)) if candidate.max_length is None else np.flatnonzero(
            longest <= candidate.max_length)
        b = candidate.per_device_train_batch_size
        order = [int(keep[i]) for i in np.argsort(-longest[keep], kind="stable")[:b]]
        return [_pair(data.rows[i]) for i in order]

    def train_dataset(self, workload: Workload, rows: list[dict] | None = None) -> datasets.Dataset:
        import datasets  # lazy: loads datasets

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

    def step_shape(self, candidate: Candidate) -> StepShape:
        """2B sequences a micro-batch of B pairs, a one-label score head instead of the LM head's logits."""
        return StepShape(sequences_per_row=2, lm_head=False)

    # ---- the fake step's hooks: none; what the notes say -----------------------------------------------------------
    def notes(self, candidate: Candidate, workload: Workload | None = None) -> list[str]:
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
