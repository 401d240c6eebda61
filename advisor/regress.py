"""Peak-memory regression checks: record a baseline once, re-measure in CI, fail when memory grew.

A baseline stores the measured peak with its breakdown, how it was measured (the backend), what is needed to
rebuild the workload (model, GPU, dataset as the user named them), the candidate, and the versions of the
libraries that decide the peak, since a dependency bump is the usual cause of a moved prediction. The
simulate backend is the default because it is deterministic on a CPU-only CI runner.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._versions import library_versions as _library_versions
from .errors import BaselineError, ConfigError, UsageError
from .measurement import Category, Measurement
from .space import Candidate
from .workload import Goals, Method

if TYPE_CHECKING:
    from .workload import Workload

SCHEMA_VERSION = 1
TRACKED_PACKAGES = ("torch", "transformers", "trl", "peft")
TOTALS = ("peak_bytes", "reserved_bytes", "device_bytes")
DEFAULT_TOLERANCE = 0.01


class Backend(str, Enum):
    """How a baseline is measured; `check` always re-measures with the baseline's own backend."""

    SIMULATE = "simulate"
    ESTIMATE = "estimate"
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True)
class WorkloadRef:
    """What rebuilds the workload: the names as given to `--model`, `--gpu`, `--dataset`, plus the goals."""

    model: str
    gpu: str
    dataset: str | None = None
    tokenizer: str | None = None
    sample: int | None = None
    goals: Goals = field(default_factory=Goals)
    fingerprint: str = ""

    @classmethod
    def of(cls, workload: Workload, **given: Any) -> WorkloadRef:
        """From a built workload; `given` (model=, gpu=, dataset=, ...) overrides what is derived."""
        data = workload.dataset
        derived: dict[str, Any] = {
            "model": workload.model.name,  # the id, or the path as the user gave it
            "gpu": workload.gpu.name,
            "dataset": None if data.source == "synthetic" else (data.dataset_name or data.name),
            # a sampled dataset is rebuilt with the same seeded sample
            "sample": len(data.rows) if getattr(data, "population", None) is not None else None,
        }
        derived.update({k: v for k, v in given.items() if v is not None})
        return cls(goals=workload.goals, fingerprint=workload.fingerprint(), **derived)

    def build(self) -> Workload:
        from .workload import build_workload

        return build_workload(
            self.model, gpu=self.gpu, dataset=self.dataset, tokenizer=self.tokenizer, sample=self.sample,
            goals=self.goals,
        )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["goals"] = {k: (v.value if isinstance(v, Enum) else v) for k, v in data["goals"].items()}
        return data


