"""The cost of one micro-step by (term, basis) with the ops it issues (queues.OpTrace), and its expectation over the
sampler's batches with host and device as two queues and the copies as a third lane (the package docstring: "Host
and device as two queues", "Expectation over batches")."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .constants import _NT, _TERMS, AttentionKind, Term
from .optimizer import OptimizerCost
from .queues import OpTrace, Segment, TraceBuilder, concat, extrapolate_trace, run_queues, segment_times, take


@dataclass(frozen=True)
class BatchPoint:
    """One micro-batch as the device sees it (for the worst batch), the values of the bases."""

    tokens: float
    trained: float
    attention: float  # tiles (CAUSAL / FULL) or score elements (DENSE)
    rows: float = 1.0
    real: float = 0.0  # non-padding tokens (model FLOPs, MFU)
    sq: float = 0.0  # sum of squared sequence lengths (model FLOPs of causal attention)


@dataclass(frozen=True, eq=False)
class StepCost:
    """Seconds of one micro-step by (term, basis) per unit of the basis, host time, the optimizer step."""

    device: np.ndarray  # (terms, bases): seconds per unit of each basis, one micro-step (the authoritative sums)
    host_s: float  # host time of one micro-step's ops (the trace's, issued ahead of the device)
    serial_host_s: float  # per micro-step, before its first op while the device idles: the Trainer's Python
    collate_row_s: float
    copy_s_per_token: float = 0.0  # activation offloading's copies, per padded token
    optimizer: OptimizerCost = OptimizerCost(0.0, 0.0, 0, 0.0)
    step_host_s: float = 0.0
    serial: bool = False  # CPU: host and device are one thread
    accumulation: int = 1
    flops_per_token: float = 0.0  # model FLOPs per real token (PaLM convention, see mfu())
    flops_per_sq: float = 0.0  # model FLOPs per squared sequence length (causal attention, fwd + bwd)
    peak_flops: float = 0.0
    worst: BatchPoint = BatchPoint(0.0, 0.0, 0.0)
    attention_kind: AttentionKind = AttentionKind.CAUSAL
    launches: float = 0.0  # kernels launched per micro-step
    # the micro-steps' ops in issue order: (trace, how many micro-steps of the step it stands for); empty: one uniform
    # block of host_s and device (uniform_trace)
    micro: tuple[tuple[OpTrace, int], ...] = ()
    views: float = 0.0  # ops without a kernel per micro-step
    syncs: float = 0.0  # syncs per micro-step (.item(), nonzero, the Trainer's nan check)
    # the closed form's micro-step (the estimate): uniform segments between syncs, timed exactly (segment_times)
    segments: tuple[Segment, ...] = ()
    sync_s: float = 0.0  # a sync's latency (the segments')

    def with_(self, **changes: Any) -> StepCost:
        return replace(self, **changes)

    def traces(self) -> tuple[tuple[OpTrace, int], ...]:
        if self.micro:
            return self.micro
        return ((uniform_trace(self.device, self.host_s, max(1, round(self.launches))), max(1, self.accumulation)),)


def uniform_trace(device: np.ndarray, host_s: float, launches: int, ops: int | None = None) -> OpTrace:
    """One stretch of `launches` kernels issued at an even pace: the trace of a cost known only by its totals."""
    b = TraceBuilder()
    b.block(host_s, device, ops=ops or launches, launches=launches)
    return b.build()


@dataclass(frozen=True)
class StepTime:
    """The expected time of one optimizer step and its parts (seconds), the throughput and MFU."""

    step_s: float
    terms: dict[str, float]
    tokens_per_second: float
    trained_per_step: float
    mfu: float | None
    worst_step_s: float  # the worst batch at every micro-step (the memory case)
    queues: QueueShare | None = None


def extrapolate_cost(lo: StepCost | None, hi: StepCost | None, k: float) -> StepCost | None:
    """The cost at full depth from two depths: every per-layer quantity is linear in depth."""
    if lo is None or hi is None:
        return hi

    def lin(a: float, b: float) -> float:
        return a + k * (b - a)

    opt = OptimizerCost(
        device_s=lin(lo.optimizer.device_s, hi.optimizer.device_s),
        host_s=lin(lo.optimizer.host_s, hi.optimizer.host_s),
        launches=round(lin(lo.optimizer.launches, hi.optimizer.launches)),
        bytes=lin(lo.optimizer.bytes, hi.optimizer.bytes),
    )
    micro = hi.micro
    if lo.micro and hi.micro and len(lo.micro) == len(hi.micro):
        depth = round(hi.micro[0][0].layers + (k - 1) * (hi.micro[0][0].layers - lo.micro[0][0].layers))
        micro = tuple((extrapolate_trace(a, b, depth)[0], n) for (a, _), (b, n) in zip(lo.micro, hi.micro,
                                                                                        strict=True))
    return hi.with_(
        device=np.maximum(0.0, lo.device + k * (hi.device - lo.device)),
        host_s=lin(lo.host_s, hi.host_s),
        launches=lin(lo.launches, hi.launches),
        views=lin(lo.views, hi.views),
        micro=micro,
        copy_s_per_token=max(0.0, lin(lo.copy_s_per_token, hi.copy_s_per_token)),
        optimizer=opt,
        flops_per_token=lin(lo.flops_per_token, hi.flops_per_token),
        flops_per_sq=lin(lo.flops_per_sq, hi.flops_per_sq),
    )


@dataclass(frozen=True)
class BatchDistribution:
    """The micro-batches the sampler makes, with their probabilities."""

    weights: np.ndarray
    tokens: np.ndarray
    trained: np.ndarray
    attention: np.ndarray
    rows: np.ndarray
    real: np.ndarray
    sq: np.ndarray

    @classmethod
    def single(cls, p: BatchPoint) -> BatchDistribution:
        one = np.ones(1)
        return cls(one, one * p.tokens, one * p.trained, one * p.attention, one * p.rows, one * p.real, one * p.sq)

    def mean(self, values: np.ndarray) -> float:
        return float(np.dot(self.weights, values))


@dataclass(frozen=True)
class QueueShare:
    """Per optimizer step (expected over the batches): the time the device waits on the host (host-bound) and the
    time the host waits on the device (device-bound), and the ops the step dispatches."""

    host_bound_s: float
    device_bound_s: float
    ops: float
    launches: float
    views: float
    syncs: float
    optimizer_launches: float  # of the launches, the optimizer step's and the clipping's (counted analytically)


def _reconciled(trace: OpTrace, device: np.ndarray, per_micro: float) -> OpTrace:
    """`trace` with its kernels' times scaled per (term, basis) to `device` (the cost's sums, which closed-form terms
    adjust: knob_time, a deeper model's), and a kernel at the end for a term the trace has none of (the offloaded
    checkpoints' copies on the compute stream)."""
    have = trace.device_matrix() / per_micro
    scale = np.divide(device, have, out=np.ones_like(device), where=have > 0)
    missing = np.where(have > 0, 0.0, device) * per_micro
    rows = trace.device * scale[trace.term]
    out = replace(trace, device=rows)
    if missing.sum() > 0:
        b = TraceBuilder()
        for t in range(_NT):
            if missing[t].sum() > 0:
                i = b.op(0.0, kernel=True, term=t, floor_s=0.0)
                b.device[i] = missing[t].copy()
        extra = b.build(layers=trace.layers, sync_s=trace.sync_s)
        cut = max(0, len(out) - 1)
        out = concat([take(out, slice(0, cut)), extra, take(out, slice(cut, None))])
    return out


