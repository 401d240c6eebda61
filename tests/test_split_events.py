"""The typed events: one frozen dataclass per EventKind, each rendered from its fields (advisor/events.py)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from advisor import events
from advisor.space import Candidate

# a value for each field type the events declare
_SAMPLES = {"int": 3, "int | None": 5, "float": 2.5, "float | None": 0.25, "bool": True, "str": "full", "str | None": "lora",
            "Candidate": Candidate(), "tuple[str, ...]": ("simulate", "estimate")}


def _sample(cls):
    return cls(**{f.name: _SAMPLES[f.type] for f in dataclasses.fields(cls)})


def test_every_kind_has_one_frozen_event_type_that_renders_from_its_fields():
    classes = events.Event.__subclasses__()
    assert sorted(c.kind.value for c in classes) == sorted(k.value for k in events.EventKind)
    for cls in classes:
        e = _sample(cls)
        assert dataclasses.is_dataclass(e) and e.kind is cls.kind
        with pytest.raises(dataclasses.FrozenInstanceError):
            e.kind_of = 1  # type: ignore[attr-defined]
        line = events.render(e)
        assert line and "{" not in line and "}" not in line, (cls.__name__, line)
        assert e.to_dict()["kind"] == cls.kind.value
        assert pickle.loads(pickle.dumps(e)) == e and hash(e) == hash(dataclasses.replace(e))
    assert events.render(events.TimeBudget(12.5, 4)) == "stopped by --time-budget 12.5s after 4 measurements"
    assert events.render(events.StorageNote("a {brace} stays")) == "a {brace} stays"


def test_a_kind_taken_twice_or_missing_is_refused_when_declared():
    with pytest.raises(TypeError, match="already"):
        class Again(events.Event, kind=events.EventKind.TIME_BUDGET):  # noqa: F841
            seconds: float
    with pytest.raises(TypeError):
        class NoKind(events.Event):  # noqa: F841
            x: int
