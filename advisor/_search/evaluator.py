"""Evaluating one candidate: dedup through the ledger, the bounds a measured failure puts on its hungrier
neighbours, pruning by the estimate (far over the limit), and the backend's measurement (a crash is an outcome)."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

from ..errors import NoFitError
from ..measurement import Measurement, Source, Status
from ..space import Candidate
from ..workload import Workload
from .backends import FunctionBackend
from .ledger import Entry, Ledger, candidate_key, device_bytes

PRUNE_FACTOR = 1.3  # the estimate prunes a candidate over limit x this: "far over budget", allowing its error
_GiB = 2**30


def source_of(backend: str) -> Source:
    return {"estimate": Source.ESTIMATE, "simulate": Source.SIMULATE, "cuda": Source.PROBE_CUDA}.get(
        backend, Source.PROBE_CPU if backend == "cpu" else Source.ESTIMATE)


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
        from ..estimate import estimate
    except ImportError:
        return None
    return estimate


class Evaluator:
    """The estimate (cached per candidate), the ledger's answers and bounds, and the backend."""

    def __init__(self, workload: Workload, backend: FunctionBackend, ledger: Ledger):
        self.workload, self.backend, self.ledger = workload, backend, ledger
        self.limit = workload.limit_bytes
        self.new_measurements = 0
        self.messages: collections.Counter[tuple[str, str]] = collections.Counter()  # (origin, text) -> count
        self._estimates: dict[str, Measurement | None] = {}
        self._estimate_fn = _load_estimate(backend)
        # The estimate backend IS the estimate: it orders the queue, but pruning by it would only skip measuring.
        self.prunes = backend.name != "estimate"

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
                self._estimates[key] = self._estimate_fn(self.workload, cand)
            except Exception:  # an estimate that cannot price a candidate only loses its help
                self._estimates[key] = None
        return self._estimates[key]

    def estimated_tps(self, cand: Candidate) -> float:
        """The estimate's tokens/s; 0 when it cannot price `cand`, -1 when it puts it far over the limit."""
        est = self.estimate(cand)
        if est is None or not est.ok:
            return 0.0
        d = device_bytes(est)
        # As a backend the estimate is exact about itself: what it puts over the limit does not fit.
        if d is not None and d > self.limit * (PRUNE_FACTOR if self.prunes else 1.0):
            return -1.0
        return est.tokens_per_second or 0.0

    # -- one candidate ---------------------------------------------------------------------------------------
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
            if self.prunes and est is not None and d is not None and d > self.limit * PRUNE_FACTOR:
                m = Measurement(Status.PRUNED, Source.ESTIMATE, peak_bytes=est.peak_bytes,
                                reserved_bytes=est.reserved_bytes, device_bytes=est.device_bytes,
                                tokens_per_second=est.tokens_per_second,
                                message=f"estimate {d / _GiB:.1f} GiB, far over the limit {self.limit / _GiB:.1f}")
                entry = Entry(cand, m, number, measured=False, reason=m.message)
            else:
                m = self.measure(cand)
                self.new_measurements += 1
                entry = Entry(cand, m, number, measured=True, reason=failure_reason(m, self.limit))
        self.ledger.add(entry)
        return entry, False

    def measure(self, cand: Candidate) -> Measurement:
        """The backend's measurement; what libraries warn while it runs is collected for the report."""
        from .._messages import capture

        start = time.perf_counter()
        said = None
        try:
            with capture() as said:  # what libraries warn per trainer goes to the report once, not to stderr
                m = self.backend.measure(self.workload, cand)
        except (KeyboardInterrupt, NoFitError):
            raise
        except Exception as exc:  # a crash of one candidate is an outcome, not the end of the search
            return Measurement(Status.ERROR, source_of(self.backend.name), message=f"{type(exc).__name__}: {exc}",
                               wall_time_s=time.perf_counter() - start)
        finally:
            if said is not None:
                self.messages.update(said)
        if m.wall_time_s is None:
            m = dataclasses.replace(m, wall_time_s=time.perf_counter() - start)
        return m
