"""The memory knobs: one `Candidate` is one value for every knob; a `SearchSpace` is the set the search explores.

`Candidate.problems()` encodes TRL 1.16's own rules, exactly as strict as TRL and no stricter, so that no
emitted configuration can be rejected by TRL.

The value types, `RunBase`, `QualityCost` and the rules live in the value-type layer `advisor/values/` (imported
through its `__init__` only), below `knobs.py`; this module holds `Candidate` and `SearchSpace` above the knobs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import knobs as _knobs
from .errors import ConfigError
from .values import (
    CHECKPOINT_EXTRA,
    UNSUPPORTED_OPTIMIZERS,
    Attention,
    Optimizer,
    PackingStrategy,
    Precision,
    QualityCost,
    Quantization,
    RunBase,
    WeightsDtype,
    candidate_problems,
    default_attention,
    model_linear_names,
    peft_default_targets,
)
from .workload import Method

if TYPE_CHECKING:
    from .workload import GPUSpec, ModelSpec

__all__ = [  # noqa: RUF022
    "Candidate", "SearchSpace", "RunBase", "QualityCost", "PackingStrategy", "Precision", "WeightsDtype",
    "Quantization", "Optimizer", "Attention", "UNSUPPORTED_OPTIMIZERS", "CHECKPOINT_EXTRA", "carried_knobs",
    "knob_value", "with_knobs", "model_linear_names", "peft_default_targets", "default_lora_targets",
]


# The order of Candidate's fields (`to_dict()`, the JSON the CLI writes, baselines): the order stored studies and
# baselines keep; a knob not named here follows, in registry order (advisor/knobs.py KNOBS).
_FIELD_ORDER = (
    "max_length", "packing", "packing_strategy", "padding_free", "pad_to_multiple_of", "per_device_train_batch_size",
    "gradient_accumulation_steps", "activation_checkpointing", "checkpoint_selective", "checkpoint_every_n_layers",
    "activation_offloading", "optim", "precision", "weights_dtype", "group_by_length", "attn_implementation",
    "use_lora", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "quantization", "expandable_segments",
    "checkpoint_offload", "use_kernels", "parallelism",
)


def _knob_fields(cls: type) -> type:
    """One field per shared knob, from its declaration (advisor/knobs.py KNOBS: name, annotation, default), then the
    class's own (`base`): each knob is declared once, in the registry."""
    rank = {name: i for i, name in enumerate(_FIELD_ORDER)}
    ordered = sorted(_knobs.KNOBS, key=lambda k: rank.get(k.name, len(rank)))  # stable: new knobs in registry order
    own = dict(cls.__dict__.get("__annotations__", {}))
    cls.__annotations__ = {**{k.name: _knobs.annotation(k) for k in ordered}, **own}
    for k in ordered:
        setattr(cls, k.name, k.default)
    return cls


@dataclass(frozen=True)
@_knob_fields
class Candidate:
    """One value for every memory knob: a field per shared knob of the registry (advisor/knobs.py `KNOBS`: its
    name, type and default, its home in TRL, validity, `--fix` names, when it is active, memory order, labels), named
    as TRL's config / ModelConfig name it where one exists. A trainer's own knobs (DPO's) ride in `base`.
    Validation and `canonical()` derive from the registry too."""

    # the user's other keys (not a knob: the search never changes it)
    base: RunBase = field(default_factory=RunBase)

    def __post_init__(self) -> None:
        # Accept plain strings (YAML, --fix) and lists; store Enums and tuples so candidates hash and compare.
        values, problems = _knobs.coerce({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
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
        kwargs: dict[str, Any] = {"use_reentrant": False, **(self.base.get(CHECKPOINT_EXTRA) or {})}
        kwargs.update(_knobs.checkpoint_kwargs(self))  # selective, every_n_layers, offload (advisor/knobs.py)
        return kwargs

    def replace(self, **changes: Any) -> Candidate:
        """A copy with `changes`, each checked as __post_init__ checks it. Only the changed knobs are coerced (the
        rest are this candidate's, already valid): the search builds tens of thousands of candidates a run."""
        if not changes:
            return self
        if "base" in changes or not changes.keys() <= _KNOB_FIELDS:
            return dataclasses.replace(self, **changes)  # the user's keys, or a name dataclasses must refuse
        values, problems = _knobs.coerce(changes)
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
        changes = _knobs.canonical_changes(self)  # knob defaults: stored values already
        return self._with_checked(changes) if changes else self

    def to_dict(self) -> dict[str, Any]:
        """Knobs as plain values; `base` only when the user's config had other keys (so the search's candidates,
        their study keys and stored baselines keep their form)."""
        knob = _knobs.knob
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
        """Every rule of TRL 1.16 / transformers 5 / torch that this candidate breaks, with the fix
        (advisor/values/rules.py)."""
        return candidate_problems(self, gpu, model)

    def check(self, gpu: GPUSpec | None = None, model: ModelSpec | None = None) -> Candidate:
        """Raise ConfigError with every problem at once; return self when valid."""
        problems = self.problems(gpu, model)
        if problems:
            raise ConfigError(problems, context="configuration rejected")
        return self

    def requirements(self) -> tuple[str, ...]:
        """Packages the training run needs beyond torch/transformers/trl/peft (pip names)."""
        # every registered knob's, a trainer's own included (GRPO's use_vllm needs vllm)
        out = [k.requires for k in _knobs.registry() if k.requires and _knobs.value(self, k) != k.default]
        if self.optim.needs_bitsandbytes and "bitsandbytes" not in out:
            out.append("bitsandbytes")
        if self.attn_implementation is not None and self.attn_implementation.is_flash:
            # kernels-community/*: loaded from the Hub through `kernels`; flash_attention_N: the flash-attn package
            # (transformers falls back to the Hub kernel only where `kernels` is installed instead)
            out.append(self.attn_implementation.package)
        return tuple(dict.fromkeys(out))  # each once (use_kernels and a Hub kernel's attention both need `kernels`)

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



def default_lora_targets(model: ModelSpec) -> tuple[str, ...]:
    """All linear layers of the decoder, written out (never 'all-linear', so the config says what it does)."""
    return model_linear_names(model)


def carried_knobs() -> dict[str, Any]:
    """The trainers' own knobs, carried in the candidate's base under their config's name (advisor/knobs.py
    `carried`, e.g. DPO's precompute_ref_log_probs) -> their defaults. Searched like Candidate fields: a space may
    name them, `knob_value` reads them and `with_knobs` sets them (the default is left out of the base, so a
    candidate without them stays as it was)."""
    return _knobs.carried_defaults()


def knob_value(cand: Candidate, name: str) -> Any:
    """A Candidate field, or a carried knob with its default when absent."""
    carried = carried_knobs()
    if name in carried:
        return cand.base.get(name, carried[name])
    return getattr(cand, name)


def with_knobs(cand: Candidate, **values: Any) -> Candidate:
    """`cand.replace(**values)` where carried knobs go into the base."""
    defaults = carried_knobs()
    carried = {k: values.pop(k) for k in list(values) if k in defaults}
    out = cand.replace(**values) if values else cand
    if carried:
        base = out.base.as_dict()
        for k, v in carried.items():
            if v == defaults[k]:
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
        names = ({f.name for f in dataclasses.fields(Candidate)} - {"base"}) | set(carried_knobs())
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
        if not any(k in carried_knobs() for k in keys):
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
_knobs.verify(Candidate)  # the field block against its declarations (advisor/knobs.py KNOBS)