def _micro_times(cost: StepCost, bases: np.ndarray):
    """Per batch point: (the micro-steps' total over the recorded ones, busy, per term), per micro-step."""
    if cost.segments and not cost.micro:
        have = sum(seg.device for seg in cost.segments)
        scale = np.divide(cost.device, have, out=np.ones_like(cost.device), where=have > 0)
        extra = np.where(have > 0, 0.0, cost.device)  # a term knob_time added (the offloaded checkpoints' copies)
        segs = tuple(Segment(seg.host_s, seg.device * scale + (extra if i == len(cost.segments) - 1 else 0.0),
                             seg.pieces, seg.syncs) for i, seg in enumerate(cost.segments))
        q = segment_times(segs, bases, serial=cost.serial, sync_s=cost.sync_s)
        return q.total, q.busy, q.per_term
    parts = cost.traces()
    covered = sum(n for _, n in parts)
    total = busy = per_term = 0.0
    for trace, n in parts:
        q = run_queues(_reconciled(trace, cost.device, 1.0), bases, serial=cost.serial)
        total = total + n * q.total
        busy = busy + n * q.busy
        per_term = per_term + n * q.per_term
    return total / covered, busy / covered, per_term / covered


def evaluate(cost: StepCost, dist: BatchDistribution) -> StepTime:
    """Expected step time over `dist`, by term: each micro-step's ops through the two queues (host and device), the
    Trainer's per-micro-step host work before it, activation offloading's copies as a third lane, the optimizer step
    (the package docstring)."""
    bases = np.stack([dist.tokens, dist.trained, dist.attention, np.ones_like(dist.tokens)], axis=1)  # (P, B)
    lane, device, per_term = _micro_times(cost, bases)
    copies = cost.copy_s_per_token * dist.tokens
    lanes = lane if cost.serial else np.maximum(lane, copies)
    serial = cost.serial_host_s + cost.collate_row_s * dist.rows
    micro = lanes + serial
    ga = cost.accumulation
    terms = {t.value: ga * dist.mean(per_term[:, i]) for i, t in enumerate(_TERMS)}
    # copies on the compute stream (offloaded checkpoints, in the device terms) plus what the side stream's copies
    # (activation offloading) add beyond the compute lane
    terms[Term.OFFLOAD.value] += ga * (dist.mean(lanes) - dist.mean(lane))
    host = dist.mean(lane) - dist.mean(device) + dist.mean(serial)
    opt = cost.optimizer.time_s(cost.serial)
    terms[Term.HOST.value] = ga * host + cost.step_host_s
    terms[Term.OPTIMIZER.value] = opt
    step = ga * dist.mean(micro) + opt + cost.step_host_s
    trained = ga * dist.mean(dist.trained)
    useful = ga * (cost.flops_per_token * dist.mean(dist.real) + cost.flops_per_sq * dist.mean(dist.sq))
    mfu = useful / (step * cost.peak_flops) if step > 0 and cost.peak_flops > 0 and useful > 0 else None
    w = cost.worst
    worst_lane, _, _ = _micro_times(cost, np.array([[w.tokens, w.trained, w.attention, 1.0]]))
    if not cost.serial:
        worst_lane = np.maximum(worst_lane, cost.copy_s_per_token * w.tokens)
    worst = ga * (float(worst_lane[0]) + cost.serial_host_s + cost.collate_row_s * w.rows) + opt + cost.step_host_s
    host_bound = terms[Term.HOST.value]
    ops = cost.launches + cost.views
    share = QueueShare(host_bound_s=host_bound, device_bound_s=step - host_bound,
                       ops=ga * ops + cost.optimizer.launches, launches=ga * cost.launches + cost.optimizer.launches,
                       views=ga * cost.views, syncs=ga * cost.syncs, optimizer_launches=cost.optimizer.launches)
    return StepTime(
        step_s=step, terms={k: v for k, v in terms.items() if abs(v) > 0}, tokens_per_second=trained / step,
        trained_per_step=trained, mfu=mfu, worst_step_s=worst, queues=share,
    )


