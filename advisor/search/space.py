"""The default search space of a workload, `--fix` pins, and the accumulation that keeps the effective batch fixed."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import knobs as _knobs
from ..errors import ConfigError, UsageError
from ..knobs import fix_names, knob, parse_fix_value, registry
from ..packages import install_hint, missing
from ..parallelism import search_layouts
from ..space import (
    Attention,
    Candidate,
    Optimizer,
    PackingStrategy,
    Precision,
    Quantization,
    SearchSpace,
    WeightsDtype,
    default_lora_targets,
    with_knobs,
)
from ..trainers import get_trainer, owners, trainer_of
from ..workload import Method

if TYPE_CHECKING:
    from ..data import Dataset
    from ..trainers import Trainer
    from ..workload import Workload

# TRL's defaults: per_device_train_batch_size=8, gradient_accumulation_steps=1 -> the default effective batch.
DEFAULT_ROWS_PER_STEP = 8

# ---- effective batch ---------------------------------------------------------------------------------------
class RowTokens:
    """Trained tokens per micro-batch row for each (max_length, packing, strategy), memoised (it scans the data);
    the data read through the Dataset protocol only (advisor.data.Dataset)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self._memo: dict[tuple, float] = {}

    def __call__(self, c: Candidate) -> float:
        key = (c.max_length, c.packing, c.packing_strategy if c.packing else None)
        if key not in self._memo:
            self._memo[key] = max(1e-9, float(self.dataset.trained_tokens_per_row(c)))
        return self._memo[key]

    def truncation(self, c: Candidate) -> float:
        key = ("trunc", c.max_length, c.packing, c.packing_strategy if c.packing else None)
        if key not in self._memo:
            self._memo[key] = self.dataset.truncated_share(c.max_length, c.packing, c.packing_strategy.value)
        return self._memo[key]


def default_tokens_per_step(workload: Workload, row_tokens: RowTokens | None = None) -> int:
    """The user's --tokens-per-step, else TRL's default 8 rows x mean trained tokens at TRL's default max_length."""
    if workload.goals.tokens_per_step:
        return int(workload.goals.tokens_per_step)
    rt = row_tokens or RowTokens(workload.dataset)
    # TRL's default is per device: 8 rows on each of --num-gpus ranks
    return max(1, round(DEFAULT_ROWS_PER_STEP * workload.num_gpus * rt(Candidate.trl_defaults())))


BATCH_TOLERANCE = 0.25  # a candidate's trained tokens per optimizer step stay within +-25% of the target


def accumulation_for(b: int, rows: float) -> int | None:
    """The accumulation that makes `b` rows per micro-batch carry `rows` rows per optimizer step within
    BATCH_TOLERANCE, or None when none does. `rows` may be fractional (1729 tokens / 216.1 per row = 7.9998)."""
    if rows <= 0 or b < 1:
        return None
    acc = max(1, round(rows / b))
    ratio = b * acc / rows
    # 1e-9 of slack so a ratio that is 1 +- 0.25 up to float rounding is judged as the exact value would be
    return acc if abs(ratio - 1.0) <= BATCH_TOLERANCE + 1e-9 else None


def with_accumulation(c: Candidate, tokens_per_step: int, row_tokens: RowTokens,
                      num_gpus: int = 1) -> Candidate | None:
    """Set gradient_accumulation_steps so micro-batch x accumulation x `num_gpus` ranks carries `tokens_per_step`
    trained tokens (the effective batch counts every rank).

    accumulation = round(rows / micro-batch); None when that leaves the trained tokens per optimizer step more
    than BATCH_TOLERANCE away from `tokens_per_step` (e.g. 16 x 1 against an 8-row step is 2.0x: refused).
    """
    rows = tokens_per_step / row_tokens(c) / num_gpus
    acc = accumulation_for(c.per_device_train_batch_size, rows)
    if acc is None:
        return None
    return c if acc == c.gradient_accumulation_steps else dataclasses.replace(c, gradient_accumulation_steps=acc)


