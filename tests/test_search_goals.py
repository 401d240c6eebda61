"""Goals declared once: suggest()'s goal parameters and `advisor suggest`'s goal flags come from `Goals`' fields."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from advisor import search
from advisor.cli.cmd_suggest import add_goal_args, goals_from_args
from advisor.errors import UsageError
from advisor.workload import Goals, Method


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_goal_args(p)
    return p


def test_every_goal_field_is_a_suggest_parameter_and_a_flag():
    names = {f.name for f in dataclasses.fields(Goals)}
    declared = Goals.declared()
    assert {g.name for g in declared} == names
    params = inspect.signature(search.suggest).parameters
    flags = {a.option_strings[0] for a in _parser()._actions if a.option_strings and a.dest != "help"}
    for g in declared:
        assert params[g.param].kind is inspect.Parameter.KEYWORD_ONLY and params[g.param].default is None
        assert g.flag in flags and g.help in (search.suggest.__doc__ or "")


def test_flags_left_out_keep_the_defaults_and_given_ones_parse():
    assert Goals(**goals_from_args(_parser().parse_args([]))) == Goals()
    ns = _parser().parse_args(["--headroom", "10%", "--memory-budget", "1GiB", "--tokens-per-step", "2048",
                               "--method", "lora", "--allow-wrapped", "--max-truncation", "0.02"])
    assert Goals(**goals_from_args(ns)) == Goals(headroom=0.1, memory_budget_bytes=2**30, tokens_per_step=2048,
                                                 method=Method.LORA, allow_wrapped=True, max_truncation=0.02)


def test_bad_goal_values_name_the_flag_or_parameter(tiny_workload):
    with pytest.raises(UsageError, match="--memory-budget 'lots'"):
        goals_from_args(_parser().parse_args(["--memory-budget", "lots"]))
    with pytest.raises(UsageError, match="--tokens-per-step 'x'"):
        goals_from_args(_parser().parse_args(["--tokens-per-step", "x"]))
    with pytest.raises(UsageError, match="headrom"):
        search.suggest(tiny_workload, backend="estimate", cache=False, trials=1, headrom=0.1)
    with pytest.raises(UsageError, match="--method 'half'"):
        search.suggest(tiny_workload, backend="estimate", cache=False, trials=1, method="half")
