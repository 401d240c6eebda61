"""The search: an Optuna study over the SearchSpace that finds the fastest candidate that fits, and confirms it.

Objective: trained tokens per second at a fixed effective batch (micro-batch x accumulation is a knob, the
trained tokens per optimizer step are not). Constraint (`Trial.set_constraint`): device bytes <= the limit.
Proposals come, in order, from the study's queue (the estimate's best guesses, or every candidate with
`exhaustive`), from the neighbours of the best candidate so far, and from TPE. Each distinct candidate is
measured once (our ledger; TPE repeats points), a measured failure bounds its larger neighbours, and the
estimate prunes candidates far over the limit before a costlier backend sees them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from ._messages import summarize
from ._search.backends import (
    FunctionBackend,
    backend_names,
    default_backend_name,
    get_backend,
    register_backend,
    unregister_backend,
)
from ._search.ledger import Entry, Ledger, candidate_key, device_bytes, feasible
from ._search.pool import check_jobs as check_jobs  # re-exported for the CLI's --jobs
from ._search.space import (
    BATCH_TOLERANCE,
    DEFAULT_ROWS_PER_STEP,
    RowTokens,
    apply_pins,
    attention_refusal,
    default_space,
    default_tokens_per_step,
    method_order,
    parse_fix,
    with_accumulation,
)
from ._search.storage import (
    cache_dir,
    library_versions,
    open_cache,
    open_given,
    open_storage,
    prepare_study,
)
from .errors import BackendError, ConfigError, NoFitError, UsageError
from .measurement import Measurement, Source, Status
from .space import Candidate, SearchSpace
from .suggestion import Suggestion, Trial
from .workload import Goals, Method, Workload, fingerprint

if TYPE_CHECKING:
    import optuna

__all__ = [
    "suggest", "run_worker", "build_space", "Progress", "check_backend", "stored_studies", "stored_suggestion",
    "StoredStudy", "register_backend", "unregister_backend", "backend_names",
    "default_backend_name", "cache_dir", "parse_fix", "DEFAULT_TRIALS",
]

DEFAULT_TRIALS = 40
# How many of the fastest feasible candidates the neighbour walk expands.
NEIGHBOUR_PARENTS = 4
PRUNE_FACTOR = 1.3  # the estimate prunes a candidate over limit x this: "far over budget", allowing its error
SEEDS = 8
FIT_CHECK = 4  # before giving up on a method: measure this many of the candidates the estimate says fit
_SPEC_KEY = "advisor"
# A measuring trial stamps the wall clock into its "heartbeat" user attr every HEARTBEAT_S; a RUNNING trial whose
# stamp is older than STALE_S belongs to a killed process: it is failed and its candidate can be measured again.
# A trial also names its "owner" (host, pid, process start): on the same host a dead owner is seen at once.
HEARTBEAT_S = 10.0
STALE_S = 120.0
_CLAIM_POLL_S = 0.05
_GiB = 2**30
_NO_ACCUMULATION = "no accumulation"  # how _Space.admit starts the reason an effective batch cannot be met


@dataclass(frozen=True)
class Progress:
    """Reported after every trial (the CLI draws a bar from it)."""

    evaluations: int
    total: int
    best_tokens_per_second: float | None
    elapsed_s: float
    message: str = ""
    note: str = ""  # a line the user must see now (e.g. the cache cannot be written), not a trial


# ---- the space ---------------------------------------------------------------------------------------------
def build_space(workload: Workload, method: Method = Method.FULL, fix: Mapping[str, Any] | None = None) -> SearchSpace:
    """The default space of `workload` for one method, narrowed by `fix` (SFTConfig / ModelConfig names)."""
    return apply_pins(default_space(workload, method), parse_fix(fix))


def _encode(v: Any) -> Any:
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, tuple):
        return ",".join(v)
    return v


class _Space:
    """A SearchSpace seen by Optuna: one categorical per knob with more than one value; decoding checks validity."""

    def __init__(self, workload: Workload, space: SearchSpace, tokens_per_step: int, rows: RowTokens):
        self.workload, self.space, self.tokens_per_step, self.rows = workload, space, tokens_per_step, rows
        self.fixed = {k: v[0] for k, v in space.values.items() if len(v) == 1}
        self.params = {k: tuple(v) for k, v in sorted(space.values.items()) if len(v) > 1}
        self.base = Candidate().replace(**self.fixed) if self.fixed else Candidate()

    def choices(self, name: str) -> list[Any]:
        return [_encode(v) for v in self.params[name]]

    def decode(self, params: Mapping[str, Any]) -> Candidate | str:
        """The candidate for Optuna params, or why it is not admissible."""
        values = {}
        for k, vals in self.params.items():
            enc = self.choices(k)
            values[k] = vals[enc.index(params[k])]
        try:
            cand = self.base.replace(**values).canonical()
        except ConfigError as exc:
            return str(exc)
        return self.admit(cand)

    def admit(self, cand: Candidate) -> Candidate | str:
        wl = self.workload
        problems = cand.problems(wl.gpu, wl.model)
        if problems:
            return "; ".join(problems)
        refused = attention_refusal(self.space, cand)
        if refused:
            return refused
        ctx = wl.model.max_position_embeddings
        if cand.max_length is None and ctx is not None and len(wl.dataset.lengths) and \
                int(wl.dataset.lengths.max()) > ctx:
            return (f"max_length=None keeps rows of {int(wl.dataset.lengths.max())} tokens, beyond the model's "
                    f"context (max_position_embeddings {ctx})")
        lost = self.rows.truncation(cand)
        if lost > wl.goals.max_truncation:
            return f"loses {lost:.2%} of trained tokens to truncation (--max-truncation {wl.goals.max_truncation:.2%})"
        out = with_accumulation(cand, self.tokens_per_step, self.rows)
        if out is None:
            return (_NO_ACCUMULATION + " keeps this micro-batch within "
                    f"{BATCH_TOLERANCE:.0%} of {self.tokens_per_step} trained tokens per optimizer step")
        return out

    def params_of(self, cand: Candidate) -> dict[str, Any]:
        out = {}
        for k in self.params:
            v = _encode(getattr(cand, k))
            out[k] = v if v in self.choices(k) else self.choices(k)[0]  # irrelevant knobs canonicalise away
        return out

    def _walk(self) -> Iterator[Candidate | str]:
        """Each distinct canonical grid point, admitted (a Candidate) or refused (the reason)."""
        seen: set[Candidate] = set()
        for cand in self.space.grid(self.base):
            try:
                cand = cand.canonical()
            except ConfigError as exc:
                yield str(exc)
                continue
            if cand in seen:
                continue
            seen.add(cand)
            yield self.admit(cand)

    def candidates(self) -> Iterator[Candidate]:
        for out in self._walk():
            if isinstance(out, Candidate):
                yield out

    def why_empty(self) -> str | None:
        """None when some candidate is admissible, else the commonest reason the grid's candidates are refused."""
        from collections import Counter

        why: Counter[str] = Counter()
        for out in self._walk():
            if isinstance(out, Candidate):
                return None
            why[out] += 1
        return why.most_common(1)[0][0] if why else "the space is empty"

    def neighbours(self, cand: Candidate) -> Iterator[Candidate]:
        """Admissible candidates that differ from `cand` in one knob."""
        for k, vals in self.params.items():
            for v in vals:
                if v == getattr(cand, k):
                    continue
                try:
                    other = cand.replace(**{k: v}).canonical()
                except ConfigError:
                    continue
                out = self.admit(other)
                if isinstance(out, Candidate) and out != cand:
                    yield out

    def to_json(self) -> dict[str, list[Any]]:
        return {k: [_encode(v) for v in vals] for k, vals in self.space.values.items()}


