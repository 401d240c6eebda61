"""From finished studies to the answer: the confirmed best, the Suggestion with every trial and its events, and
what to say when nothing fits (or the backend failed on everything, or the space is empty)."""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping

from .._messages import summarize
from ..errors import BackendError, ConfigError
from ..events import (
    ConfirmationDrift,
    ConfirmationFailed,
    Derived,
    Event,
    LibraryMessages,
    MethodUsed,
    NotInstalled,
    describe,
    render,
)
from ..measurement import Measurement, Status
from ..packages import missing
from ..space import Candidate
from ..suggestion import Suggestion, Trial
from ..workload import Method, Workload
from .evaluator import failure_reason
from .ledger import Entry, candidate_key, device_bytes, feasible
from .loop import StudyRun
from .params import NO_ACCUMULATION, StudySpace
from .space import BATCH_TOLERANCE, DEFAULT_ROWS_PER_STEP, LeftOut, RowTokens

_GiB = 2**30


def confirmed_best(run: StudyRun, events: list[Event]) -> tuple[Entry, Measurement] | None:
    rejected: set[str] = set()
    for _ in range(3):
        ok = sorted((e for e in run.ledger.measured
                     if feasible(e.measurement, run.limit) and candidate_key(e.candidate) not in rejected),
                    key=lambda e: candidate_key(e.candidate))  # ties go the same way in every run sharing a study
        if not ok:
            return None
        # On a tie (e.g. flash-attn2 simulated as sdpa), prefer fewer extra packages, then less memory.
        best = max(ok, key=lambda e: (e.measurement.tokens_per_second or 0.0, -len(e.candidate.requirements()),
                                      -(device_bytes(e.measurement) or 0)))
        confirmed = run.confirm(best)
        if feasible(confirmed, run.limit):
            return best, confirmed
        rejected.add(candidate_key(best.candidate))
        events.append(ConfirmationFailed(best.candidate, failure_reason(confirmed, run.limit)))
    return None


def smallest(run: StudyRun) -> tuple[int, Candidate] | None:
    sized = [(device_bytes(e.measurement), e.candidate) for e in run.ledger.entries.values()
             if device_bytes(e.measurement) is not None]
    return min(sized, key=lambda s: s[0]) if sized else None  # type: ignore[return-value]


def next_knob(last: Method) -> str:
    return {Method.FULL: "--method lora (or auto)", Method.LORA: "--method qlora"}.get(
        last, "a larger --memory-budget or --gpu, or a larger --max-truncation (shorter max_length)")


def no_fit_message(workload: Workload, order: list[Method], small: list[tuple[int, Candidate]],
                   events: list[Event]) -> str:
    limit = workload.limit_bytes / _GiB
    head = f"nothing fits {workload.gpu.name} within {limit:.2f} GiB (budget x (1 - headroom))"
    if small:
        d, c = min(small, key=lambda s: s[0])
        head += f"; the smallest device peak found was {d / _GiB:.2f} GiB ({describe(c)})"
    return head + f"; next knob to try: {next_knob(order[-1])}. " + " | ".join(map(render, events))


def empty_message(workload: Workload, spaces: Mapping[Method, StudySpace], empty: Mapping[Method, str | None],
                  rows: RowTokens, tps: int, why: str) -> str:
    """Why no method has an admissible candidate, naming the flag that decides it and a value that works."""
    goals = workload.goals
    # Candidates within the truncation allowance that only the effective batch refuses: the batch is the blocker.
    per_row = []
    if any(w and (w.startswith(NO_ACCUMULATION) or "truncation" in w) for w in empty.values()):
        for space in spaces.values():
            for cand in space.space.grid(space.base):
                try:
                    cand = cand.canonical()
                except ConfigError:
                    continue
                if not cand.problems(workload.gpu, workload.model) and rows.truncation(cand) <= goals.max_truncation:
                    per_row.append(rows(cand))
    if not per_row:
        return (f"--max-truncation {goals.max_truncation:g}: no admissible candidate ({why}); allow more "
                "truncation (e.g. --max-truncation 0.05)")
    if goals.tokens_per_step:
        given = f"--tokens-per-step {tps} (yours)"
    else:
        default = rows(Candidate.trl_defaults())
        given = (f"the effective batch of {tps} trained tokens per optimizer step (you did not set "
                 f"--tokens-per-step: it is TRL's default {DEFAULT_ROWS_PER_STEP} rows x {default:,.0f} trained "
                 f"tokens per row at TRL's default max_length={Candidate.trl_defaults().max_length})")
    world = workload.num_gpus
    need = int(math.ceil(DEFAULT_ROWS_PER_STEP * world * max(per_row) / 1024.0)) * 1024
    if world > 1:  # the effective batch counts every rank: at least one row on each of them
        given += f" split over --num-gpus {world} ranks"
    return (f"{given} does not hold whole rows of this data: kept within --max-truncation "
            f"{goals.max_truncation:g}, a micro-batch row carries {min(per_row):,.0f} to {max(per_row):,.0f} "
            f"trained tokens, and no micro-batch x accumulation lands within {BATCH_TOLERANCE:.0%} of {tps}; set "
            f"--tokens-per-step {need} ({DEFAULT_ROWS_PER_STEP} such rows per optimizer step"
            + (f" on each of the {world} ranks, or fewer --num-gpus)" if world > 1 else ")"))


