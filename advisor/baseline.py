"""A baseline file: one recorded measurement of a workload and candidate, comparable across commits.

It stores the measured peak with its breakdown, the backend that measured it (a name in `advisor.backends`),
what rebuilds the workload (an `inputs.WorkloadRef`), the candidate, and the library versions. Recording and
comparing are `regress.py`'s; this module only holds the type and reads and writes the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._files import write_atomic
from .backends import backend_names
from .errors import BaselineError, ConfigError
from .inputs import WorkloadRef
from .space import Candidate

SCHEMA_VERSION = 1
TOTALS = ("peak_bytes", "reserved_bytes", "device_bytes")


@dataclass(frozen=True)
class Baseline:
    """One recorded measurement of a workload and candidate. `backend` is the registered backend's name."""

    peak_bytes: int
    reserved_bytes: int | None
    device_bytes: int | None
    breakdown: dict[str, int]
    backend: str
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
            "backend": self.backend,
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

        return write_atomic(path, json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")


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
    for k in TOTALS:
        v = data.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            problems.append(f"{k}={v!r}: must be a non-negative integer")
    if "breakdown" in data and not (
        isinstance(data["breakdown"], dict)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in data["breakdown"].values())
    ):
        problems.append("breakdown: must map a category to an integer number of bytes")
    backend = data.get("backend")
    if "backend" in data and backend not in backend_names():
        problems.append(f"backend={backend!r}: not one of {', '.join(backend_names())} (a backend registered at "
                        "runtime must be registered again before the check)")
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
            ref = WorkloadRef.from_dict(wl)
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
        backend=str(backend),
        source=str(data["source"]),
        workload=ref,
        candidate=candidate,
        versions={str(k): str(v) for k, v in dict(data["versions"]).items()},
        created=str(data["created"]),
        config_path=data.get("config_path"),
    )