# ---- the default space -------------------------------------------------------------------------------------
def default_space(workload: Workload, method: Method) -> SearchSpace:
    """Every quality-neutral knob free; quality-changing ones only as the workload's goals allow.

    The values the model, the data, the target or the goals decide are worked out here (the max_length rungs: the
    trainer's, from its data); the rest are each knob's declaration (advisor/knobs.py `search`, a trainer's own knob
    in its module), and a knob the workload's trainer does not search (`Trainer.searches`) is held at its default."""
    gpu, model, goals = workload.gpu, workload.model, workload.goals
    cuda = gpu.is_cuda
    trainer = trainer_of(workload)
    if not trainer.accepts(knob("max_length")):  # GRPOConfig / RLOOConfig have no max_length: held
        lengths: tuple[int, ...] = (knob("max_length").default,)
    else:
        lengths = trainer.max_length_values(workload)
    ctx = model.max_position_embeddings  # no max_length beyond the model's context (rows longer are truncated)
    if ctx is not None:
        lengths = tuple(sorted({min(v, ctx) for v in lengths}))
    precision = (Precision.BF16,) if (not cuda or gpu.supports_bf16) else (Precision.FP16,)
    weights = [WeightsDtype.FLOAT32]
    if goals.allow_low_precision_weights:
        weights.append(WeightsDtype.BFLOAT16 if precision[0] is Precision.BF16 else WeightsDtype.FLOAT16)
    strategies = [PackingStrategy.BFD, PackingStrategy.BFD_SPLIT]
    if goals.allow_wrapped:
        strategies.append(PackingStrategy.WRAPPED)
    optims = [Optimizer.ADAMW_TORCH_FUSED, Optimizer.ADAMW_TORCH]
    if cuda:
        optims += [Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT]
    attention = [Attention.SDPA]
    if cuda and gpu.supports_flash_attention:
        attention.append(Attention.FLASH_ATTENTION_2)
    every_n = tuple(n for n in (1, 2) if n <= model.num_layers)
    values: dict[str, tuple[Any, ...]] = {
        "max_length": (*lengths, None),
        "packing_strategy": tuple(strategies),
        "checkpoint_every_n_layers": every_n,
        "activation_offloading": (False, True) if cuda else (False,),
        "optim": tuple(optims),
        "precision": precision,
        "weights_dtype": tuple(weights),
        "attn_implementation": tuple(attention),
        "expandable_segments": (True,) if cuda else (False,),
        "use_lora": (method in (Method.LORA, Method.QLORA),),
        "lora_target_modules": (default_lora_targets(model),),
        "quantization": (Quantization.NF4, Quantization.INT8) if method is Method.QLORA else (Quantization.NONE,),
    }
    # Hub kernels (use_kernels) only where a run can load them: the optional `kernels` package importable
    # (pip install 'advisor[kernels]') and a CUDA target (transformers' mapping has no CPU training kernels).
    # Offline without the package the key stays out of the space, so candidates keep use_kernels=False and the
    # space, its study key and the search's trials are what they were.
    if cuda and _knobs.kernels_available():  # looked up on the module: tests stand one in
        values["use_kernels"] = (False, True)
    # several GPUs: the parallelism; on one GPU the key stays out, so candidates, study keys and the search's trials
    # are what they were
    if workload.num_gpus > 1:
        values["parallelism"] = search_layouts(workload.num_gpus)
    for k in registry():
        if k.name not in values:
            if k.search is None or (k.carried and not trainer.accepts(k)):
                continue  # offered through --fix only (checkpoint_offload, lora_alpha), or another trainer's own
            values[k.name] = k.search
        if not trainer.searches(k):
            values[k.name] = (k.default,)  # a Candidate field every candidate has: held at its default
    # the values a trainer decides from the target (online RL's generation engine: vLLM only on CUDA, server mode
    # only with several GPUs), declared in its module under advisor/trainers/
    values.update(trainer.search_values(workload, values))
    return SearchSpace(values)


# ---- what a run here can import ------------------------------------------------------------------------------
def value_requirements(name: str, value: Any) -> tuple[str, ...]:
    """The packages a run needs for knob `name` at `value`, beyond what the default candidate needs
    (Candidate.requirements: 8-bit optimizers and quantization need bitsandbytes, Hub kernels `kernels`, vLLM
    `vllm`)."""
    try:
        cand = with_knobs(Candidate(), **{name: value})
    except (ConfigError, TypeError, ValueError):
        return ()
    default = set(Candidate().requirements())
    return tuple(p for p in cand.requirements() if p not in default)


@dataclass(frozen=True)
class LeftOut:
    """What `installed_space` left out of a space for a run on this machine: the knob values that need each missing
    package, and the knobs none of whose values were left (the space is then empty)."""

    by_package: Mapping[str, tuple[tuple[str, Any], ...]]
    emptied: Mapping[str, tuple[str, ...]]

    def why_empty(self) -> str | None:
        """Why no candidate is left, when a knob lost every value; else None."""
        if not self.emptied:
            return None
        needs = tuple(dict.fromkeys(p for ps in self.emptied.values() for p in ps))
        return (f"every value of {', '.join(self.emptied)} needs {', '.join(needs)}, which is not installed here "
                f"and the run is on this machine ({install_hint(needs)})")


def installed_space(space: SearchSpace, pins: Pins) -> tuple[SearchSpace, LeftOut]:
    """For a run on this machine: `space` without the knob values that need a package missing here, and what was
    left out (where a knob would lose every value, the space has no admissible candidate: LeftOut.why_empty). A
    --fix that leaves a knob only such values is refused (UsageError) naming it and the install."""
    values: dict[str, tuple[Any, ...]] = {}
    left: dict[str, list[tuple[str, Any]]] = {}
    emptied: dict[str, tuple[str, ...]] = {}
    for name, vals in space.values.items():
        keep = []
        for v in vals:
            gone = missing(value_requirements(name, v))
            for package in gone:
                left.setdefault(package, []).append((name, v))
            if not gone:
                keep.append(v)
        if vals and not keep:  # kept whole (a SearchSpace has a value for every knob); `why_empty` says why not
            emptied[name] = missing(p for v in vals for p in value_requirements(name, v))
        values[name] = tuple(keep) or vals
    refused = [f"--fix {name}={','.join(str(getattr(v, 'value', v)) for v in space.values[name])}: needs "
               f"{', '.join(needs)}, which is not installed here, and the run is on this machine (its GPU, or a "
               f"probe); {install_hint(needs)}, or drop the --fix"
               for name, needs in emptied.items() if name in pins.values]
    if refused:
        raise UsageError("; ".join(refused))
    return SearchSpace(values), LeftOut({p: tuple(v) for p, v in left.items()}, emptied)


