"""Host and device as two queues (advisor/physics/timing/queues.py, host.py; advisor/simulator/timing_hook.py,
phase_timing.py): each op of the fake run issued by the host at its measured cost per op, each kernel run by the
device, the host waiting where the real step reads a value back.

Every count here is checked against an independent one: the ops and syncs a real CPU step of the same model
dispatches (a dispatch mode on real tensors), and a real GRPO run's decode steps. No wall-clock assertion: the host's
cost per op is pinned (ADVISOR_HOST_COST, conftest), so a prediction is a pure function of the ops; the
microbenchmark's own test checks its structure and its cache, not its values.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import tempfile
import warnings

import numpy as np
import pytest
import torch

from advisor.space import Candidate
from advisor.workload import Goals, Workload

HOST_US = 40.0  # a host slow enough that a tiny model on an H100 waits on it: the floor is the ops' issue time


def _pin(monkeypatch, us: float) -> None:
    from advisor.physics import time_constants

    monkeypatch.setenv("ADVISOR_HOST_COST", json.dumps(
        {"nograd_us": us, "grad_us": us, "backward_us": us, "loop_us": us}))
    time_constants.cache_clear()


# ---- the two queues --------------------------------------------------------------------------------------------------


def _trace(rows):
    """rows: (host s, device s, sync) per op; every op with device time launches a kernel."""
    from advisor.physics import TraceBuilder

    b = TraceBuilder()
    for host, dev, sync in rows:
        b.op(host, device_s=dev, basis=3, kernel=dev > 0)
        if sync:
            b.mark_sync()
    return b.build()


def test_two_queues_overlap_wait_on_the_host_and_drain_at_a_sync():
    from advisor.physics import run_queues

    one = np.ones((1, 4))
    # device-bound: the host issues three 1 s kernels in 0.3 s; the device ends at 0.1 + 3
    assert run_queues(_trace([(0.1, 1.0, False)] * 3), one, serial=False).total[0] == pytest.approx(3.1)
    # host-bound: 1 s of host per op, 0.1 s kernels: the last kernel starts at 3 s
    q = run_queues(_trace([(1.0, 0.1, False)] * 3), one, serial=False)
    assert q.total[0] == pytest.approx(3.1) and q.busy[0] == pytest.approx(0.3)
    assert q.host_bound[0] == pytest.approx(2.8)
    # a host-bound stretch, then a device-bound one: without a sync they overlap (the device runs the first kernels
    # while the host issues), with a sync between them the device idles while the host issues the second
    rows = [(1.0, 0.1, False)] * 3 + [(0.1, 1.0, False)] * 3
    free = run_queues(_trace(rows), one, serial=False).total[0]
    rows[2] = (1.0, 0.1, True)
    synced = run_queues(_trace(rows), one, serial=False).total[0]
    assert free == pytest.approx(3.0 + 0.1 + 3.0) and synced == pytest.approx(3.1 + 0.1 + 3.0)
    # one thread (the CPU target): everything adds
    assert run_queues(_trace(rows), one, serial=True).total[0] == pytest.approx(3 * 1.1 + 3 * 1.1)


def test_a_kernel_never_runs_under_its_floor():
    from advisor.physics import TraceBuilder, run_queues

    b = TraceBuilder()
    b.op(0.0, device_s=1e-3, basis=0, kernel=True, floor_s=5e-6)
    t = b.build()
    bases = np.array([[1.0, 0, 0, 1], [1e-3, 0, 0, 1], [1e-6, 0, 0, 1]])
    assert run_queues(t, bases, serial=False).busy.tolist() == pytest.approx([1e-3, 5e-6, 5e-6])


# ---- the real step's ops and syncs ----------------------------------------------------------------------------------


def _real_micro_step(tiny_model, tiny_data, candidate):
    """The ops (and the host's reads: `_local_scalar_dense`) a real CPU SFT micro-step dispatches, from its
    `training_step` through the Trainer's nan check to the gradient norm: TRL's SFTTrainer on real tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from advisor.modeling import placeholder_tokenizer, save_random_model
    from advisor.trainers import get_trainer

    counts: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[func._overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    kind = get_trainer("sft")
    wl = Workload(model=tiny_model, gpu=_cpu(), dataset=tiny_data, goals=Goals())
    c = candidate.for_model(tiny_model)
    tmp = tempfile.mkdtemp()
    rows = kind.worst_rows(wl, c) * 3  # the simulated batch (the longest rows) at every step
    ds = kind.dataset_from_rows(tiny_data.name, tiny_data.source, tuple(rows), dataset_name=None,
                                completion_only_loss=True)
    wl = dataclasses.replace(wl, dataset=ds)
    config = kind.build_config(c, wl, measured=True, output_dir=tmp, use_cpu=True, max_steps=3, report_to="none",
                               save_strategy="no", logging_strategy="no", train_sampling_strategy="sequential",
                               dataloader_num_workers=0, disable_tqdm=True, seed=0)
    state = {"n": 0, "mode": None}
    base = kind.trainer_class()

    class Counted(base):
        def training_step(self, *a, **k):
            state["n"] += 1
            if state["n"] == 3:
                state["mode"] = Count()
                state["mode"].__enter__()
            return super().training_step(*a, **k)

        def _get_grad_norm(self, *a, **k):
            if state["mode"] is not None:
                state["mode"].__exit__(None, None, None)
                state["mode"] = None
            return super()._get_grad_norm(*a, **k)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Counted(model=str(save_random_model(tiny_model, tmp + "/m", c)), args=config,
                          train_dataset=kind.train_dataset(wl), processing_class=placeholder_tokenizer(tiny_model),
                          peft_config=kind.peft_config(c, tiny_model))
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        trainer.train()
    return counts


def _cpu():
    from advisor.profiles import resolve_gpu

    return resolve_gpu("cpu")


@pytest.fixture(scope="module")
def real_counts(tiny_model, tiny_data):
    return _real_micro_step(tiny_model, tiny_data, Candidate(max_length=64, per_device_train_batch_size=2))


@pytest.fixture(scope="module")
def tiny_model():
    from conftest import TINY_QWEN2

    from advisor.workload import ModelSpec

    return ModelSpec(name="tiny-qwen2", config=dict(TINY_QWEN2), source="local")


@pytest.fixture(scope="module")
def tiny_data():
    from advisor.data import synthetic

    return synthetic(vocab_size=1024, rows=64, seed=0, median=64, max_len=256)


def test_the_host_bound_floor_is_every_op_of_the_real_step_at_the_hosts_cost(real_counts, tiny_model, tiny_data,
                                                                            h100_target, monkeypatch):
    """The prediction counts the real step's ops (a real CPU micro-step on real tensors against the fake run's, on
    the CPU target: the same code path, within 1%) and costs each at the host's cost per op; a tiny model on an H100
    waits on its host: its step is at least its ops issued at that cost, and twice the host's cost doubles the time
    the device waits. Fails on a model with a host cost it assumes (8 us a launch, 1 us a view)."""
    from advisor.simulator import simulate

    _pin(monkeypatch, HOST_US)
    cand = Candidate(max_length=64, per_device_train_batch_size=2)
    cpu = simulate(Workload(model=tiny_model, gpu=_cpu(), dataset=tiny_data, goals=Goals()), cand)
    d = cpu.time_detail
    micro_ops = d["ops"] - d["optimizer_launches"]
    real_ops = sum(real_counts.values())
    assert micro_ops == pytest.approx(real_ops, rel=0.01)
    assert cpu.time_breakdown["launch_host"] > micro_ops * HOST_US * 1e-6  # one thread: every op's host time adds

    m = simulate(Workload(model=tiny_model, gpu=h100_target, dataset=tiny_data, goals=Goals()), cand)
    d = m.time_detail
    micro_ops = d["ops"] - d["optimizer_launches"]
    assert m.step_time_s > micro_ops * HOST_US * 1e-6
    assert d["host_bound_s"] > 0.8 * m.step_time_s  # the device waits on the host most of the step
    _pin(monkeypatch, 2 * HOST_US)
    m2 = simulate(Workload(model=tiny_model, gpu=h100_target, dataset=tiny_data, goals=Goals()), cand)
    assert m2.time_detail["host_bound_s"] > 1.9 * d["host_bound_s"]


def test_the_step_waits_where_the_real_step_reads_a_value(real_counts, tiny_model, tiny_data, h100_target):
    """The syncs of the prediction are the real step's reads (`.item()`: TRL's metrics after the forward, the
    Trainer's nan check), and a sync costs time: the same ops without them run shorter. Fails on a model without
    syncs."""
    from advisor.physics import BatchDistribution, evaluate
    from advisor.simulator import runnable, simulate, simulate_depth

    wl = Workload(model=tiny_model, gpu=h100_target, dataset=tiny_data, goals=Goals())
    cand = Candidate(max_length=64, per_device_train_batch_size=2)
    m = simulate(dataclasses.replace(wl, gpu=_cpu()), cand)
    real = real_counts["_local_scalar_dense"]
    # the fake run answers the nan check's first read (`torch.isnan(loss)`) True, so `or torch.isinf(loss)`, the
    # real run's second read, is never asked: one fewer
    assert m.time_detail["syncs"] == real - 1 and real >= 6
    rc, _ = runnable(cand, h100_target)
    cost = simulate_depth(wl, rc, h100_target, 2, steps=2, original=cand).cost
    free = cost.with_(micro=tuple((dataclasses.replace(t, sync=np.zeros_like(t.sync)), n) for t, n in cost.micro))
    one = BatchDistribution.single(cost.worst)
    assert evaluate(cost, one).step_s > evaluate(free, one).step_s


# ---- generation: a decode step as the host issues it -----------------------------------------------------------------


def _real_decode_ops() -> list[int]:
    """Ops per decode step of a real GRPO run's transformers generate (scripts/grpo_cpu_peak.py's tiny Qwen2, its
    "grpo-full" case, on real tensors): counted per window between the model's forwards, inside generate."""
    import sys
    from pathlib import Path

    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import grpo_cpu_peak as real
    from test_simulate_accuracy_grpo import _reward, _run_inputs

    case = real.CASES["grpo-full"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**real.SIZES["tiny"]), dtype=torch.float32)
    kwargs, peft_config, tok, data = _run_inputs(case)
    kwargs.update(max_steps=1, generation_kwargs={"min_new_tokens": kwargs["max_completion_length"]})
    windows: list[int] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if windows:
                windows[-1] += 1
            return func(*args, **(kwargs or {}))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=GRPOConfig(**kwargs), train_dataset=data,
                              processing_class=tok)
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        model.register_forward_pre_hook(lambda *a: windows.append(0))
        generate = model.generate

        def counted(*a, **k):
            with Count():
                return generate(*a, **k)

        model.generate = counted
        trainer.train()
    return windows


