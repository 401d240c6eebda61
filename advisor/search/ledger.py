"""Our own table of measured candidates (TPE repeats points) and the bounds that a failed candidate puts on others."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..knobs import memory_le, ordered_names
from ..measurement import Measurement, Status
from ..space import Candidate

# Fields that differ between otherwise identical candidates without changing what is trained or how.
_DERIVED = ("gradient_accumulation_steps",)


def candidate_key(c: Candidate) -> str:
    return json.dumps(c.to_dict(), sort_keys=True)


def device_bytes(m: Measurement) -> int | None:
    """The bytes the budget applies to (device, else reserved, else allocated): Measurement.budget_bytes."""
    return m.budget_bytes


def feasible(m: Measurement, limit_bytes: int) -> bool:
    return m.feasible(limit_bytes)


def needs_at_least(bigger: Candidate, failed: Candidate) -> bool:
    """True when `bigger` cannot use less memory than `failed`: same knobs, except the ones along which memory
    only grows (each knob's `memory` in advisor/knobs.py: a micro-batch, max_length, less checkpointing, no
    offloading), where `bigger` is at least `failed`."""
    ordered = set(ordered_names())
    for f in Candidate.__dataclass_fields__:
        if f in _DERIVED or f in ordered:
            continue
        if getattr(bigger, f) != getattr(failed, f):
            return False
    return memory_le(failed, bigger)


@dataclass(frozen=True)
class Entry:
    candidate: Candidate
    measurement: Measurement
    number: int | None
    measured: bool  # False: pruned or bounded without running the backend
    reason: str = ""


class Ledger:
    """Key -> the one measurement of each distinct candidate, plus the failures that bound others."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.entries: dict[str, Entry] = {}
        self._failures: list[Entry] = []

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str) -> Entry | None:
        return self.entries.get(key)

    def add(self, entry: Entry) -> None:
        key = candidate_key(entry.candidate)
        if key in self.entries:
            return
        self.entries[key] = entry
        m = entry.measurement
        if entry.measured and (m.status is Status.OOM or (m.ok and (device_bytes(m) or 0) > self.limit_bytes)):
            self._failures.append(entry)

    def bound(self, c: Candidate) -> Entry | None:
        """A measured failure that proves `c` cannot fit either."""
        for e in self._failures:
            if needs_at_least(c, e.candidate):
                return e
        return None

    @property
    def measured(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.measured]

    def best(self) -> Entry | None:
        ok = [e for e in self.measured if feasible(e.measurement, self.limit_bytes)]
        return max(ok, key=lambda e: e.measurement.tokens_per_second or 0.0, default=None)