def attention_refusal(space: SearchSpace, cand: Candidate) -> str | None:
    """Why `cand` is not admitted for its attention, or None.

    Where the space offers FlashAttention next to other implementations (an FA-capable GPU and attn_implementation
    not pinned by --fix), a padding-free batch (padding_free, or bfd / bfd_split packing) must use FlashAttention:
    its varlen kernel attends within each sequence, while sdpa and eager get a block-diagonal mask over the whole
    flattened row (T x T) and K/V repeated to every head, which TRL warns against. A space that offers one
    implementation (pinned, or a GPU without FlashAttention) admits every combination TRL accepts.
    """
    offered = space.values.get("attn_implementation", (Candidate().attn_implementation,))
    flash = [a for a in map(_attention, offered) if a is not None and a.is_flash]
    attn = _attention(cand.attn_implementation)
    if len(offered) > 1 and flash and cand.effective_padding_free and not (attn is not None and attn.is_flash):
        batch = "padding_free=True" if cand.padding_free else f"packing_strategy={cand.packing_strategy.value}"
        name = attn.value if attn is not None else "None"
        return (f"{batch} with attn_implementation={name}: padding-free batches take "
                f"FlashAttention ({flash[0].value}) on this GPU; pin --fix "
                f"attn_implementation={name} to measure it anyway")
    return None


def _attention(value: Any) -> Attention | None:
    """A space's attn_implementation value as the Enum (None: not written, or not an Attention at all)."""
    try:
        return None if value is None else Attention(value)
    except ValueError:
        return None


# ---- --fix FIELD=VALUE -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pins:
    """Knob -> allowed values, from --fix; `methods` narrows full/lora/qlora when a pin implies one."""

    values: Mapping[str, tuple[Any, ...]]
    methods: frozenset[Method] | None = None


def fixable_fields(trainer: Trainer | None = None) -> list[str]:
    """Every name `--fix` accepts (for `trainer`; None: for any registered trainer): each knob's field name, TRL's
    names and aliases (advisor/knobs.py)."""
    return sorted(fix_names(trainer))


def parse_fix(fix: Mapping[str, Any] | None, trainer: str | Trainer | None = None) -> Pins:
    """Map TRL's config / ModelConfig names to knobs; raise ConfigError naming every bad field at once. `trainer`:
    a knob that trainer's config has no field for is refused by name (None: every trainer's knobs accepted)."""
    if not fix:
        return Pins({})
    trainer = get_trainer(trainer) if trainer is not None else None
    pins: dict[str, tuple[Any, ...]] = {}
    methods: frozenset[Method] | None = None
    problems: list[str] = []

    def pin(knob: str, vals: tuple[Any, ...]) -> None:
        pins[knob] = tuple(v for v in pins[knob] if v in vals) if knob in pins else vals
        if not pins[knob]:
            problems.append(f"--fix: contradictory values for {knob}")

    for raw_key, raw_value in fix.items():
        key = str(raw_key).strip()
        text = str(raw_value).lower() if isinstance(raw_value, bool) else str(raw_value)
        result = parse_fix_value(key, text)
        if result is None:
            problems.append(f"--fix {key}: unknown field; fixable: {', '.join(fixable_fields(trainer))}")
            continue
        if trainer is not None and key not in fix_names(trainer):
            owned = ", ".join(sorted(owners(fix_names()[key][0])))
            problems.append(f"--fix {key}: a knob of {owned}, not of trainer {trainer.name!r} (its config has no "
                            f"such field); drop it or use --trainer {owned.split(', ')[0]}")
            continue
        if result.problem:
            problems.append(result.problem)
            continue
        for name, vals in result.pins.items():
            pin(name, vals)
        if result.methods is not None:
            methods = result.methods
    if problems:
        raise ConfigError(problems, context="--fix")
    return Pins(pins, methods)


def apply_pins(space: SearchSpace, pins: Pins) -> SearchSpace:
    values = dict(space.values)
    values.update(pins.values)
    return SearchSpace(values)


def method_order(method: Method, pins: Pins) -> list[Method]:
    """auto escalates full -> lora -> qlora; a pin may rule some out."""
    order = [Method.FULL, Method.LORA, Method.QLORA] if method is Method.AUTO else [method]
    if pins.methods is not None:
        ruled_out = [m for m in order if m not in pins.methods]
        order = [m for m in order if m in pins.methods]
        if not order:
            implied = ", ".join(sorted(m.value for m in pins.methods))
            raise ConfigError(f"--method {method.value} contradicts --fix (which implies {implied}); drop one of them")
        del ruled_out
    return order