def _space_from_json(data: Mapping[str, list[Any]]) -> SearchSpace:
    def dec(k: str, v: Any) -> Any:
        return tuple(x for x in v.split(",") if x) if k == "lora_target_modules" and isinstance(v, str) else v

    values = {}
    for k, vals in data.items():
        decoded = []
        for v in vals:
            d = dec(k, v)
            decoded.append(getattr(Candidate(**{k: d}), k))  # strings back to Enums
        values[k] = tuple(decoded)
    return SearchSpace(values)


# ---- one study ---------------------------------------------------------------------------------------------
@dataclass
class _Outcome:
    ledger: Ledger
    best: Entry | None
    evaluations: int
    new_measurements: int
    study: optuna.Study
    notes: list[str]


class _Study:
    """One method's search: the Optuna study, our ledger, the estimate, and the backend."""

    def __init__(self, workload: Workload, method: Method, space: _Space, backend: FunctionBackend,
                 study: optuna.Study, progress: Callable[[Progress], None] | None = None):
        self.workload, self.method, self.space, self.backend, self.study = workload, method, space, backend, study
        self.limit = workload.limit_bytes
        self.ledger = Ledger(self.limit)
        self.progress = progress
        self.new_measurements = 0
        self.notes: list[str] = []
        self.messages: collections.Counter[tuple[str, str]] = collections.Counter()  # (origin, text) -> count
        self.stopped_by_time = False
        self._estimates: dict[str, Measurement | None] = {}
        self._estimate_fn = self._load_estimate()
        # The estimate backend IS the estimate: it orders the queue, but pruning by it would only skip measuring.
        self._prunes = backend.name != "estimate"
        self.refresh()
        self.stored = frozenset(self.ledger.entries)  # answered from the stored study, not by this run

    # -- estimate ------------------------------------------------------------------------------------------
    def _load_estimate(self) -> Callable[[Workload, Candidate], Measurement] | None:
        if self.backend.name == "estimate":
            return self.backend.measure  # the backend itself: its numbers seed and order the queue
        try:
            from .estimator import estimate
        except ImportError:
            return None
        return estimate

    def estimate(self, cand: Candidate) -> Measurement | None:
        if self._estimate_fn is None:
            return None
        key = candidate_key(cand)
        if key not in self._estimates:
            try:
                self._estimates[key] = self._estimate_fn(self.workload, cand)
            except Exception:  # an estimate that cannot price a candidate only loses its help
                self._estimates[key] = None
        return self._estimates[key]

    def _estimated_tps(self, cand: Candidate) -> float:
        est = self.estimate(cand)
        if est is None or not est.ok:
            return 0.0
        d = device_bytes(est)
        # As a backend the estimate is exact about itself: what it puts over the limit does not fit.
        if d is not None and d > self.limit * (PRUNE_FACTOR if self._prunes else 1.0):
            return -1.0
        return est.tokens_per_second or 0.0

    # -- the ledger, rebuilt from the study (other runs and workers write there too) ---------------------------
    def refresh(self) -> None:
        from optuna.trial import TrialState

        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            attrs = t.user_attrs
            if "measurement" not in attrs or attrs.get("cached"):
                continue
            key = attrs["key"]
            if key in self.ledger:
                continue
            cand = Candidate.from_dict(attrs["candidate"])
            self.ledger.add(Entry(cand, Measurement.from_dict(attrs["measurement"]), t.number,
                                  bool(attrs.get("measured")), attrs.get("reason", "")))

    def _live_running(self) -> list[optuna.trial.FrozenTrial]:
        """RUNNING trials whose owner is alive; stale ones (a killed run or worker) are failed on the way: a dead
        owner process on this host at once, any other when its heartbeat is older than STALE_S."""
        from optuna.trial import TrialState

        now, live = time.time(), []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            beat = t.user_attrs.get("heartbeat")
            if beat is None and t.datetime_start is not None:
                beat = t.datetime_start.timestamp()
            if _owner_dead(t.user_attrs.get("owner")) or (beat is not None and now - float(beat) > STALE_S):
                self._fail_stale(t)
                continue
            live.append(t)
        return live

    def _fail_stale(self, t: optuna.trial.FrozenTrial) -> None:
        """Fail a dead process's trial and queue its candidate again (the one process whose FAIL lands does)."""
        from optuna.trial import TrialState

        try:
            self.study._storage.set_trial_user_attr(t._trial_id, "stale", True)
            self.study.tell(t.number, state=TrialState.FAIL)
        except Exception:  # its owner finished it meanwhile, or another process failed it first
            return
        params = t.system_attrs.get("fixed_params") or t.params
        key = t.user_attrs.get("key")
        if key and params and key not in self.ledger and set(params) == set(self.space.params):
            self.study.enqueue_trial(params, user_attrs={"proposed_by": "retry"})

    def _claim(self, trial: optuna.Trial, key: str) -> bool:
        """True when this trial is the one to evaluate `key`; False when another live trial has it.

        Several processes may pop trials of one candidate at once (two runs enqueue the same seeds). Each trial
        has written its key before it looks: a trial yields to one of the same key that is measuring or has a
        lower number, waits while only higher-numbered ones are still deciding (they never wait on it), and
        otherwise marks itself measuring. So exactly one measures, and none waits in a cycle.
        """
        number, deadline = trial.number, time.monotonic() + STALE_S
        while True:
            self.refresh()
            if key in self.ledger:
                return True  # measured meanwhile: evaluate() answers from the ledger
            others = [t for t in self._live_running() if t.user_attrs.get("key") == key and t.number != number]
            if any(t.user_attrs.get("measuring") or t.number < number for t in others):
                return False
            if not others or time.monotonic() > deadline:
                trial.set_user_attr("measuring", True)
                return True
            time.sleep(_CLAIM_POLL_S)

    @contextlib.contextmanager
    def _heartbeat(self, trial: optuna.Trial) -> Iterator[None]:
        """Keep `trial`'s heartbeat fresh while it is measured, so that others can tell it from a dead one."""
        trial.set_user_attr("heartbeat", time.time())
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                try:
                    trial.set_user_attr("heartbeat", time.time())
                except Exception:  # the storage went away: the trial will be judged stale, as it should
                    return

        thread = threading.Thread(target=beat, name="advisor-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    # -- evaluating one candidate --------------------------------------------------------------------------
    def evaluate(self, cand: Candidate, number: int | None) -> tuple[Entry, bool]:
        """(entry, cached). Measures only a candidate never seen, not bounded and not far over by the estimate."""
        key = candidate_key(cand)
        hit = self.ledger.get(key)
        if hit is not None:
            return hit, True
        bound = self.ledger.bound(cand)
        if bound is not None:
            m = Measurement(Status.PRUNED, bound.measurement.source,
                            message=f"cannot fit: trial #{bound.number}, no hungrier, already failed")
            entry = Entry(cand, m, number, measured=False, reason=m.message)
        else:
            est = self.estimate(cand)
            d = device_bytes(est) if est is not None else None
            if self._prunes and est is not None and d is not None and d > self.limit * PRUNE_FACTOR:
                m = Measurement(Status.PRUNED, Source.ESTIMATE, peak_bytes=est.peak_bytes,
                                reserved_bytes=est.reserved_bytes, device_bytes=est.device_bytes,
                                tokens_per_second=est.tokens_per_second,
                                message=f"estimate {d / _GiB:.1f} GiB, far over the limit {self.limit / _GiB:.1f}")
                entry = Entry(cand, m, number, measured=False, reason=m.message)
            else:
                m = self._measure(cand)
                self.new_measurements += 1
                entry = Entry(cand, m, number, measured=True, reason=_failure_reason(m, self.limit))
        self.ledger.add(entry)
        return entry, False

    def _measure(self, cand: Candidate) -> Measurement:
        from ._messages import capture

        start = time.perf_counter()
        said = None
        try:
            with capture() as said:  # what libraries warn per trainer goes to the report once, not to stderr
                m = self.backend.measure(self.workload, cand)
        except (KeyboardInterrupt, NoFitError):
            raise
        except Exception as exc:  # a crash of one candidate is an outcome, not the end of the search
            return Measurement(Status.ERROR, _source_of(self.backend.name), message=f"{type(exc).__name__}: {exc}",
                               wall_time_s=time.perf_counter() - start)
        finally:
            if said is not None:
                self.messages.update(said)
        if m.wall_time_s is None:
            m = dataclasses.replace(m, wall_time_s=time.perf_counter() - start)
        return m

    # -- the Optuna side -----------------------------------------------------------------------------------
    def _tell(self, trial: optuna.Trial, entry: Entry | None, cached: bool, reason: str = "") -> None:
        trial.set_user_attr("cached", cached)
        if entry is None:  # not admissible: infeasible for TPE, never measured
            trial.set_user_attr("invalid", reason[:500])
            trial.set_constraint("device_bytes", 1.0)
            self._finish(trial, 0.0)
            return
        m = entry.measurement
        trial.set_user_attr("key", candidate_key(entry.candidate))
        trial.set_user_attr("candidate", entry.candidate.to_dict())
        trial.set_user_attr("measurement", _json_safe(m.to_dict()))
        trial.set_user_attr("measured", entry.measured)
        trial.set_user_attr("reason", entry.reason)
        d = device_bytes(m)
        violation = (d - self.limit) / _GiB if (m.ok and d is not None) else 1.0 + (d or 0) / _GiB
        trial.set_constraint("device_bytes", float(violation))
        self._finish(trial, float(m.tokens_per_second or 0.0) if m.ok else 0.0)

    def _finish(self, trial: optuna.Trial, value: float) -> None:
        """Tell the study; if another process judged this trial stale and failed it meanwhile (its heartbeat
        could not be written for STALE_S), the result is stored as a new finished trial, not lost."""
        import optuna

        try:
            self.study.tell(trial, value)
            return
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            frozen = self.study._storage.get_trial(trial._trial_id)
            if frozen.state is not optuna.trial.TrialState.FAIL:
                raise
        attrs = {k: v for k, v in frozen.user_attrs.items() if k not in ("stale", "measuring")}
        self.study.add_trial(optuna.trial.create_trial(
            params=frozen.params, distributions=frozen.distributions, value=value, user_attrs=attrs,
            system_attrs={k: v for k, v in frozen.system_attrs.items() if k.startswith("constraints")}))

    def step(self, trial: optuna.Trial) -> tuple[Entry | None, bool]:
        """Evaluate the candidate of one asked trial and tell the study."""
        trial.set_user_attr("owner", _owner())
        params = {k: trial.suggest_categorical(k, self.space.choices(k)) for k in self.space.params}
        cand = self.space.decode(params)
        if not isinstance(cand, Candidate):
            self._tell(trial, None, True, cand)
            return None, True
        key = candidate_key(cand)
        trial.set_user_attr("key", key)
        if not self._claim(trial, key):
            from optuna.trial import TrialState

            trial.set_user_attr("claimed_elsewhere", True)
            self.study.tell(trial, state=TrialState.FAIL)
            return None, True
        try:
            with self._heartbeat(trial):
                entry, cached = self.evaluate(cand, trial.number)
        except BaseException:
            from optuna.trial import TrialState

            self.study.tell(trial, state=TrialState.FAIL)  # finished trials stay; this one is retried next run
            raise
        self._tell(trial, entry, cached)
        return entry, cached

    def enqueue(self, cands: list[Candidate], tag: str) -> None:
        """Queue candidates not measured and not already waiting or being measured. Unlike Optuna's
        skip_if_exists, a failed trial (an interrupted or killed measurement) does not keep its candidate out."""
        from optuna.trial import TrialState

        running = self._live_running()  # first: failing a stale trial queues its candidate again
        pending = [t.system_attrs.get("fixed_params", t.params)
                   for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))]
        pending += [t.system_attrs.get("fixed_params", t.params) for t in running]
        for c in cands:
            params = self.space.params_of(c)
            if candidate_key(c) not in self.ledger and params not in pending:
                self.study.enqueue_trial(params, user_attrs={"proposed_by": tag})
                pending.append(params)

    def waiting(self) -> int:
        from optuna.trial import TrialState

        return len(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def seeds(self, n: int) -> list[Candidate]:
        """The estimate's best guesses among candidates it does not put far over the limit."""
        if self._estimate_fn is None:
            return []
        scored = [(self._estimated_tps(c), i, c) for i, c in enumerate(self.space.candidates())]
        scored = [s for s in scored if s[0] > 0]
        scored.sort(key=lambda s: (-s[0], s[1]))
        return [c for _, _, c in scored[:n]]

    def reused(self, n: int) -> list[Candidate]:
        """The fastest feasible candidates of stored studies of this workload, method and effective batch that a
        cheaper measuring backend (simulate for a cuda or cpu search) answered: they seed the queue first."""
        import optuna
        from optuna.trial import TrialState

        own = self.study.user_attrs.get(_SPEC_KEY) or {}
        found: dict[str, tuple[float, Candidate, int]] = {}
        sources: list[str] = []
        for summary in optuna.get_all_study_summaries(self.study._storage, include_best_trial=False):
            spec = summary.user_attrs.get(_SPEC_KEY) or {}
            if (summary.study_name == self.study.study_name or spec.get("backend") in (None, "estimate")
                    or any(spec.get(k) != own.get(k) for k in ("workload_fingerprint", "method", "tokens_per_step"))):
                continue
            try:
                if get_backend(spec["backend"]).cost >= self.backend.cost:
                    continue
            except UsageError:
                continue
            other = optuna.load_study(study_name=summary.study_name, storage=self.study._storage)
            sources.append(spec["backend"])
            for t in other.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
                a = t.user_attrs
                if not a.get("measured") or "measurement" not in a:
                    continue
                m = Measurement.from_dict(a["measurement"])
                cand = self.space.admit(Candidate.from_dict(a["candidate"]))
                if not isinstance(cand, Candidate) or not feasible(m, self.limit):
                    continue
                key = candidate_key(cand)
                if key not in self.ledger and m.tokens_per_second > found.get(key, (0.0,))[0]:
                    found[key] = (m.tokens_per_second, cand, device_bytes(m) or 0)
        # the order _confirmed_best picks in: fastest, fewer extra packages, less memory, then the key
        best = [c for _, c, _ in sorted(found.values(), key=lambda v: (-v[0], len(v[1].requirements()), v[2],
                                                                        candidate_key(v[1])))[:n]]
        if best:
            self.notes.append(f"seeded with the {len(best)} fastest candidates of stored "
                              f"{'/'.join(sorted(set(sources)))} studies of this workload")
        return best

    def fit_check(self, n: int = FIT_CHECK) -> tuple[list[Candidate], int, int]:
        """Before giving up on this method: (the unmeasured candidates the estimate puts under the limit, the
        lowest-peak and the best-predicted first, at most `n`; how many it puts under the limit; how many
        admissible candidates remain unmeasured). Scans the whole admissible space with the estimate."""
        if self._estimate_fn is None:
            return [], 0, 0
        fits: list[tuple[int, float, int, Candidate]] = []
        unmeasured = 0
        for i, c in enumerate(self.space.candidates()):
            hit = self.ledger.get(candidate_key(c))
            if hit is not None and hit.measured:
                continue
            unmeasured += 1
            if hit is not None or self.ledger.bound(c) is not None:
                continue
            est = self.estimate(c)
            d = device_bytes(est) if est is not None and est.ok else None
            if d is not None and d <= self.limit:
                fits.append((d, est.tokens_per_second or 0.0, i, c))
        low = sorted(fits, key=lambda f: (f[0], f[2]))
        fast = sorted(fits, key=lambda f: (-f[1], f[2]))
        picked: list[Candidate] = []
        for pair in zip(low, fast, strict=True):
            for f in pair:
                if f[3] not in picked and len(picked) < n:
                    picked.append(f[3])
        return picked, len(fits), unmeasured

    def next_neighbour(self) -> Candidate | None:
        """The unmeasured neighbour, of the NEIGHBOUR_PARENTS fastest feasible candidates so far, that the estimate
        ranks fastest. Several parents, not only the best: a plateau of ties (e.g. optimizers of equal speed)
        otherwise keeps the walk from the one-knob move off a slightly slower candidate that leads higher."""
        ok = [e for e in self.ledger.measured if feasible(e.measurement, self.limit)]
        parents = sorted(ok, key=lambda e: -(e.measurement.tokens_per_second or 0.0))[:NEIGHBOUR_PARENTS]
        fresh: dict[str, tuple[int, Candidate]] = {}
        for rank, parent in enumerate(parents):
            for c in self.space.neighbours(parent.candidate):
                key = candidate_key(c)
                if key not in fresh and key not in self.ledger and self.ledger.bound(c) is None:
                    fresh[key] = (rank, c)
        if not fresh:
            return None
        if self._estimate_fn is None:
            return min(fresh.values(), key=lambda rc: rc[0])[1]
        rank, best = min(fresh.values(), key=lambda rc: (-self._estimated_tps(rc[1]), rc[0]))
        return best if self._estimated_tps(best) >= 0 else None

    def run(self, *, trials: int, time_budget_s: float | None, exhaustive: bool, queue_only: bool = False,
            idle_s: float = 0.0) -> None:
        """Ask, evaluate, tell until `trials` distinct measurements (in the study), the time budget, or no new point."""
        start = time.perf_counter()
        total = trials
        if exhaustive:
            grid = list(self.space.candidates())
            total = len(grid)  # the progress bar counts toward the grid, not --trials
            self.enqueue(grid, "exhaustive")
        elif not queue_only:
            self.enqueue(self.reused(SEEDS), "stored")
            self.enqueue(self.seeds(SEEDS), "estimate")
        misses, turn = 0, 0
        miss_limit = 40
        idle_since: float | None = None
        while True:
            if not queue_only:
                self.refresh()  # other runs sharing the study count toward `trials` as soon as they finish
            done = len(self.ledger.measured)
            if not exhaustive and not queue_only and done >= trials:
                break
            if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
                self.notes.append(f"stopped by --time-budget {time_budget_s:g}s after {done} measurements")
                self.stopped_by_time = True
                break
            waiting = self.waiting()
            if not waiting:
                if exhaustive or queue_only:
                    if queue_only and idle_s > 0:
                        idle_since = idle_since or time.perf_counter()
                        if time.perf_counter() - idle_since < idle_s:
                            time.sleep(0.2)
                            continue
                    break
                turn += 1
                if turn % 2:
                    nb = self.next_neighbour()
                    if nb is not None:
                        self.enqueue([nb], "neighbour")
                if misses >= miss_limit:
                    self.notes.append(f"stopped after {miss_limit} proposals in a row gave no new candidate")
                    break
            idle_since = None
            trial = self.study.ask()
            if queue_only and "proposed_by" not in trial.user_attrs:
                from optuna.trial import TrialState

                self.study.tell(trial, state=TrialState.FAIL)  # lost the race for the last queued trial
                continue
            entry, cached = self.step(trial)
            misses = misses + 1 if (cached or entry is None or not entry.measured) else 0
            if self.progress is not None:
                best = self.ledger.best()
                self.progress(Progress(len(self.ledger.measured), total, best.measurement.tokens_per_second
                                       if best else None, time.perf_counter() - start,
                                       _describe(entry.candidate) if entry else ""))

    def wait_for_running(self, timeout_s: float = 600.0) -> None:
        """Workers, or other runs sharing the study, may still be measuring; their results belong in the answer.
        A RUNNING trial whose owner died is failed instead of waited for, and its candidate, queued again, is
        measured here (with whatever else is still queued then)."""
        from optuna.trial import TrialState

        end = time.perf_counter() + timeout_s
        while time.perf_counter() < end:
            running = [t for t in self._live_running() if "key" in t.user_attrs]
            if running:
                time.sleep(0.2)
                continue
            retry = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
                     if t.user_attrs.get("proposed_by") == "retry"]
            if not retry:
                break
            self.run(trials=0, time_budget_s=None, exhaustive=False, queue_only=True)
        self.refresh()

    # -- confirmation --------------------------------------------------------------------------------------
    def confirm(self, entry: Entry) -> Measurement:
        """One more measurement of the same backend (stored in the study, so a rerun does not repeat it)."""
        attr = "confirm:" + fingerprint(candidate_key(entry.candidate))
        stored = self.study.user_attrs.get(attr)
        if stored is not None:
            return Measurement.from_dict(stored)
        m = self._measure(entry.candidate)
        self.study.set_user_attr(attr, _json_safe(m.to_dict()))
        return m


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), so that a reused pid is not taken for it;
    "zombie" for a process that has exited but is not yet reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return "zombie" if fields[0] in ("Z", "X") else fields[19]


