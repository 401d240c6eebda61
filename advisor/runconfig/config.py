"""From a Candidate to TRL's config objects: a trainer's config kwargs (every memory-relevant field set explicitly,
from the knobs its TRL config class has: the one writer of every trainer's), `model_init_kwargs`, the
BitsAndBytesConfig, the LoraConfig and the allocator's environment variables."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from ..knobs import Home, Knob, config_knobs, knobs_in
from ..space import CHECKPOINT_EXTRA, Candidate, Precision, Quantization
from .keys import KEY_USES, KeyUse, trl_fields

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    from ..trainers import Trainer
    from ..workload import ModelSpec, Workload

ALLOC_CONF = "expandable_segments:True"
ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def config_kwargs(trainer: Trainer, candidate: Candidate, workload: Workload | None = None, *,
                  measured: bool = False) -> dict[str, Any]:
    """`trainer`'s config kwargs, the one writer of every trainer's: each knob its TRL config class has (advisor/
    knobs.py, in registry order; its own knobs from its typed view, its TRL defaults resolved), `use_liger_kernel`
    off (its replacement, use_kernels, is a knob), what no knob owns (`Trainer.config_extras`), `model_init_kwargs`,
    then the base's keys of its config as the user wrote them (`measured`: only those that reach a measured run,
    see `base_config_keys`)."""
    c = candidate
    view = trainer.knobs(c)
    fields = trainer.config_fields()
    out: dict[str, Any] = {}
    for k in config_knobs(trainer):
        out.update(_write_knob(k, c, view, fields))
    out["use_liger_kernel"] = False
    extras = trainer.config_extras(c, workload, measured=measured)
    out.update(extras)
    out["model_init_kwargs"] = model_init_kwargs(c, measured=measured)
    out.update(base_config_keys(trainer, c, skip={*extras, *(k.key for k in view.KNOBS)}, measured=measured))
    return out


def _write_knob(k: Knob, c: Candidate, view: Any, fields: frozenset[str]) -> dict[str, Any]:
    """One knob as TRL spells it: its key (a trainer's own knob from its view; one that declares `emit_none=False`
    left out at None), or the keys of the knobs TRL spells differently; max_length with the truncation TRL applies
    (`keep_start`) where the config has truncation_mode."""
    if k.carried:
        value = getattr(view, k.name)
        return {} if value is None and not k.emit_none else {k.key: k.plain(value)}
    if k.name == "precision":
        return {"bf16": c.precision is Precision.BF16, "fp16": c.precision is Precision.FP16}
    if k.name == "group_by_length":
        return {"train_sampling_strategy": "group_by_length" if c.group_by_length else
                c.base.get("train_sampling_strategy", "random")}
    if k.name == "activation_checkpointing":
        return {"activation_checkpointing": c.activation_checkpointing,
                "activation_checkpointing_kwargs": c.checkpointing_kwargs}
    if k.name == "max_length" and "truncation_mode" in fields:
        return {"max_length": c.max_length, "truncation_mode": "keep_start"}
    return {k.key: k.plain(getattr(c, k.name))}


def base_config_keys(trainer: Trainer, candidate: Candidate, *, skip: Collection[str], measured: bool
                     ) -> dict[str, Any]:
    """The base's keys that are fields of `trainer`'s config, as the user wrote them (over what the knobs wrote:
    truncation_mode), but `skip` (what the trainer writes itself: its own knobs, its `config_extras`), `env`, the
    checkpointing extras and `model_init_kwargs` (the knobs write those). `measured`: only those that reach a
    measured run: TRL's simulated keys (KEY_USES) and the trainer's own (its loss, which the simulator runs as
    written: the config's keys the shared reader does not know)."""
    fields = trainer.config_fields()
    known = trl_fields()
    out: dict[str, Any] = {}
    for key, value in candidate.base.as_dict().items():
        if key in skip or key in ("env", CHECKPOINT_EXTRA, "model_init_kwargs") or key not in fields:
            continue
        if measured and key in known and KEY_USES.get(key) is not KeyUse.SIMULATED:
            continue
        out[key] = value
    return out


def model_init_kwargs(candidate: Candidate, *, measured: bool = False) -> dict[str, Any]:
    """What `from_pretrained` gets through the config's model_init_kwargs (as trl/scripts/sft.py builds it).

    Quantization is passed separately, as the trainer's `quantization_config=` argument (see
    `quantization_config`), exactly like trl/scripts/sft.py does. No attn_implementation: transformers picks.
    The knobs that live in model_init_kwargs (advisor/knobs.py, Home.MODEL_INIT_KWARGS) are written explicitly.
    """
    out: dict[str, Any] = {} if measured else dict(candidate.base.get("model_init_kwargs") or {})
    out["dtype"] = candidate.weights_dtype.value
    if candidate.attn_implementation is not None:
        out["attn_implementation"] = candidate.attn_implementation.value
    for k in knobs_in(Home.MODEL_INIT_KWARGS):  # use_kernels, written explicitly
        out[k.key] = k.plain(getattr(candidate, k.name))
    return out


def quantization_config(candidate: Candidate) -> BitsAndBytesConfig | None:
    """The BitsAndBytesConfig of trl.get_quantization_config for this candidate, or None."""
    if candidate.quantization is Quantization.NONE:
        return None
    from transformers import BitsAndBytesConfig  # lazy: loads transformers

    if candidate.quantization is Quantization.NF4:
        b = candidate.base
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_compute_dtype=compute_dtype(candidate),
            bnb_4bit_quant_type=b.get("bnb_4bit_quant_type", "nf4"),
            bnb_4bit_use_double_quant=bool(b.get("use_bnb_nested_quant", False)),
            bnb_4bit_quant_storage=b.get("bnb_4bit_quant_storage"),
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def compute_dtype(candidate: Candidate) -> str:
    """trl.get_quantization_config computes in the weights' dtype (ModelConfig.dtype); so do we."""
    return candidate.weights_dtype.value


def peft_targets(candidate: Candidate) -> list[str] | str | None:
    """LoraConfig.target_modules: None is PEFT's default for the model type, 'all-linear' PEFT's own keyword."""
    t = candidate.lora_target_modules
    if t is None:
        return None
    return "all-linear" if t == ("all-linear",) else list(t)


def peft_config(candidate: Candidate, model: ModelSpec | None = None) -> LoraConfig | None:
    """The LoraConfig of trl.get_peft_config for this candidate (with the base's LoRA keys)."""
    if not candidate.use_lora:
        return None
    from peft import LoraConfig  # lazy: loads peft

    b = candidate.base
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=candidate.lora_r,
        target_modules=peft_targets(candidate),
        lora_alpha=candidate.lora_alpha,
        lora_dropout=candidate.lora_dropout,
        bias="none",
        use_rslora=bool(b.get("use_rslora", False)),
        use_dora=bool(b.get("use_dora", False)),
        modules_to_save=b.get("lora_modules_to_save"),
    )


def env_vars(candidate: Candidate) -> dict[str, str]:
    """Allocator settings; both names, since PyTorch 2.10 reads PYTORCH_ALLOC_CONF and vLLM the CUDA one. Then
    the base's other environment variables."""
    out = dict(candidate.base.get("env") or {})
    if candidate.expandable_segments:
        out.update({name: ALLOC_CONF for name in ALLOC_ENV})
    return out



