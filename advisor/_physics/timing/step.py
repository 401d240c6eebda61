"""The cost of one micro-step by (term, basis), and its expectation over the sampler's batches with the overlap of
host, device and copies (the package docstring: "Host and overlap", "Expectation over batches")."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .constants import _TERMS, AttentionKind, Term
from .optimizer import OptimizerCost


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

    device: np.ndarray  # (terms, bases): seconds per unit of each basis
    host_s: float  # host time of one micro-step's ops (async with the device)
    serial_host_s: float  # per micro-step, serial with the device: syncs, the Trainer's Python
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

    def with_(self, **changes: Any) -> StepCost:
        return replace(self, **changes)


@dataclass(frozen=True)
class StepTime:
    """The expected time of one optimizer step and its parts (seconds), the throughput and MFU."""

    step_s: float
    terms: dict[str, float]
    tokens_per_second: float
    trained_per_step: float
    mfu: float | None
    worst_step_s: float  # the worst batch at every micro-step (the memory case)


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
    return hi.with_(
        device=np.maximum(0.0, lo.device + k * (hi.device - lo.device)),
        host_s=lin(lo.host_s, hi.host_s),
        launches=lin(lo.launches, hi.launches),
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


def evaluate(cost: StepCost, dist: BatchDistribution) -> StepTime:
    """Expected step time over `dist`, by term, with the overlap of host, device and copies (the package docstring)."""
    bases = np.stack([dist.tokens, dist.trained, dist.attention, np.ones_like(dist.tokens)], axis=1)  # (P, B)
    per_term = bases @ cost.device.T  # (P, T)
    device = per_term.sum(axis=1)
    copies = cost.copy_s_per_token * dist.tokens
    if cost.serial:
        lane = device + cost.host_s
        lanes = lane
    else:
        lane = np.maximum(device, cost.host_s)
        lanes = np.maximum(lane, copies)
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
    worst_dev = float(np.array([w.tokens, w.trained, w.attention, 1.0]) @ cost.device.sum(axis=0))
    if cost.serial:
        worst_lane = worst_dev + cost.host_s
    else:
        worst_lane = max(worst_dev, cost.host_s, cost.copy_s_per_token * w.tokens)
    worst = ga * (worst_lane + cost.serial_host_s + cost.collate_row_s * w.rows) + opt + cost.step_host_s
    return StepTime(
        step_s=step, terms={k: v for k, v in terms.items() if abs(v) > 0}, tokens_per_second=trained / step,
        trained_per_step=trained, mfu=mfu, worst_step_s=worst,
    )


def model_flops(trained_params: float, frozen_params: float, layers: int, q_dim: int) -> tuple[float, float]:
    """(FLOPs per real token, FLOPs per squared sequence length): the PaLM convention (6N for trained weights,
    4N for frozen ones: forward and grad-input, no weight gradient; causal attention 6 L q_dim s^2 fwd + bwd).
    Recompute, padding and masked tiles are not useful work, so they lower the MFU."""
    return 6.0 * trained_params + 4.0 * frozen_params, 6.0 * layers * q_dim

