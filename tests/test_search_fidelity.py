"""Multi-fidelity correction (advisor/search/fidelity.py): fitted per memory category and per time term."""

from __future__ import annotations

import pytest

from advisor.measurement import Measurement
from advisor.search import FIDELITY_FLOOR, FIDELITY_MIN_POINTS, FIDELITY_SHRINK, Correction, cannot_win
from advisor.search import fit_correction as fit

GiB = 2**30


def point(params: float, acts: float, matmul: float, attn: float, tokens: int = 8192) -> Measurement:
    """A measurement with a two-category breakdown and a two-term step time."""
    step = matmul + attn
    dev = int((params + acts) * GiB)
    return Measurement("ok", "estimate", peak_bytes=dev, reserved_bytes=dev, device_bytes=dev,
                       breakdown={"parameters": int(params * GiB), "activations": int(acts * GiB)},
                       step_time_s=step, tokens_per_second=tokens / step,
                       time_breakdown={"matmul": matmul, "attention": attn})


def truth(est: Measurement) -> Measurement:
    """What a costlier backend 'measures': activations 1.5x the estimate's, attention 2x, the rest exact."""
    b, t = est.breakdown, est.time_breakdown
    return point(b["parameters"] / GiB, 1.5 * b["activations"] / GiB, t["matmul"], 2.0 * t["attention"],
                 tokens=round(est.tokens_per_second * est.step_time_s))


ESTIMATES = [point(2, a, m, at) for a, m, at in [(1, 0.5, 0.1), (3, 0.7, 0.3), (6, 1.0, 0.6), (2, 0.4, 0.4),
                                                  (4, 0.9, 0.2), (8, 1.5, 1.0)]]


def test_the_fit_recovers_each_category_and_term_toward_the_truth():
    c = fit((e, truth(e)) for e in ESTIMATES)
    assert c.memory["parameters"] == pytest.approx(1.0)
    assert 1.0 < c.memory["activations"] < 1.5  # shrunk toward 1 by SHRINK pseudo-points
    n = len(ESTIMATES)
    assert c.memory["activations"] == pytest.approx((1.5 * n + FIDELITY_SHRINK) / (n + FIDELITY_SHRINK))
    assert c.time["matmul"] == pytest.approx(1.0) and 1.0 < c.time["attention"] < 2.0
    # the corrected estimate lands nearer the truth than the raw one, for a candidate not in the fit
    other = point(2, 5, 0.8, 0.8)
    real = truth(other)
    assert abs(c.device_bytes(other) - real.device_bytes) < abs(other.device_bytes - real.device_bytes)
    assert abs(c.tokens_per_second(other) - real.tokens_per_second) < abs(
        other.tokens_per_second - real.tokens_per_second)
    assert c.points == n and c.memory_resolution >= FIDELITY_FLOOR and c.time_resolution >= FIDELITY_FLOOR


def test_identity_changes_nothing_and_an_exact_estimate_fits_as_identity():
    e = ESTIMATES[0]
    ident = Correction.identity()
    assert not ident.changes and ident.device_bytes(e) == e.device_bytes
    assert ident.tokens_per_second(e) == e.tokens_per_second
    exact = fit((x, x) for x in ESTIMATES)
    assert not exact.changes and exact.time_resolution == FIDELITY_FLOOR
    failed = Measurement("oom", "simulate")
    assert fit([(e, failed)]) == Correction.identity(), "only points measured OK are fitted"


def test_only_what_can_still_win_is_measured():
    c = fit((e, truth(e)) for e in ESTIMATES)
    fast = point(2, 1, 0.3, 0.05)
    slow = point(2, 1, 2.0, 1.0)
    assert cannot_win(c, fast, c.tokens_per_second(fast) * 1.01, 100 * GiB) == "", "within the resolution"
    assert "slower than the best measured" in cannot_win(c, slow, c.tokens_per_second(fast), 100 * GiB)
    assert "over the limit" in cannot_win(c, point(40, 40, 0.3, 0.05), None, 50 * GiB)
    few = fit((e, truth(e)) for e in ESTIMATES[:FIDELITY_MIN_POINTS - 1])
    assert cannot_win(few, slow, 1e9, GiB) == "", "too few points: the resolution is not known, nothing skipped"


def test_ties_are_equal_memory_and_time_within_the_resolution():
    c = fit((e, truth(e)) for e in ESTIMATES)
    a = point(2, 3, 0.7, 0.3)
    assert c.ties(a, point(2, 3.01, 0.7, 0.301))
    assert not c.ties(a, point(2, 5, 0.7, 0.3)), "memory differs"
    assert not c.ties(a, point(2, 3, 1.4, 0.3)), "time differs"
