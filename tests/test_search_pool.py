"""The loop measures through a pool (submit -> Future[Measurement]); batches of `jobs` are told in proposal order."""

from __future__ import annotations

import dataclasses

import pytest
from test_search import LIMIT_BUDGET, fake_measure

from advisor import search
from advisor.errors import UsageError
from advisor.measurement import Status
from advisor.search import SerialPool, candidate_key
from advisor.search import open_search_pool as _open_pool
from advisor.space import Candidate
from advisor.workload import Goals


@pytest.fixture
def budget_workload(tiny_workload):
    return dataclasses.replace(tiny_workload, goals=Goals(tokens_per_step=2048, memory_budget_bytes=LIMIT_BUDGET))


@pytest.fixture(autouse=True)
def _fake():
    search.register_backend("fake", fake_measure)
    yield
    search.unregister_backend("fake")


def test_serial_pool_resolves_futures_in_process(budget_workload):
    def broken(w, c):
        raise RuntimeError("no such kernel")

    search.register_backend("broken", broken)
    try:
        with _open_pool("fake", 1) as pool:
            m = pool.submit(budget_workload, Candidate()).result()
            assert m.status is Status.OK and m == fake_measure(budget_workload, Candidate())
        with SerialPool("broken") as pool:
            with pytest.raises(RuntimeError, match="no such kernel"):
                pool.submit(budget_workload, Candidate()).result()
    finally:
        search.unregister_backend("broken")
    with pytest.raises(UsageError, match="--jobs 0"):
        _open_pool("fake", 0)


# the fake backend ignores the optimizer: pinned, so that no two candidates tie and "the same pick" means one thing
FIX = {"packing": "false", "optim": "adamw_torch"}


def _trials(s):
    return [(t.number, candidate_key(t.candidate), t.reason) for t in s.trials]


def test_jobs_two_is_deterministic_and_picks_as_jobs_one(budget_workload):
    one = search.suggest(budget_workload, backend="fake", cache=False, trials=12, fix=FIX, jobs=1)
    two = search.suggest(budget_workload, backend="fake", cache=False, trials=12, fix=FIX, jobs=2)
    again = search.suggest(budget_workload, backend="fake", cache=False, trials=12, fix=FIX, jobs=2)
    assert two.candidate == one.candidate
    assert two.measurement.tokens_per_second == one.measurement.tokens_per_second
    assert _trials(two) == _trials(again), "the same study and jobs give the same trials"
    assert two.evaluations == one.evaluations >= 3


def test_a_worker_takes_jobs(budget_workload, tmp_path):
    storage = str(tmp_path / "journal.log")
    with pytest.raises(UsageError, match="no such study"):
        search.run_worker(storage, "nobody", workload=budget_workload, idle_s=0.1, jobs=2)
