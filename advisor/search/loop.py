"""One method's search: the study's ask / evaluate / tell loop over the proposers, the evaluator and liveness."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._interrupt import requested as interrupt_requested
from ..events import Converged, Event, NoNewCandidate, Progress, Seeded, TimeBudget, describe
from ..measurement import Measurement
from ..space import Candidate
from ..workload import Method, Workload, fingerprint
from . import liveness, proposers
from .backends import FunctionBackend
from .evaluator import Evaluator, Pending
from .ledger import Entry, Ledger, candidate_key, device_bytes
from .params import StudySpace

if TYPE_CHECKING:
    import optuna

_GiB = 2**30
MISS_LIMIT = 40  # proposals in a row that give no new candidate end the search


def json_safe(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


@dataclass
class _InFlight:
    """An asked trial whose candidate is being measured (pending None: a repeat of one in the same batch)."""

    trial: optuna.Trial
    cand: Candidate
    key: str
    pending: Pending | None
    beat: contextlib.ExitStack


class StudyRun:
    """One method's search: the Optuna study, our ledger (rebuilt from the study), the evaluator."""

    def __init__(self, workload: Workload, method: Method, space: StudySpace, backend: FunctionBackend,
                 study: optuna.Study, progress: Callable[[Progress], None] | None = None, pool: Any = None,
                 jobs: int = 1):
        self.workload, self.method, self.space, self.backend, self.study = workload, method, space, backend, study
        self.limit = workload.limit_bytes
        self.ledger = Ledger(self.limit)
        self.evaluator = Evaluator(workload, backend, self.ledger, pool)
        self.jobs = max(1, jobs)  # candidates measured at once: one batch is proposed, then told in order
        self._in_flight: set[str] = set()
        self.progress = progress
        self.events: list[Event] = []
        self.stopped_by_time = False
        self.refresh()
        self.stored = frozenset(self.ledger.entries)  # answered from the stored study, not by this run

    @property
    def new_measurements(self) -> int:
        return self.evaluator.new_measurements

    @property
    def messages(self) -> Any:
        return self.evaluator.messages

    # -- the ledger, rebuilt from the study (other runs and workers write there too) ---------------------------
    def refresh(self) -> None:
        from optuna.trial import TrialState  # lazy: loads optuna

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
        return liveness.live_running(self.study, self._requeue_stale)

    def _requeue_stale(self, t: optuna.trial.FrozenTrial) -> None:
        """Fail a dead process's trial and queue its candidate again (the one process whose FAIL lands does)."""
        if not liveness.fail_stale(self.study, t):
            return
        params = liveness.fixed_params(t)
        key = t.user_attrs.get("key")
        if key and params and key not in self.ledger and set(params) == set(self.space.params):
            self.study.enqueue_trial(params, user_attrs={"proposed_by": "retry"})

    def _measured_now(self, key: str) -> bool:
        self.refresh()
        return key in self.ledger

    # -- the Optuna side -----------------------------------------------------------------------------------
    def _tell(self, trial: optuna.Trial, entry: Entry | None, cached: bool, reason: str = "") -> None:
        trial.set_user_attr("cached", cached)
        if entry is None:  # not admissible: infeasible for TPE, never measured
            trial.set_user_attr("invalid", reason[:500])
            trial.set_constraint("device_bytes", 1.0)
            liveness.finish(self.study, trial, 0.0)
            return
        m = entry.measurement
        trial.set_user_attr("key", candidate_key(entry.candidate))
        trial.set_user_attr("candidate", entry.candidate.to_dict())
        trial.set_user_attr("measurement", json_safe(m.to_dict()))
        trial.set_user_attr("measured", entry.measured)
        trial.set_user_attr("reason", entry.reason)
        d = device_bytes(m)
        violation = (d - self.limit) / _GiB if (m.ok and d is not None) else 1.0 + (d or 0) / _GiB
        trial.set_constraint("device_bytes", float(violation))
        liveness.finish(self.study, trial, float(m.tokens_per_second or 0.0) if m.ok else 0.0)

    def _start(self, trial: optuna.Trial) -> tuple[Entry | None, bool] | _InFlight:
        """Decode and claim one asked trial's candidate: told at once (entry, cached) when it needs no measurement,
        else its measurement is submitted to the pool (an _InFlight, told by _finish in proposal order)."""
        trial.set_user_attr("owner", liveness.owner())
        params = {k: trial.suggest_categorical(k, self.space.choices(k)) for k in self.space.params}
        cand = self.space.decode(params)
        if not isinstance(cand, Candidate):
            self._tell(trial, None, True, cand)
            return None, True
        key = candidate_key(cand)
        trial.set_user_attr("key", key)
        if not liveness.claim(trial, key, lambda: self._measured_now(key), self._live_running):
            trial.set_user_attr("claimed_elsewhere", True)
            liveness.fail(self.study, trial)
            return None, True
        beat = contextlib.ExitStack()
        try:
            beat.enter_context(liveness.heartbeat(trial))
            done = self.evaluator.prepare(cand, trial.number)
            if done is not None:
                beat.close()
                self._tell(trial, *done)
                return done
            # the same candidate twice in one batch (TPE repeats points): the ledger answers it after the first
            pending = None if key in self._in_flight else self.evaluator.submit(cand)
        except BaseException:
            beat.close()
            liveness.fail(self.study, trial)  # finished trials stay; this one is retried next run
            raise
        if pending is not None:
            self._in_flight.add(key)
        return _InFlight(trial, cand, key, pending, beat)

    def _finish(self, batch: list[_InFlight]) -> list[tuple[Entry | None, bool]]:
        """Wait for the batch's measurements and tell them in proposal order (whatever finished first)."""
        out: list[tuple[Entry | None, bool]] = []
        try:
            for i, f in enumerate(batch):
                try:
                    if f.pending is None:
                        entry, cached = self.evaluator.evaluate(f.cand, f.trial.number)
                    else:
                        entry, cached = self.evaluator.record(f.cand, f.trial.number,
                                                              self.evaluator.result(f.pending)), False
                except BaseException:
                    for g in batch[i:]:
                        g.beat.close()
                        liveness.fail(self.study, g.trial)  # retried next run
                    raise
                f.beat.close()
                self._tell(f.trial, entry, cached)
                out.append((entry, cached))
        finally:
            self._in_flight.clear()
        return out

    def step(self, trial: optuna.Trial) -> tuple[Entry | None, bool]:
        """Evaluate the candidate of one asked trial and tell the study."""
        started = self._start(trial)
        return self._finish([started])[0] if isinstance(started, _InFlight) else started

    def enqueue(self, cands: list[Candidate], tag: str) -> None:
        """Queue candidates not measured and not already waiting or being measured. Unlike Optuna's
        skip_if_exists, a failed trial (an interrupted or killed measurement) does not keep its candidate out."""
        from optuna.trial import TrialState  # lazy: loads optuna

        running = self._live_running()  # first: failing a stale trial queues its candidate again
        pending = [liveness.fixed_params(t)
                   for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))]
        pending += [liveness.fixed_params(t) for t in running]
        for c in cands:
            params = self.space.params_of(c)
            if candidate_key(c) not in self.ledger and params not in pending:
                self.study.enqueue_trial(params, user_attrs={"proposed_by": tag})
                pending.append(params)

    @property
    def _multi_fidelity(self) -> bool:
        """The corrected estimate proposes (advisor/search/proposers.py's frontier) and says when to stop; without
        an estimate, or when the estimate is itself the backend, the neighbour walk and TPE do."""
        ev = self.evaluator
        return ev.has_estimate and ev.prunes and ev.skip_losers

    def waiting(self) -> int:
        from optuna.trial import TrialState  # lazy: loads optuna

        return len(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def _seed(self) -> None:
        stored, backends = proposers.reused(self.study, self.space, self.ledger, self.backend, proposers.SEEDS)
        if stored:
            self.events.append(Seeded(len(stored), backends))
        self.enqueue(stored, "stored")
        self.enqueue(proposers.seeds(self.space, self.evaluator, proposers.SEEDS), "estimate")

    def run(self, *, trials: int, time_budget_s: float | None, exhaustive: bool, queue_only: bool = False,
            idle_s: float = 0.0) -> None:
        """Ask, evaluate, tell until `trials` distinct measurements (in the study), the time budget, or no new point."""
        self._started, self._total, self._misses = time.perf_counter(), trials, 0
        if exhaustive:
            grid = list(self.space.candidates())
            self._total = len(grid)  # the progress bar counts toward the grid, not --trials
            self.evaluator.skip_losers = False
            self.enqueue(grid, "exhaustive")
        elif not queue_only:
            if not self.ledger.entries:  # a fresh study will measure: workers start while the estimate ranks
                warm_up = getattr(self.evaluator.pool, "warm_up", None)
                if warm_up is not None:
                    warm_up()
            self._seed()
        turn = 0
        idle_since: float | None = None
        batch: list[_InFlight] = []
        while True:
            if interrupt_requested():  # a Ctrl-C swallowed where it landed (a weakref callback): end here
                self._interrupted(batch)
            if len(batch) >= self.jobs:
                batch = self._told_all(batch)
            if not queue_only:
                self.refresh()  # other runs sharing the study count toward `trials` as soon as they finish
            done = len(self.ledger.measured) + len(batch)  # in flight counts toward `trials`
            if not exhaustive and not queue_only and done >= trials:
                break
            if time_budget_s is not None and time.perf_counter() - self._started > time_budget_s:
                self.events.append(TimeBudget(time_budget_s, done))
                self.stopped_by_time = True
                break
            if not self.waiting():
                if exhaustive or queue_only:
                    if batch:  # what is in flight may bound or answer what is left: finish it, then look again
                        batch = self._told_all(batch)
                        continue
                    if queue_only and idle_s > 0:
                        idle_since = idle_since or time.perf_counter()
                        if time.perf_counter() - idle_since < idle_s:
                            time.sleep(0.2)
                            continue
                    break
                turn += 1
                proposed = self._propose(batch, turn)
                if proposed is None:  # what is in flight corrects the estimate: finished; look again
                    batch = []
                    continue
                if not proposed:
                    break
            idle_since = None
            trial = liveness.ask(self.study)  # a re-queued candidate first
            if queue_only and "proposed_by" not in trial.user_attrs:
                liveness.fail(self.study, trial)  # lost the race for the last queued trial
                continue
            started = self._start(trial)
            if isinstance(started, _InFlight):
                batch.append(started)
            else:
                self._told([started])
        if batch:
            self._told(self._finish(batch))

    def _told(self, results: list[tuple[Entry | None, bool]]) -> None:
        """Count the misses (a proposal that measured nothing new) and show the progress."""
        for entry, cached in results:
            self._misses = self._misses + 1 if (cached or entry is None or not entry.measured) else 0
            if self.progress is not None:
                best = self.ledger.best()
                self.progress(Progress(len(self.ledger.measured), self._total, best.measurement.tokens_per_second
                                       if best else None, time.perf_counter() - self._started,
                                       describe(entry.candidate) if entry else ""))

    def _told_all(self, batch: list[_InFlight]) -> list[_InFlight]:
        """Finish the batch in flight and tell its results; the empty batch after it."""
        self._told(self._finish(batch))
        return []

    def _interrupted(self, batch: list[_InFlight]) -> None:
        """A Ctrl-C: what finished measuring is told (it stays), the rest is failed for a rerun."""
        measured = 0
        while measured < len(batch) and batch[measured].pending is not None \
                and batch[measured].pending.future.done():
            measured += 1
        if measured:
            self._told(self._finish(batch[:measured]))
        for f in batch[measured:]:
            f.beat.close()
            liveness.fail(self.study, f.trial)
        raise KeyboardInterrupt

    def _propose(self, batch: list[_InFlight], turn: int) -> bool | None:
        """Nothing waits in the queue: the policy proposes the next point. True: go on; False: the search ends
        (converged, or no new candidate in MISS_LIMIT proposals); None: the batch in flight was finished first (the
        caller empties it and looks again)."""
        if self._multi_fidelity:
            nxt = proposers.frontier(self.space, self.ledger, self.evaluator, frozenset(self._in_flight))
            if nxt is None:
                if batch:
                    self._told(self._finish(batch))
                    return None
                ev = self.evaluator.correction()
                self.events.append(Converged(len(self.ledger.measured), ev.time_resolution,
                                             ev.memory_resolution, sum(1 for _ in self.space.candidates())))
                return False
            self.enqueue([nxt], "frontier")
        elif turn % 2:
            nb = proposers.next_neighbour(self.space, self.ledger, self.evaluator)
            if nb is not None:
                self.enqueue([nb], "neighbour")
        if self._misses >= MISS_LIMIT:
            self.events.append(NoNewCandidate(MISS_LIMIT))
            return False
        return True

    def wait_for_running(self, timeout_s: float = 600.0) -> None:
        """Workers, or other runs sharing the study, may still be measuring; their results belong in the answer.
        A RUNNING trial whose owner died is failed instead of waited for, and its candidate, queued again, is
        measured here (with whatever else is still queued then)."""
        from optuna.trial import TrialState  # lazy: loads optuna

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
        """One more measurement of the same backend (stored in the study, so a rerun does not repeat it). A
        backend declared deterministic (the simulator, the estimate) gives the same answer again: its measurement
        is its confirmation, and the pick costs no extra run."""
        attr = "confirm:" + fingerprint(candidate_key(entry.candidate))
        stored = self.study.user_attrs.get(attr)
        if stored is not None:
            return Measurement.from_dict(stored)
        m = entry.measurement if self.backend.deterministic else self.evaluator.measure(entry.candidate)
        self.study.set_user_attr(attr, json_safe(m.to_dict()))
        return m
