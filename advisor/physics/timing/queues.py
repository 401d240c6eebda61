"""A micro-step as two queues: the host thread issuing each op, the device stream running each kernel (the package
docstring: "Host and device as two queues").

An `OpTrace` is the micro-step's ops in the order the host issues them: per op the host time it costs, its kernel's
device time per unit of each basis (at the worst batch) and the kernel's minimum time, its term, whether it launches
a kernel, whether the host waits there for the device to drain (a sync), and the decoder layer it belongs to (to
deepen a shallow run's trace). `run_queues` times it on any batch of the sampler's distribution:

    host h_j = h_{j-1} + host_j                  (the host issues op j)
    device d_j = max(h_j, d_{j-1}) + k_j          (its kernel starts when issued and when the stream is free)
    after a sync: h = max(h, d) (+ the sync's latency on CUDA)

so d at a segment's end (between syncs) is max_j (h_j + k_j + ... + k_end): the device waits wherever the host is the
slower queue. On the CPU one thread runs both: the times add. k_j = max(device_j . bases, floor_j).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .constants import _NB, _NT


@dataclass(frozen=True, eq=False)
class OpTrace:
    """The ops of one micro-step in issue order (the module docstring)."""

    host: np.ndarray  # (J,) seconds of host time per op
    device: np.ndarray  # (J, bases) seconds of its kernel per unit of each basis
    floor: np.ndarray  # (J,) the kernel's minimum time (0 for an op without a kernel)
    term: np.ndarray  # (J,) int: the Term index of its kernel
    kernel: np.ndarray  # (J,) bool: launches a kernel
    sync: np.ndarray  # (J,) bool: the host waits for the device to drain after issuing it
    layer: np.ndarray  # (J,) int: the decoder layer it belongs to, -1 outside one
    cls: np.ndarray  # (J,) int: its host.OpClass (issued from Python with grad off / on, by autograd's engine)
    layers: int = 0  # the depth it was recorded at
    sync_s: float = 0.0  # the host's latency after a drained sync (CUDA)

    def __len__(self) -> int:
        return int(self.host.shape[0])

    @property
    def launches(self) -> int:
        return int(self.kernel.sum())

    @property
    def syncs(self) -> int:
        return int(self.sync.sum())

    @property
    def host_s(self) -> float:
        return float(self.host.sum())

    def device_matrix(self) -> np.ndarray:
        """(terms, bases): the device seconds per unit of each basis, summed by term (at the worst batch)."""
        out = np.zeros((_NT, _NB))
        np.add.at(out, self.term, self.device)
        return out

    def scaled(self, host: float = 1.0, device: float = 1.0) -> OpTrace:
        return replace(self, host=self.host * host, device=self.device * device, floor=self.floor * device)


# the per-op arrays of an OpTrace
FIELDS = ("host", "device", "floor", "term", "kernel", "sync", "layer", "cls")


def concat(traces: list[OpTrace]) -> OpTrace:
    first = traces[0]
    return replace(first, **{k: np.concatenate([getattr(t, k) for t in traces]) for k in FIELDS})


def take(trace: OpTrace, index: np.ndarray | slice) -> OpTrace:
    """The ops of `trace` at `index`, in that order."""
    return replace(trace, **{k: getattr(trace, k)[index] for k in FIELDS})


@dataclass
class TraceBuilder:
    """Appends ops one by one (the fake run's hook) or as uniform blocks (the estimate's closed form)."""

    host: list = field(default_factory=list)
    device: list = field(default_factory=list)
    floor: list = field(default_factory=list)
    term: list = field(default_factory=list)
    kernel: list = field(default_factory=list)
    sync: list = field(default_factory=list)
    layer: list = field(default_factory=list)
    cls: list = field(default_factory=list)

    def op(self, host_s: float, *, term: int = 0, basis: int = 0, device_s: float = 0.0, floor_s: float = 0.0,
           kernel: bool = False, layer: int = -1, cls: int = 0) -> int:
        row = np.zeros(_NB)
        row[basis] = device_s
        self.host.append(host_s)
        self.device.append(row)
        self.floor.append(floor_s if kernel else 0.0)
        self.term.append(term)
        self.kernel.append(kernel)
        self.sync.append(False)
        self.layer.append(layer)
        self.cls.append(cls)
        return len(self.host) - 1

    def add_device(self, index: int, term: int, basis: int, device_s: float) -> None:
        """More device time on op `index`'s kernel (an extra pass of the same launch, e.g. TRL's fold)."""
        self.device[index][basis] += device_s
        self.term[index] = term

    def mark_sync(self) -> None:
        """The host waits for the device to drain after the last op."""
        if self.sync:
            self.sync[-1] = True

    def block(self, host_s: float, device: np.ndarray, *, ops: int, launches: int, floor_s: float = 0.0,
              layer: int = -1, cls: int = 0) -> None:
        """`ops` ops issued at an even pace, `launches` of them kernels sharing `device` (terms x bases) seconds: the
        closed form's stand-in for a stretch of the fake run's ops. Each launch carries every term's share of the
        device time (as kernels the host issues back to back, at no host time of their own)."""
        ops = max(int(ops), int(launches), 1)
        launches = max(0, int(launches))
        terms = [t for t in range(device.shape[0]) if device[t].sum() > 0]
        slots = {(i * ops) // launches for i in range(launches)} if launches and terms else set()
        for i in range(ops):
            self.op(host_s / ops, layer=layer, cls=cls)
            if i in slots:
                for n, t in enumerate(terms):
                    if n:
                        self.op(0.0, layer=layer, cls=cls)
                    self.device[-1] = device[t] / launches
                    self.term[-1] = t
                    self.kernel[-1] = True
                    self.floor[-1] = floor_s

    def build(self, *, layers: int = 0, sync_s: float = 0.0) -> OpTrace:
        n = len(self.host)
        return OpTrace(
            host=np.asarray(self.host, dtype=float).reshape(n),
            device=np.asarray(self.device, dtype=float).reshape(n, _NB),
            floor=np.asarray(self.floor, dtype=float).reshape(n),
            term=np.asarray(self.term, dtype=np.int64).reshape(n),
            kernel=np.asarray(self.kernel, dtype=bool).reshape(n),
            sync=np.asarray(self.sync, dtype=bool).reshape(n),
            layer=np.asarray(self.layer, dtype=np.int64).reshape(n),
            cls=np.asarray(self.cls, dtype=np.int64).reshape(n),
            layers=layers, sync_s=sync_s,
        )


@dataclass(frozen=True)
class QueueTimes:
    """Per batch point: the micro-step's time, the device's busy time, and the busy time by term."""

    total: np.ndarray  # (P,)
    busy: np.ndarray  # (P,)
    per_term: np.ndarray  # (P, terms)

    @property
    def host_bound(self) -> np.ndarray:
        """Time the device waits on the host (idle while the host issues, or after a drained sync)."""
        return self.total - self.busy


_CHUNK_ELEMENTS = 1 << 21


def run_queues(trace: OpTrace, bases: np.ndarray, *, serial: bool) -> QueueTimes:
    """Time `trace` on each row of `bases` (P, bases): the two queues of the module docstring (`serial`: one thread
    runs both, the CPU target)."""
    bases = np.atleast_2d(np.asarray(bases, dtype=float))
    points = bases.shape[0]
    n = len(trace)
    if n == 0:
        zero = np.zeros(points)
        return QueueTimes(zero, zero, np.zeros((points, _NT)))
    onehot = np.zeros((_NT, n))
    onehot[trace.term, np.arange(n)] = 1.0
    kern = trace.kernel[:, None]
    bounds = np.flatnonzero(trace.sync) + 1
    starts = np.concatenate([[0], bounds[bounds < n]])
    ends = np.concatenate([starts[1:], [n]])
    total = np.zeros(points)
    busy = np.zeros(points)
    per_term = np.zeros((points, _NT))
    step = max(1, _CHUNK_ELEMENTS // n)
    for lo in range(0, points, step):
        b = bases[lo:lo + step]
        k = np.where(kern, np.maximum(trace.device @ b.T, trace.floor[:, None]), 0.0)  # (J, p)
        busy[lo:lo + step] = k.sum(axis=0)
        per_term[lo:lo + step] = (onehot @ k).T
        if serial:
            total[lo:lo + step] = trace.host.sum() + k.sum(axis=0)
            continue
        t = np.zeros(b.shape[0])
        for a, e in zip(starts, ends, strict=True):
            h = np.cumsum(trace.host[a:e])
            suffix = np.cumsum(k[a:e][::-1], axis=0)[::-1]
            seg = np.maximum((h[:, None] + suffix).max(axis=0), h[-1])
            if trace.sync[e - 1]:
                seg = seg + trace.sync_s
            t += seg
        total[lo:lo + step] = t
    return QueueTimes(total, busy, per_term)


@dataclass(frozen=True, eq=False)
class Segment:
    """A stretch of a micro-step in closed form (the estimate): `pieces` kernels issued at an even pace by `host_s` of
    host time, sharing `device` (terms x bases, seconds per unit of each basis), then `syncs` reads of a value (the
    first drains the queue, each costs the host a sync's latency)."""

    host_s: float
    device: np.ndarray
    pieces: int
    syncs: int = 0


def segment_times(segments: tuple[Segment, ...], bases: np.ndarray, *, serial: bool, sync_s: float) -> QueueTimes:
    """The two queues over uniform segments, exactly: n pieces of host h and device d each end at
    max(h + n d, n h + d) (the device waits for the first piece, or the last piece waits for the host); one thread
    (the CPU): n (h + d)."""
    bases = np.atleast_2d(np.asarray(bases, dtype=float))
    total = np.zeros(bases.shape[0])
    per_term = np.zeros((bases.shape[0], _NT))
    for seg in segments:
        terms = (seg.device @ bases.T).T  # (P, terms)
        d = terms.sum(axis=1)
        n = max(1, int(seg.pieces))
        if serial:
            t = seg.host_s + d
        else:
            t = np.maximum(seg.host_s / n + d, seg.host_s + d / n) + seg.syncs * sync_s
        total += t
        per_term += terms
    return QueueTimes(total, per_term.sum(axis=1), per_term)


def deepen(trace: OpTrace, extra: int, block: tuple[int, ...]) -> OpTrace | None:
    """The trace of a model `extra` decoder layers deeper: every run of consecutive ops tagged with a layer of `block`
    (the forward's, the backward's, a recompute's) repeated `extra / len(block)` more times after itself. None where
    the trace has no such run."""
    if extra <= 0:
        return trace
    if extra % len(block):
        return None
    times = extra // len(block)
    inside = np.isin(trace.layer, np.asarray(block))
    if not inside.any():
        return None
    index: list[np.ndarray] = []
    n = len(trace)
    i = 0
    while i < n:
        if not inside[i]:
            j = i
            while j < n and not inside[j]:
                j += 1
            index.append(np.arange(i, j))
        else:
            j = i
            while j < n and inside[j]:
                j += 1
            index.extend([np.arange(i, j)] * (1 + times))
        i = j
    return replace(take(trace, np.concatenate(index)), layers=trace.layers + extra)


def extrapolate_trace(lo: OpTrace, hi: OpTrace, depth: int) -> tuple[OpTrace, str]:
    """The full depth's trace from two shallow ones: `hi` deepened by its second-to-last block of layers (neither the
    first layer, which the embedding's backward joins, nor the last), checked: that block holds exactly the ops `hi`
    has more than `lo`. Else `hi` scaled so its totals are linear in depth. Returns the trace and how it was built."""
    period = hi.layers - lo.layers
    if period <= 0 or depth <= hi.layers:
        return hi, "recorded at full depth"
    block = tuple(range(hi.layers - 1 - period, hi.layers - 1))
    if min(block) >= 1 and int(np.isin(hi.layer, block).sum()) == len(hi) - len(lo):
        full = deepen(hi, depth - hi.layers, block)
        if full is not None:
            return full, f"the {hi.layers}-layer trace's layers {block[0]}..{block[-1]} repeated to {depth} layers"
    k = (depth - lo.layers) / period

    def ratio(a: float, b: float) -> float:
        return (a + k * (b - a)) / b if b > 0 else 1.0

    dev_lo, dev_hi = float(lo.device.sum()), float(hi.device.sum())
    return hi.scaled(ratio(lo.host_s, hi.host_s), ratio(dev_lo, dev_hi)), \
        "the deepest trace's host and device times scaled linearly in depth (its layers could not be repeated)"


def trace_summary(trace: OpTrace, views: int) -> dict[str, Any]:
    return {"ops": len(trace), "launches": trace.launches, "views": views, "syncs": trace.syncs}
