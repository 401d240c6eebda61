"""Multi-fidelity: the estimate (microseconds) corrected by what the costlier backend measured.

From the measured points, the estimate's error is fitted per memory category (the breakdown at the peak) and per
step-time term (`time_breakdown`): one ratio measured / estimated each, shrunk toward 1 (the estimate is right)
by SHRINK pseudo-points, so that one point moves a ratio only part of the way. A candidate's corrected device
bytes scale its estimate by the category-weighted ratio; its corrected step time is the sum of its terms times
their ratios, and its tokens per second follow. The model's resolution is how far the corrected estimate still
misses the measured points (relative RMS, at least FLOOR): within it, two candidates are ties, and a candidate
is worth measuring only while its corrected estimate can still beat the best measured one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..measurement import Measurement

SHRINK = 2.0  # pseudo-points at ratio 1
FLOOR = 0.02  # the resolution never claims better than 2%
MIN_POINTS = 3  # fewer measured points: no skipping (the resolution is not known yet)
TIE_CAP = 0.05  # the widest tie: beyond this a poor model's resolution no longer makes candidates one move


def _ratios(pairs: list[tuple[Mapping[str, float], Mapping[str, float]]]) -> dict[str, float]:
    est: dict[str, float] = {}
    got: dict[str, float] = {}
    n: dict[str, int] = {}
    for e, m in pairs:
        for k, v in e.items():
            if v > 0 and k in m:
                est[k] = est.get(k, 0.0) + float(v)
                got[k] = got.get(k, 0.0) + float(m[k])
                n[k] = n.get(k, 0) + 1
    # a ratio of sums, shrunk: (sum measured + SHRINK x mean estimate) / (sum estimated + SHRINK x mean estimate)
    return {k: (got[k] + SHRINK * est[k] / n[k]) / (est[k] + SHRINK * est[k] / n[k]) for k in est}


def _scaled(parts: Mapping[str, float], ratios: Mapping[str, float]) -> float:
    """sum(part x ratio) / sum(part): the factor by which the parts' total moves."""
    total = sum(v for v in parts.values() if v > 0)
    if total <= 0:
        return 1.0
    return sum(v * ratios.get(k, 1.0) for k, v in parts.items() if v > 0) / total


@dataclass(frozen=True)
class Correction:
    """The fitted ratios; `identity()` changes nothing."""

    memory: dict[str, float] = field(default_factory=dict)  # Category value -> measured / estimated bytes
    time: dict[str, float] = field(default_factory=dict)  # time term -> measured / estimated seconds
    memory_resolution: float = FLOOR
    time_resolution: float = FLOOR
    points: int = 0

    @classmethod
    def identity(cls) -> Correction:
        return cls()

    @property
    def changes(self) -> bool:
        return any(r != 1.0 for r in (*self.memory.values(), *self.time.values()))

    def device_bytes(self, est: Measurement) -> int | None:
        d = est.device_bytes if est.device_bytes is not None else est.peak_bytes
        if d is None or not self.memory:
            return d
        return int(round(d * _scaled(est.breakdown, self.memory)))

    def tokens_per_second(self, est: Measurement) -> float:
        tps = est.tokens_per_second or 0.0
        if not tps or not self.time:
            return tps
        return tps / _scaled(est.time_breakdown, self.time)

    def ties(self, a: Measurement, b: Measurement) -> bool:
        """Equal within the resolution (at most TIE_CAP) in both predicted memory and predicted time. The cap: a
        model that misses by 50% cannot tell candidates apart at all, and calling everything a tie of what was
        measured would end the search on its second point; such a model ties only what it predicts alike."""
        da, db = self.device_bytes(a), self.device_bytes(b)
        ta, tb = self.tokens_per_second(a), self.tokens_per_second(b)
        if da is None or db is None or not ta or not tb:
            return False
        return (abs(da - db) <= min(self.memory_resolution, TIE_CAP) * max(da, db)
                and abs(ta - tb) <= min(self.time_resolution, TIE_CAP) * max(ta, tb))


def _rms(errors: list[float]) -> float:
    return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else 0.0


def fit(points: Iterable[tuple[Measurement, Measurement]]) -> Correction:
    """The correction from (estimate, measurement) pairs of the same candidates; only pairs both OK count."""
    pairs = [(e, m) for e, m in points if e.ok and m.ok]
    if not pairs:
        return Correction.identity()
    memory = _ratios([(e.breakdown, m.breakdown) for e, m in pairs if e.breakdown and m.breakdown])
    time = _ratios([(e.time_breakdown, m.time_breakdown) for e, m in pairs if e.time_breakdown and m.time_breakdown])
    c = Correction(memory, time, points=len(pairs))
    mem_err = [c.device_bytes(e) / d - 1.0 for e, m in pairs
               if (d := m.device_bytes or m.peak_bytes) and c.device_bytes(e) is not None]
    time_err = [c.tokens_per_second(e) / m.tokens_per_second - 1.0 for e, m in pairs
                if m.tokens_per_second and e.tokens_per_second]
    return Correction(memory, time, max(FLOOR, _rms(mem_err)), max(FLOOR, _rms(time_err)), len(pairs))


def memory_class(cand: Any) -> tuple[Any, ...]:
    """The knobs that change which of the estimate's memory terms apply (what is saved for backward, where, how
    batches are laid out, which weights train): the memory correction fitted on one class is not evidence about
    another, so a class with no measured point is never skipped for memory by the corrected estimate."""
    return (cand.activation_checkpointing, cand.checkpoint_selective, cand.activation_offloading, cand.packing,
            cand.effective_padding_free, cand.use_lora, cand.quantization)


def cannot_win(c: Correction, est: Measurement, best_tps: float | None, limit: int,
               memory_trusted: bool = True) -> str:
    """Why a candidate need not be measured (its corrected estimate is slower than the best measured by more than
    twice the resolution, or over the limit by more than twice the memory resolution: only where its memory class
    has a measured point, `memory_trusted`), else ''."""
    if c.points < MIN_POINTS or not est.ok:
        return ""
    d = c.device_bytes(est)
    if memory_trusted and d is not None and d > limit * (1.0 + 2 * c.memory_resolution):
        return (f"corrected estimate {d / 2**30:.2f} GiB, over the limit {limit / 2**30:.2f} GiB by more than the "
                f"model's resolution ({c.memory_resolution:.1%}, {c.points} points)")
    tps = c.tokens_per_second(est)
    if best_tps and tps and tps < best_tps * (1.0 - 2 * c.time_resolution):
        return (f"corrected estimate {tps:,.0f} tokens/s, slower than the best measured {best_tps:,.0f} by more "
                f"than the model's resolution ({c.time_resolution:.1%}, {c.points} points)")
    return ""
