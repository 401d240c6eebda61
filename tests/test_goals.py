"""Goals passed to `suggest()` beside a Workload override the Workload's own, even when equal to the defaults."""

from __future__ import annotations

import dataclasses

import pytest

from advisor import search
from advisor.workload import Goals


@pytest.mark.parametrize(
    ("own", "given", "expected"),
    [
        ({"headroom": 0.1}, {"headroom": 0.05}, {"headroom": 0.05}),  # a default-valued override still wins
        ({"allow_wrapped": True}, {"allow_wrapped": False}, {"allow_wrapped": False}),
        ({"max_truncation": 0.2}, {"max_truncation": 0.01}, {"max_truncation": 0.01}),
        ({"headroom": 0.1, "max_truncation": 0.2}, {}, {"headroom": 0.1, "max_truncation": 0.2}),  # nothing given
    ],
)
def test_suggest_goals_override_the_workloads(tiny_workload, own, given, expected):
    wl = dataclasses.replace(tiny_workload, goals=Goals(tokens_per_step=2048, **own))
    s = search.suggest(wl, backend="estimate", cache=False, trials=1, method="full", **given)
    for key, value in expected.items():
        assert getattr(s.workload.goals, key) == value
    assert s.workload.goals.tokens_per_step == 2048  # what was not given is kept

