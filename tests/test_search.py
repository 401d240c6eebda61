"""The search on tiny workloads with fake backends: fake OOMs, a counting backend, the ledger and the storage."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from advisor import events, search
from advisor.errors import ConfigError, NoFitError
from advisor.measurement import Measurement
from advisor.search import RowTokens, candidate_key, needs_at_least, parse_fix
from advisor.space import Candidate, Precision, Quantization, WeightsDtype
from advisor.workload import Goals, Method

LIMIT_BUDGET = 10**9  # limit = 0.95 GB
NARROW = {"optim": "adamw_torch", "group_by_length": "false", "packing": "false", "padding_free": "false",
          "checkpoint_selective": "false", "checkpoint_every_n_layers": "1"}


def fake_measure(w, c):
    """Memory grows with micro-batch x length, falls with checkpointing; big micro-batches are fast."""
    length = c.max_length or 256
    act = c.per_device_train_batch_size * length * 4e5 * (0.3 if c.activation_checkpointing else 1.0)
    dev = int(2e8 + act) // (3 if c.use_lora else 1)
    tps = 1000 * c.per_device_train_batch_size ** 0.5 * (0.75 if c.activation_checkpointing else 1.0)
    tps *= 1.1 if c.packing else 1.0
    if dev > 1.2e9:
        return Measurement("oom", "probe-cpu", message="fake OOM")
    return Measurement("ok", "probe-cpu", peak_bytes=dev, reserved_bytes=dev, device_bytes=dev, tokens_per_second=tps)


class Counter:
    def __init__(self, fail_after: int | None = None):
        self.calls: list[str] = []
        self.fail_after = fail_after

    def __call__(self, w, c):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt
        self.calls.append(candidate_key(c))
        return fake_measure(w, c)


@pytest.fixture
def budget_workload(tiny_workload):
    import dataclasses

    return dataclasses.replace(tiny_workload, goals=Goals(tokens_per_step=2048, memory_budget_bytes=LIMIT_BUDGET))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path / "cache"))
    search.register_backend("fake", fake_measure)
    yield
    search.unregister_backend("fake")


def test_infeasible_trials_never_win(budget_workload):
    # packing off (packed sdpa batches of this tiny model are attention-bound), and the whole space: a search in
    # the corrected estimate's order need not propose what the estimate puts far over the limit, which would leave
    # nothing to check
    s = search.suggest(budget_workload, backend="fake", cache=False, exhaustive=True, fix={"packing": "false"})
    limit = budget_workload.limit_bytes
    assert s.measurement.ok and s.measurement.device_bytes <= limit
    faster = [t for t in s.trials if (t.measurement.tokens_per_second or 0) > s.measurement.tokens_per_second]
    assert faster, "the fake space has faster candidates that do not fit"
    assert all(not t.measurement.ok or t.measurement.device_bytes > limit for t in faster)
    # measured out of memory, or skipped because the estimate corrected by the measured points puts it over the limit
    assert any(t.measurement.status.value == "oom" or "over the limit" in t.reason for t in s.trials)


def test_effective_batch_is_fixed(budget_workload):
    # every candidate of the space (a converged search measures only a few)
    s = search.suggest(budget_workload, backend="fake", cache=False, exhaustive=True)
    rows = RowTokens(budget_workload.dataset)
    assert len(s.trials) >= 10
    for t in s.trials:
        c = t.candidate
        per_step = c.per_device_train_batch_size * c.gradient_accumulation_steps * rows(c)
        # every trial, accumulation 1 included, carries the 2048 trained tokens the user asked for, +-25%
        assert 0.75 - 1e-9 <= per_step / 2048 <= 1.25 + 1e-9, (c, per_step)


def test_accumulation_tolerance_is_robust_to_rounding():
    from advisor.search import accumulation_for

    rows = 7.9998  # the default 1729-token step in rows of mean trained tokens
    assert accumulation_for(8, rows) == 1
    assert accumulation_for(16, rows) is None  # 2.0x the step
    assert accumulation_for(15, rows) is None  # 1.875x: the x0.9 finder's old pick
    assert accumulation_for(9, rows) == 1 and accumulation_for(4, rows) == 2 and accumulation_for(1, rows) == 8
    assert accumulation_for(5, rows) is None  # 5 x 2 = 1.25x of 7.9998 rows, 5 x 1 = 0.625x
    assert accumulation_for(1, 0.5) is None  # one row already carries twice the step
    assert accumulation_for(6, 8.0) == 1 and accumulation_for(10, 8.0) == 1  # exactly 0.75x and 1.25x


def test_second_run_makes_no_new_measurement(budget_workload):
    first = Counter()
    search.register_backend("fake", first)
    s1 = search.suggest(budget_workload, backend="fake", trials=12)
    # distinct candidates (at most --trials: the search may converge first); a deterministic backend's measurement
    # is its own confirmation, so nothing is measured twice
    n = len(first.calls)
    assert 3 <= n <= 12 and len(set(first.calls)) == n
    second = Counter()
    search.register_backend("fake", second)
    s2 = search.suggest(budget_workload, backend="fake", trials=12)
    assert second.calls == []
    # evaluations: the distinct candidates this search measured with its backend; the stored ones are listed apart
    assert s1.evaluations == n and s2.candidate == s1.candidate and s2.evaluations == 0
    assert sum(t.cached and t.measurement.status.value != "pruned" for t in s2.trials) == n
    assert f"0 (+{n} answered from the stored study)" in s2.report()
    assert any(isinstance(e, events.AnsweredFromStored) for e in s2.events), s2.events
    assert not any(t.cached for t in s1.trials)
    assert s2.trials and all(t.cached for t in s2.trials)
    assert "(stored)" in s2.report() and f"{len(s2.trials)} answered from the stored study" in s2.report()


def test_cheaper_backend_results_seed_a_costlier_search(budget_workload):
    search.register_backend("fake-sim", fake_measure, cost=1)
    probe = Counter()
    search.register_backend("fake-probe", probe, cost=2)
    try:
        cheap = search.suggest(budget_workload, backend="fake-sim", trials=12)
        costly = search.suggest(budget_workload, backend="fake-probe", trials=3)
    finally:
        search.unregister_backend("fake-sim")
        search.unregister_backend("fake-probe")
    assert probe.calls[0] == candidate_key(cheap.candidate), "the cheaper backend's best is measured first"
    assert costly.candidate == cheap.candidate
    assert any(isinstance(e, events.Seeded) and e.backends == ("fake-sim",) for e in costly.events), costly.events


def test_no_cache_measures_again(budget_workload):
    search.suggest(budget_workload, backend="fake", trials=5)
    again = Counter()
    search.register_backend("fake", again)
    s = search.suggest(budget_workload, backend="fake", trials=5, cache=False)
    assert len(again.calls) == s.evaluations >= 3


def test_interrupted_run_resumes(budget_workload):
    fresh = search.suggest(budget_workload, backend="fake", trials=10, cache=False)
    n = fresh.evaluations  # what an uninterrupted run measures (the search may converge before --trials)
    assert n > 4
    broken = Counter(fail_after=4)
    search.register_backend("fake", broken)
    with pytest.raises(KeyboardInterrupt):
        search.suggest(budget_workload, backend="fake", trials=10)
    assert len(broken.calls) == 4
    resumed = Counter()
    search.register_backend("fake", resumed)
    s = search.suggest(budget_workload, backend="fake", trials=10)
    assert not set(broken.calls) & set(resumed.calls), "a finished trial was measured again"
    # measured by this search (the four stored ones are listed as cached); it converges on what is stored, so it
    # measures at most what the fresh run measured beyond them, and answers as the fresh run does
    assert 1 <= s.evaluations <= n - 4 and len(resumed.calls) == s.evaluations
    assert s.candidate == fresh.candidate
    assert sum(t.cached and t.measurement.status.value != "pruned" for t in s.trials) == 4


def test_oom_bounds_its_neighbours(budget_workload):
    small = Candidate(max_length=128, per_device_train_batch_size=4, activation_checkpointing=True)
    assert needs_at_least(small.replace(per_device_train_batch_size=8), small)
    assert needs_at_least(small.replace(max_length=256, activation_checkpointing=False), small)
    assert not needs_at_least(small.replace(per_device_train_batch_size=2), small)
    assert not needs_at_least(small.replace(optim="adamw_torch"), small)
    s = search.suggest(budget_workload, backend="fake", cache=False, trials=30)
    pruned = [t for t in s.trials if t.measurement.status.value == "pruned"]
    assert all("cannot fit" in t.reason or "estimate" in t.reason for t in pruned)
    # the grid, micro-batches in ascending order: a failure at micro-batch b bounds b' > b without a measurement
    s = search.suggest(budget_workload, backend="fake", cache=False, exhaustive=True, fix=NARROW, method="full")
    bounded = [t for t in s.trials if t.measurement.status.value == "pruned" and "cannot fit" in t.reason]
    assert bounded, "at least one candidate was bounded by a measured failure, not measured"
    assert s.evaluations == len(s.trials) - len([t for t in s.trials if t.measurement.status.value == "pruned"])
    failed = {t.number: t for t in s.trials if t.measurement.status.value == "oom"
              or (t.measurement.ok and t.measurement.device_bytes > budget_workload.limit_bytes)}
    for t in bounded:  # the failure it names is a measured one that t needs at least as much memory as
        number = int(t.reason.split("#")[1].split(",")[0])
        assert number in failed and needs_at_least(t.candidate, failed[number].candidate)


def test_nothing_fits_raises_with_smallest_peak(budget_workload):
    import dataclasses

    tiny_budget = dataclasses.replace(budget_workload, goals=Goals(tokens_per_step=2048, memory_budget_bytes=10**8))
    with pytest.raises(NoFitError) as err:
        search.suggest(tiny_budget, backend="fake", cache=False, trials=8, method="full")
    assert err.value.exit_code == 1
    assert "smallest device peak" in str(err.value) and "--method lora" in str(err.value)


def test_auto_escalates_to_lora(budget_workload):
    import dataclasses

    wl = dataclasses.replace(budget_workload, goals=Goals(tokens_per_step=2048, memory_budget_bytes=2 * 10**8))
    s = search.suggest(wl, backend="fake", cache=False, trials=8)
    assert s.candidate.use_lora
    assert any(e.kind is events.EventKind.NOTHING_FITS and e.method == "full" and e.escalated_to == "lora"
               for e in s.events), s.events
    full = [t for t in s.trials if not t.candidate.use_lora]
    assert full and all(t.reason.startswith("full: ") for t in full), "the full fine-tuning trials stay in the report"
    measured = [t for t in s.trials if t.measurement.status.value != "pruned"]
    assert s.evaluations == len(measured) > len([t for t in measured if t.candidate.use_lora])


def test_fix_maps_trl_field_names():
    pins = parse_fix({"bf16": "false", "dtype": "bfloat16", "load_in_4bit": "true", "optim": "adamw_torch",
                      "gradient_checkpointing": "off", "max_length": "none", "lora_target_modules": "q_proj,v_proj"})
    assert Precision.BF16 not in pins.values["precision"]
    assert pins.values["weights_dtype"] == (WeightsDtype.BFLOAT16,)
    assert pins.values["quantization"] == (Quantization.NF4,) and pins.methods == {Method.QLORA}
    assert pins.values["activation_checkpointing"] == (False,) and pins.values["max_length"] == (None,)
    assert pins.values["lora_target_modules"] == (("q_proj", "v_proj"),)


def test_fix_reports_every_bad_field_at_once():
    with pytest.raises(ConfigError) as err:
        parse_fix({"optimizer": "adamw", "optim": "lomo", "packing": "maybe"})
    msg = str(err.value)
    assert "optimizer" in msg and "fixable" in msg
    assert "optim=lomo" in msg and "adamw_torch_fused" in msg
    assert "packing=maybe" in msg and "boolean" in msg
    assert err.value.exit_code == 2


def test_fix_narrows_every_trial(budget_workload):
    s = search.suggest(budget_workload, backend="fake", cache=False, trials=6, fix={"optim": "adamw_torch",
                                                                                      "per_device_train_batch_size": 2})
    assert all(t.candidate.optim.value == "adamw_torch" and t.candidate.per_device_train_batch_size == 2
               for t in s.trials)


def test_report_lists_every_trial(budget_workload, tmp_path):
    from advisor.report import plot

    # packing off, as in test_infeasible_trials_never_win: the estimate's order would keep 10 trials on packed
    # micro-batches that all fit
    s = search.suggest(budget_workload, backend="fake", cache=False, trials=10, fix={"packing": "false"})
    text = s.report()
    assert "chosen" in text and ("out of memory" in text or "over the limit" in text)
    assert text.count("\n") > len(s.trials)
    out = plot(s, tmp_path / "front.png")
    assert out.stat().st_size > 1000
    assert s.front and s.front[-1].measurement.tokens_per_second == max(
        t.measurement.tokens_per_second for t in s.front)


def _worker(storage, study, workload, out):
    search.register_backend("fake", _slow_fake)
    n = search.run_worker(storage, study, workload=workload, idle_s=8.0)
    out.put(n)


def _slow_fake(w, c):
    import time

    time.sleep(0.05)
    return fake_measure(w, c)


def test_two_workers_never_measure_the_same_candidate(budget_workload, tmp_path):
    storage = str(tmp_path / "journal.log")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    fix = dict(NARROW)
    workers = [ctx.Process(target=_worker, args=(storage, "shared", budget_workload, out)) for _ in range(2)]
    for p in workers:
        p.start()
    search.register_backend("fake", _slow_fake)
    s = search.suggest(budget_workload, backend="fake", exhaustive=True, storage=storage, study_name="shared",
                       fix=fix, method="full")
    for p in workers:
        p.join(60)
    counts = [out.get(timeout=5) for _ in workers]
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    study = optuna.load_study(study_name="shared",
                              storage=JournalStorage(JournalFileBackend(storage)))
    measured = [t.user_attrs["key"] for t in study.trials
                if t.user_attrs.get("measured") and not t.user_attrs.get("cached")]
    assert len(measured) == len(set(measured)) == s.evaluations
    assert sum(counts) > 0, "the workers took part"
    assert json.loads(measured[0])  # keys are the candidates' JSON


@pytest.mark.slow
def test_cpu_probe_backend(tiny_workload):
    s = search.suggest(tiny_workload, backend="cpu", cache=False, trials=2, method="full",
                       fix={**NARROW, "max_length": 256, "activation_checkpointing": "true"})
    assert s.measurement.source.value == "probe-cpu" and s.measurement.ok
    assert s.evaluations == 2


def _estimate_fake(w, c):
    from advisor.estimator import estimate

    return estimate(w, c)


def test_auto_measures_what_the_estimate_says_fits_before_escalating(tiny_workload):
    """The trial budget running out is not "nothing fits": the whole space is checked with the estimate first."""
    import dataclasses

    from advisor.search import device_bytes

    search.register_backend("fake-est", _estimate_fake)
    try:
        probe = search.suggest(tiny_workload, backend="fake-est", cache=False, method="full", trials=2,
                               fix={"optim": "adamw_torch"}, exhaustive=True)
        peaks = sorted(device_bytes(t.measurement) for t in probe.trials if t.measurement.ok)
        # a budget only the leanest few full fine-tuning candidates fit: the estimate's fastest seeds do not
        budget = int(peaks[2] / 0.95) + 1
        wl = dataclasses.replace(tiny_workload, goals=Goals(tokens_per_step=2048, memory_budget_bytes=budget))
        s = search.suggest(wl, backend="fake-est", cache=False, trials=2, fix={"optim": "adamw_torch"})
    finally:
        search.unregister_backend("fake-est")
    assert not s.candidate.use_lora, s.reasons
    assert device_bytes(s.measurement) <= wl.limit_bytes
    assert any(isinstance(e, events.FitCheck) and e.measured == 2 for e in s.events), s.events
    assert not any(getattr(e, "escalated_to", None) for e in s.events)


def test_estimate_backend_seeds_from_itself(tiny_workload):
    import dataclasses

    wl = dataclasses.replace(tiny_workload, goals=Goals(tokens_per_step=2048, memory_budget_bytes=LIMIT_BUDGET))
    s = search.suggest(wl, backend="estimate", cache=False, trials=1, method="full", fix={"optim": "adamw_torch"})
    grid = search.suggest(wl, backend="estimate", cache=False, exhaustive=True, method="full",
                          fix={"optim": "adamw_torch"})
    assert s.evaluations == 1 and s.measurement.tokens_per_second == grid.measurement.tokens_per_second


def test_reused_study_name_with_changed_flags_exits_2(budget_workload, tmp_path):
    from advisor.errors import UsageError

    storage = str(tmp_path / "j.log")
    search.suggest(budget_workload, backend="fake", trials=3, method="full", storage=storage, study_name="mine")
    with pytest.raises(UsageError) as err:
        search.suggest(budget_workload, backend="fake", trials=3, method="full", storage=storage,
                       study_name="mine", fix={"optim": "adamw_torch"})
    assert err.value.exit_code == 2 and "--study 'mine'" in str(err.value) and "space (optim" in str(err.value)
    search.register_backend("fake-2", fake_measure)
    try:
        with pytest.raises(UsageError) as err:
            search.suggest(budget_workload, backend="fake-2", trials=3, method="full", storage=storage,
                           study_name="mine", headroom=0.2)
    finally:
        search.unregister_backend("fake-2")
    assert "backend" in str(err.value) and "goals (headroom)" in str(err.value)
    again = Counter()
    search.register_backend("fake", again)
    search.suggest(budget_workload, backend="fake", trials=3, method="full", storage=storage, study_name="mine")
    assert again.calls == [], "the same flags resume the stored study"


def _killed_run(storage, workload):
    """A run that dies hard (no exception handler runs) while measuring its third candidate."""
    import os

    calls = []

    def dying(w, c):
        if len(calls) == 2:
            os._exit(3)
        calls.append(1)
        return fake_measure(w, c)

    search.register_backend("fake", dying)
    search.suggest(workload, backend="fake", exhaustive=True, storage=storage, study_name="killed",
                   fix=NARROW, method="full")


def test_a_killed_run_leaves_no_candidate_blocked(budget_workload, tmp_path):
    import time

    import optuna
    from optuna.trial import TrialState

    from advisor.search import open_storage

    storage = str(tmp_path / "j.log")
    child = mp.get_context("fork").Process(target=_killed_run, args=(storage, budget_workload))
    child.start()
    child.join(60)
    assert child.exitcode == 3
    store = open_storage(storage)
    study = optuna.load_study(study_name="killed", storage=store)
    (left,) = study.get_trials(states=(TrialState.RUNNING,))
    assert "key" in left.user_attrs and "heartbeat" in left.user_attrs
    store.set_trial_user_attr(left._trial_id, "heartbeat", time.time() - 10 * search.STALE_S)
    resumed = Counter()
    search.register_backend("fake", resumed)
    s = search.suggest(budget_workload, backend="fake", exhaustive=True, storage=storage, study_name="killed",
                       fix=NARROW, method="full")
    assert left.user_attrs["key"] in resumed.calls, "the killed trial's candidate is measured again"
    study = optuna.load_study(study_name="killed", storage=store)
    assert study.trials[left.number].state is TrialState.FAIL and study.trials[left.number].user_attrs["stale"]
    assert not study.get_trials(states=(TrialState.RUNNING,))
    assert len(resumed.calls) == s.evaluations, "the two finished before the kill are not repeated"
    assert sum(t.cached and t.measurement.status.value != "pruned" for t in s.trials) == 2


def test_exhaustive_progress_counts_the_grid_and_ignores_trials(budget_workload):
    seen = []
    s = search.suggest(budget_workload, backend="fake", cache=False, exhaustive=True, trials=3, fix=NARROW,
                       method="full", progress=seen.append)
    assert seen and all(p.total == len(s.trials) for p in seen) and len(s.trials) > 3
    assert events.TrialsIgnored(3) in s.events
    assert "--trials 3 is ignored with --exhaustive" in events.render(events.TrialsIgnored(3))


def test_the_pick_does_not_hang_on_the_walks_parameters(budget_workload):
    """Issue 14: the search answers the same whatever the neighbour walk's breadth and the seeds. The fake backend
    reports no breakdown, so the estimate cannot be corrected by it and its resolution stays poor: the frontier
    then skips nothing and measures in the corrected estimate's order up to --trials (no Converged event); ties
    are capped, so two points do not make every candidate a tie of them (which ended such a search at 2)."""
    picks = set()
    evaluations = []
    for parents, seeds in ((1, 2), (1, 16), (8, 2), (8, 16)):
        with search.walk_parameters(parents=parents, seeds=seeds):
            s = search.suggest(budget_workload, backend="fake", cache=False, trials=40)
        picks.add((s.candidate, s.measurement.tokens_per_second))
        evaluations.append(s.evaluations)
    grid = search.suggest(budget_workload, backend="fake", cache=False, exhaustive=True)
    assert len(picks) == 1, picks
    (pick, tps), = picks
    # an estimate that knows nothing of the fake's cost function still leads 40 of 492 measurements to 0.9 of the
    # grid's best (3,000 of 3,300 tokens/s here)
    assert tps >= 0.9 * grid.measurement.tokens_per_second
    assert max(evaluations) <= 40 < grid.evaluations
