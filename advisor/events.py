"""What a search says about its run, as typed values: each event is a frozen dataclass with a `kind`.

`Suggestion.events` (and `NoFitError.details["events"]`) hold them; tests and programs match on the kind and
fields, and `render` (below, apart from the types) turns one into the line the CLI and the report print.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, ClassVar, dataclass_transform

from .space import Candidate

_GiB = 2**30


class EventKind(str, Enum):
    TRIALS_IGNORED = "trials-ignored"  # --trials given with --exhaustive
    STORAGE = "storage"  # the cache or --storage could not be used as asked (its note, from the storage layer)
    EFFECTIVE_BATCH = "effective-batch"  # the default effective batch the search kept fixed
    DERIVED = "derived"  # how the pick's derived knobs were derived (colocated vLLM's utilization)
    NO_ADMISSIBLE = "no-admissible"  # one method's space has no admissible candidate
    ERRORS_DISCARDED = "errors-discarded"  # a stored study holding only errors was measured again
    FIT_CHECK = "fit-check"  # nothing measured fitted: the estimate's few fitting candidates were measured
    ANSWERED_FROM_STORED = "answered-from-stored"
    STORED_AS = "stored-as"
    EMPTY_STUDY = "empty-study"  # a method's study has no entry at all
    NOTHING_FITS = "nothing-fits"  # a method found nothing under the limit
    CONFIRMATION_FAILED = "confirmation-failed"
    SEEDED = "seeded"  # the queue was seeded with a cheaper backend's stored results
    TIME_BUDGET = "time-budget"
    NO_NEW_CANDIDATE = "no-new-candidate"  # the proposers ran dry
    CONVERGED = "converged"  # no unmeasured candidate can still beat the best measured one
    LIBRARY_MESSAGES = "library-messages"
    CONFIRMATION_DRIFT = "confirmation-drift"
    METHOD = "method"  # the pick's method, when not full fine-tuning
    SHOWN_FROM_STORED = "shown-from-stored"  # stored_suggestion: nothing measured
    NO_CONFIRMATION_STORED = "no-confirmation-stored"
    NOT_INSTALLED = "not-installed"  # a run here: candidates needing a missing package were left out, and the gain


_BY_KIND: dict[EventKind, type[Event]] = {}


@dataclass_transform(frozen_default=True)
@dataclass(frozen=True)
class Event:
    """One thing a search says about its run. A subclass names its kind and declares its fields; it is made a frozen
    dataclass here (`class TimeBudget(Event, kind=EventKind.TIME_BUDGET): seconds: float; ...`), one per kind."""

    kind: ClassVar[EventKind]

    def __init_subclass__(cls, kind: EventKind, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind in _BY_KIND:
            raise TypeError(f"{cls.__name__}: the event kind {kind.value!r} is {_BY_KIND[kind].__name__}'s already")
        cls.kind = kind
        dataclass(frozen=True)(cls)
        _BY_KIND[kind] = cls

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if isinstance(v, Candidate) else list(v) if isinstance(v, tuple) else v
        return out


class TrialsIgnored(Event, kind=EventKind.TRIALS_IGNORED):
    trials: int


class StorageNote(Event, kind=EventKind.STORAGE):
    note: str


class EffectiveBatch(Event, kind=EventKind.EFFECTIVE_BATCH):
    tokens_per_step: int
    unit: str = "rows"  # what per_device_train_batch_size counts: rows (SFT), pairs (DPO), completions (GRPO)


class Derived(Event, kind=EventKind.DERIVED):
    note: str


class NoAdmissible(Event, kind=EventKind.NO_ADMISSIBLE):
    method: str
    why: str
    escalated_to: str | None = None


class ErrorsDiscarded(Event, kind=EventKind.ERRORS_DISCARDED):
    method: str


class FitCheck(Event, kind=EventKind.FIT_CHECK):
    method: str
    measured: int
    fits: int  # unmeasured candidates the estimate puts under the limit
    checked: int  # of them, measured now


class AnsweredFromStored(Event, kind=EventKind.ANSWERED_FROM_STORED):
    study: str


class StoredAs(Event, kind=EventKind.STORED_AS):
    study: str
    storage: str | None = None


class EmptyStudy(Event, kind=EventKind.EMPTY_STUDY):
    method: str


class NothingFits(Event, kind=EventKind.NOTHING_FITS):
    method: str
    limit_bytes: int
    smallest_bytes: int | None
    measured: int
    unmeasured: int  # admissible candidates left unmeasured (the estimate puts them over the limit)
    estimate_backend: bool
    escalated_to: str | None = None


class ConfirmationFailed(Event, kind=EventKind.CONFIRMATION_FAILED):
    candidate: Candidate
    why: str


class Seeded(Event, kind=EventKind.SEEDED):
    count: int
    backends: tuple[str, ...]


class TimeBudget(Event, kind=EventKind.TIME_BUDGET):
    seconds: float
    measured: int


class NoNewCandidate(Event, kind=EventKind.NO_NEW_CANDIDATE):
    proposals: int


class Converged(Event, kind=EventKind.CONVERGED):
    """Multi-fidelity's end: every unmeasured admissible candidate is, by the estimate corrected on `points`
    measurements, slower than the best measured one or over the limit by more than the model's resolution, or
    tied with a measured one."""

    points: int
    time_resolution: float
    memory_resolution: float
    candidates: int  # admissible candidates in the space


class LibraryMessages(Event, kind=EventKind.LIBRARY_MESSAGES):
    shown: tuple[str, ...]  # the most frequent distinct messages, as the report lists them
    total: int  # distinct messages in all


class ConfirmationDrift(Event, kind=EventKind.CONFIRMATION_DRIFT):
    backend: str
    searched_tokens_per_second: float
    confirmed_tokens_per_second: float


class MethodUsed(Event, kind=EventKind.METHOD):
    method: str


class ShownFromStored(Event, kind=EventKind.SHOWN_FROM_STORED):
    study: str
    measured: int


class NoConfirmationStored(Event, kind=EventKind.NO_CONFIRMATION_STORED):
    """Nothing but its kind."""


class NotInstalled(Event, kind=EventKind.NOT_INSTALLED):
    """The run is on this machine, so the candidates needing `package` (missing here) were neither measured nor
    picked: `values` are the knob values it would unlock, `gain` the best of them that fits over the pick, by the
    estimate corrected on this search's measurements (None: none of them fits)."""

    package: str
    values: tuple[str, ...]
    gain: float | None