_OWNERS: dict[int, list[Any]] = {}


def _owner() -> list[Any]:
    """[host, pid, start] of this process (per pid: a forked worker is its own owner)."""
    pid = os.getpid()
    if pid not in _OWNERS:
        _OWNERS[pid] = [socket.gethostname(), pid, _process_start(pid)]
    return _OWNERS[pid]


def _owner_dead(owner: Any) -> bool:
    """True when `owner` ([host, pid, start]) was a process on this host that no longer runs."""
    me = _owner()
    if not isinstance(owner, list) or len(owner) != 3 or owner[0] != me[0] or owner[1] == me[1]:
        return False  # another machine (its heartbeat decides), an older advisor, or this very process
    try:
        pid = int(owner[1])
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError, TypeError):
        return False
    now = _process_start(pid)
    return now == "zombie" or (owner[2] is not None and now is not None and now != owner[2])


def _json_safe(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def _source_of(backend: str) -> Source:
    from .backends import source_of

    return source_of(backend)  # the registry's declaration: an unknown backend is never labelled estimate


def _failure_reason(m: Measurement, limit: int) -> str:
    if m.status is Status.OOM:
        return "out of memory" + (f": {m.message}" if m.message else "")
    if not m.ok:
        return f"{m.status.value}: {m.message}" if m.message else m.status.value
    d = device_bytes(m)
    if d is None:
        return "no device peak measured"
    if d > limit:
        return f"device {d / _GiB:.2f} GiB over the limit {limit / _GiB:.2f} GiB"
    return ""


def _describe(c: Candidate) -> str:
    ckpt = "off"
    if c.activation_checkpointing:
        ckpt = "selective" if c.checkpoint_selective else f"every {c.checkpoint_every_n_layers}"
    pack = c.packing_strategy.value if c.packing else ("padding-free" if c.padding_free else "padded")
    return (f"mb={c.per_device_train_batch_size}x{c.gradient_accumulation_steps} len={c.max_length} {pack} "
            f"ckpt={ckpt} {c.optim.value}")


# ---- public API ----------------------------------------------------------------------------------------------
def _goals(base: Goals | None, **given: Any) -> Goals:
    """The Workload's goals (or the defaults) with every goal the caller passed (not None) over them: a value
    equal to the default still overrides a Workload's own (headroom=0.05 over a Workload's 0.1)."""
    merged = dict((base or Goals()).__dict__)
    merged.update({k: v for k, v in given.items() if v is not None})
    return Goals(**merged)


def _resolve_workload(model: str | Workload, gpu: str | None, dataset: str | None, goals: dict[str, Any]) -> Workload:
    if isinstance(model, Workload):
        if gpu is not None or dataset is not None:
            raise UsageError("suggest(): pass gpu and dataset inside the Workload, not beside it")
        return dataclasses.replace(model, goals=_goals(model.goals, **goals))
    from .workload import build_workload

    return build_workload(model, gpu=gpu, dataset=dataset, goals=_goals(None, **goals))


def _study_name(workload: Workload, backend: str, method: Method, space: _Space) -> str:
    fp = fingerprint({
        "workload": workload.fingerprint(), "backend": backend, "method": method.value, "space": space.to_json(),
        "tokens_per_step": space.tokens_per_step, "limit": workload.limit_bytes, "versions": library_versions(),
    })
    short = workload.model.name.rstrip("/").split("/")[-1]
    return f"advisor-{short}-{workload.gpu.name}-{backend}-{method.value}-{fp}"


# What a stored study must agree on with a new run that reuses its name (pins are part of the space).
_SPEC_FIELDS = ("backend", "method", "space", "tokens_per_step", "workload_fingerprint", "goals")


def _spec_differences(stored: Mapping[str, Any], spec: Mapping[str, Any]) -> list[str]:
    out = []
    for k in _SPEC_FIELDS:
        a, b = stored.get(k), spec.get(k)
        if k == "goals":  # the requested method (auto or not) is not the study's: "method" above is
            a = {g: v for g, v in (a or {}).items() if g != "method"}
            b = {g: v for g, v in (b or {}).items() if g != "method"}
            changed = sorted(g for g in set(a) | set(b) if a.get(g) != b.get(g))
            if changed:
                out.append(f"goals ({', '.join(changed)})")
        elif k == "space" and a != b:
            keys = sorted(g for g in set(a or {}) | set(b or {}) if (a or {}).get(g) != (b or {}).get(g))
            out.append(f"space ({', '.join(keys)}: --fix, --method or --max-truncation)")
        elif a != b:
            out.append(k if k != "workload_fingerprint" else "workload (model, GPU, dataset or budget)")
    return out


def _open_store(storage: str | None, cache: bool, reasons: list[str],
                progress: Callable[[Progress], None] | None) -> tuple[optuna.storages.BaseStorage, bool]:
    """--storage as given (errors name it), else the default cache, which never fails: an unusable one is
    replaced by memory, a read-only one is read; either says so in one line (the report, and the CLI's stderr).
    The flag says whether what this run measures is kept (False: in memory, or a read-only copy)."""
    if not storage and not cache:
        return open_storage(None), False
    opened = open_given(storage) if storage else open_cache()
    if opened.note:
        reasons.append(opened.note)
        if progress is not None:
            progress(Progress(0, 0, None, 0.0, note=opened.note))
    return opened.storage, not opened.note


def _create_study(storage: optuna.storages.BaseStorage, name: str, spec: dict[str, Any],
                  given_name: str | None = None) -> optuna.Study:
    import optuna

    prepare_study(storage, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=0, multivariate=True, group=True, constant_liar=True,
                                             n_startup_trials=5)
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize", sampler=sampler,
                                load_if_exists=True)
    stored = study.user_attrs.get(_SPEC_KEY)
    if stored is None:
        study.set_user_attr(_SPEC_KEY, spec)
    elif differences := _spec_differences(stored, spec):
        shown = given_name or name
        raise UsageError(f"--study {shown!r}: the stored study {name!r} was made with a different "
                         f"{'; '.join(differences)}; pass the original flags to resume it, or name a new --study")
    return study


