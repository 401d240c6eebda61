"""What a knob is: its declaration (`Knob`: kind, default, home in TRL, `--fix` parsing, memory order, labels), its
value types (`Home`, `Kind`, `Memory`, `FixResult`) and a trainer's own knobs as one typed view (`KnobView`,
`knob_view`). The registry of every knob, and what derives from it, is advisor/knobs.py (the public way to these)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..space import Candidate
    from ..workload import Method


class Home(str, Enum):
    """Where a knob lives in what `trl <command>` reads."""

    TRAINING_ARGUMENTS = "TrainingArguments"  # a field of transformers.TrainingArguments: every trainer's config
    TRAINER_CONFIG = "trainer config"  # a field of the trainers' own configs (SFTConfig, DPOConfig, ...)
    MODEL_CONFIG = "ModelConfig"  # a field of trl.ModelConfig (trl sft builds model_init_kwargs / quantization)
    LORA_CONFIG = "LoraConfig"  # ModelConfig's lora_* fields, which trl.get_peft_config turns into a LoraConfig
    MODEL_INIT_KWARGS = "model_init_kwargs"  # a key of the trainer config's model_init_kwargs (from_pretrained's)
    CHECKPOINT_KWARGS = "activation_checkpointing_kwargs"  # a key of TrainingArguments' activation_checkpointing_kwargs
    ENV = "env"  # an environment variable (the YAML's `env:` block)
    ACCELERATE = "accelerate"  # the accelerate config (`accelerate launch --config_file`), not the TRL YAML


class Kind(str, Enum):
    """The value type of a knob; `Candidate`'s annotation must say the same (checked at import)."""

    BOOL = "bool"
    INT = "int"
    OPTIONAL_INT = "int | None"
    FLOAT = "float"
    ENUM = "enum"
    OPTIONAL_ENUM = "enum | None"
    MODULES = "tuple[str, ...] | None"


class Memory(str, Enum):
    """How peak memory moves along a knob, all else equal (what a failed candidate bounds, see ledger)."""

    UNORDERED = "unordered"  # no order: a failure says nothing about other values
    GROWS = "grows"  # more memory at larger values; None (no cap) is comparable only with itself
    SAVES_WHEN_ON = "saves_when_on"  # a bool whose True never needs more memory than False
    CHECKPOINTING = "checkpointing"  # one of the checkpointing group, ordered jointly (`_checkpointing_le`)


# `absent` of a knob whose YAML key, when missing, takes TRL's own default for that field
TRL_DEFAULT = object()
NO_STAND_IN = object()  # a knob fake tensors run as it is

_BOOL_TRUE = {"true", "1", "yes", "on"}
_BOOL_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null", "~"}


