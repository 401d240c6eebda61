"""The knob registry: every memory knob of every trainer declared once.

A `Knob` says what it is (its kind, default and validity), where it lives in TRL 1.16 (`Home` and the key there:
a trainer accepts it when its TRL config class has that field, advisor/trainers/base.py `TrlTrainer.accepts`), its
`--fix` names and their parser, its values in the default search space (`search`; a trainer declares the knobs its
space holds at their default), when it has an effect (`active`), how memory moves along it (`memory`), its report
label and its quality cost. The rest derives from the registry, the way TrlParser
derives flags and YAML keys from dataclass fields: Candidate's validation and `canonical()` (advisor/space.py), the
default space and `--fix` (advisor/search/space.py), both directions of emit (advisor/runconfig), the report's labels
(advisor/report.py), the ledger's memory order (advisor/search/ledger.py) and the stand-ins of what fake tensors
cannot run (advisor/simulator/modelled.py). `Candidate`'s field block is checked against `KNOBS` when advisor/space.py
defines it: a field without a declaration, or a declaration without a field, fails loudly with the fix.

Two kinds of knob: the shared ones in `KNOBS` below are `Candidate` fields; a trainer's own knob (DPO's
`precompute_ref_log_probs`) is declared in its trainer module with `carried=True`, in its typed view (`knob_view`),
and rides in the Candidate's base under its config key (so a candidate of another trainer is unchanged by it); the
trainer registry registers a trainer's view when it registers the trainer (`register_knobs`). `registry()` is both,
in order: the shared knobs, then each trainer's.

Adding a knob: a shared one is one `Knob(...)` in `KNOBS` below and one field on `Candidate` (advisor/space.py); a
trainer's own is one `Knob(..., carried=True)` in its module under advisor/trainers/, in its view.
Then its memory and time in the estimate (advisor/estimator.py, advisor/estimator/) and, where fake tensors cannot
run it, the simulator's stand-in (`stand_in` here, the modelled difference in advisor/simulator/modelled.py); see
docs/architecture.md, "Where to add things".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from . import packages
from .errors import ConfigError
from .parallelism import Layout
from .values import (
    LLAMA_LINEARS,
    NO_STAND_IN,
    TRL_DEFAULT,
    Attention,
    FixResult,
    Home,
    Kind,
    Knob,
    KnobView,
    Memory,
    Optimizer,
    PackingStrategy,
    Precision,
    Quantization,
    WeightsDtype,
    annotation,
    knob_view,
    parse_bool,
)
from .workload import Method

if TYPE_CHECKING:
    from .space import Candidate
    from .trainers import Trainer

__all__ = [  # noqa: RUF022
    "Home", "Kind", "Memory", "Knob", "FixResult", "KNOBS", "knob", "knobs_in", "fix_names", "parse_fix_value",
    "canonical_changes", "coerce", "stand_ins", "memory_le", "ordered_names", "trial_label", "summary_rows",
    "TRL_DEFAULT", "kernels_available", "yaml_keys", "checkpoint_kwargs", "registry", "register_knobs",
    "unregister_knobs", "value", "carried_defaults", "config_knobs", "owned_rows", "verify", "annotation",
    "KnobView", "knob_view",
]


# ---- the --fix parsers of knobs TRL spells differently --------------------------------------------------------

def _fix_precision_flag(key: str, text: str) -> FixResult:
    """bf16 / fp16 (SFTConfig): true pins that precision, false rules it out."""
    b = parse_bool(text)
    if b is None:
        return FixResult(problem=f"--fix {key}={text}: not a boolean; use true or false")
    if b:
        return FixResult({"precision": (Precision(key),)})
    return FixResult({"precision": tuple(p for p in Precision if p.value != key)})


def _fix_load_in(key: str, text: str) -> FixResult:
    """load_in_4bit / load_in_8bit (ModelConfig): true is QLoRA with that quantization."""
    b = parse_bool(text)
    q = Quantization.NF4 if key == "load_in_4bit" else Quantization.INT8
    if b is None:
        return FixResult(problem=f"--fix {key}={text}: not a boolean; use true or false")
    if b:
        return FixResult({"quantization": (q,), "use_lora": (True,)}, frozenset({Method.QLORA}))
    return FixResult({"quantization": tuple(v for v in Quantization if v is not q)})


def _fix_sampling(key: str, text: str) -> FixResult:
    """train_sampling_strategy (TrainingArguments): group_by_length is the knob, random / sequential are not."""
    t = text.lower()
    if t not in ("group_by_length", "random", "sequential"):
        return FixResult(problem=f"--fix {key}={text}: not one of group_by_length, random, sequential")
    return FixResult({"group_by_length": (t == "group_by_length",)})


def _fix_plain(knob_name: str, methods: Callable[[Any], frozenset[Method] | None] | None = None):
    def parse(key: str, text: str) -> FixResult:
        value, problem = knob(knob_name).parse_text(text)
        if problem:
            return FixResult(problem=problem)
        return FixResult({knob_name: (value,)}, methods(value) if methods else None)

    return parse


def _lora_methods(value: bool) -> frozenset[Method]:
    return frozenset({Method.LORA, Method.QLORA} if value else {Method.FULL})


def _quant_methods(value: Quantization) -> frozenset[Method]:
    return frozenset({Method.FULL, Method.LORA} if value is Quantization.NONE else {Method.QLORA})


# ---- labels -----------------------------------------------------------------------------------------------------

def _ckpt_summary(c: Candidate) -> str:
    if not c.activation_checkpointing:
        return "off"
    return "selective" if c.checkpoint_selective else f"every {c.checkpoint_every_n_layers} layer(s)"


def _ckpt_short(c: Candidate) -> str:
    ckpt = "off"
    if c.activation_checkpointing:
        ckpt = "sel" if c.checkpoint_selective else f"1/{c.checkpoint_every_n_layers}"
    return f"ckpt={ckpt}"


def _pack_short(c: Candidate) -> str:
    return c.packing_strategy.value if c.packing else ("pf" if c.padding_free else "pad")


def _lora_short(c: Candidate) -> str | None:
    if not c.use_lora:
        return None
    return f"lora{c.lora_r}" + (f"/{c.quantization.value}" if c.quantization.value != "none" else "")


def _attn_short(c: Candidate) -> str | None:
    a = c.attn_implementation
    if a is None or a.value == "sdpa":
        return None
    return f"fa{a.flash_version}" if a.is_flash else "eager"


def _attn_summary(c: Candidate) -> str:
    return c.attn_implementation.value if c.attn_implementation is not None else "None"


def _on(token: str, field: str) -> Callable[[Candidate], str | None]:
    return lambda c: token if getattr(c, field) else None


def _shown_if_on(field: str) -> Callable[[Candidate], str | None]:
    return lambda c: "True" if getattr(c, field) else None


# ---- the optional `kernels` package ------------------------------------------------------------------------------

def kernels_available() -> bool:
    """transformers' own check that a compatible `kernels` package is importable (what `use_kernels=True` needs)."""
    return packages.installed("kernels")