def _spec(workload: Workload, backend: str, method: Method, space: _Space, origin: dict[str, Any]) -> dict[str, Any]:
    return {"backend": backend, "method": method.value, "space": space.to_json(),
            "tokens_per_step": space.tokens_per_step, "workload_fingerprint": workload.fingerprint(),
            "goals": {k: (v.value if isinstance(v, Enum) else v) for k, v in workload.goals.__dict__.items()},
            **origin}


def suggest(
    model: str | Workload,
    gpu: str | None = None,
    dataset: str | None = None,
    *,
    backend: str | None = None,
    method: str | Method | None = None,
    memory_budget: int | None = None,
    headroom: float | None = None,
    max_truncation: float | None = None,
    tokens_per_step: int | None = None,
    trials: int | None = None,
    time_budget_s: float | None = None,
    fix: Mapping[str, Any] | None = None,
    storage: str | None = None,
    study_name: str | None = None,
    cache: bool = True,
    exhaustive: bool = False,
    allow_low_precision_weights: bool | None = None,
    allow_wrapped: bool | None = None,
    progress: Callable[[Progress], None] | None = None,
    workload_names: Mapping[str, Any] | None = None,
) -> Suggestion:
    """The fastest candidate whose device peak stays under budget x (1 - headroom), measured by `backend`.

    Raises NoFitError (exit 1) when nothing fits, ConfigError / UsageError (exit 2) for bad input (a `cuda`
    backend without a CUDA device included, before any work), BackendError (exit 3) when the backend failed with
    an error on every candidate it measured.
    `evaluations` in the answer counts the distinct candidates this search measured with its backend (every
    method it tried, its workers included); those answered from a stored study are listed in the trials as
    cached but not counted. `workload_names` (model, gpu, dataset, tokenizer, sample: the names a Workload
    passed as `model` was built from) are stored in the study so that `advisor worker` can rebuild the
    workload and join it.
    """
    try:
        method = Method(method) if method is not None else None  # None: the Workload's (default auto)
    except ValueError:
        raise UsageError(f"--method {method!r}: choose one of full, lora, qlora, auto") from None
    if trials is not None and trials < 1:
        raise UsageError(f"--trials {trials}: must be >= 1")
    ignored = [f"--trials {trials} is ignored with --exhaustive (every valid candidate is evaluated)"] if (
        exhaustive and trials is not None) else []
    if time_budget_s is not None and time_budget_s <= 0:
        raise UsageError(f"--time-budget {time_budget_s:g}: must be a positive number of seconds, e.g. 600")
    goals = dict(memory_budget_bytes=memory_budget, headroom=headroom, max_truncation=max_truncation,
                 tokens_per_step=tokens_per_step, method=method,
                 allow_low_precision_weights=allow_low_precision_weights, allow_wrapped=allow_wrapped)
    origin: dict[str, Any] = {"model": model if isinstance(model, str) else None, "gpu": gpu, "dataset": dataset,
                              "tokenizer": None, "sample": None}
    origin.update({k: v for k, v in (workload_names or {}).items() if k in origin and v is not None})
    if backend is not None:
        check_backend(backend)  # before the workload is built: an unusable backend fails in a second
    workload = _resolve_workload(model, gpu, dataset, goals)
    backend_name = backend or default_backend_name()
    be = get_backend(backend_name)
    pins = parse_fix(fix)
    order = method_order(workload.goals.method, pins)
    rows = RowTokens(workload.dataset)
    tps = default_tokens_per_step(workload, rows)
    reasons: list[str] = list(ignored)
    store, kept = _open_store(storage, cache, reasons, progress)
    if not workload.goals.tokens_per_step:
        reasons.append(f"effective batch: {tps} trained tokens per optimizer step (TRL's default 8 rows x mean "
                       "trained tokens per row; set --tokens-per-step to change)")
    smallest: list[tuple[int, Candidate]] = []
    runs: list[_Study] = []
    spaces = {m: _Space(workload, apply_pins(default_space(workload, m), pins), tps, rows) for m in order}
    empty = {m: sp.why_empty() for m, sp in spaces.items()}
    if all(empty.values()):  # no method has an admissible candidate: bad input, not "nothing fits"
        why = "; ".join(f"{m.value}: {w}" for m, w in empty.items())
        if fix:
            shown = " ".join(f"--fix {k}={v}" for k, v in fix.items())
            raise UsageError(f"{shown}: leaves no admissible candidate ({why}); drop or change the --fix")
        raise UsageError(_empty_message(workload, spaces, empty, rows, tps, why))
    for i, m in enumerate(order):
        space = spaces[m]
        if empty[m]:
            nxt = order[i + 1].value if i + 1 < len(order) else None
            reasons.append(f"{m.value}: no admissible candidate ({empty[m]})"
                           + (f"; escalated to {nxt}" if nxt else ""))
            continue
        name = study_name if study_name and len(order) == 1 else (
            f"{study_name}-{m.value}" if study_name else _study_name(workload, backend_name, m, space))
        if not study_name and _drop_failed_study(store, name):
            reasons.append(f"{m.value}: the stored study held only error outcomes of an earlier run (a "
                           "BackendError): measured again")
        study = _create_study(store, name, _spec(workload, backend_name, m, space, origin), study_name)
        run = _Study(workload, m, space, be, study, progress)
        runs.append(run)
        run.run(trials=trials or DEFAULT_TRIALS, time_budget_s=time_budget_s, exhaustive=exhaustive)
        run.wait_for_running()  # workers, or another run sharing the cache: their results belong in the answer
        _raise_if_backend_failed(run, backend_name, name)
        best = _confirmed_best(run, reasons)
        unmeasured = 0
        if best is None and not run.stopped_by_time:
            # The trial budget may have run out before anything that fits was tried: ask the estimate about
            # the whole admissible space and measure the few it says fit before escalating or giving up.
            extra, n_fit, unmeasured = run.fit_check()
            if extra:
                reasons.append(f"{m.value}: none of the {len(run.ledger.measured)} measured candidates fit; the "
                               f"estimate puts {n_fit} unmeasured ones under the limit: measured the {len(extra)} "
                               "lowest-peak / best-predicted of them")
                run.enqueue(extra, "fit-check")
                run.run(trials=0, time_budget_s=None, exhaustive=False, queue_only=True)
                best = _confirmed_best(run, reasons)
                unmeasured = run.fit_check(0)[2]
        if best is not None:
            entry, confirmed = best
            if not any(r.new_measurements for r in runs) and run.ledger.measured:
                reasons.append(f"answered from the stored study {name!r}: no new measurement")
            elif kept:
                reasons.append(f"stored as the study {name!r}: `advisor report --study {name}"
                               + (f" --storage {storage}" if storage else "") + "` shows it again")
            return _suggestion(workload, runs, entry, confirmed, reasons, backend_name)
        if not run.ledger.measured and time_budget_s is not None and run.stopped_by_time:
            raise NoFitError(
                f"--time-budget {time_budget_s:g}s ended before any candidate was measured with {backend_name}; "
                "give it more time (finished trials are kept and the next run resumes)",
                details={"limit_bytes": workload.limit_bytes, "next_knob": "--time-budget"},
            )
        if not run.ledger.entries:
            reasons.append(f"{m.value}: no admissible candidate in the space (check --fix, --max-truncation)")
        low = _smallest(run)
        if low is not None:
            smallest.append(low)
        peak = f"; the smallest device peak found was {low[0] / _GiB:.2f} GiB" if low else ""
        nxt = order[i + 1].value if i + 1 < len(order) else None
        if unmeasured and backend_name == "estimate":
            what = (f"nothing fits the limit {workload.limit_bytes / _GiB:.2f} GiB{peak} (the estimate puts the "
                    f"{unmeasured} unmeasured admissible candidates over it too)")
        elif unmeasured:
            what = (f"none of the {len(run.ledger.measured)} measured candidates fit the limit "
                    f"{workload.limit_bytes / _GiB:.2f} GiB{peak}; raise --trials to measure the {unmeasured} "
                    "unmeasured ones (the estimate puts them over the limit)")
        else:
            what = f"nothing fits the limit {workload.limit_bytes / _GiB:.2f} GiB{peak}"
        reasons.append(f"{m.value}: {what}" + (f"; escalated to {nxt}" if nxt else ""))
    low = min(smallest, key=lambda s: s[0]) if smallest else None
    raise NoFitError(_no_fit_message(workload, order, smallest, reasons), details={
        "limit_bytes": workload.limit_bytes,
        "smallest_device_bytes": low[0] if low else None,
        "smallest_config": low[1].to_dict() if low else None,
        "next_knob": _next_knob(order[-1]),
        "notes": reasons,
    })