def time_detail(timed: StepTime, tc: Any) -> dict[str, Any]:
    """What a Measurement's `time_detail` says of a predicted step: its two queues, its ops, the host measured and the
    constants' calibration (`tc`: the target's TimeConstants)."""
    out: dict[str, Any] = {}
    q = timed.queues
    if q is not None:
        out.update(host_bound_s=q.host_bound_s, device_bound_s=q.device_bound_s, ops=q.ops, launches=q.launches,
                   views=q.views, syncs=q.syncs, optimizer_launches=q.optimizer_launches)
    host = tc.host.label
    if tc.cuda:
        host += "; this host stands in for the target's (a kernel launch adds host.cuda_launch_us)"
    out["host"] = host
    out["calibration"] = tc.calibration
    return out


def model_flops(trained_params: float, frozen_params: float, layers: int, q_dim: int) -> tuple[float, float]:
    """(FLOPs per real token, FLOPs per squared sequence length): the PaLM convention (6N for trained weights,
    4N for frozen ones: forward and grad-input, no weight gradient; causal attention 6 L q_dim s^2 fwd + bwd).
    Recompute, padding and masked tiles are not useful work, so they lower the MFU."""
    return 6.0 * trained_params + 4.0 * frozen_params, 6.0 * layers * q_dim

