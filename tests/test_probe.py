"""Real probes on the CPU: ok with a peak, oom under a cap, a killed child, a hung child; nothing survives.

The faults come from the worker's test hook ADVISOR_PROBE_FAULT (advisor.probing.runner.FAULT_ENV).
"""

from __future__ import annotations

import json
import signal

import pytest

from advisor.measurement import Source, Status
from advisor.probing import FAULT_ENV, BatchKind, plan_batches, probe
from advisor.probing import runner as runner_mod
from advisor.probing.meters import is_oom, oom_request_bytes
from advisor.space import Candidate

SMALL = Candidate(max_length=256, per_device_train_batch_size=4, optim="adamw_torch", precision="fp32")


def assert_no_child_left(children):
    assert children, "no child was started"
    for exit_ in children:
        assert not runner_mod.group_alive(exit_.pgid), f"process group {exit_.pgid} survived the probe"


# ---- planning and parsing (no child) -------------------------------------------------------------------------
def test_plan_puts_the_longest_rows_first(tiny_workload):
    plan = plan_batches(tiny_workload, SMALL, steps=3, warmup=1)
    lengths = [len(r["input_ids"]) for r in plan.rows]
    assert plan.rows_per_step == 4
    assert len(plan.rows) == 4 * 4
    assert plan.kinds == (BatchKind.LONGEST, BatchKind.LONGEST, BatchKind.TYPICAL, BatchKind.TYPICAL)
    longest = sorted(tiny_workload.dataset.lengths.tolist(), reverse=True)[:4]
    assert lengths[:4] == longest and lengths[4:8] == longest
    assert max(lengths[8:]) <= min(longest)


def test_plan_scales_rows_with_accumulation_and_cycles_a_small_dataset(tiny_workload):
    cand = SMALL.replace(per_device_train_batch_size=8, gradient_accumulation_steps=4)
    plan = plan_batches(tiny_workload, cand, steps=3, warmup=1)
    assert plan.rows_per_step == 32
    assert len(plan.rows) == 128  # more than the 64 rows: typical rows repeat


def test_plan_skips_the_rows_a_short_max_length_leaves_fully_masked(tiny_workload):
    # max_length 48: the longest rows' prompts run past it, so TRL drops them (nothing trained) and a plan of the
    # longest rows left the step with nothing to train on
    import numpy as np

    data = tiny_workload.dataset
    cand = SMALL.replace(max_length=48)
    trained = data.trained_after_truncation(48)
    longest = np.argsort(-data.lengths, kind="stable")[:4]
    assert (trained[longest] == 0).any(), "the case no longer breaks the old plan"
    plan = plan_batches(tiny_workload, cand, steps=3, warmup=1)
    by_row = {id(r): i for i, r in enumerate(data.rows)}
    planned = [by_row[id(r)] for r in plan.rows]
    assert all(trained[i] > 0 for i in planned)
    kept = np.flatnonzero(trained > 0)
    assert sorted(data.lengths[planned[:4]].tolist(), reverse=True) == sorted(data.lengths[kept].tolist(),
                                                                              reverse=True)[:4]


def test_plan_with_every_row_fully_masked_names_max_length(tiny_workload):
    from advisor.errors import UsageError

    with pytest.raises(UsageError, match=r"max_length=4: .*raise max_length"):
        plan_batches(tiny_workload, SMALL.replace(max_length=4), steps=3, warmup=1)


def test_oom_messages_are_parsed():
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 314572800 bytes. Error code 12 (Cannot allocate memory)")
    assert is_oom(cpu) and oom_request_bytes(str(cpu)) == 314572800
    cuda = "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB"
    assert oom_request_bytes(cuda) == 20 * 2**20
    assert is_oom(MemoryError()) and not is_oom(ValueError("shapes do not match"))


def test_cpu_peak_replays_the_allocator_events():
    import torch

    from advisor.probing.meters import cpu_peak

    before = torch.ones(4 * 1024 * 1024)  # 16 MiB live before profiling (earlier work): not part of the peak
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.ones(1024, 1024)  # 4 MiB
        b = torch.ones(1024, 1024)  # 8 MiB live
        del a
        c = torch.ones(512, 1024)  # 6 MiB live: below the peak
        del b, c
    found = cpu_peak(prof)
    assert found.peak_bytes == 8 * 2**20
    del before
    assert found.events >= 5


def test_invalid_arguments_are_reported_together(tiny_workload):
    from advisor.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        probe(tiny_workload, SMALL, "tpu", steps=0, timeout_s=0)
    assert len(info.value.problems) == 3