def check_backend(name: str) -> None:
    """UsageError (exit 2) for an unknown backend, or one that cannot run here (cuda without a CUDA device)."""
    from .backends import check_usable

    check_usable(name)


def _raise_if_backend_failed(run: _Study, backend: str, study: str) -> None:
    """An error outcome for every candidate measured is an error of the run (BackendError), not "nothing fits"."""
    from collections import Counter

    measured = run.ledger.measured
    if not measured or any(e.measurement.status is not Status.ERROR for e in measured):
        return
    why = Counter(e.measurement.message or "no message" for e in measured)
    message, count = why.most_common(1)[0]
    others = f" ({len(why) - 1} other message(s))" if len(why) > 1 else ""
    raise BackendError(
        f"--backend {backend}: every one of the {len(measured)} candidates measured failed with an error, so "
        f"nothing was learnt about memory; {count}x: {message}{others}. Fix that cause (or choose another "
        f"--backend) and rerun: a study that holds only errors is measured again",
        details={"backend": backend, "study": study, "errors": len(measured), "message": message},
    )


def _drop_failed_study(store: optuna.storages.BaseStorage, name: str) -> bool:
    """Delete a cached study whose every measurement is an error (the run raised BackendError): it says nothing
    about memory, and keeping it would answer the rerun, after the cause is fixed, with the same errors."""
    import optuna
    from optuna.trial import TrialState

    if name not in _study_names(store):
        return False
    study = optuna.load_study(study_name=name, storage=store)
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    statuses = [t.user_attrs["measurement"].get("status") for t in done
                if t.user_attrs.get("measured") and "measurement" in t.user_attrs]
    if not statuses or any(st != Status.ERROR.value for st in statuses):
        return False
    with contextlib.suppress(KeyError):  # another run deleted it first
        optuna.delete_study(study_name=name, storage=store)
    return True