@dataclass(frozen=True)
class Baseline:
    """One recorded measurement of a workload and candidate, comparable across commits."""

    peak_bytes: int
    reserved_bytes: int | None
    device_bytes: int | None
    breakdown: dict[str, int]
    backend: Backend
    source: str
    workload: WorkloadRef
    candidate: Candidate
    versions: dict[str, str]
    created: str
    config_path: str | None = None
    schema_version: int = SCHEMA_VERSION

    def totals(self) -> dict[str, int | None]:
        return {"peak_bytes": self.peak_bytes, "reserved_bytes": self.reserved_bytes,
                "device_bytes": self.device_bytes}

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            **self.totals(),
            "breakdown": dict(self.breakdown),
            "backend": self.backend.value,
            "source": self.source,
            "workload": self.workload.to_dict(),
            "candidate": self.candidate.to_dict(),
            "versions": dict(self.versions),
            "created": self.created,
            "config_path": self.config_path,
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")
        return path


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

    def verdict(self) -> str:
        if not self.measurement.ok:
            return f"REGRESSION: the run now ends with status {self.measurement.status.value}"
        if self.regressed:
            return f"REGRESSION: peak memory grew by more than {self.tolerance:.2%} ({', '.join(self.grown)})"
        if self.improved:
            return (f"within tolerance ({self.tolerance:.2%}); memory shrank beyond it: record a new baseline to "
                    "lock the gain in")
        return f"within tolerance ({self.tolerance:.2%})"

    def table(self, tablefmt: str = "simple") -> str:
        return render_table(self.rows, self.tolerance, tablefmt=tablefmt)

    def explanation(self) -> list[str]:
        """The lines printed under the table: library changes first, since they are the usual cause."""
        out = []
        if self.version_changes:
            out.append("library versions changed since the baseline (the usual cause): "
                       + ", ".join(str(v) for v in self.version_changes))
        out.extend(self.notes)
        if self.measurement.message:
            out.append(f"measurement: {self.measurement.message}")
        return out

    def text(self) -> str:
        lines = [self.verdict(), "", self.table(), ""]
        lines.extend(self.explanation())
        return "\n".join(lines).rstrip() + "\n"

    def markdown(self) -> str:
        title = "Peak-memory check: " + ("regression" if self.regressed else "ok")
        lines = [f"### {title}", "", f"{self.verdict()}", "",
                 f"backend `{self.baseline.backend.value}`, model `{self.baseline.workload.model}`, "
                 f"target `{self.baseline.workload.gpu}`", "", self.table("github"), ""]
        lines.extend(f"- {line}" for line in self.explanation())
        return "\n".join(lines).rstrip() + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {
            "regressed": self.regressed,
            "verdict": self.verdict(),
            "tolerance": self.tolerance,
            "backend": self.baseline.backend.value,
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

def measure(workload: Workload, candidate: Candidate, backend: Backend | str = Backend.SIMULATE) -> Measurement:
    """Measure with the named backend; the candidate is checked against TRL's rules first (exit 2 if broken)."""
    backend = parse_backend(backend)
    candidate = candidate.for_model(workload.model)  # the run's own defaults for attention and LoRA targets
    candidate.check(workload.gpu, workload.model)
    if backend is Backend.SIMULATE:
        from .simulate import simulate

        return simulate(workload, candidate)
    if backend is Backend.ESTIMATE:
        from .estimate import estimate

        return estimate(workload, candidate)
    from .probe import probe

    return probe(workload, candidate, backend=backend.value)


def parse_backend(value: Backend | str) -> Backend:
    try:
        return Backend(value)
    except ValueError:
        allowed = ", ".join(b.value for b in Backend)
        raise UsageError(f"--backend {value!r}: not one of {allowed}; simulate is deterministic on a CPU") from None


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


def library_versions() -> dict[str, str]:
    return _library_versions(TRACKED_PACKAGES)


# ---- baseline file ---------------------------------------------------------------------------------------------

def record_baseline(
    workload: Workload,
    candidate: Candidate,
    backend: Backend | str = Backend.SIMULATE,
    config_path: str | Path | None = None,
    *,
    ref: WorkloadRef | None = None,
) -> Baseline:
    """Measure once and keep everything `check` needs. `ref` names the workload as the user gave it."""
    backend = parse_backend(backend)
    m = measure(workload, candidate, backend)
    if not m.ok or m.peak_bytes is None:
        raise ConfigError(
            f"the {backend.value} backend ended with status {m.status.value}"
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


_REQUIRED = ("peak_bytes", "breakdown", "backend", "source", "workload", "candidate", "versions", "created")


def load_baseline(path: str | Path) -> Baseline:
    """Read a baseline file; every problem is reported at once, naming the file and the fix (exit 2)."""
    path = Path(path)
    record = f"record it with `advisor baseline --model M --config RUN.yaml --out {path}`"
    if not path.is_file():
        raise BaselineError(f"--baseline {path}: no such file; {record}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BaselineError(
            f"--baseline {path}: not valid JSON ({exc}); the file is truncated or corrupt: restore it from git "
            f"or {record}"
        ) from None
    if not isinstance(data, dict):
        raise BaselineError(f"--baseline {path}: expected a JSON object, got {type(data).__name__}; {record}")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BaselineError(
            f"--baseline {path}: schema_version {version!r} is not the supported {SCHEMA_VERSION}; "
            f"{'upgrade advisor, or ' if isinstance(version, int) and version > SCHEMA_VERSION else ''}{record}"
        )
    problems = [f"missing key {k!r}" for k in _REQUIRED if k not in data]
    for k in ("peak_bytes", "reserved_bytes", "device_bytes"):
        v = data.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            problems.append(f"{k}={v!r}: must be a non-negative integer")
    if "breakdown" in data and not (
        isinstance(data["breakdown"], dict)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in data["breakdown"].values())
    ):
        problems.append("breakdown: must map a category to an integer number of bytes")
    backend = None
    if "backend" in data:
        try:
            backend = Backend(data["backend"])
        except ValueError:
            problems.append(f"backend={data['backend']!r}: not one of {', '.join(b.value for b in Backend)}")
    candidate = None
    if isinstance(data.get("candidate"), dict):
        try:
            candidate = Candidate.from_dict(data["candidate"])
        except ConfigError as exc:
            problems.extend(f"candidate: {p}" for p in exc.problems)
    elif "candidate" in data:
        problems.append("candidate: must be an object of knobs")
    ref = None
    wl = data.get("workload")
    if isinstance(wl, dict):
        try:
            goals = wl.get("goals") or {}
            ref = WorkloadRef(
                model=str(wl["model"]), gpu=str(wl["gpu"]), dataset=wl.get("dataset"),
                tokenizer=wl.get("tokenizer"), sample=wl.get("sample"),
                goals=Goals(**{**goals, "method": Method(goals.get("method", Method.AUTO))}),
                fingerprint=str(wl.get("fingerprint", "")),
            )
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            problems.append(f"workload: {exc!s}; it needs at least 'model' and 'gpu'")
    elif "workload" in data:
        problems.append("workload: must be an object with 'model' and 'gpu'")
    if problems:
        raise BaselineError(f"--baseline {path}: {len(problems)} problem(s): " + "; ".join(problems) + f"; {record}")
    assert backend is not None and candidate is not None and ref is not None
    return Baseline(
        peak_bytes=data["peak_bytes"],
        reserved_bytes=data.get("reserved_bytes"),
        device_bytes=data.get("device_bytes"),
        breakdown=dict(data["breakdown"]),
        backend=backend,
        source=str(data["source"]),
        workload=ref,
        candidate=candidate,
        versions={str(k): str(v) for k, v in dict(data["versions"]).items()},
        created=str(data["created"]),
        config_path=data.get("config_path"),
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


def version_changes(was: dict[str, str], now: dict[str, str], backend: Backend) -> tuple[VersionChange, ...]:
    """Changed packages. Simulate and estimate never touch a device, so a build label (+cpu, +cu128) is ignored."""

    def same(a: str | None, b: str | None) -> bool:
        if backend in (Backend.SIMULATE, Backend.ESTIMATE) and a and b:
            return a.split("+")[0] == b.split("+")[0]
        return a == b

    return tuple(VersionChange(p, was.get(p), now.get(p)) for p in sorted(set(was) | set(now))
                 if not same(was.get(p), now.get(p)))


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


def format_bytes(n: int | None, signed: bool = False) -> str:
    if n is None:
        return "-"
    sign = ("+" if n > 0 else "-" if n < 0 else "") if signed else ("-" if n < 0 else "")
    v = abs(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= scale:
            return f"{sign}{v / scale:.2f} {unit}"
    return f"{sign}{v} B"


def render_table(rows: tuple[Row, ...] | list[Row], tolerance: float, *, tablefmt: str = "simple",
                 reference: str = "baseline") -> str:
    """The per-metric table shared by `advisor check`, its Markdown summary and `assert_peak_memory`."""
    from tabulate import tabulate

    body = []
    for r in rows:
        if r.grew(tolerance):
            flag = "over" if r.metric in TOTALS else "grew"
        elif r.shrank(tolerance):
            flag = "shrank"
        else:
            flag = ""
        change = "-" if r.change is None else f"{r.change:+.2%}"
        body.append([r.metric, format_bytes(r.reference), format_bytes(r.now), format_bytes(r.difference, True),
                     change, flag])
    headers = ["", reference, "now", "difference", "change", ""]
    return tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True)


# ---- pytest helper ---------------------------------------------------------------------------------------------

def assert_peak_memory(
    config: Candidate | str | Path,
    *,
    model: str,
    max_bytes: int,
    gpu: str = "cpu",
    dataset: str | None = None,
    backend: Backend | str = Backend.SIMULATE,
) -> Measurement:
    """Fail the calling test with the per-category table when the device peak exceeds `max_bytes`.

    `config` is a Candidate or a RUN.yaml path. The device peak (what the budget applies to) is compared;
    on the CPU it equals the allocator's peak. Returns the measurement for further assertions.
    """
    from .workload import build_workload

    if isinstance(config, Candidate):
        candidate = config
    else:
        from .emit import load_run_config

        candidate = load_run_config(config).candidate
    workload = build_workload(model, gpu=gpu, dataset=dataset)
    m = measure(workload, candidate, backend)
    peak = m.device_bytes if m.device_bytes is not None else m.peak_bytes
    if m.ok and peak is not None and peak <= max_bytes:
        return m
    limits = {"peak_bytes": None, "reserved_bytes": None, "device_bytes": max_bytes}
    rows = compare_rows(limits, {}, m)
    head = (f"{m.source.value} run of {model} on {gpu} ended with status {m.status.value}: {m.message}"
            if not m.ok else
            f"peak memory {format_bytes(peak)} ({peak} B) exceeds max_bytes {format_bytes(max_bytes)} "
            f"({max_bytes} B) by {format_bytes(peak - max_bytes)}")
    raise AssertionError(head + "\n" + render_table(rows, 0.0, reference="limit"))