# ---- the child's outcomes -------------------------------------------------------------------------------------
def test_killed_child_is_an_error_with_the_signal(tiny_workload, monkeypatch, children):
    monkeypatch.setenv(FAULT_ENV, "kill:start")
    m = probe(tiny_workload, SMALL, "cpu", timeout_s=60)
    assert m.status is Status.ERROR and m.source is Source.PROBE_CPU
    assert "SIGKILL" in m.message
    assert children[0].returncode == -signal.SIGKILL
    assert_no_child_left(children)


def test_hung_child_times_out_and_its_group_is_killed(tiny_workload, monkeypatch, children):
    monkeypatch.setenv(FAULT_ENV, "hang:start")
    m = probe(tiny_workload, SMALL, "cpu", timeout_s=1.5)
    assert m.status is Status.TIMEOUT
    assert "1.5 s" in m.message
    assert children[0].timed_out
    assert_no_child_left(children)


def test_caller_interrupted_while_waiting_leaves_no_child(tmp_path, monkeypatch):
    """An exception in the parent (e.g. Ctrl-C) while the child runs still kills the group."""
    monkeypatch.setenv(FAULT_ENV, "hang:start")
    (tmp_path / runner_mod.JOB_FILE).write_text("{}")
    started = []

    def interrupt(pgid):
        started.append(pgid)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner_mod.run_child(tmp_path, Source.PROBE_CPU, timeout_s=30, on_start=interrupt)
    assert started and not runner_mod.group_alive(started[0])


@pytest.mark.slow
def test_probe_cpu_ok_reports_peak_speed_and_the_peak_batch(tiny_workload, children):
    m = probe(tiny_workload, SMALL, "cpu", steps=2, warmup=1, timeout_s=120)
    assert m.status is Status.OK, m.message
    assert m.source is Source.PROBE_CPU
    # the CPU has one memory: all three figures are the allocator's peak
    assert m.peak_bytes > 0 and m.peak_bytes == m.reserved_bytes == m.device_bytes
    from advisor.modeling import build_model

    n_params = sum(p.numel() for p in build_model(tiny_workload.model, SMALL, device="meta").parameters())
    assert m.breakdown["parameters"] == 4 * n_params  # float32 weights
    assert m.breakdown["optimizer_state"] >= 2 * 4 * n_params  # AdamW's two moments
    assert m.peak_bytes > m.breakdown["parameters"] + m.breakdown["optimizer_state"]
    assert m.tokens_per_second > 0 and m.step_time_s > 0 and m.trained_tokens_per_step > 0
    assert "longest rows" in m.peak_batch
    assert_no_child_left(children)


def test_probe_cpu_times_the_steady_state(tiny_workload, children):
    """The peaks from the measured steps (the CPU's profiler on), then the step time from a run of the longest rows
    again and again without it: its first step untimed, then timed until the median of the last `window` steps is
    within the tolerance of the `window` before (or the bound); the report says how many and their spread. The peaks
    are those of a probe that times nothing."""
    import statistics

    from advisor.probing.runner import Timing

    timing = Timing(window=3, tolerance=0.05, max_steps=9, max_s=120)
    m = probe(tiny_workload, SMALL, "cpu", steps=1, warmup=1, timeout_s=120, timing=timing)
    assert m.status is Status.OK, m.message
    d = m.time_detail
    times = d["steady_step_s"]
    assert len(times) == d["timed_steps"] and 1 <= len(times) <= timing.max_steps
    last = times[-timing.window:]
    assert m.step_time_s == pytest.approx(statistics.median(last))
    assert d["spread"] == pytest.approx(max(last) / min(last) - 1)
    before = statistics.median(times[-2 * timing.window:-timing.window]) if len(times) >= 2 * timing.window else None
    stable = before is not None and abs(statistics.median(last) - before) <= timing.tolerance * statistics.median(last)
    assert d["stable"] is stable
    assert stable or len(times) == timing.max_steps  # it stops when stable, else at the bound
    assert any("steady-state steps" in n for n in m.notes)
    plain = probe(tiny_workload, SMALL, "cpu", steps=1, warmup=1, timeout_s=120, timing=None)
    assert (m.peak_bytes, m.breakdown) == (plain.peak_bytes, plain.breakdown) and not plain.time_detail
    assert_no_child_left(children)


@pytest.mark.slow
def test_probe_cpu_under_a_small_budget_is_oom_with_the_size(tiny_workload, children):
    m = probe(tiny_workload, SMALL, "cpu", memory_budget_bytes=40 * 2**20, timeout_s=120)
    assert m.status is Status.OOM, m.message
    assert "while allocating" in m.message and "bytes" in m.message
    assert_no_child_left(children)