def test_generate_costs_each_decode_steps_ops_at_the_hosts_cost(tiny_model, h100_target, monkeypatch):
    """GRPO with transformers' generate on an H100: each decode step is at least its ops (counted in a real GRPO
    run's decode steps) at the host's cost, and the prediction counts them (within 2%). Fails on a closed form that
    assumes 40 ops a layer at a constant cost per op."""
    from test_simulate_online import _candidate, _workload

    from advisor.simulator import simulate

    real = _real_decode_ops()
    decode = real[1:-1]  # the prefill's window first; the last window ends the loop
    _pin(monkeypatch, HOST_US)
    m = simulate(_workload(tiny_model, h100_target), _candidate(max_completion_length=16))
    d = m.time_detail
    assert d["decode_ops"] == pytest.approx(np.median(decode), rel=0.02)
    assert d["decode_token_s"] > np.median(decode) * HOST_US * 1e-6
    # the generation term: 15 decode steps (the prefill picks the first token) per generation call
    per_call = m.time_breakdown["generation"] / max(1.0, d["generation_s"] / m.time_breakdown["generation"])
    assert per_call >= 15 * d["decode_token_s"]
    # the estimate's closed form counts the same ops a decode step (online_rl_constants.json hf_generate_ops)
    from advisor.estimator import estimate

    e = estimate(_workload(tiny_model, h100_target), _candidate(max_completion_length=16))
    assert e.time_breakdown["generation"] == pytest.approx(m.time_breakdown["generation"], rel=0.25)