@dataclass(frozen=True)
class Progress:
    """Reported after every trial (the CLI draws a bar from it)."""

    evaluations: int
    total: int
    best_tokens_per_second: float | None
    elapsed_s: float
    message: str = ""
    note: str = ""  # a line the user must see now (e.g. the cache cannot be written), not a trial


# ---- rendering -------------------------------------------------------------------------------------------------
def describe(c: Candidate) -> str:
    """A candidate in one short line (progress messages, failed confirmations)."""
    ckpt = "off"
    if c.activation_checkpointing:
        ckpt = "selective" if c.checkpoint_selective else f"every {c.checkpoint_every_n_layers}"
    pack = c.packing_strategy.value if c.packing else ("padding-free" if c.padding_free else "padded")
    return (f"mb={c.per_device_train_batch_size}x{c.gradient_accumulation_steps} len={c.max_length} {pack} "
            f"ckpt={ckpt} {c.optim.value}")


def _escalated(to: str | None) -> str:
    return f"; escalated to {to}" if to else ""


def _nothing_fits(e: NothingFits) -> str:
    limit = e.limit_bytes / _GiB
    peak = "" if e.smallest_bytes is None else f"; the smallest device peak found was {e.smallest_bytes / _GiB:.2f} GiB"
    if e.unmeasured and e.estimate_backend:
        what = (f"nothing fits the limit {limit:.2f} GiB{peak} (the estimate puts the {e.unmeasured} unmeasured "
                "admissible candidates over it too)")
    elif e.unmeasured:
        what = (f"none of the {e.measured} measured candidates fit the limit {limit:.2f} GiB{peak}; raise --trials "
                f"to measure the {e.unmeasured} unmeasured ones (the estimate puts them over the limit)")
    else:
        what = f"nothing fits the limit {limit:.2f} GiB{peak}"
    return f"{e.method}: {what}" + _escalated(e.escalated_to)


def _drift(e: ConfirmationDrift) -> str:
    a, b = e.searched_tokens_per_second, e.confirmed_tokens_per_second
    change = (b - a) / a
    return (f"confirmation: a second {e.backend} measurement of the chosen configuration gave {b:,.0f} trained "
            f"tokens/s against {a:,.0f} in the search ({change:+.1%}); the table shows the second. Timings on this "
            f"machine vary by about that much (other load, clocks), so candidates within {abs(change):.0%} of "
            "the chosen one are as good as ties")


