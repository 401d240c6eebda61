"""Peak-memory regression checks: record a baseline once, re-measure in CI, fail when memory grew.

A baseline (`baseline.py`) is measured through the backend registry (`advisor.backends`), so any backend
`suggest` can use can be baselined, and `check` always re-measures with the baseline's own backend. The simulate
backend is the default because it is deterministic on a CPU-only CI runner. The results here are typed values;
`render.py` turns them into the table, the text and the Markdown summary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._versions import library_versions
from .backends import check_baselinable, check_usable, source_of
from .baseline import SCHEMA_VERSION, TOTALS, Baseline, load_baseline
from .errors import ConfigError, UsageError
from .inputs import WorkloadRef
from .measurement import Category, Measurement
from .space import Candidate
from .trainers import training_workload

if TYPE_CHECKING:
    from .workload import Workload

__all__ = [
    "DEFAULT_BACKEND", "DEFAULT_TOLERANCE", "SCHEMA_VERSION", "TOTALS", "Baseline", "CheckResult", "Row",
    "Verdict", "VersionChange", "WorkloadRef", "check", "compare_rows", "knob_changes",
    "library_versions", "load_baseline", "measure", "parse_tolerance", "record_baseline", "version_changes",
]

DEFAULT_TOLERANCE = 0.01
DEFAULT_BACKEND = "simulate"


class Verdict(str, Enum):
    """The outcome of a check."""

    FAILED = "failed"  # the run no longer succeeds (OOM, error, timeout): a regression
    REGRESSED = "regressed"  # a total grew beyond the tolerance
    IMPROVED = "improved"  # within tolerance, and a total shrank beyond it
    WITHIN = "within_tolerance"


@dataclass(frozen=True)
class VersionChange:
    package: str
    was: str | None
    now: str | None

    def __str__(self) -> str:
        return f"{self.package} {self.was or 'absent'} -> {self.now or 'absent'}"


@dataclass(frozen=True)
class Row:
    """One line of the comparison: a total or a category, in bytes."""

    metric: str
    reference: int | None
    now: int | None

    @property
    def difference(self) -> int | None:
        if self.reference is None or self.now is None:
            return None
        return self.now - self.reference

    @property
    def change(self) -> float | None:
        if self.difference is None or not self.reference:
            return None
        return self.difference / self.reference

    def grew(self, tolerance: float) -> bool:
        diff = self.difference
        if diff is None or diff <= 0:
            return False
        return self.reference == 0 or diff > self.reference * tolerance

    def shrank(self, tolerance: float) -> bool:
        diff = self.difference
        return diff is not None and diff < 0 and -diff > (self.reference or 0) * tolerance


@dataclass(frozen=True)
class CheckResult:
    """A re-measurement against a baseline. `regressed` is True when a total grew beyond the tolerance."""

    baseline: Baseline
    measurement: Measurement
    candidate: Candidate
    tolerance: float
    rows: tuple[Row, ...]
    version_changes: tuple[VersionChange, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def regressed(self) -> bool:
        if not self.measurement.ok:
            return True
        return any(r.grew(self.tolerance) for r in self.rows if r.metric in TOTALS)

    @property
    def grown(self) -> tuple[str, ...]:
        """Every metric (totals and categories) that grew beyond the tolerance: what to look at first."""
        return tuple(r.metric for r in self.rows if r.grew(self.tolerance))

    @property
    def improved(self) -> bool:
        return not self.regressed and any(r.shrank(self.tolerance) for r in self.rows if r.metric in TOTALS)

    @property
    def outcome(self) -> Verdict:
        if not self.measurement.ok:
            return Verdict.FAILED
        if self.regressed:
            return Verdict.REGRESSED
        return Verdict.IMPROVED if self.improved else Verdict.WITHIN

    def to_dict(self) -> dict[str, Any]:
        return {
            "regressed": self.regressed,
            "outcome": self.outcome.value,
            "tolerance": self.tolerance,
            "backend": self.baseline.backend,
            "source": self.measurement.source.value,
            "status": self.measurement.status.value,
            "grown": list(self.grown),
            "rows": [{"metric": r.metric, "baseline": r.reference, "now": r.now, "difference": r.difference,
                      "change": r.change} for r in self.rows],
            "version_changes": [dataclasses.asdict(v) for v in self.version_changes],
            "notes": list(self.notes),
            "peak_bytes": self.measurement.peak_bytes,
            "reserved_bytes": self.measurement.reserved_bytes,
            "device_bytes": self.measurement.device_bytes,
            "breakdown": dict(self.measurement.breakdown),
        }


# ---- measuring -------------------------------------------------------------------------------------------------

def measure(workload: Workload, candidate: Candidate, backend: str = DEFAULT_BACKEND) -> Measurement:
    """Measure with the named backend of the registry (advisor.backends); the candidate is checked against TRL's
    rules first (exit 2 if broken), and an unknown backend name is a UsageError naming --backend. Measured as the
    search measures it: on the ranks that train (vLLM server mode's GPUs left out: trainers.training_workload)."""
    be = check_usable(backend)
    candidate = candidate.for_model(workload.model)  # the run's own defaults for attention and LoRA targets
    candidate.check(workload.gpu, workload.model)
    return be.measure(training_workload(workload, candidate), candidate)


def parse_tolerance(value: str | float) -> float:
    """'1%' -> 0.01, '0.01' -> 0.01; a bare number above 1 is refused rather than guessed at."""
    text = str(value).strip()
    try:
        tol = float(text[:-1]) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        raise UsageError(f"--tolerance {value!r}: not a number; write e.g. 1% or 0.01") from None
    if not 0.0 <= tol < 1.0:
        raise UsageError(f"--tolerance {value!r}: must be in [0, 1), e.g. 1% or 0.01 (a fraction, not a percent)")
    return tol


# ---- baseline file ---------------------------------------------------------------------------------------------

def record_baseline(
    workload: Workload,
    candidate: Candidate,
    backend: str = DEFAULT_BACKEND,
    config_path: str | Path | None = None,
    *,
    ref: WorkloadRef | None = None,
) -> Baseline:
    """Measure once and keep everything `check` needs. `ref` names the workload as the user gave it."""
    backend = check_baselinable(backend).name
    m = measure(workload, candidate, backend)
    if not m.ok or m.peak_bytes is None:
        raise ConfigError(
            f"the {backend} backend ended with status {m.status.value}"
            + (f" ({m.message})" if m.message else "")
            + "; a baseline needs a run that fits: use a configuration that fits the target",
            context="advisor baseline",
        )
    return Baseline(
        peak_bytes=m.peak_bytes,
        reserved_bytes=m.reserved_bytes,
        device_bytes=m.device_bytes,
        breakdown={str(k): int(v) for k, v in m.breakdown.items()},
        backend=backend,
        source=m.source.value,
        workload=ref or WorkloadRef.of(workload),
        candidate=candidate,
        versions=library_versions(),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        config_path=str(config_path) if config_path is not None else None,
    )


# ---- comparing -------------------------------------------------------------------------------------------------

def check(
    baseline: Baseline,
    candidate: Candidate | None = None,
    tolerance: float | str = DEFAULT_TOLERANCE,
    workload: Workload | None = None,
) -> CheckResult:
    """Re-measure the baseline's workload (or `candidate` against it) with the baseline's backend and compare."""
    tolerance = parse_tolerance(tolerance)
    candidate = candidate or baseline.candidate
    notes: list[str] = []
    workload = workload or baseline.workload.build()
    fingerprint = workload.fingerprint()
    if baseline.workload.fingerprint and fingerprint != baseline.workload.fingerprint:
        notes.append(
            f"the workload differs from the baseline's (fingerprint {baseline.workload.fingerprint} -> "
            f"{fingerprint}): the model config, the data, the target or the goals changed"
        )
    # as the run resolves them: no attn_implementation is transformers' pick, no LoRA targets PEFT's default
    changed = knob_changes(baseline.candidate.for_model(workload.model), candidate.for_model(workload.model))
    if changed:
        notes.append("configuration differs from the baseline's: " + ", ".join(changed))
    m = measure(workload, candidate, baseline.backend)
    rows = compare_rows(baseline.totals(), baseline.breakdown, m)
    changes = version_changes(baseline.versions, library_versions(), baseline.backend)
    return CheckResult(baseline=baseline, measurement=m, candidate=candidate, tolerance=tolerance, rows=rows,
                       version_changes=changes, notes=tuple(notes))


def version_changes(was: dict[str, str], now: dict[str, str], backend: str) -> tuple[VersionChange, ...]:
    """Changed packages among those the baseline recorded (a package tracked since is not a change).

    A backend whose source is a prediction (simulate, estimate) never runs a device kernel, so a build label
    (+cpu, +cu128) is ignored for it."""
    predicted = not source_of(backend).is_run

    def same(a: str | None, b: str | None) -> bool:
        if predicted and a and b:
            return a.split("+")[0] == b.split("+")[0]
        return a == b

    return tuple(VersionChange(p, was.get(p), now.get(p)) for p in sorted(was) if not same(was.get(p), now.get(p)))


def knob_changes(before: Candidate, after: Candidate) -> list[str]:
    """Each knob that differs, then each key of the user's base that differs."""
    a, b = before.to_dict(), after.to_dict()
    ba, bb = a.pop("base", {}), b.pop("base", {})
    out = [f"{k} {a[k]!r} -> {b[k]!r}" for k in a if a[k] != b[k]]
    out += [f"{k} {ba.get(k)!r} -> {bb.get(k)!r}" for k in sorted(set(ba) | set(bb)) if ba.get(k) != bb.get(k)]
    return out


def compare_rows(totals: dict[str, int | None], breakdown: dict[str, int], now: Measurement) -> tuple[Row, ...]:
    """Totals first, then every category either side knows, in the Category order."""
    rows = [Row(k, totals.get(k), getattr(now, k)) for k in TOTALS]
    order = [c.value for c in Category]
    names = sorted(set(breakdown) | set(now.breakdown), key=lambda n: (order.index(n) if n in order else len(order), n))
    # a category absent from a non-empty breakdown had no bytes live at that peak
    def get(side: dict[str, int], n: str) -> int | None:
        return side.get(n, 0) if side else None

    rows.extend(Row(n, get(breakdown, n), get(now.breakdown, n)) for n in names)
    return tuple(rows)


# ---- pytest helper ---------------------------------------------------------------------------------------------