# ---- the host's cost per op ------------------------------------------------------------------------------------------


def test_the_microbenchmark_measures_this_host_once_and_caches_it(tmp_path, monkeypatch):
    """Measured on first use, cached per host and versions under the advisor's cache, read back after (a value
    written into the cached file is what the next process gets)."""
    from advisor.physics import host_cost, time_constants

    monkeypatch.delenv("ADVISOR_HOST_COST", raising=False)
    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path))
    host_cost.cache_clear()
    try:
        cost = host_cost()
        assert cost.source == "microbenchmark" and cost.measured
        assert 0 < cost.backward_s and 0 < cost.loop_s and 0 < cost.grad_s and 0 < cost.nograd_s
        assert "measured on" in cost.label and cost.host in cost.label
        files = list((tmp_path / "host_cost").glob("*.json"))
        assert len(files) == 1 and json.loads(files[0].read_text())["grad_s"] == cost.grad_s
        data = json.loads(files[0].read_text())
        files[0].write_text(json.dumps({**data, "grad_s": 1.25e-5}))
        host_cost.cache_clear()
        assert host_cost().grad_s == 1.25e-5  # read back, not measured again
        time_constants.cache_clear()
        assert "measured on" in time_constants(_cpu()).host.label
    finally:
        host_cost.cache_clear()
        time_constants.cache_clear()


def test_a_malformed_pinned_host_cost_names_the_variable(monkeypatch):
    from advisor.errors import ConfigError
    from advisor.physics import host_cost

    monkeypatch.setenv("ADVISOR_HOST_COST", '{"nograd_us": 5}')
    with pytest.raises(ConfigError, match="ADVISOR_HOST_COST.*grad_us"):
        host_cost()
