"""Evaluating one candidate: dedup through the ledger, the bounds a measured failure puts on its hungrier
neighbours, pruning by the estimate (far over the limit), and the backend's measurement (a crash is an outcome)."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .._messages import capture
from ..backends import source_of as declared
from ..errors import NoFitError, UsageError
from ..measurement import Measurement, Source, Status
from ..space import Candidate
from ..trainers import trainer_of, training_workload
from ..workload import Workload
from . import fidelity
from .backends import FunctionBackend, get_backend
from .fidelity import Correction
from .ledger import Entry, Ledger, candidate_key, device_bytes
from .pool import check_jobs, messages_of, open_pool

PRUNE_FACTOR = 1.3  # the estimate prunes a candidate over limit x this: "far over budget", allowing its error
_GiB = 2**30


def source_of(backend: str) -> Source:
    """The Source the registry declares for `backend` (an unregistered name is EXTERNAL, never an estimate)."""
    try:
        return declared(backend)
    except UsageError:
        return Source.EXTERNAL


def failure_reason(m: Measurement, limit: int) -> str:
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


def _load_estimate(backend: FunctionBackend) -> Callable[[Workload, Candidate], Measurement] | None:
    if backend.name == "estimate":
        return backend.measure  # the backend itself: its numbers seed and order the queue
    try:
        from ..estimator import estimate  # lazy: an ImportError answers None
    except ImportError:
        return None
    return estimate


class Evaluator:
    """The estimate (cached per candidate), the ledger's answers and bounds, and the backend."""

    def __init__(self, workload: Workload, backend: FunctionBackend, ledger: Ledger, pool: Any = None):
        self.workload, self.backend, self.ledger = workload, backend, ledger

        self.trainer = trainer_of(workload)
        self.pool = pool if pool is not None else SerialPool(backend)
        self.limit = workload.limit_bytes
        self.new_measurements = 0
        self.messages: collections.Counter[tuple[str, str]] = collections.Counter()  # (origin, text) -> count
        self._estimates: dict[str, Measurement | None] = {}
        self._estimate_fn = _load_estimate(backend)
        # The estimate backend IS the estimate: it orders the queue, but pruning by it would only skip measuring.
        self.prunes = backend.name != "estimate"
        self._correction, self._fitted_on = Correction.identity(), 0
        self.skip_losers = True  # multi-fidelity skipping; off for an exhaustive run, which measures everything

    # -- the estimate ----------------------------------------------------------------------------------------
    @property
    def has_estimate(self) -> bool:
        return self._estimate_fn is not None

    def estimate(self, cand: Candidate) -> Measurement | None:
        if self._estimate_fn is None:
            return None
        key = candidate_key(cand)
        if key not in self._estimates:
            try:
                self._estimates[key] = self._estimate_fn(self.workload_for(cand), cand)
            except Exception:  # an estimate that cannot price a candidate only loses its help
                self._estimates[key] = None
        return self._estimates[key]

    def correction(self) -> Correction:
        """The estimate's error fitted on every candidate measured so far (refitted when the ledger grew)."""
        if not self.prunes or self._estimate_fn is None:
            return self._correction  # the estimate backend measures the estimate itself: nothing to correct
        measured = self.ledger.measured
        if len(measured) != self._fitted_on:
            pairs = [(est, e.measurement) for e in measured if (est := self.estimate(e.candidate)) is not None]
            self._correction, self._fitted_on = fidelity.fit(pairs), len(measured)
        return self._correction

    def predicted(self, cand: Candidate) -> tuple[float, int | None] | None:
        """The (corrected) estimate's tokens/s and device bytes of `cand`; None when it cannot price it."""
        est = self.estimate(cand)
        if est is None or not est.ok:
            return None
        corr = self.correction()
        if corr.changes:
            d = corr.device_bytes(est) if self._memory_trusted(cand) else device_bytes(est)
            return corr.tokens_per_second(est), d
        return est.tokens_per_second or 0.0, device_bytes(est)

    def estimated_tps(self, cand: Candidate) -> float:
        """The (corrected) estimate's tokens/s; 0 when it cannot price `cand`, -1 when it puts it far over the
        limit."""
        predicted = self.predicted(cand)
        if predicted is None:
            return 0.0
        tps, d = predicted
        # As a backend the estimate is exact about itself (uncorrected): what it puts over the limit does not fit.
        far = PRUNE_FACTOR if (self.prunes or self.correction().changes) else 1.0
        if d is not None and d > self.limit * far:
            return -1.0
        return tps

    # -- one candidate ---------------------------------------------------------------------------------------
    def prepare(self, cand: Candidate, number: int | None) -> tuple[Entry, bool] | None:
        """(entry, cached) when `cand` needs no measurement: seen before, bounded by a measured failure, or far
        over the limit by the estimate (that entry is added to the ledger); None when it must be measured."""
        key = candidate_key(cand)
        hit = self.ledger.get(key)
        if hit is not None:
            return hit, True
        bound = self.ledger.bound(cand)
        if bound is not None:
            m = Measurement(Status.PRUNED, bound.measurement.source,
                            message=f"cannot fit: trial #{bound.number}, no hungrier, already failed")
        else:
            est = self.estimate(cand)
            d = device_bytes(est) if est is not None else None
            if not (self.prunes and est is not None and d is not None and d > self.limit * PRUNE_FACTOR):
                why = self._cannot_win(est, cand)
                if not why:
                    return None
                entry = Entry(cand, Measurement(Status.PRUNED, Source.ESTIMATE, peak_bytes=est.peak_bytes,
                                                device_bytes=est.device_bytes, tokens_per_second=est.tokens_per_second,
                                                message=why), number, measured=False, reason=why)
                self.ledger.add(entry)
                return entry, False
            m = Measurement(Status.PRUNED, Source.ESTIMATE, peak_bytes=est.peak_bytes,
                            reserved_bytes=est.reserved_bytes, device_bytes=est.device_bytes,
                            tokens_per_second=est.tokens_per_second,
                            message=f"estimate {d / _GiB:.1f} GiB, far over the limit {self.limit / _GiB:.1f}")
        entry = Entry(cand, m, number, measured=False, reason=m.message)
        self.ledger.add(entry)
        return entry, False

    def can_still_win(self, cand: Candidate) -> bool:
        """Worth measuring by the corrected estimate: not far over the limit and not slower than the best measured
        by more than the model's resolution (always True while the search does not skip losers)."""
        est = self.estimate(cand)
        if est is None:
            return True
        d = device_bytes(est)
        if self.prunes and d is not None and d > self.limit * PRUNE_FACTOR:
            return False
        return not self._cannot_win(est, cand)

    def _memory_trusted(self, cand: Candidate) -> bool:
        """A measured candidate shares `cand`'s memory class (fidelity.memory_class): the memory correction may
        judge it."""
        cls = fidelity.memory_class(cand)
        return any(fidelity.memory_class(e.candidate) == cls for e in self.ledger.measured)

    def _cannot_win(self, est: Measurement | None, cand: Candidate | None = None) -> str:
        """Multi-fidelity: measure only what the corrected estimate says can still win."""
        if not self.prunes or not self.skip_losers or est is None:
            return ""
        best = self.ledger.best()
        trusted = True if cand is None else self._memory_trusted(cand)
        return fidelity.cannot_win(self.correction(), est, best.measurement.tokens_per_second if best else None,
                                   self.limit, memory_trusted=trusted)

    def record(self, cand: Candidate, number: int | None, m: Measurement) -> Entry:
        """A measurement of `cand` into the ledger."""
        self.new_measurements += 1
        entry = Entry(cand, m, number, measured=True, reason=failure_reason(m, self.limit))
        self.ledger.add(entry)
        return entry

    def workload_for(self, cand: Candidate) -> Workload:
        """The workload a backend measures `cand` on: the training side of the run (advisor/trainers/registry.py
        `training_workload`: vLLM server mode's `trl vllm-serve` GPUs left out)."""
        return training_workload(self.workload, cand)

    def evaluate(self, cand: Candidate, number: int | None) -> tuple[Entry, bool]:
        """(entry, cached). Measures only a candidate never seen, not bounded and not far over by the estimate."""
        done = self.prepare(cand, number)
        if done is not None:
            return done
        return self.record(cand, number, self.measure(cand)), False

    def submit(self, cand: Candidate) -> Pending:
        """Start measuring `cand` in the pool; what libraries warn while an in-process pool runs it is collected
        for the report."""
        start = time.perf_counter()
        said = None
        try:
            with capture() as said:  # what libraries warn per trainer goes to the report once, not to stderr
                future = self.pool.submit(self.workload_for(cand), cand)
        finally:
            if said is not None:
                self.messages.update(said)
        return Pending(future, start)

    def result(self, pending: Pending) -> Measurement:
        """The measurement; a crash of one candidate is an outcome (ERROR), not the end of the search."""
        try:
            m = pending.future.result()
            if getattr(self.pool, "remote", False):  # measured in a worker: its messages travel with the future

                self.messages.update(messages_of(pending.future))
        except (KeyboardInterrupt, NoFitError):
            raise
        except Exception as exc:
            return Measurement(Status.ERROR, source_of(self.backend.name), message=f"{type(exc).__name__}: {exc}",
                               wall_time_s=time.perf_counter() - pending.start)
        if m.wall_time_s is None:
            m = dataclasses.replace(m, wall_time_s=time.perf_counter() - pending.start)
        return m

    def measure(self, cand: Candidate) -> Measurement:
        """The backend's measurement of `cand`, through the pool."""
        return self.result(self.submit(cand))