def _empty_message(workload: Workload, spaces: Mapping[Method, _Space], empty: Mapping[Method, str | None],
                   rows: RowTokens, tps: int, why: str) -> str:
    """Why no method has an admissible candidate, naming the flag that decides it and a value that works."""
    goals = workload.goals
    # Candidates within the truncation allowance that only the effective batch refuses: the batch is the blocker.
    per_row = []
    if any(w and (w.startswith(_NO_ACCUMULATION) or "truncation" in w) for w in empty.values()):
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
    need = int(math.ceil(DEFAULT_ROWS_PER_STEP * max(per_row) / 1024.0)) * 1024
    return (f"{given} does not hold whole rows of this data: kept within --max-truncation "
            f"{goals.max_truncation:g}, a micro-batch row carries {min(per_row):,.0f} to {max(per_row):,.0f} "
            f"trained tokens, and no micro-batch x accumulation lands within {BATCH_TOLERANCE:.0%} of {tps}; set "
            f"--tokens-per-step {need} ({DEFAULT_ROWS_PER_STEP} such rows per optimizer step)")


def _confirmed_best(run: _Study, reasons: list[str]) -> tuple[Entry, Measurement] | None:
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
        reasons.append(f"{_describe(best.candidate)} failed its confirmation ({_failure_reason(confirmed, run.limit)})")
    return None