def _not_installed(e: NotInstalled) -> str:
    unlock = f"`pip install {e.package}` would unlock {', '.join(e.values)}"
    if e.gain is None:
        verdict = "none of those candidates fits the limit"
    elif e.gain >= 0.0005:
        verdict = f"the best of them that fits is predicted {e.gain:.1%} faster than the pick"
    elif e.gain > -0.0005:
        verdict = "the best of them that fits is predicted as fast as the pick"
    else:
        verdict = f"none is predicted faster than the pick (the best: {-e.gain:.1%} slower)"
    return (f"{e.package} is not installed here, and the run is on this machine, so the candidates needing it were "
            f"neither measured nor picked: {unlock}; {verdict} (the estimate, corrected by this search's "
            "measurements; not measured)")


def _library(e: LibraryMessages) -> str:
    shown = "; ".join(m if len(m) <= 240 else m[:239] + "…" for m in e.shown)
    more = f"; {e.total - len(e.shown)} more" if e.total > len(e.shown) else ""
    return f"libraries said while measuring (each distinct message once, all with --verbose): {shown}{more}"


# The line of each kind: a template of the event's fields (str.format), or a function of the event
_TEXT: dict[EventKind, str | Callable[[Any], str]] = {
    EventKind.TRIALS_IGNORED: "--trials {trials} is ignored with --exhaustive (every valid candidate is evaluated)",
    EventKind.STORAGE: "{note}",
    EventKind.EFFECTIVE_BATCH: lambda e: f"effective batch: {e.tokens_per_step} trained tokens per optimizer step "
                                         f"(TRL's default 8 {e.unit} x mean trained tokens per "
                                         f"{e.unit[:-1] if e.unit.endswith('s') else e.unit}; set --tokens-per-step "
                                         "to change)",
    EventKind.DERIVED: "{note}",
    EventKind.NO_ADMISSIBLE: lambda e: f"{e.method}: no admissible candidate ({e.why})" + _escalated(e.escalated_to),
    EventKind.ERRORS_DISCARDED: "{method}: the stored study held only error outcomes of an earlier run (a "
                                "BackendError): measured again",
    EventKind.FIT_CHECK: "{method}: none of the {measured} measured candidates fit; the estimate puts {fits} "
                         "unmeasured ones under the limit: measured the {checked} lowest-peak / best-predicted of them",
    EventKind.ANSWERED_FROM_STORED: "answered from the stored study {study!r}: no new measurement",
    EventKind.STORED_AS: lambda e: f"stored as the study {e.study!r}: `advisor report --study {e.study}"
                                   + (f" --storage {e.storage}" if e.storage else "") + "` shows it again",
    EventKind.EMPTY_STUDY: "{method}: no admissible candidate in the space (check --fix, --max-truncation)",
    EventKind.NOTHING_FITS: _nothing_fits,
    EventKind.CONFIRMATION_FAILED: lambda e: f"{describe(e.candidate)} failed its confirmation ({e.why})",
    EventKind.SEEDED: lambda e: f"seeded with the {e.count} fastest candidates of stored "
                                f"{'/'.join(sorted(set(e.backends)))} studies of this workload",
    EventKind.TIME_BUDGET: "stopped by --time-budget {seconds:g}s after {measured} measurements",
    EventKind.NO_NEW_CANDIDATE: "stopped after {proposals} proposals in a row gave no new candidate",
    EventKind.CONVERGED: ("converged after {points} measurements of {candidates} candidates: the estimate corrected "
                          "on them (resolution {time_resolution:.1%} in time, {memory_resolution:.1%} in memory) "
                          "puts every other one slower, over the limit, or tied with one measured"),
    EventKind.LIBRARY_MESSAGES: _library,
    EventKind.CONFIRMATION_DRIFT: _drift,
    EventKind.METHOD: "method: {method}",
    EventKind.SHOWN_FROM_STORED: "shown from the stored study {study!r} ({measured} measured trials); nothing was "
                                 "measured again",
    EventKind.NO_CONFIRMATION_STORED: "no confirmation is stored for this candidate (the search was interrupted): "
                                      "its numbers are the search's single measurement",
    EventKind.NOT_INSTALLED: _not_installed,
}
if set(_TEXT) != set(EventKind) or set(_BY_KIND) != set(EventKind):
    raise RuntimeError(f"advisor/events.py: every EventKind needs one Event class and one line in _TEXT; classes "
                       f"missing for {sorted(k.value for k in set(EventKind) - set(_BY_KIND))}, lines missing for "
                       f"{sorted(k.value for k in set(EventKind) - set(_TEXT))}")


def render(event: Event) -> str:
    """The line the CLI and the report print for `event`."""
    text = _TEXT[event.kind]
    if isinstance(text, str):
        return text.format(**{f.name: getattr(event, f.name) for f in fields(event)})
    return text(event)