# ---- the registry -------------------------------------------------------------------------------------------------
# In the order of the report's candidate cell (the trial table) and of the emitted keys within each home.

_CKPT = lambda c: c.activation_checkpointing  # noqa: E731
_LORA = lambda c: c.use_lora  # noqa: E731

KNOBS: tuple[Knob, ...] = (
    Knob("per_device_train_batch_size", Kind.INT, 8, Home.TRAINING_ARGUMENTS, "per_device_train_batch_size",
         "rows per micro-batch", minimum=1, memory=Memory.GROWS, search=(1, 2, 4, 8, 16, 32, 64),
         label="micro-batch x accumulation",
         summary=lambda c: f"{c.per_device_train_batch_size} x {c.gradient_accumulation_steps}",
         short=lambda c: f"{c.per_device_train_batch_size}x{c.gradient_accumulation_steps}", absent=8),
    Knob("gradient_accumulation_steps", Kind.INT, 1, Home.TRAINING_ARGUMENTS, "gradient_accumulation_steps",
         "micro-batches per optimizer step (derived: keeps the trained tokens per step fixed)", minimum=1,
         absent=1, search=(1,)),
    Knob("max_length", Kind.OPTIONAL_INT, 1024, Home.TRAINER_CONFIG, "max_length",
         "tokens per row after truncation (None: no truncation)", minimum=1, memory=Memory.GROWS,
         label="max_length", summary=lambda c: str(c.max_length), short=lambda c: f"L={c.max_length}",
         quality="rows longer than max_length are truncated", absent=1024),
    Knob("packing", Kind.BOOL, False, Home.TRAINER_CONFIG, "packing", "pack rows into max_length sequences",
         label="packing", summary=lambda c: c.packing_strategy.value if c.packing else "off", short=_pack_short,
         absent=False, search=(False, True)),
    Knob("packing_strategy", Kind.ENUM, PackingStrategy.BFD, Home.TRAINER_CONFIG, "packing_strategy",
         "bfd / bfd_split (padding-free) or wrapped", enum=PackingStrategy, active=lambda c: c.packing,
         quality="'wrapped' mixes examples and cuts them mid-sequence", absent="bfd"),
    Knob("padding_free", Kind.BOOL, False, Home.TRAINER_CONFIG, "padding_free",
         "one flattened row without padding (implied by bfd / bfd_split packing)",
         active=lambda c: not (c.packing and c.packing_strategy is not PackingStrategy.WRAPPED),
         label="padding_free", summary=lambda c: str(c.effective_padding_free), absent=False,
         search=(False, True)),
    Knob("pad_to_multiple_of", Kind.OPTIONAL_INT, None, Home.TRAINER_CONFIG, "pad_to_multiple_of",
         "pad each batch's length to a multiple", minimum=1, absent=None,
         # tensor-core-friendly lengths (8) or FA tiles (64), measured like every knob (more padding, fewer shapes)
         search=(None, 8, 64)),
    Knob("activation_checkpointing", Kind.BOOL, True, Home.TRAINING_ARGUMENTS, "activation_checkpointing",
         "recompute each checkpointed layer in the backward instead of keeping its activations",
         trl_aliases=("gradient_checkpointing",), memory=Memory.CHECKPOINTING, label="activation checkpointing",
         summary=_ckpt_summary, short=_ckpt_short, absent=True, search=(False, True)),
    Knob("checkpoint_selective", Kind.BOOL, False, Home.CHECKPOINT_KWARGS, "selective",
         "TRL's selective checkpointing: keep the matmul outputs, recompute the rest", aliases=("selective",),
         active=_CKPT, memory=Memory.CHECKPOINTING, absent=False, search=(False, True)),
    Knob("checkpoint_every_n_layers", Kind.INT, 1, Home.CHECKPOINT_KWARGS, "every_n_layers",
         "transformers checkpoints every n-th decoder layer only", minimum=1, aliases=("every_n_layers",),
         active=_CKPT, memory=Memory.CHECKPOINTING, absent=1),
    Knob("checkpoint_offload", Kind.BOOL, False, Home.CHECKPOINT_KWARGS, "offload",
         "transformers holds the checkpointed layers' saved inputs in pinned host memory "
         "(torch.autograd.graph.save_on_cpu around torch's checkpoint); the copies run on the compute stream",
         aliases=("activation_checkpointing_kwargs.offload", "gradient_checkpointing_kwargs.offload"),
         active=_CKPT, memory=Memory.CHECKPOINTING, label="checkpoint offload",
         summary=_shown_if_on("checkpoint_offload"), short=_on("ckpt-offload", "checkpoint_offload"),
         keyed_at_default=False, absent=False, stand_in=False),
    # no `search`: offered through --fix only; its copies run on the compute stream (always slower) and its saving
    # is modelled at the simulated peak (advisor/simulator/modelled.py), so the search does not pick it unasked
    Knob("optim", Kind.ENUM, Optimizer.ADAMW_TORCH_FUSED, Home.TRAINING_ARGUMENTS, "optim", "the optimizer",
         enum=Optimizer, label="optim", summary=lambda c: c.optim.value, short=lambda c: c.optim.value,
         absent="adamw_torch_fused"),
    Knob("activation_offloading", Kind.BOOL, False, Home.TRAINER_CONFIG, "activation_offloading",
         "TRL moves saved activations to pinned host memory on a side stream", memory=Memory.SAVES_WHEN_ON,
         label="activation offloading", summary=lambda c: str(c.activation_offloading),
         short=_on("offload", "activation_offloading"), absent=False, stand_in=False),
    Knob("group_by_length", Kind.BOOL, False, Home.TRAINING_ARGUMENTS, "train_sampling_strategy",
         "TrainingArguments.train_sampling_strategy=group_by_length", label="group_by_length",
         summary=lambda c: str(c.group_by_length), short=_on("gbl", "group_by_length"),
         extra_fix={"train_sampling_strategy": _fix_sampling}, search=(False, True)),
    Knob("use_lora", Kind.BOOL, False, Home.MODEL_CONFIG, "use_peft", "train LoRA adapters (trl sft --use_peft)",
         fix=_fix_plain("use_lora", _lora_methods), short=_lora_short,
         quality="LoRA adapters instead of full weights", absent=False),
    Knob("lora_r", Kind.INT, 16, Home.LORA_CONFIG, "lora_r", "LoRA rank", minimum=1, active=_LORA,
         absent=TRL_DEFAULT, search=(16,)),
    Knob("lora_alpha", Kind.INT, 32, Home.LORA_CONFIG, "lora_alpha", "LoRA scaling numerator", active=_LORA,
         absent=TRL_DEFAULT),
    Knob("lora_dropout", Kind.FLOAT, 0.0, Home.LORA_CONFIG, "lora_dropout", "dropout on the adapters' input",
         bounds=(0.0, 1.0), active=_LORA, absent=TRL_DEFAULT),
    Knob("lora_target_modules", Kind.MODULES, LLAMA_LINEARS, Home.LORA_CONFIG, "lora_target_modules",
         "the adapted projections (None: PEFT's default for the model type, peft's "
         "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)",
         active=_LORA, absent=None),
    Knob("quantization", Kind.ENUM, Quantization.NONE, Home.MODEL_CONFIG, "load_in_4bit",
         "bitsandbytes base weights (load_in_4bit / load_in_8bit)", enum=Quantization, trl_aliases=("load_in_8bit",),
         fix=_fix_plain("quantization", _quant_methods),
         extra_fix={"load_in_4bit": _fix_load_in, "load_in_8bit": _fix_load_in},
         quality="quantized base weights", requires="bitsandbytes"),
    Knob("weights_dtype", Kind.ENUM, WeightsDtype.FLOAT32, Home.MODEL_CONFIG, "dtype",
         "the dtype the weights load in (ModelConfig.dtype / model_init_kwargs dtype)", enum=WeightsDtype,
         aliases=("torch_dtype",), short=lambda c: None if c.weights_dtype.value == "float32" else
         c.weights_dtype.value, quality="pure low-precision weights (no float32 master copy)"),
    Knob("attn_implementation", Kind.OPTIONAL_ENUM, Attention.SDPA, Home.MODEL_CONFIG, "attn_implementation",
         "transformers' attention (None: what transformers picks, see space.default_attention)", enum=Attention,
         aliases=("attention",),
         label="attention", summary=_attn_summary, short=_attn_short, absent=None),
    Knob("precision", Kind.ENUM, Precision.BF16, Home.TRAINING_ARGUMENTS, "bf16",
         "mixed precision (TrainingArguments bf16 / fp16)",
         enum=Precision, trl_aliases=("fp16",), label="precision / weights",
         summary=lambda c: f"{c.precision.value} / {c.weights_dtype.value}",
         extra_fix={"bf16": _fix_precision_flag, "fp16": _fix_precision_flag}),
    Knob("expandable_segments", Kind.BOOL, True, Home.ENV, "PYTORCH_CUDA_ALLOC_CONF",
         "the caching allocator's expandable segments (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF)"),
    Knob("use_kernels", Kind.BOOL, False, Home.MODEL_INIT_KWARGS, "use_kernels",
         "transformers kernelizes the model with Hub kernels (the `kernels` package; TRL 1.16's replacement for "
         "use_liger_kernel): for training on CUDA its mapping swaps every RMSNorm for Liger's fused RMSNorm "
         "(kernels-community/liger-kernels); rotary is swapped for inference only, and the SwiGLU / Linear / loss "
         "kernels only where a KernelConfig asks for them", label="hub kernels",
         summary=_shown_if_on("use_kernels"), short=_on("kernels", "use_kernels"), keyed_at_default=False,
         absent=False, requires="kernels"),
    Knob("parallelism", Kind.ENUM, Layout.DDP, Home.ACCELERATE, "distributed_type",
         "how accelerate shards the model over --num-gpus ranks: DDP (nothing sharded), FSDP2 (fsdp_version: 2; "
         "resharding after forward or not; CPUOffloadPolicy) or DeepSpeed ZeRO-2 / ZeRO-3 (optimizer / parameter "
         "offload); written to the accelerate config (advisor/accelerate_config.py)", enum=Layout,
         aliases=("strategy",), label="parallelism",
         summary=lambda c: None if c.parallelism is Layout.DDP else c.parallelism.value,
         short=lambda c: None if c.parallelism is Layout.DDP else c.parallelism.value, keyed_at_default=False,
         absent="ddp"),
)

_BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}  # the Candidate fields
_OWNED: dict[str, Knob] = {}  # the trainers' own knobs (register_knobs), carried in the Candidate's base
_ALL: tuple[Knob, ...] | None = None
_CARRIED: dict[str, Any] | None = None


def register_knobs(*owned: Knob) -> tuple[Knob, ...]:
    """Add a trainer's own knobs (the trainer registry calls this when it registers the trainer; trainers sharing a
    declaration, GRPO and RLOO, register the same Knob twice). A taken knob or `--fix` name is refused."""
    global _ALL, _CARRIED
    owned = tuple(k for k in owned if _OWNED.get(k.name) is not k)
    taken = {n for k in (*KNOBS, *_OWNED.values()) for n in (k.name, *_fix_entries(k))}
    problems = []
    for k in owned:
        if not k.carried:
            problems.append(f"{k.name}: a trainer's own knob is carried in the candidate's base (carried=True); a "
                            "shared one is a Candidate field declared in advisor/knobs.py KNOBS")
        clash = sorted(taken & {k.name, *_fix_entries(k)})
        if clash:
            problems.append(f"{k.name}: {', '.join(clash)} already taken by another knob; choose another name")
        taken |= {k.name, *_fix_entries(k)}
    if problems:
        raise ConfigError(problems, context="knob registry")
    for k in owned:
        _OWNED[k.name] = k
    _ALL = _CARRIED = None
    return owned


