"""TRL 1.16's own rules for a Candidate, exactly as strict as TRL and no stricter, so that no emitted configuration
can be rejected by TRL: between knobs, on the target device, and on the model (`Candidate.problems()`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .enums import Attention, Precision, Quantization, WeightsDtype
from .runbase import CHECKPOINT_EXTRA

if TYPE_CHECKING:
    from ..space import Candidate
    from ..workload import GPUSpec, ModelSpec

# Every linear projection of a Llama-style decoder layer; resolved per model by `model_linear_names`.
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def candidate_problems(c: Candidate, gpu: GPUSpec | None = None, model: ModelSpec | None = None) -> list[str]:
    """Every rule of TRL 1.16 / transformers 5 / torch that `c` breaks, with the fix."""
    out: list[str] = []
    if c.packing and c.max_length is None:
        out.append(
            "packing=True with max_length=None: TRL raises \"When packing is enabled, `max_length` can't be "
            "`None`.\"; set max_length"
        )
    if c.padding_free and not c.packing and c.max_length is not None:
        out.append(
            "padding_free=True without packing and with max_length set: TRL raises \"When `padding_free=True` "
            "without packing, `max_length` is not enforced\"; set max_length=None, enable packing, or "
            "pre-truncate the data"
        )
    if c.quantization is not Quantization.NONE and not c.use_lora:
        out.append(
            f"quantization={c.quantization.value} without LoRA: transformers raises \"You cannot perform "
            "fine-tuning on purely quantized models\"; set use_lora=True (QLoRA) or quantization=none"
        )
    if c.use_lora and "lm_head" in (c.lora_target_modules or ()):
        out.append(
            "lora_target_modules contains 'lm_head': TRL raises \"Applying a PEFT adapter to `lm_head` is not "
            "supported\" (its fused LM head reads lm_head.weight directly); remove 'lm_head'"
        )
    if c.use_lora and c.lora_target_modules is not None and not c.lora_target_modules:
        out.append("use_lora=True with no lora_target_modules: name the modules, e.g. q_proj,v_proj")
    extra_ck = c.base.get(CHECKPOINT_EXTRA) or {}
    if c.activation_checkpointing and c.checkpoint_selective and extra_ck.get("use_reentrant"):
        out.append(
            "activation_checkpointing_kwargs selective=True with use_reentrant=True: TRL raises \"requires "
            "non-reentrant gradient checkpointing\"; set use_reentrant: false or leave it unset"
        )
    if c.precision is Precision.FP16 and c.weights_dtype is WeightsDtype.FLOAT16:
        out.append(
            "precision=fp16 with weights_dtype=float16: the gradient scaler raises \"Attempting to unscale FP16 "
            "gradients\"; load float32 weights or use bf16"
        )
    if gpu is not None:
        out.extend(_device_problems(c, gpu))
    if model is not None:
        out.extend(_model_problems(c, model))
    return out

def _device_problems(c: Candidate, gpu: GPUSpec) -> list[str]:
    out = []
    if not gpu.is_cuda:
        if c.activation_offloading:
            out.append(
                "activation_offloading=True on the CPU: TRL's offloading needs an accelerator (CUDA streams); "
                "set activation_offloading=False"
            )
        if c.activation_checkpointing and c.checkpoint_offload:
            out.append(
                "activation_checkpointing_kwargs offload=True on the CPU: transformers holds the checkpoints in "
                "pinned host memory, and torch raises \"pin_memory=True requires a CUDA or other accelerator "
                "backend\" without one; set checkpoint_offload=False"
            )
        if c.quantization is not Quantization.NONE:
            out.append(
                f"quantization={c.quantization.value} on the CPU: bitsandbytes training kernels need CUDA; "
                "set quantization=none"
            )
        if c.optim.needs_bitsandbytes:
            out.append(f"optim={c.optim.value} on the CPU: bitsandbytes optimizers need CUDA; use adamw_torch")
        if c.precision is Precision.FP16:
            out.append("precision=fp16 on the CPU: fp16 mixed precision needs a GPU; use bf16 or fp32")
        if c.attn_implementation is not None and c.attn_implementation.is_flash:
            out.append(
                f"attn_implementation={c.attn_implementation.value} on the CPU: FlashAttention needs CUDA; "
                "set attn_implementation=sdpa"
            )
    else:
        if c.precision is Precision.BF16 and not gpu.supports_bf16:
            out.append(
                f"precision=bf16 on {gpu.name}: transformers raises \"Your setup doesn't support bf16/gpu\"; "
                "use fp16 or fp32"
            )
        if c.weights_dtype is WeightsDtype.BFLOAT16 and not gpu.supports_bf16:
            out.append(f"weights_dtype=bfloat16 on {gpu.name}: no bf16 support; use float32 or float16")
        attn = c.attn_implementation
        if attn is not None and attn.is_flash and not _flash_runs_on(attn, gpu):
            need = "Hopper (compute capability 9.0)" if attn.min_compute_capability >= 9 else "Ampere (8.0)"
            out.append(
                f"attn_implementation={attn.value} on {gpu.name} (compute capability {gpu.compute_capability}): "
                f"FlashAttention {attn.flash_version} needs {need} or newer; set attn_implementation=sdpa"
            )
    return out

def _model_problems(c: Candidate, model: ModelSpec) -> list[str]:
    out = []
    ctx = model.max_position_embeddings
    if ctx is not None and c.max_length is not None and c.max_length > ctx:
        out.append(
            f"max_length={c.max_length} is beyond {model.name}'s context (max_position_embeddings {ctx} in "
            f"its config.json); set max_length <= {ctx} (--fix max_length={ctx})"
        )
    if c.use_lora and c.lora_target_modules is None and peft_default_targets(model) is None:
        mt = model.config.get("model_type")
        out.append(
            f"use_peft with no lora_target_modules on {model.name} (model_type {mt!r}): PEFT has no default "
            "targets for it and raises \"Please specify `target_modules`\"; set lora_target_modules"
        )
    elif c.use_lora and c.lora_target_modules != ("all-linear",):
        available = set(model_linear_names(model))
        targets = [m for m in c.lora_target_modules or () if m != "lm_head"]
        if targets and available and not set(targets) & available:
            # PEFT raises only when no target matches ("Target modules {...} not found in the base model")
            out.append(
                f"lora_target_modules {targets} do not exist in {model.name} (PEFT raises \"Target modules "
                f"not found in the base model\"); available: {sorted(available)}"
            )
    return out


def _flash_runs_on(attn: Attention, gpu: GPUSpec) -> bool:
    """The GPU profile's FlashAttention flag (Ampere+), and for FlashAttention 4 its compute capability (Hopper+)."""
    if not gpu.supports_flash_attention:
        return False
    try:
        cc = float(gpu.compute_capability or 0)
    except ValueError:
        return True  # profiles.py validates the field; a profile that passed says supports_flash_attention
    return cc == 0 or cc >= attn.min_compute_capability


def model_linear_names(model: ModelSpec) -> tuple[str, ...]:
    """Names of the decoder layers' linear projections (LoRA targets), from the architecture family."""
    mt = str(model.config.get("model_type", ""))
    if mt in {"gpt2"}:
        return ("c_attn", "c_proj", "c_fc")
    return LLAMA_LINEARS


def peft_default_targets(model: ModelSpec) -> tuple[str, ...] | None:
    """What PEFT targets when LoraConfig.target_modules is None (LoraModel._prepare_adapter_config), or None when
    PEFT has no default for this model type (it then raises)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping  # lazy: loads peft

    targets = mapping.get(str(model.config.get("model_type", "")))
    if targets is None:
        return None
    return (targets,) if isinstance(targets, str) else tuple(targets)


def default_attention(spec: ModelSpec) -> Attention:
    """The attention transformers 5 picks when none is asked for (`PreTrainedModel.get_correct_attn_implementation`
    with None): sdpa where the model class supports it, else eager (Gemma2: softcapping, no sdpa)."""
    from transformers import AutoModelForCausalLM  # lazy: loads transformers

    config = spec.hf_config()
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    return Attention.SDPA if getattr(cls, "_supports_sdpa", False) else Attention.EAGER