def raise_if_backend_failed(run: StudyRun, backend: str, study: str) -> None:
    """An error outcome for every candidate measured is an error of the run (BackendError), not "nothing fits"."""
    measured = run.ledger.measured
    if not measured or any(e.measurement.status is not Status.ERROR for e in measured):
        return
    why = collections.Counter(e.measurement.message or "no message" for e in measured)
    message, count = why.most_common(1)[0]
    others = f" ({len(why) - 1} other message(s))" if len(why) > 1 else ""
    raise BackendError(
        f"--backend {backend}: every one of the {len(measured)} candidates measured failed with an error, so "
        f"nothing was learnt about memory; {count}x: {message}{others}. Fix that cause (or choose another "
        f"--backend) and rerun: a study that holds only errors is measured again",
        details={"backend": backend, "study": study, "errors": len(measured), "message": message},
    )


def evaluations(runs: list[StudyRun]) -> int:
    """The distinct candidates this search measured with its backend, over every method it tried: by this
    process or by workers sharing its study, but not those answered from a stored study, nor confirmations."""
    return sum(1 for r in runs for key, e in r.ledger.entries.items() if e.measured and key not in r.stored)


def confirmation_drift(searched: Measurement, confirmed: Measurement, backend: str,
                       tolerance: float = 0.05) -> ConfirmationDrift | None:
    """The confirmation's difference from the search's measurement, when it is over `tolerance`."""
    a, b = searched.tokens_per_second or 0.0, confirmed.tokens_per_second or 0.0
    if not a or abs(b - a) <= tolerance * a:
        return None
    return ConfirmationDrift(backend, a, b)


def confirmation_note(searched: Measurement, confirmed: Measurement, backend: str, tolerance: float = 0.05) -> str:
    """What the confirmation compared and what a difference means, when it is over `tolerance`; else ''."""
    drift = confirmation_drift(searched, confirmed, backend, tolerance)
    return render(drift) if drift else ""


def front(trials: list[Trial], limit: int) -> tuple[Trial, ...]:
    """Feasible trials that no other is both smaller and faster than."""
    ok = sorted((t for t in trials if feasible(t.measurement, limit)),
                key=lambda t: (device_bytes(t.measurement), -(t.measurement.tokens_per_second or 0)))
    out, best = [], -1.0
    for t in ok:
        if (t.measurement.tokens_per_second or 0) > best:
            out.append(t)
            best = t.measurement.tokens_per_second or 0
    return tuple(out)


def not_installed(run: StudyRun, full: StudySpace, left: LeftOut, pick: Candidate) -> list[NotInstalled]:
    """For each package a run here lacks, what installing it alone would unlock: the knob values `installed_space`
    left out, and the best candidate of the whole space needing it (and nothing else missing) that the corrected
    estimate puts under the limit, against the same estimate of the pick."""
    ev = run.evaluator
    base = ev.predicted(pick)
    base_tps = base[0] if base else 0.0
    best: dict[str, float | None] = dict.fromkeys(left.by_package)
    for cand in full.candidates():
        gone = missing(cand.requirements())
        if len(gone) != 1 or gone[0] not in best:
            continue
        predicted = ev.predicted(cand)
        if predicted is None or (predicted[1] is not None and predicted[1] > run.limit):
            continue
        best[gone[0]] = max(best[gone[0]] or 0.0, predicted[0])
    return [NotInstalled(package, tuple(dict.fromkeys(f"{k}={getattr(v, 'value', v)}" for k, v in values)),
                         None if best[package] is None or not base_tps else best[package] / base_tps - 1.0)
            for package, values in left.by_package.items()]


def build_suggestion(workload: Workload, runs: list[StudyRun], entry: Entry, confirmed: Measurement,
                     events: list[Event], backend: str) -> Suggestion:
    run = runs[-1]
    best_tps = confirmed.tokens_per_second or 0.0
    chosen_key = candidate_key(entry.candidate)
    trials = []
    for rank, r in enumerate(runs):  # earlier methods' trials too: they are why the search escalated
        own: list[Trial] = []
        for key, e in r.ledger.entries.items():
            if r is run and key == chosen_key:
                why = "chosen"
            elif e.reason:
                why = e.reason
            elif feasible(e.measurement, r.limit):
                slower = 1.0 - (e.measurement.tokens_per_second or 0.0) / best_tps if best_tps else 0.0
                why = f"{slower:.1%} slower"
            else:
                why = failure_reason(e.measurement, r.limit)
            if r is not run:
                why = f"{r.method.value}: {why}"
            own.append(Trial(e.candidate, e.measurement, e.number, why, cached=key in r.stored))
        own.sort(key=lambda t: (rank, t.number if t.number is not None else 1 << 30))
        trials += own
    out = list(events) + run.events
    said: collections.Counter[tuple[str, str]] = collections.Counter()
    for r in runs:
        said.update(r.messages)
    messages = summarize(said)
    if messages:
        out.append(LibraryMessages(tuple(map(str, messages[:3])), len(messages)))
    drift = confirmation_drift(entry.measurement, confirmed, backend)
    if drift:
        out.append(drift)
    if run.method is not Method.FULL:
        out.append(MethodUsed(run.method.value))
    out += [Derived(note) for note in run.space.derivation_notes(entry.candidate)]
    return Suggestion(
        workload=workload, candidate=entry.candidate, measurement=confirmed, trials=tuple(trials),
        events=tuple(out), backend=backend, evaluations=evaluations(runs), front=front(trials, run.limit),
        messages=messages,
    )
