"""The memory knobs: one `Candidate` is one value for every knob; a `SearchSpace` is the set the search explores.

`Candidate.problems()` encodes TRL 1.16's own rules, exactly as strict as TRL and no stricter, so that no
emitted configuration can be rejected by TRL.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .parallelism import Layout
from .workload import Method

if TYPE_CHECKING:
    from .workload import GPUSpec, ModelSpec


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
    """Values of TrainingArguments.optim the advisor measures: torch's own optimizers run on fake tensors as they
    are; the bitsandbytes ones are modelled (simulate._modelled_adjustments). The search considers a subset
    (_search/space.py). Every other `optim` TrainingArguments accepts is refused by name (`UNSUPPORTED_OPTIMIZERS`).
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

    The FlashAttention names are every one transformers knows for CUDA (advisor/_sim/flash.py
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


@dataclass(frozen=True)
class RunBase:
    """The keys of a run config that are not knobs, as the user wrote them: what every measured and emitted run
    keeps (see emit.KEY_USES for which keys reach the measured run). Sorted (key, JSON text) pairs, so a Candidate
    that carries it stays hashable and comparable; empty for the search's own candidates."""

    items: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, mapping: Mapping[str, Any] | RunBase | None) -> RunBase:
        import json

        if isinstance(mapping, RunBase):
            return mapping
        problems, items = [], []
        for k, v in sorted((mapping or {}).items()):
            try:
                items.append((str(k), json.dumps(v, sort_keys=True)))
            except (TypeError, ValueError):
                problems.append(f"{k}={v!r}: not a YAML/JSON value")
        if problems:
            raise ConfigError(problems, context="run config")
        return cls(tuple(items))

    def as_dict(self) -> dict[str, Any]:
        import json

        return {k: json.loads(v) for k, v in self.items}

    def get(self, key: str, default: Any = None) -> Any:
        import json

        for k, v in self.items:
            if k == key:
                return json.loads(v)
        return default

    def __contains__(self, key: object) -> bool:
        return any(k == key for k, _ in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


# Every linear projection of a Llama-style decoder layer; resolved per model by `default_lora_targets`.
_LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class QualityCost:
    """What a candidate gives up against full fine-tuning of every token in float32 weights."""

    truncated_fraction: float = 0.0
    adapters: bool = False
    quantization: Quantization = Quantization.NONE
    low_precision_weights: bool = False
    mixed_examples: bool = False

    @property
    def neutral(self) -> bool:
        return not (
            self.truncated_fraction > 0
            or self.adapters
            or self.quantization is not Quantization.NONE
            or self.low_precision_weights
            or self.mixed_examples
        )

    def describe(self) -> list[str]:
        out = []
        if self.truncated_fraction > 0:
            out.append(f"{self.truncated_fraction:.2%} of trained tokens lost to truncation")
        if self.adapters:
            out.append("LoRA adapters instead of full weights")
        if self.quantization is not Quantization.NONE:
            out.append(f"{self.quantization.value} quantized base weights")
        if self.low_precision_weights:
            out.append("pure low-precision weights (no float32 master copy)")
        if self.mixed_examples:
            out.append("'wrapped' packing mixes examples and cuts them mid-sequence")
        return out


@dataclass(frozen=True)
class Candidate:
    """One value for every memory knob. Field names follow SFTConfig / ModelConfig where one exists.

    Each field is declared in the knob registry (advisor/knobs.py: its home in TRL, validity, `--fix` names, when
    it is active, memory order, labels); the registry checks this field block against its declarations when it is
    imported, and validation and `canonical()` derive from it.
    """

    max_length: int | None = 1024
    packing: bool = False
    packing_strategy: PackingStrategy = PackingStrategy.BFD
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    activation_checkpointing: bool = True
    checkpoint_selective: bool = False
    checkpoint_every_n_layers: int = 1
    activation_offloading: bool = False
    optim: Optimizer = Optimizer.ADAMW_TORCH_FUSED
    precision: Precision = Precision.BF16
    weights_dtype: WeightsDtype = WeightsDtype.FLOAT32
    group_by_length: bool = False
    # None: what transformers picks when `attn_implementation` is not given (see modeling.default_attention)
    attn_implementation: Attention | None = Attention.SDPA
    use_lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    # None: PEFT's default for the model type (peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
    lora_target_modules: tuple[str, ...] | None = _LLAMA_LINEARS
    quantization: Quantization = Quantization.NONE
    expandable_segments: bool = True
    checkpoint_offload: bool = False
    use_kernels: bool = False
    # several GPUs (issue 16): how accelerate shards the model; DDP shards nothing (the single-GPU run on one)
    parallelism: Layout = Layout.DDP
    # the user's other keys (not a knob: the search never changes it)
    base: RunBase = field(default_factory=RunBase)

    def __post_init__(self) -> None:
        # Accept plain strings (YAML, --fix) and lists; store Enums and tuples so candidates hash and compare.
        from .knobs import coerce

        values, problems = coerce({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        for name, value in values.items():
            if value is not getattr(self, name):
                object.__setattr__(self, name, value)
        if not isinstance(self.base, RunBase):
            try:
                object.__setattr__(self, "base", RunBase.of(self.base))
            except ConfigError as exc:
                problems.extend(exc.problems)
        if problems:
            raise ConfigError(problems, context="invalid candidate")

    # ---- derived -----------------------------------------------------------------------------------------
    @property
    def method(self) -> Method:
        if not self.use_lora:
            return Method.FULL
        return Method.QLORA if self.quantization is not Quantization.NONE else Method.LORA

    @property
    def effective_padding_free(self) -> bool:
        """What SFTTrainer really uses: bfd and bfd_split packing switch padding-free on."""
        return self.padding_free or (
            self.packing and self.packing_strategy in (PackingStrategy.BFD, PackingStrategy.BFD_SPLIT)
        )

    @property
    def checkpointing_kwargs(self) -> dict[str, Any] | None:
        if not self.activation_checkpointing:
            return None
        # TRL sets use_reentrant=False when it is not given (SFTTrainer.__init__); the user's other keys are kept
        from .knobs import checkpoint_kwargs

        kwargs: dict[str, Any] = {"use_reentrant": False, **(self.base.get(CHECKPOINT_EXTRA) or {})}
        kwargs.update(checkpoint_kwargs(self))  # selective, every_n_layers, offload (advisor/knobs.py)
        return kwargs

    def replace(self, **changes: Any) -> Candidate:
        """A copy with `changes`, each checked as __post_init__ checks it. Only the changed knobs are coerced (the
        rest are this candidate's, already valid): the search builds tens of thousands of candidates a run."""
        if not changes:
            return self
        if "base" in changes or not changes.keys() <= _KNOB_FIELDS:
            return dataclasses.replace(self, **changes)  # the user's keys, or a name dataclasses must refuse
        from .knobs import coerce

        values, problems = coerce(changes)
        if problems:
            raise ConfigError(problems, context="invalid candidate")
        return self._with_checked({**changes, **values})  # fields that are not knobs: as given, as __post_init__

    def _with_checked(self, values: Mapping[str, Any]) -> Candidate:
        """A copy with `values` that are already stored values (coerced and checked, or knob defaults)."""
        new = object.__new__(Candidate)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(values)
        return new

    def canonical(self) -> Candidate:
        """Fields that have no effect reset to their defaults, so equivalent candidates compare equal (each knob's
        `active` in advisor/knobs.py)."""
        from .knobs import canonical_changes

        changes = canonical_changes(self)  # knob defaults: stored values already
        return self._with_checked(changes) if changes else self

    def to_dict(self) -> dict[str, Any]:
        """Knobs as plain values; `base` only when the user's config had other keys (so the search's candidates,
        their study keys and stored baselines keep their form)."""
        from .knobs import knob

        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "base":
                if value:
                    out["base"] = value.as_dict()
                continue
            k = knob(f.name)
            if not k.keyed_at_default and value == k.default:
                continue  # a knob added later: candidates at its default keep the study keys they had
            out[f.name] = k.plain(value)
        return out

    def for_model(self, model: ModelSpec) -> Candidate:
        """The model-dependent defaults made explicit, as the real run resolves them: transformers' attention
        selection when `attn_implementation` is None, PEFT's default targets when `lora_target_modules` is None."""
        changes: dict[str, Any] = {}
        if self.attn_implementation is None:
            from .modeling import default_attention

            changes["attn_implementation"] = default_attention(model)
        if self.use_lora and self.lora_target_modules is None:
            targets = peft_default_targets(model)
            if targets is not None:
                changes["lora_target_modules"] = targets
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Candidate:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                [f"unknown knob {k!r}; known: {', '.join(sorted(names))}" for k in unknown], context="candidate"
            )
        return cls(**dict(data))

    # ---- rules -------------------------------------------------------------------------------------------
    def problems(self, gpu: GPUSpec | None = None, model: ModelSpec | None = None) -> list[str]:
        """Every rule of TRL 1.16 / transformers 5 / torch that this candidate breaks, with the fix."""
        out: list[str] = []
        if self.packing and self.max_length is None:
            out.append(
                "packing=True with max_length=None: TRL raises \"When packing is enabled, `max_length` can't be "
                "`None`.\"; set max_length"
            )
        if self.padding_free and not self.packing and self.max_length is not None:
            out.append(
                "padding_free=True without packing and with max_length set: TRL raises \"When `padding_free=True` "
                "without packing, `max_length` is not enforced\"; set max_length=None, enable packing, or "
                "pre-truncate the data"
            )
        if self.quantization is not Quantization.NONE and not self.use_lora:
            out.append(
                f"quantization={self.quantization.value} without LoRA: transformers raises \"You cannot perform "
                "fine-tuning on purely quantized models\"; set use_lora=True (QLoRA) or quantization=none"
            )
        if self.use_lora and "lm_head" in (self.lora_target_modules or ()):
            out.append(
                "lora_target_modules contains 'lm_head': TRL raises \"Applying a PEFT adapter to `lm_head` is not "
                "supported\" (its fused LM head reads lm_head.weight directly); remove 'lm_head'"
            )
        if self.use_lora and self.lora_target_modules is not None and not self.lora_target_modules:
            out.append("use_lora=True with no lora_target_modules: name the modules, e.g. q_proj,v_proj")
        extra_ck = self.base.get(CHECKPOINT_EXTRA) or {}
        if self.activation_checkpointing and self.checkpoint_selective and extra_ck.get("use_reentrant"):
            out.append(
                "activation_checkpointing_kwargs selective=True with use_reentrant=True: TRL raises \"requires "
                "non-reentrant gradient checkpointing\"; set use_reentrant: false or leave it unset"
            )
        if self.precision is Precision.FP16 and self.weights_dtype is WeightsDtype.FLOAT16:
            out.append(
                "precision=fp16 with weights_dtype=float16: the gradient scaler raises \"Attempting to unscale FP16 "
                "gradients\"; load float32 weights or use bf16"
            )
        if gpu is not None:
            out.extend(self._device_problems(gpu))
        if model is not None:
            out.extend(self._model_problems(model))
        return out

    def _device_problems(self, gpu: GPUSpec) -> list[str]:
        out = []
        if not gpu.is_cuda:
            if self.activation_offloading:
                out.append(
                    "activation_offloading=True on the CPU: TRL's offloading needs an accelerator (CUDA streams); "
                    "set activation_offloading=False"
                )
            if self.activation_checkpointing and self.checkpoint_offload:
                out.append(
                    "activation_checkpointing_kwargs offload=True on the CPU: transformers holds the checkpoints in "
                    "pinned host memory, and torch raises \"pin_memory=True requires a CUDA or other accelerator "
                    "backend\" without one; set checkpoint_offload=False"
                )
            if self.quantization is not Quantization.NONE:
                out.append(
                    f"quantization={self.quantization.value} on the CPU: bitsandbytes training kernels need CUDA; "
                    "set quantization=none"
                )
            if self.optim.needs_bitsandbytes:
                out.append(f"optim={self.optim.value} on the CPU: bitsandbytes optimizers need CUDA; use adamw_torch")
            if self.precision is Precision.FP16:
                out.append("precision=fp16 on the CPU: fp16 mixed precision needs a GPU; use bf16 or fp32")
            if self.attn_implementation is not None and self.attn_implementation.is_flash:
                out.append(
                    f"attn_implementation={self.attn_implementation.value} on the CPU: FlashAttention needs CUDA; "
                    "set attn_implementation=sdpa"
                )
        else:
            if self.precision is Precision.BF16 and not gpu.supports_bf16:
                out.append(
                    f"precision=bf16 on {gpu.name}: transformers raises \"Your setup doesn't support bf16/gpu\"; "
                    "use fp16 or fp32"
                )
            if self.weights_dtype is WeightsDtype.BFLOAT16 and not gpu.supports_bf16:
                out.append(f"weights_dtype=bfloat16 on {gpu.name}: no bf16 support; use float32 or float16")
            attn = self.attn_implementation
            if attn is not None and attn.is_flash and not _flash_runs_on(attn, gpu):
                need = "Hopper (compute capability 9.0)" if attn.min_compute_capability >= 9 else "Ampere (8.0)"
                out.append(
                    f"attn_implementation={attn.value} on {gpu.name} (compute capability {gpu.compute_capability}): "
                    f"FlashAttention {attn.flash_version} needs {need} or newer; set attn_implementation=sdpa"
                )
        return out

    def _model_problems(self, model: ModelSpec) -> list[str]:
        out = []
        ctx = model.max_position_embeddings
        if ctx is not None and self.max_length is not None and self.max_length > ctx:
            out.append(
                f"max_length={self.max_length} is beyond {model.name}'s context (max_position_embeddings {ctx} in "
                f"its config.json); set max_length <= {ctx} (--fix max_length={ctx}, or max_length in --config)"
            )
        if self.use_lora and self.lora_target_modules is None and peft_default_targets(model) is None:
            mt = model.config.get("model_type")
            out.append(
                f"use_peft with no lora_target_modules on {model.name} (model_type {mt!r}): PEFT has no default "
                "targets for it and raises \"Please specify `target_modules`\"; set lora_target_modules"
            )
        elif self.use_lora and self.lora_target_modules != ("all-linear",):
            available = set(model_linear_names(model))
            targets = [m for m in self.lora_target_modules or () if m != "lm_head"]
            if targets and available and not set(targets) & available:
                # PEFT raises only when no target matches ("Target modules {...} not found in the base model")
                out.append(
                    f"lora_target_modules {targets} do not exist in {model.name} (PEFT raises \"Target modules "
                    f"not found in the base model\"); available: {sorted(available)}"
                )
        return out

    def check(self, gpu: GPUSpec | None = None, model: ModelSpec | None = None) -> Candidate:
        """Raise ConfigError with every problem at once; return self when valid."""
        problems = self.problems(gpu, model)
        if problems:
            raise ConfigError(problems, context="configuration rejected")
        return self

    def requirements(self) -> tuple[str, ...]:
        """Packages the training run needs beyond torch/transformers/trl/peft (pip names)."""
        from .knobs import KNOBS

        out = [k.requires for k in KNOBS if k.requires and getattr(self, k.name) != k.default]
        if self.optim.needs_bitsandbytes and "bitsandbytes" not in out:
            out.append("bitsandbytes")
        if self.attn_implementation is not None and self.attn_implementation.is_flash:
            # kernels-community/*: loaded from the Hub through `kernels`; flash_attention_N: the flash-attn package
            # (transformers falls back to the Hub kernel only where `kernels` is installed instead)
            out.append(self.attn_implementation.package)
        return tuple(out)

    def quality_cost(self, truncated_fraction: float = 0.0) -> QualityCost:
        """`truncated_fraction` comes from the dataset's length distribution (data.TokenizedDataset)."""
        return QualityCost(
            truncated_fraction=truncated_fraction,
            adapters=self.use_lora,
            quantization=self.quantization,
            low_precision_weights=self.weights_dtype is not WeightsDtype.FLOAT32,
            mixed_examples=self.packing and self.packing_strategy is PackingStrategy.WRAPPED,
        )

    @classmethod
    def trl_defaults(cls) -> Candidate:
        """What `SFTConfig()` gives on a GPU with TRL 1.16 and transformers 5 (float32 weights, bf16 autocast)."""
        return cls(
            max_length=1024,
            packing=False,
            padding_free=False,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=1,
            activation_checkpointing=True,
            optim=Optimizer.ADAMW_TORCH_FUSED,
            precision=Precision.BF16,
            weights_dtype=WeightsDtype.FLOAT32,
            expandable_segments=False,
        )


# The base key that holds the user's activation_checkpointing_kwargs other than the knobs' (selective,
# every_n_layers): use_reentrant, preserve_rng_state, ...
CHECKPOINT_EXTRA = "activation_checkpointing_kwargs"


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
    return _LLAMA_LINEARS


def peft_default_targets(model: ModelSpec) -> tuple[str, ...] | None:
    """What PEFT targets when LoraConfig.target_modules is None (LoraModel._prepare_adapter_config), or None when
    PEFT has no default for this model type (it then raises)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping

    targets = mapping.get(str(model.config.get("model_type", "")))
    if targets is None:
        return None
    return (targets,) if isinstance(targets, str) else tuple(targets)


def default_lora_targets(model: ModelSpec) -> tuple[str, ...]:
    """All linear layers of the decoder, written out (never 'all-linear', so the config says what it does)."""
    return model_linear_names(model)


# Knobs a trainer carries in the candidate's base under its config's name (advisor.trainers.dpo.DPOKnobs), searched
# like Candidate fields: a space may name them, `knob_value` reads them and `with_knobs` sets them (False, the
# default, is left out of the base, so a candidate without them stays as it was).
BASE_KNOBS: dict[str, Any] = {"precompute_ref_log_probs": False}


def knob_value(cand: Candidate, name: str) -> Any:
    """A Candidate field, or a base-carried knob (BASE_KNOBS) with its default when absent."""
    if name in BASE_KNOBS:
        return cand.base.get(name, BASE_KNOBS[name])
    return getattr(cand, name)


def with_knobs(cand: Candidate, **values: Any) -> Candidate:
    """`cand.replace(**values)` where base-carried knobs (BASE_KNOBS) go into the base."""
    carried = {k: values.pop(k) for k in list(values) if k in BASE_KNOBS}
    out = cand.replace(**values) if values else cand
    if carried:
        base = out.base.as_dict()
        for k, v in carried.items():
            if v == BASE_KNOBS[k]:
                base.pop(k, None)
            else:
                base[k] = v
        out = out.replace(base=base)
    return out


@dataclass(frozen=True)
class SearchSpace:
    """The values each knob may take. `candidates()` yields the valid, canonical, distinct combinations.

    `gradient_accumulation_steps` is not a free dimension: it is derived from the micro-batch so that the
    trained tokens per optimizer step stay fixed (see `accumulation`).
    """

    values: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = ({f.name for f in dataclasses.fields(Candidate)} - {"base"}) | set(BASE_KNOBS)
        unknown = sorted(set(self.values) - names)
        if unknown:
            raise ConfigError([f"unknown knob {k!r}" for k in unknown], context="search space")
        empty = [k for k, v in self.values.items() if len(v) == 0]
        if empty:
            raise ConfigError([f"knob {k!r} has no allowed value" for k in empty], context="search space")

    def fix(self, **fixed: Any) -> SearchSpace:
        """Pin knobs to one value each."""
        values = dict(self.values)
        for k, v in fixed.items():
            values[k] = (v,)
        return SearchSpace(values)

    def grid(self, base: Candidate | None = None) -> Iterator[Candidate]:
        """Every combination (before validity), in a stable order."""
        base = base or Candidate()
        keys = sorted(self.values)
        if not any(k in BASE_KNOBS for k in keys):
            # each value checked once (a knob's check does not depend on the others), then combined unchecked
            checked: list[list[Any]] = []
            for k in keys:
                ok = []
                for v in self.values[k]:
                    try:
                        ok.append(getattr(base.replace(**{k: v}), k))
                    except ConfigError:
                        continue
                checked.append(ok)
            for combo in itertools.product(*checked):
                yield base._with_checked(dict(zip(keys, combo, strict=True)))
            return
        put = with_knobs
        for combo in itertools.product(*(self.values[k] for k in keys)):
            try:
                yield put(base, **dict(zip(keys, combo, strict=True)))
            except ConfigError:
                continue

    def candidates(
        self, gpu: GPUSpec | None = None, model: ModelSpec | None = None, base: Candidate | None = None
    ) -> Iterator[Candidate]:
        seen: set[Candidate] = set()
        for cand in self.grid(base):
            cand = cand.canonical()
            if cand in seen or cand.problems(gpu, model):
                continue
            seen.add(cand)
            yield cand

    def size(self) -> int:
        n = 1
        for v in self.values.values():
            n *= len(v)
        return n


_KNOB_FIELDS = frozenset(f.name for f in dataclasses.fields(Candidate)) - {"base"}

# The knob registry checks Candidate's field block against its declarations when it is imported (advisor/knobs.py)
from . import knobs as _knobs  # noqa: E402,F401