def unregister_knobs(*owned: Knob) -> None:
    """Take a trainer's own knobs out of the registry again (the trainer registry's `unregister`)."""
    global _ALL, _CARRIED
    for k in owned:
        if _OWNED.get(k.name) is k:
            del _OWNED[k.name]
    _ALL = _CARRIED = None


def registry() -> tuple[Knob, ...]:
    """Every knob of every registered trainer: the shared ones (KNOBS, Candidate's fields), then the trainers' own,
    registered with their trainer (importing `advisor.trainers` registers the built-ins). This module sits below
    the trainers and never imports them."""
    global _ALL
    if _ALL is None:  # (re)built after a trainer registered its knobs
        _ALL = (*KNOBS, *_OWNED.values())
    return _ALL


def knob(name: str) -> Knob:
    k = _BY_NAME.get(name)
    if k is None:
        k = {x.name: x for x in registry()}[name]
    return k


def knobs_in(*homes: Home) -> tuple[Knob, ...]:
    """The shared knobs (Candidate fields) that live in `homes`, in registry order."""
    return tuple(k for k in KNOBS if k.home in homes)


def config_knobs(trainer: Trainer) -> tuple[Knob, ...]:
    """The knobs `trainer`'s config object holds as fields (TrainingArguments' and its own), in registry order."""
    return tuple(k for k in registry() if k.home in (Home.TRAINING_ARGUMENTS, Home.TRAINER_CONFIG)
                 and trainer.accepts(k))