def _smallest(run: _Study) -> tuple[int, Candidate] | None:
    sized = [(device_bytes(e.measurement), e.candidate) for e in run.ledger.entries.values()
             if device_bytes(e.measurement) is not None]
    return min(sized, key=lambda s: s[0]) if sized else None  # type: ignore[return-value]


def _no_fit_message(workload: Workload, order: list[Method], smallest: list[tuple[int, Candidate]],
                    reasons: list[str]) -> str:
    limit = workload.limit_bytes / _GiB
    head = f"nothing fits {workload.gpu.name} within {limit:.2f} GiB (budget x (1 - headroom))"
    if smallest:
        d, c = min(smallest, key=lambda s: s[0])
        head += f"; the smallest device peak found was {d / _GiB:.2f} GiB ({_describe(c)})"
    return head + f"; next knob to try: {_next_knob(order[-1])}. " + " | ".join(reasons)


def _next_knob(last: Method) -> str:
    return {Method.FULL: "--method lora (or auto)", Method.LORA: "--method qlora"}.get(
        last, "a larger --memory-budget or --gpu, or a larger --max-truncation (shorter max_length)")


def _evaluations(runs: list[_Study]) -> int:
    """The distinct candidates this search measured with its backend, over every method it tried: by this
    process or by workers sharing its study, but not those answered from a stored study, nor confirmations."""
    return sum(1 for r in runs for key, e in r.ledger.entries.items() if e.measured and key not in r.stored)


def _suggestion(workload: Workload, runs: list[_Study], entry: Entry, confirmed: Measurement, reasons: list[str],
                backend: str) -> Suggestion:
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
                why = _failure_reason(e.measurement, r.limit)
            if r is not run:
                why = f"{r.method.value}: {why}"
            own.append(Trial(e.candidate, e.measurement, e.number, why, cached=key in r.stored))
        own.sort(key=lambda t: (rank, t.number if t.number is not None else 1 << 30))
        trials += own
    notes = list(reasons) + run.notes
    said: collections.Counter[tuple[str, str]] = collections.Counter()
    for r in runs:
        said.update(r.messages)
    messages = summarize(said)
    if messages:
        shown = "; ".join(m if len(m) <= 240 else m[:239] + "…" for m in map(str, messages[:3]))
        more = f"; {len(messages) - 3} more" if len(messages) > 3 else ""
        notes.append(f"libraries said while measuring (each distinct message once, all with --verbose): {shown}{more}")
    drift = confirmation_note(entry.measurement, confirmed, backend)
    if drift:
        notes.append(drift)
    if run.method is not Method.FULL:
        notes.append(f"method: {run.method.value}")
    return Suggestion(
        workload=workload, candidate=entry.candidate, measurement=confirmed, trials=tuple(trials),
        reasons=tuple(notes), backend=backend, evaluations=_evaluations(runs), front=_front(trials, run.limit),
        messages=messages,
    )


def confirmation_note(searched: Measurement, confirmed: Measurement, backend: str, tolerance: float = 0.05) -> str:
    """What the confirmation compared and what a difference means, when it is over `tolerance`; else ''."""
    a, b = searched.tokens_per_second or 0.0, confirmed.tokens_per_second or 0.0
    if not a or abs(b - a) <= tolerance * a:
        return ""
    change = (b - a) / a
    return (f"confirmation: a second {backend} measurement of the chosen configuration gave {b:,.0f} trained "
            f"tokens/s against {a:,.0f} in the search ({change:+.1%}); the table shows the second. Timings on this "
            f"machine vary by about that much (other load, clocks), so candidates within {abs(change):.0%} of "
            "the chosen one are as good as ties")


def _front(trials: list[Trial], limit: int) -> tuple[Trial, ...]:
    """Feasible trials that no other is both smaller and faster than."""
    ok = sorted((t for t in trials if feasible(t.measurement, limit)),
                key=lambda t: (device_bytes(t.measurement), -(t.measurement.tokens_per_second or 0)))
    out, best = [], -1.0
    for t in ok:
        if (t.measurement.tokens_per_second or 0) > best:
            out.append(t)
            best = t.measurement.tokens_per_second or 0
    return tuple(out)


# ---- stored searches, shown again without measuring ------------------------------------------------------------
@dataclass(frozen=True)
class StoredStudy:
    """One stored study (one method of one search): what it was for, and how far it got."""

    name: str
    model: str | None
    gpu: str | None
    dataset: str | None
    backend: str
    method: str
    trials: int  # distinct candidates measured
    answered: bool  # a confirmation is stored: `suggest` returned an answer from it
    started: str | None  # ISO date of its first trial


def stored_studies(storage: str | None = None) -> list[StoredStudy]:
    """The advisor studies in `storage` (default: the study cache that `suggest` uses), oldest first."""
    import optuna
    from optuna.trial import TrialState

    store = open_given(storage).storage if storage else open_cache().storage
    out = []
    for su in optuna.get_all_study_summaries(store, include_best_trial=False):
        spec = su.user_attrs.get(_SPEC_KEY)
        if not spec:
            continue
        study = optuna.load_study(study_name=su.study_name, storage=store)
        measured = {t.user_attrs.get("key") for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    if t.user_attrs.get("measured")}
        out.append(StoredStudy(
            name=su.study_name, model=spec.get("model"), gpu=spec.get("gpu"), dataset=spec.get("dataset"),
            backend=spec["backend"], method=spec["method"], trials=len(measured),
            answered=any(k.startswith("confirm:") for k in study.user_attrs),
            started=su.datetime_start.isoformat(timespec="seconds") if su.datetime_start else None,
        ))
    return sorted(out, key=lambda s: (s.started or "", s.name))


