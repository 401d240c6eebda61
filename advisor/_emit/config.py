"""From a Candidate to TRL's config objects: SFTConfig kwargs (every memory-relevant field set explicitly),
`model_init_kwargs`, the BitsAndBytesConfig, the LoraConfig and the allocator's environment variables."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..knobs import Home, Knob, config_knobs, knobs_in
from ..space import Candidate, Precision, Quantization
from .keys import base_keys

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig
    from trl import SFTConfig

    from ..workload import ModelSpec, Workload

ALLOC_CONF = "expandable_segments:True"
ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def sft_config_kwargs(candidate: Candidate, workload: Workload | None = None, *,
                      measured: bool = False) -> dict[str, Any]:
    """The SFTConfig fields that decide memory and speed, each set explicitly, then the base's SFTConfig keys
    (`measured`: only those that reach a measured run, see KeyUse)."""
    c = candidate
    completion_only = workload.dataset.completion_only_loss if workload is not None else None
    out: dict[str, Any] = {}
    for k in config_knobs("sft"):  # TrainingArguments' knobs and SFTConfig's own (advisor/knobs.py)
        out.update(_write_sft(k, c))
        if k.name == "max_length":
            out["truncation_mode"] = "keep_start"
    out["use_liger_kernel"] = False  # replaced by model_init_kwargs use_kernels (a knob)
    out["completion_only_loss"] = completion_only
    out["model_init_kwargs"] = model_init_kwargs(c, measured=measured)
    out.update(base_keys(c, "sft", measured))
    return out


def emitted_sft_kwargs(candidate: Candidate, completion_only_loss: bool | None = None) -> dict[str, Any]:
    """SFTConfig's kwargs as every emitted form carries them (the YAML, the snippet, `trl_config()`):
    `completion_only_loss` as the user wrote it, else `completion_only_loss` (explicit for the synthetic set, TRL's
    own default None for real data)."""
    kw = sft_config_kwargs(candidate)
    kw["completion_only_loss"] = candidate.base.get("completion_only_loss", completion_only_loss)
    return kw


def _write_sft(k: Knob, c: Candidate) -> dict[str, Any]:
    """One SFTConfig knob as TRL spells it: its key, or the keys of the knobs TRL spells differently."""
    if k.name == "precision":
        return {"bf16": c.precision is Precision.BF16, "fp16": c.precision is Precision.FP16}
    if k.name == "group_by_length":
        return {"train_sampling_strategy": "group_by_length" if c.group_by_length else
                c.base.get("train_sampling_strategy", "random")}
    if k.name == "activation_checkpointing":
        return {"activation_checkpointing": c.activation_checkpointing,
                "activation_checkpointing_kwargs": c.checkpointing_kwargs}
    return {k.key: k.plain(getattr(c, k.name))}


def model_init_kwargs(candidate: Candidate, *, measured: bool = False) -> dict[str, Any]:
    """What `from_pretrained` gets through SFTConfig.model_init_kwargs (as trl/scripts/sft.py builds it).

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
    from transformers import BitsAndBytesConfig

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
    from peft import LoraConfig

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


def build_sft_config(candidate: Candidate, workload: Workload | None = None, *, measured: bool = False,
                     **overrides: Any) -> SFTConfig:
    """A trl.SFTConfig built through its constructor (so activation/gradient checkpointing names stay synced).

    `measured=True` for the simulator's and the probe's runs: the base's neutral keys (hub, reporting, output
    paths) stay out. On a machine without a GPU a bf16 config needs `use_cpu=True` among the overrides.
    """
    from trl import SFTConfig

    kwargs = sft_config_kwargs(candidate, workload, measured=measured)
    kwargs["output_dir"] = overrides.pop("output_dir", kwargs.get("output_dir", "advisor-sft"))
    kwargs.update(overrides)
    return SFTConfig(**kwargs)