@dataclasses.dataclass(frozen=True)
class Pending:
    future: Future[Measurement]
    start: float


class SerialPool:
    """The pool interface (`submit(workload, candidate) -> Future[Measurement]`, `close()`, a context manager)
    with each measurement made in this process, inside `submit`: for jobs=1 and for backends registered in this
    process (a lambda cannot be sent to a worker). A KeyboardInterrupt is raised from `submit`; any other error is
    the future's exception."""

    def __init__(self, backend: str | FunctionBackend, jobs: int = 1):
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.jobs = max(1, jobs)

    def submit(self, workload: Workload, candidate: Candidate) -> Future[Measurement]:
        future: Future[Measurement] = Future()
        try:
            future.set_result(self.backend.measure(workload, candidate))
        except Exception as exc:  # noqa: BLE001 (the caller decides what an error means)
            future.set_exception(exc)
        return future

    def close(self) -> None:
        return None

    def __enter__(self) -> SerialPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_pool(backend: str | FunctionBackend, jobs: int | None) -> Any:
    """The pool the search measures through: advisor/search/pool.py's `open_pool` (warm worker processes for
    simulate, one per usable core unless `jobs` says otherwise; in this process for the estimate, the probes and
    backends registered in this process), or a SerialPool for a backend object that is not registered by name.
    `pool.jobs` sets how many candidates one batch of the loop proposes and tells, in proposal order."""
    if not isinstance(backend, str):
        check_jobs(jobs)
        return SerialPool(backend, 1)
    return open_pool(backend, jobs)
