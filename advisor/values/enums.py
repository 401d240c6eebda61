"""The value types of the knobs (str-Enums, so YAML strings and `--fix` values coerce to them) and the `optim`
values the advisor refuses by name."""

from __future__ import annotations

from enum import Enum


class PackingStrategy(str, Enum):
    BFD = "bfd"
    BFD_SPLIT = "bfd_split"
    WRAPPED = "wrapped"


class Precision(str, Enum):
    """Mixed-precision compute (SFTConfig `bf16` / `fp16`); FP32 means neither."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


class WeightsDtype(str, Enum):
    """The dtype the weights are loaded in (ModelConfig.dtype). TRL loads float32 unless told."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Quantization(str, Enum):
    NONE = "none"
    INT8 = "8bit"
    NF4 = "4bit"


class Optimizer(str, Enum):
    """Values of TrainingArguments.optim the advisor measures: torch's own optimizers run on fake tensors as they are;
    the bitsandbytes ones are modelled (advisor/simulator/modelled.py `modelled_adjustments`). The search considers a
    subset (search/space.py). Every other `optim` TrainingArguments accepts is refused by name
    (`UNSUPPORTED_OPTIMIZERS`).
    """

    ADAMW_TORCH_FUSED = "adamw_torch_fused"
    ADAMW_TORCH = "adamw_torch"
    ADAMW_8BIT = "adamw_bnb_8bit"
    PAGED_ADAMW_8BIT = "paged_adamw_8bit"
    ADAFACTOR = "adafactor"
    SGD = "sgd"
    ADAGRAD = "adagrad"
    RMSPROP = "rmsprop"

    @property
    def needs_bitsandbytes(self) -> bool:
        return self in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT)


# The rest of transformers' OptimizerNames, and why each is not measured: they need packages that are not installed
# or kernels that cannot run on fake tensors, and their state is not the AdamW state the 8-bit model scales.
UNSUPPORTED_OPTIMIZERS: dict[str, str] = {
    **{name: "an XLA / NPU device optimizer; the advisor targets CUDA and the CPU"
       for name in ("adamw_torch_xla", "adamw_torch_npu_fused")},
    **{name: "needs apex / torchdistx / torchao kernels that cannot run on fake tensors"
       for name in ("adamw_apex_fused", "adamw_anyprecision", "adamw_torch_4bit", "adamw_torch_8bit", "stable_adamw")},
    **{name: "a bitsandbytes optimizer whose state is not modelled (only adamw_bnb_8bit and paged_adamw_8bit are)"
       for name in ("adamw_8bit", "ademamix", "ademamix_8bit", "lion_8bit", "lion_32bit", "paged_adamw_32bit",
                    "paged_ademamix_32bit", "paged_ademamix_8bit", "paged_lion_32bit", "paged_lion_8bit",
                    "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit")},
    **{name: "projects or fuses gradients in its own kernels (GaLore, APOLLO, LOMO); not simulated"
       for name in ("galore_adamw", "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise",
                    "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise", "lomo", "adalomo", "apollo_adamw",
                    "apollo_adamw_layerwise")},
    **{name: "needs a package the advisor does not install (grokadamw, schedulefree); not simulated"
       for name in ("grokadamw", "schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd")},
}


class Attention(str, Enum):
    """`attn_implementation` as transformers 5 accepts it (PreTrainedModel._check_and_adjust_attn_implementation).

    The FlashAttention names are every one transformers knows for CUDA (advisor/simulator/flash.py
    `flash_attention_names()`, which tests/test_attention_names.py keeps equal to these): `flash_attention_N` is
    the flash-attn package of that version (transformers falls back to the Hub kernel FLASH_ATTN_KERNEL_FALLBACK
    names when the package is missing and `kernels` is installed); `kernels-community/...` is a Hub kernel loaded
    through the `kernels` package. Every one runs transformers' same flash path (`_flash_attention_forward`), so
    memory and time are modelled alike; they differ in what they need (`package`, `min_compute_capability`).
    """

    SDPA = "sdpa"
    EAGER = "eager"
    FLASH_ATTENTION_2 = "kernels-community/flash-attn2"  # the one the search offers
    FLASH_ATTENTION_2_PACKAGE = "flash_attention_2"
    FLASH_ATTENTION_3_PACKAGE = "flash_attention_3"
    FLASH_ATTENTION_4_PACKAGE = "flash_attention_4"
    FLASH_ATTENTION_3 = "kernels-community/flash-attn3"
    VLLM_FLASH_ATTENTION_3 = "kernels-community/vllm-flash-attn3"
    FLASH_ATTENTION_4 = "kernels-community/flash-attn4"

    @property
    def is_flash(self) -> bool:
        """Any FlashAttention (transformers' `is_flash_attention_requested`): the flash path, varlen, no mask."""
        return self not in (Attention.SDPA, Attention.EAGER)

    @property
    def is_hub_kernel(self) -> bool:
        """Loaded from the Hugging Face Hub through the `kernels` package (`transformers.integrations.hub_kernels`)."""
        return self.value.startswith("kernels-community/")

    @property
    def flash_version(self) -> int | None:
        """2, 3 or 4 for FlashAttention, None for sdpa / eager."""
        return int(self.value[-1]) if self.is_flash else None

    @property
    def package(self) -> str | None:
        """The pip distribution transformers imports it from: `kernels` for a Hub kernel; for flash_attention_N the
        distribution transformers' FLASH_ATTENTION_COMPATIBILITY_MATRIX checks (flash-attn, flash-attn-3 providing
        `flash_attn_interface`, flash-attn-4); None for sdpa / eager (torch)."""
        if not self.is_flash:
            return None
        if self.is_hub_kernel:
            return "kernels"
        return {2: "flash-attn", 3: "flash-attn-3", 4: "flash-attn-4"}[self.flash_version]

    @property
    def min_compute_capability(self) -> float | None:
        """The lowest CUDA compute capability it runs on: FlashAttention 2 and 3 need Ampere (8.0: flash-attn 2's
        kernels; transformers' cuda_min_major_version 8 for FA3), FlashAttention 4 Hopper (9.0: transformers'
        cuda_min_major_version 9). None for sdpa / eager."""
        if not self.is_flash:
            return None
        return 9.0 if self.flash_version == 4 else 8.0