def value(c: Candidate, k: Knob) -> Any:
    """The knob's value on `c`: its field, or (a trainer's own knob) its key in the base, its default when absent."""
    if k.carried:
        return c.base.get(k.key, k.default)
    return getattr(c, k.name)


def carried_defaults() -> dict[str, Any]:
    """The trainers' own knobs (carried in the base) -> their defaults (a default is left out of the base)."""
    global _CARRIED
    if _CARRIED is None:
        _CARRIED = {k.name: k.default for k in registry() if k.carried}
    return _CARRIED

# ---- derivations ------------------------------------------------------------------------------------------------

def coerce(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Every knob's stored value and every problem at once (Candidate.__post_init__)."""
    out, problems = {}, []
    for name, value in values.items():
        k = _BY_NAME.get(name)
        if k is None:
            continue
        v, problem = k.coerce(value)
        if problem:
            problems.append(problem)
        out[name] = v
    return out, problems


def canonical_changes(c: Candidate) -> dict[str, Any]:
    """Inactive knobs back to their defaults (judged on `c` as it is), so equivalent candidates compare equal."""
    return {k.name: k.default for k in KNOBS if not k.is_active(c) and getattr(c, k.name) != k.default}


def stand_ins(c: Candidate) -> dict[str, Any]:
    """The values fake tensors run instead of what they cannot (simulate models the difference)."""
    return {k.name: k.stand_in for k in KNOBS
            if k.stand_in is not NO_STAND_IN and getattr(c, k.name) != k.stand_in}


_TRL_HOMES = (Home.TRAINING_ARGUMENTS, Home.TRAINER_CONFIG, Home.MODEL_CONFIG, Home.LORA_CONFIG)


def yaml_keys(k: Knob) -> tuple[str, ...]:
    """The top-level keys of a `trl <command>` run config this knob is read from (none for kwargs / env knobs)."""
    return (k.key, *k.trl_aliases) if k.home in _TRL_HOMES else ()


def _fix_entries(k: Knob) -> dict[str, Callable[[str, str], FixResult]]:
    parser = k.fix or _plain_parser(k)
    out = {name: parser for name in (k.name, *yaml_keys(k), *k.aliases)}
    out.update(k.extra_fix)
    return out


def fix_names(trainer: Trainer | None = None) -> dict[str, tuple[Knob, Callable[[str, str], FixResult]]]:
    """Every name `--fix` accepts -> (its knob, its parser): the field name, TRL's names, the aliases; of the knobs
    `trainer` accepts (None: of every registered trainer's)."""
    return {name: (k, parser) for k in registry() if trainer is None or trainer.accepts(k)
            for name, parser in _fix_entries(k).items()}


def _plain_parser(k: Knob) -> Callable[[str, str], FixResult]:
    def parse(key: str, text: str) -> FixResult:
        value, problem = k.parse_text(text, as_name=k.name)
        return FixResult(problem=problem) if problem else FixResult({k.name: (value,)})

    return parse


def parse_fix_value(key: str, text: str) -> FixResult | None:
    """One `--fix KEY=TEXT`; None when KEY is not a name any knob of any trainer answers to."""
    entry = fix_names().get(key)
    if entry is None:
        return None
    return entry[1](key, text)


def ordered_names() -> tuple[str, ...]:
    """Knobs along which memory only moves one way (as far as a failure bounds its neighbours)."""
    return tuple(k.name for k in registry() if k.memory is not Memory.UNORDERED)


def memory_le(a: Candidate, b: Candidate) -> bool:
    """a needs no more memory than b along every ordered knob (the other knobs are the caller's to compare)."""
    for k in registry():
        va, vb = value(a, k), value(b, k)
        if k.memory is Memory.GROWS and va != vb and (va is None or vb is None or va > vb):
            return False
        if k.memory is Memory.SAVES_WHEN_ON and vb and not va:
            return False
    return _checkpointing_le(a, b)


def _checkpointing_le(a: Candidate, b: Candidate) -> bool:
    """a saves no more activations on the device than b. A partial order: no checkpointing is the most; full
    checkpointing of every layer is the least but for the same with its saved inputs offloaded; offloading the
    saved inputs never adds device memory (the one brought back for its layer's recompute is the one that would
    have stayed)."""
    names = [k.name for k in KNOBS if k.memory is Memory.CHECKPOINTING]
    la, lb = tuple(getattr(a, n) for n in names), tuple(getattr(b, n) for n in names)
    if la == lb or not b.activation_checkpointing:
        return True
    if not a.activation_checkpointing:
        return False
    full = not a.checkpoint_selective and a.checkpoint_every_n_layers == 1
    if full and (a.checkpoint_offload or not b.checkpoint_offload):
        return True
    same_but_offload = (a.checkpoint_selective, a.checkpoint_every_n_layers) == (
        b.checkpoint_selective, b.checkpoint_every_n_layers)
    return same_but_offload and a.checkpoint_offload and not b.checkpoint_offload


def checkpoint_kwargs(c: Candidate) -> dict[str, Any]:
    """The activation_checkpointing_kwargs keys of the knobs that live there, where not at their default."""
    return {k.key: k.plain(getattr(c, k.name)) for k in knobs_in(Home.CHECKPOINT_KWARGS)
            if getattr(c, k.name) != k.default}


def trial_label(c: Candidate, trainer: Trainer | None = None) -> str:
    """The trial table's candidate cell: each knob's token, in registry order (a trainer's own knob after the
    shared ones, shown only where the candidate carries it); with `trainer`, only the knobs its config has (a GRPO
    candidate's cell shows no max_length or padding, which GRPOConfig does not have)."""
    return " ".join(t for t in (k.short(c) for k in registry()
                                if k.short is not None and (trainer is None or trainer.accepts(k))) if t)


def summary_rows(c: Candidate, trainer: Trainer | None = None) -> list[list[str]]:
    """The report's (label, value) rows of the knobs, in registry order (a knob whose value is None is left out;
    with `trainer`, a knob its config has no field for: GRPO's report shows no max_length)."""
    return _rows(c, tuple(k for k in KNOBS if trainer is None or trainer.accepts(k)))


def owned_rows(c: Candidate, trainer: Trainer) -> list[list[str]]:
    """The report's (label, value) rows of `trainer`'s own knobs (its view's, carried in the base), in order."""
    return _rows(c, trainer.knob_view.KNOBS)


def _rows(c: Candidate, ks: tuple[Knob, ...]) -> list[list[str]]:
    rows = []
    for k in ks:
        if k.summary is None:
            continue
        shown = k.summary(c)
        if shown is not None:
            rows.append([k.label, shown])
    return rows


# ---- the check of Candidate against the registry -----------------------------------------------------------------

def verify(cls: type) -> None:
    """Raise ConfigError when Candidate's field block (`cls`) and KNOBS disagree (advisor/space.py calls it)."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "base"}
    problems = []
    for name in sorted(set(fields) - set(_BY_NAME)):
        problems.append(f"Candidate.{name} has no declaration in advisor/knobs.py KNOBS: declare it there "
                        "(its home in TRL, --fix names, when it is active, memory order, label)")
    for name in sorted(set(_BY_NAME) - set(fields)):
        problems.append(f"KNOBS declares {name!r}, which is not a Candidate field: add the field to "
                        "advisor/space.py Candidate or remove the declaration")
    for name in sorted(set(fields) & set(_BY_NAME)):
        k, f = _BY_NAME[name], fields[name]
        want = annotation(k)
        if str(f.type) != want:
            problems.append(f"Candidate.{name} is annotated {f.type!r}; its declaration says {want!r}")
        if f.default is not dataclasses.MISSING and f.default != k.default:
            problems.append(f"Candidate.{name} defaults to {f.default!r}; its declaration says {k.default!r}")
    names = [n for k in KNOBS for n in _fix_entries(k)]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        problems.append(f"--fix names declared twice: {dup}")
    if problems:
        raise ConfigError(problems, context="Candidate and the knob registry disagree")