@pytest.mark.slow
def test_exception_in_training_is_an_error_with_the_message(tiny_workload, monkeypatch, children):
    monkeypatch.setenv(FAULT_ENV, "raise")
    m = probe(tiny_workload, SMALL, "cpu", timeout_s=120)
    assert m.status is Status.ERROR
    assert "RuntimeError in step 1" in m.message and "injected failure" in m.message
    assert_no_child_left(children)


@pytest.mark.slow
def test_child_killed_during_a_training_step(tiny_workload, monkeypatch, children):
    monkeypatch.setenv(FAULT_ENV, "kill")
    m = probe(tiny_workload, SMALL, "cpu", timeout_s=120)
    assert m.status is Status.ERROR and "SIGKILL" in m.message
    assert_no_child_left(children)


@pytest.mark.slow
def test_child_hung_during_a_training_step(tiny_workload, monkeypatch, children):
    monkeypatch.setenv(FAULT_ENV, "hang")
    # long enough for the imports between two heartbeats on a loaded machine, short enough for a test
    m = probe(tiny_workload, SMALL, "cpu", timeout_s=25)
    assert m.status is Status.TIMEOUT
    assert_no_child_left(children)


# ---- the command line -----------------------------------------------------------------------------------------
@pytest.fixture
def model_dir(tmp_path):
    from conftest import TINY_QWEN2

    d = tmp_path / "tiny-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_QWEN2))
    return d


@pytest.fixture
def run_yaml(tmp_path):
    from advisor.emit import to_yaml

    path = tmp_path / "RUN.yaml"
    path.write_text(to_yaml(SMALL, model_name_or_path=None))
    return path


def _cli(argv, capsys):
    from advisor.cli import main

    rc = main(argv)
    out = capsys.readouterr().out
    return rc, json.loads(out)


@pytest.mark.slow
def test_cli_probe_cpu_ok(model_dir, run_yaml, capsys, children):
    rc, data = _cli(["probe", "--model", str(model_dir), "--gpu", "cpu", "--config", str(run_yaml),
                     "--backend", "cpu", "--steps", "2", "--json"], capsys)
    assert rc == 0
    for key in ("status", "peak_bytes", "reserved_bytes", "device_bytes", "breakdown", "tokens_per_second",
                "source", "step_time_s", "peak_batch", "message"):
        assert key in data
    assert data["status"] == "ok" and data["source"] == "probe-cpu"
    assert data["peak_bytes"] > 0 and data["tokens_per_second"] > 0
    # the peak's micro-batch has the worst shape, 4 rows x max_length 256: the longest rows' steps do, and so may a
    # typical step (most rows of the default set are truncated to 256), whose peak is then as high or a little higher
    assert "4 x 256 tokens" in data["peak_batch"], data["peak_batch"]
    assert_no_child_left(children)


@pytest.mark.slow
def test_cli_probe_cpu_budget_below_need_is_oom(model_dir, run_yaml, capsys, children):
    rc, data = _cli(["probe", "--model", str(model_dir), "--gpu", "cpu", "--config", str(run_yaml),
                     "--backend", "cpu", "--memory-budget", "40MiB", "--json"], capsys)
    assert rc == 1
    assert data["status"] == "oom" and "allocating" in data["message"]
    assert_no_child_left(children)


def test_cli_probe_killed_and_hung_children(model_dir, run_yaml, capsys, monkeypatch, children):
    base = ["probe", "--model", str(model_dir), "--gpu", "cpu", "--config", str(run_yaml), "--backend", "cpu",
            "--json"]
    monkeypatch.setenv(FAULT_ENV, "kill:start")
    rc, data = _cli(base, capsys)
    assert rc == 1 and data["status"] == "error" and "SIGKILL" in data["message"]
    monkeypatch.setenv(FAULT_ENV, "hang:start")
    rc, data = _cli([*base, "--timeout", "1"], capsys)
    assert rc == 1 and data["status"] == "timeout"
    assert len(children) == 2
    assert_no_child_left(children)


def test_bad_probe_inputs_fail_in_the_parent_with_usage_errors(tiny_workload, monkeypatch):
    """No child is started for a probe that could only fail: exit 2 material, not an `error` measurement."""
    import torch

    from advisor.errors import ConfigError
    from advisor.space import Candidate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as info:
        probe(tiny_workload, Candidate(activation_offloading=True, precision="fp32"), "cpu", weights="/nonexistent")
    text = str(info.value)
    assert "--backend cpu: activation_offloading=True on the CPU" in text
    assert "--weights /nonexistent: not a directory" in text
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--backend cuda: no CUDA device"):
            probe(tiny_workload, Candidate(precision="fp32"), "cuda")