@dataclass(frozen=True)
class FixResult:
    """What one `--fix NAME=VALUE` pins: knob -> allowed values, the methods it implies, or the problem."""

    pins: Mapping[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    methods: frozenset[Method] | None = None
    problem: str | None = None


@dataclass(frozen=True)
class Knob:
    """One memory knob, declared once (see the module docstring for what derives from it)."""

    name: str  # the Candidate field
    kind: Kind
    default: Any  # Candidate's default
    home: Home
    key: str  # its name in its home (the YAML key, the kwargs key, the variable)
    doc: str  # what it does in TRL / transformers / torch
    enum: type[Enum] | None = None
    minimum: int | None = None  # INT / OPTIONAL_INT: validated >= minimum (None: not validated)
    bounds: tuple[float, float] | None = None  # FLOAT: lo <= value < hi
    trl_aliases: tuple[str, ...] = ()  # TRL's other keys for it, read from a run config and accepted by --fix
    aliases: tuple[str, ...] = ()  # other names --fix accepts
    fix: Callable[[str, str], FixResult] | None = None  # a parser of its own for `--fix NAME=VALUE`
    extra_fix: Mapping[str, Callable[[str, str], FixResult]] = dataclasses.field(default_factory=dict)
    active: Callable[[Candidate], bool] | None = None  # None: always has an effect
    memory: Memory = Memory.UNORDERED
    label: str = ""  # the report's row name; "" when it is shown in another knob's row
    summary: Callable[[Candidate], str | None] | None = None  # the report's row value (None: row left out)
    short: Callable[[Candidate], str | None] | None = None  # its token in the trial table's candidate cell
    quality: str = ""  # what it gives up against full float32 fine-tuning ("" when quality-neutral)
    keyed_at_default: bool = True  # False: left out of to_dict() at its default (study keys of older knobs stay)
    absent: Any = None  # its value when a run config does not set its key (TRL_DEFAULT: TRL's own default)
    stand_in: Any = NO_STAND_IN  # the value fake tensors run instead (simulate models the difference)
    requires: str | None = None  # a pip package the run needs when the knob is on
    search: tuple[Any, ...] | None = None  # its default-space values where no workload decides them (search/space)
    carried: bool = False  # a trainer's own knob: in the Candidate's base under `key` (== name), not a field
    emit_none: bool = True  # False: left out of the emitted config at None (TRL's own None then applies)

    def __post_init__(self) -> None:
        problems = []
        if self.carried and self.key != self.name:
            problems.append(f"{self.name}: a carried knob rides in the base under its config key (key == name)")
        if self.kind in (Kind.ENUM, Kind.OPTIONAL_ENUM) and self.enum is None:
            problems.append(f"{self.name}: an enum knob needs `enum`")
        if self.kind is Kind.FLOAT and self.bounds is None:
            problems.append(f"{self.name}: a float knob needs `bounds`")
        if self.memory is Memory.SAVES_WHEN_ON and self.kind is not Kind.BOOL:
            problems.append(f"{self.name}: SAVES_WHEN_ON is for bool knobs")
        if problems:
            raise ConfigError(problems, context="knob registry")

    # ---- values ------------------------------------------------------------------------------------------
    def coerce(self, value: Any) -> tuple[Any, str | None]:
        """(the stored value, problem): plain strings (YAML, --fix) to Enums, lists to tuples, then the checks."""
        k = self.kind
        if k in (Kind.ENUM, Kind.OPTIONAL_ENUM):
            if value is None and k is Kind.OPTIONAL_ENUM:
                return None, None
            if isinstance(value, self.enum):
                return value, None
            try:
                return self.enum(value), None
            except ValueError:
                allowed = ", ".join(e.value for e in self.enum)
                return value, f"{self.name}={value!r}: not one of {allowed}"
        if k is Kind.MODULES:
            if isinstance(value, str):
                return (value,), None
            if isinstance(value, list):
                return tuple(value), None
            return value, None
        if k is Kind.FLOAT:
            lo, hi = self.bounds
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value < hi:
                return value, f"{self.name}={value!r}: must be a number in [{lo:g}, {hi:g})"
            return float(value), None
        if k in (Kind.INT, Kind.OPTIONAL_INT) and self.minimum is not None:
            if value is None and k is Kind.OPTIONAL_INT:
                return None, None
            if isinstance(value, bool) or not isinstance(value, int) or value < self.minimum:
                tail = " or None" if k is Kind.OPTIONAL_INT else ""
                return value, f"{self.name}={value!r}: must be an integer >= {self.minimum}{tail}"
        return value, None

    def plain(self, value: Any) -> Any:
        """The value as JSON / YAML holds it."""
        return value.value if isinstance(value, Enum) else list(value) if isinstance(value, tuple) else value

    def parse_text(self, text: str, as_name: str | None = None) -> tuple[Any, str | None]:
        """(value, problem) of `--fix NAME=TEXT` for this knob's kind."""
        name = as_name or self.name
        t = text.strip()
        k = self.kind
        if k is Kind.BOOL:
            b = parse_bool(t)
            return (b, None) if b is not None else (None, f"--fix {name}={text}: not a boolean; use true or false")
        if k is Kind.OPTIONAL_INT and t.lower() in _NONE:
            return None, None
        if k in (Kind.INT, Kind.OPTIONAL_INT):
            try:
                v = int(t)
            except ValueError:
                return None, f"--fix {name}={text}: not an integer"
            return (v, None) if v >= 1 else (None, f"--fix {name}={text}: must be >= 1")
        if k is Kind.FLOAT:
            try:
                v = float(t)
            except ValueError:
                return None, f"--fix {name}={text}: not a number"
            lo, hi = self.bounds
            return (v, None) if lo <= v < hi else (None, f"--fix {name}={text}: must be in [{lo:g}, {hi:g})")
        if k is Kind.MODULES:
            mods = tuple(m.strip() for m in t.split(",") if m.strip())
            return (mods, None) if mods else (None, f"--fix {name}={text}: name modules, e.g. q_proj,v_proj")
        if k is Kind.OPTIONAL_ENUM and t.lower() in _NONE:
            return None, None
        try:
            return self.enum(t), None
        except ValueError:
            allowed = ", ".join(e.value for e in self.enum)
            return None, f"--fix {name}={text}: not one of {allowed}"

    def is_active(self, c: Candidate) -> bool:
        return self.active is None or bool(self.active(c))


def parse_bool(text: str) -> bool | None:
    t = text.strip().lower()
    return True if t in _BOOL_TRUE else False if t in _BOOL_FALSE else None


def annotation(k: Knob) -> str:
    """The annotation of the Candidate field a shared knob declares (advisor/space.py derives the field)."""
    if k.kind is Kind.ENUM:
        return k.enum.__name__
    if k.kind is Kind.OPTIONAL_ENUM:
        return f"{k.enum.__name__} | None"
    return k.kind.value


class KnobView:
    """A trainer's own knobs of a candidate, typed: one field per declaration in `KNOBS` (`knob_view` builds the
    dataclass), read from the candidate's base (`of`) and written back (`apply`). `DEFAULTS`: the trainer's TRL
    defaults of the knobs that declare None ("the trainer's default"; GRPOConfig's num_generations 8, RLOOConfig's
    2), each given once, by the trainer's view; `CONTEXT` names the trainer in a ConfigError."""

    KNOBS: ClassVar[tuple[Knob, ...]] = ()
    DEFAULTS: ClassVar[Mapping[str, Any]] = {}
    CONTEXT: ClassVar[str] = "knobs"

    @classmethod
    def of(cls, candidate: Candidate) -> Any:
        """The view of `candidate`'s base, each knob at its declared default (or the trainer's TRL default) when
        the base does not carry it."""
        b = candidate.base
        values = {}
        for k in cls.KNOBS:
            v = b.get(k.key, k.default)
            values[k.name] = cls.DEFAULTS[k.name] if v is None and k.name in cls.DEFAULTS else v
        return cls(**values)

    def apply(self, candidate: Candidate) -> Candidate:
        """The candidate with these knobs in its base (a knob at its default, or the trainer's, left out: a plain
        candidate stays plain)."""
        base = candidate.base.as_dict()
        for k in self.KNOBS:
            value = getattr(self, k.name)
            if value == k.default or (k.name in self.DEFAULTS and value == self.DEFAULTS[k.name]):
                base.pop(k.key, None)
            else:
                base[k.key] = k.plain(value)
        return candidate.replace(base=base)

    def __post_init__(self) -> None:
        problems = []
        for k in self.KNOBS:
            v = getattr(self, k.name)
            if k.kind is Kind.BOOL:
                if not isinstance(v, bool):
                    problems.append(f"{k.name}={v!r}: must be true or false")
            elif v is not None:
                stored, problem = k.coerce(v)
                if problem:
                    problems.append(problem)
                elif stored is not v:
                    object.__setattr__(self, k.name, stored)  # a plain string to its Enum
        if problems:
            raise ConfigError(problems, context=self.CONTEXT)


def knob_view(name: str, knobs: tuple[Knob, ...], methods: type = KnobView, module: str = __name__) -> type:
    """The frozen dataclass of a trainer's own knobs: one field per declaration (its default the declaration's),
    with `methods` (a KnobView subclass: what the trainer derives from them) as its base."""
    fields = [(k.name, annotation(k), dataclasses.field(default=k.default)) for k in knobs]
    cls = dataclasses.make_dataclass(name, fields, bases=(methods,), frozen=True,
                                     namespace={"KNOBS": tuple(knobs), "__module__": module})
    cls.__doc__ = methods.__doc__
    return cls