def stored_suggestion(study_name: str, storage: str | None = None, *, workload: Workload | None = None) -> Suggestion:
    """The answer of a stored study, rebuilt from its trials and stored confirmation; nothing is measured.

    The workload is rebuilt from the names the study keeps (model, GPU, dataset), unless given.
    """
    import optuna

    label = storage or "the study cache"
    store = open_given(storage).storage if storage else open_cache().storage
    names = _study_names(store)
    if study_name not in names:
        ours = [n for n in names if n.startswith("advisor-") or study_name in n]
        listed = f"stored: {', '.join(ours)}" if ours else "none is stored there yet"
        raise UsageError(f"--study {study_name!r}: no such study in {label} ({listed}); `advisor studies` lists "
                         "them")
    study = optuna.load_study(study_name=study_name, storage=store)
    spec = study.user_attrs.get(_SPEC_KEY)
    if spec is None:
        raise UsageError(f"--study {study_name!r}: not an advisor study (no spec attribute)")
    if workload is None:
        from .workload import build_workload

        if not spec.get("model"):
            raise UsageError(f"--study {study_name!r}: made from a Workload object; call "
                             "advisor.search.stored_suggestion(name, workload=...)")
        workload = build_workload(spec["model"], gpu=spec.get("gpu"), dataset=spec.get("dataset"),
                                  tokenizer=spec.get("tokenizer"), sample=spec.get("sample"))
    workload = dataclasses.replace(workload, goals=Goals(**spec["goals"]))
    if workload.fingerprint() != spec["workload_fingerprint"]:
        raise UsageError(f"--study {study_name!r}: the model, GPU profile or dataset it names has changed since "
                         "the search; rerun `advisor suggest` with the same flags")
    try:
        be = get_backend(spec["backend"])
    except UsageError:  # a backend registered by the process that made the study: never called here
        be = FunctionBackend(spec["backend"], lambda w, c: Measurement(Status.ERROR, Source.ESTIMATE))
    space = _Space(workload, _space_from_json(spec["space"]), int(spec["tokens_per_step"]),
                   RowTokens(workload.dataset))
    run = _Study(workload, Method(spec["method"]), space, be, study)
    reasons = [f"shown from the stored study {study_name!r} ({len(run.ledger.measured)} measured trials); "
               "nothing was measured again"]
    ok = sorted((e for e in run.ledger.measured if feasible(e.measurement, run.limit)),
                key=lambda e: (-(e.measurement.tokens_per_second or 0.0), len(e.candidate.requirements()),
                               device_bytes(e.measurement) or 0))
    for entry in ok:
        stored = study.user_attrs.get("confirm:" + fingerprint(candidate_key(entry.candidate)))
        if stored is None:
            reasons.append("no confirmation is stored for this candidate (the search was interrupted): its "
                           "numbers are the search's single measurement")
            return _suggestion(workload, [run], entry, entry.measurement, reasons, spec["backend"])
        confirmed = Measurement.from_dict(stored)
        if feasible(confirmed, run.limit):
            return _suggestion(workload, [run], entry, confirmed, reasons, spec["backend"])
        reasons.append(f"{_describe(entry.candidate)} failed its confirmation "
                       f"({_failure_reason(confirmed, run.limit)})")
    raise NoFitError(f"--study {study_name!r}: no measured candidate fits the limit "
                     f"{workload.limit_bytes / _GiB:.2f} GiB ({len(run.ledger.measured)} measured); "
                     "rerun `advisor suggest` to search further",
                     details={"limit_bytes": workload.limit_bytes, "notes": reasons})


METHOD_SUFFIXES = tuple(f"-{m.value}" for m in (Method.FULL, Method.LORA, Method.QLORA))


def _study_names(store: optuna.storages.BaseStorage) -> list[str]:
    import optuna

    return [su.study_name for su in optuna.get_all_study_summaries(store, include_best_trial=False)]


def _worker_names(names: list[str], study_name: str) -> list[str]:
    """The study itself, or the per-method studies `suggest --method auto --study NAME` makes (NAME-full, ...)."""
    if study_name in names:
        return [study_name]
    return [study_name + sfx for sfx in METHOD_SUFFIXES if study_name + sfx in names]


def _worker_run(store: optuna.storages.BaseStorage, name: str, storage: str, workload: Workload | None,
                backend: str | None, progress: Callable[[Progress], None] | None) -> _Study:
    import optuna

    study = optuna.load_study(study_name=name, storage=store)
    spec = study.user_attrs.get(_SPEC_KEY)
    end = time.monotonic() + 30.0
    while spec is None and time.monotonic() < end:  # a leader creates the study, then stores its spec
        time.sleep(0.2)
        spec = study.user_attrs.get(_SPEC_KEY)
    if spec is None:
        raise UsageError(f"--study {name!r}: not an advisor study in {storage} (no spec attribute); name a study "
                         "made by `advisor suggest --storage URL --study NAME`")
    if backend is not None and backend != spec["backend"]:
        raise UsageError(f"--backend {backend}: the study {name!r} measures with {spec['backend']}; a worker must "
                         f"use the study's backend: drop --backend or pass --backend {spec['backend']}")
    if workload is None:
        from .workload import build_workload

        if not spec.get("model"):
            raise UsageError(f"--study {name!r}: started from a Workload object; run workers through "
                             "advisor.search.run_worker(workload=...)")
        workload = build_workload(spec["model"], gpu=spec.get("gpu"), dataset=spec.get("dataset"),
                                  tokenizer=spec.get("tokenizer"), sample=spec.get("sample"),
                                  goals=Goals(**spec["goals"]))
    workload = dataclasses.replace(workload, goals=Goals(**spec["goals"]))
    if workload.fingerprint() != spec["workload_fingerprint"]:
        raise UsageError(f"--study {name!r}: the workload differs from the one the study was made for")
    be = get_backend(spec["backend"])
    space = _Space(workload, _space_from_json(spec["space"]), int(spec["tokens_per_step"]),
                   RowTokens(workload.dataset))
    return _Study(workload, Method(spec["method"]), space, be, study, progress)


def run_worker(storage: str, study_name: str, *, workload: Workload | None = None, backend: str | None = None,
               idle_s: float = 5.0, progress: Callable[[Progress], None] | None = None) -> int:
    """Measure queued candidates of a shared study until no queue has had work for `idle_s`; return how many.

    `study_name` is the name given to `suggest --study`: with `--method auto` the worker follows the per-method
    studies NAME-full, NAME-lora, NAME-qlora as the leader escalates. Optuna hands each queued trial to one
    worker only, so no two workers measure the same candidate.
    """
    store = open_storage(storage)
    runs: dict[str, _Study] = {}
    idle_since = time.perf_counter()
    while True:  # a worker may start before the leader has made the study, or before it escalates
        for name in _worker_names(_study_names(store), study_name):
            if name not in runs:
                runs[name] = _worker_run(store, name, storage, workload, backend, progress)
                idle_since = time.perf_counter()  # `idle_s` of an empty queue counts from the study's making
        worked = 0
        for run in runs.values():
            before = run.new_measurements
            run.run(trials=0, time_budget_s=None, exhaustive=False, queue_only=True, idle_s=0.0)
            worked += run.new_measurements - before
        if worked:
            idle_since = time.perf_counter()
        elif time.perf_counter() - idle_since > idle_s:
            break
        else:
            time.sleep(0.2)
    if not runs:
        known = _study_names(store)
        listed = f"studies there: {', '.join(known)}" if known else "it holds no study yet"
        raise UsageError(f"--study {study_name!r}: no such study in {storage} ({listed}); pass the --study name "
                         "given to `advisor suggest`")
    return sum(run.new_measurements for run in runs.values())
