"""Several GPUs (issue 16): one rank simulated on fake tensors (the fake process group, FSDP2 by accelerate's own
sharding, TRL's train()) against a real 2-process CPU run (gloo), per-rank peak from the allocator's own events."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from advisor.space import Candidate

HERE = os.path.dirname(os.path.abspath(__file__))
BASE = dict(max_length=128, per_device_train_batch_size=2, precision="fp32", optim="adamw_torch")


def _real_per_rank(candidate: dict, parallelism: dict, config: dict | None = None, world: int = 2) -> list[int]:
    spec = {"world": world, "candidate": candidate, "parallelism": parallelism, "config": config or {}}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, os.path.join(HERE, "multigpu_worker.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return [r["peak"] for r in json.loads(done.stdout.strip().splitlines()[-1])]


def _workload(config: dict | None = None):
    sys.path.insert(0, HERE)
    from multigpu_worker import workload

    return workload(config)


def _check(candidate: dict, parallelism: dict, config: dict | None = None) -> None:
    from advisor.parallelism import Parallelism
    from advisor.simulator import simulate_per_rank

    real = _real_per_rank(candidate, parallelism, config)
    sim = simulate_per_rank(_workload(config), Candidate(**candidate), 2, Parallelism(**parallelism), gpu="cpu")
    print(f"per-rank peak: simulated {sim.peak_bytes} B, real {real} B")
    # Every rank peaks at the simulated bytes (within 2%) or higher by one FSDP unit's bytes (a decoder layer, the
    # embedding unit). The higher readings are the measurement's, not the run's (issue 16, traced in the allocator's
    # events): buffers of gloo's collectives are freed on gloo's worker threads, whose frees the profiler does not
    # follow (advisor/probing/meters.memory_profiler). The worker measures as the probe of several ranks does (each
    # reduce-scatter's Work held a moment, no USER_SCOPE callbacks, cpu_peak(backend_frees=True)); the unit is left
    # for the residual case that docstring names. Measured while the full suite loaded both cores: 30 of 30
    # rank-readings of the five cases within 0.15% of the simulation (wide-model-states +1,804 B each); the earlier
    # worker (main thread's events only), same load: 13 of 28 wide-model-states ranks 1.0-5.8 MB high, one past the
    # allowance (+5.8 MB, 1.7 units), as in the CI run it failed.
    unit = _largest_unit_bytes(candidate, config)
    for r in real:
        assert 0.98 * sim.peak_bytes <= r <= 1.02 * sim.peak_bytes + unit, (sim.peak_bytes, real, unit)
    assert any("FSDP2 on 2 ranks" in n for n in sim.notes)


def _largest_unit_bytes(candidate: dict, config: dict | None) -> int:
    """The embedding unit plus one decoder layer, unsharded, in the dtype FSDP2 gathers (physics/ranks_closed)."""
    from advisor.estimator import architecture

    arch = architecture(_workload(config).model)
    return (arch.embedding + arch.per_layer) * (4 if candidate.get("precision", "fp32") == "fp32" else 2)


# one row of 32 tokens: the sharded model states are a visible share of the peak (2 ranks: 6% under one GPU)
SMALL_BATCH = dict(BASE, per_device_train_batch_size=1, max_length=32, activation_checkpointing=False)


@pytest.mark.slow  # a 2-process gloo run and the simulation: about 30 s on an idle 2-core host
def test_fsdp2_two_ranks_matches_real_gloo_run():
    _check(SMALL_BATCH, {})


CASES = {
    "no-reshard-small-batch": (SMALL_BATCH, dict(reshard_after_forward=False)),
    "logits-dominated-ckpt": (BASE, {}),
    # 4x wider: parameters, gradients and AdamW's state outweigh the activations (the sharding is the peak)
    "wide-model-states": (SMALL_BATCH, {}, dict(hidden_size=256, intermediate_size=512, head_dim=64)),
    "bf16-mixed-grad-accum2": (dict(BASE, precision="bf16", gradient_accumulation_steps=2, max_length=64), {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_fsdp2_two_ranks_matrix(name):
    _check(*CASES[name])


def test_sharding_halves_the_model_states():
    """Against the single-GPU simulation: optimizer state 1/2 per rank; the peak is never higher than one GPU's."""
    from advisor.measurement import Category
    from advisor.simulator import simulate, simulate_per_rank

    wl = _workload()
    cand = Candidate(**BASE)
    one = simulate(wl, cand, "cpu", layers=None)
    two = simulate_per_rank(wl, cand, 2, gpu="cpu")
    opt = Category.OPTIMIZER.value
    assert two.breakdown[opt] == pytest.approx(one.breakdown[opt] / 2, rel=0.01)
    assert two.peak_bytes < one.peak_bytes
    assert two.trained_tokens_per_step == 2 * one.trained_tokens_per_step


def test_cpu_offload_keeps_the_model_states_on_the_host():
    """FSDP2's CPUOffloadPolicy: the sharded parameters, gradients, optimizer state and step leave the device."""
    from advisor.measurement import Category
    from advisor.parallelism import Parallelism
    from advisor.simulator import simulate_per_rank

    wl = _workload()
    cand = Candidate(**SMALL_BATCH)
    on_device = simulate_per_rank(wl, cand, 2, gpu="cpu")
    offloaded = simulate_per_rank(wl, cand, 2, Parallelism(offload_params=True, offload_optimizer=True), gpu="cpu")
    assert Category.OPTIMIZER.value not in offloaded.breakdown
    assert on_device.peak_bytes - offloaded.peak_bytes >= on_device.breakdown[Category.OPTIMIZER.value]
    assert any(n.startswith("CPU offload") for n in offloaded.notes)


def test_ddp_adds_the_reducers_buckets():
    """DDP (modelled): the single-GPU run plus one more copy of the trainable gradients, named in the notes."""
    from advisor.estimator import architecture
    from advisor.parallelism import Parallelism
    from advisor.simulator import simulate, simulate_per_rank

    wl = _workload()
    cand = Candidate(**SMALL_BATCH)
    one = simulate(wl, cand, "cpu", layers=None)
    ddp = simulate_per_rank(wl, cand, 4, Parallelism(strategy="ddp"), gpu="cpu", layers=None)
    assert ddp.peak_bytes - one.peak_bytes == architecture(wl.model).total * 4
    assert any(n.startswith("DDP: modelled") for n in ddp.notes)


@pytest.mark.slow  # Llama-3.1-8B at full depth on fake tensors: about 90 s
def test_llama8b_full_finetune_fits_per_rank_on_8_h100():
    """The issue's case through the Python API: AdamW full fine-tuning of an 8B model does not fit one 80 GB card but
    fits each of 8 with FSDP2; the accelerate config names what was chosen."""
    from advisor.accelerate_config import accelerate_config
    from advisor.inputs import build_workload
    from advisor.measurement import Status
    from advisor.parallelism import Parallelism
    from advisor.simulator import simulate_per_rank

    wl = build_workload("meta-llama/Llama-3.1-8B", gpu="H100-80GB", num_gpus=8)
    cand = Candidate(max_length=2048, per_device_train_batch_size=1, precision="bf16", optim="adamw_torch",
                     activation_checkpointing=True, attn_implementation="sdpa")
    rank = simulate_per_rank(wl, cand)
    assert rank.status is Status.OK and rank.device_bytes < wl.budget_bytes
    # AdamW's two fp32 moments of 1/8 of the (fp32-upcast, accelerate's FSDP2 rule) parameters
    params = 8_030_261_248
    assert rank.breakdown["optimizer_state"] == pytest.approx(2 * 4 * params / 8, rel=0.001)
    launch = accelerate_config(cand, Parallelism(), 8)
    assert launch.config["fsdp_config"]["fsdp_version"] == 2 and "FSDP2" in launch.chosen


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_zero_replaces_the_model_states_with_the_closed_form(strategy, monkeypatch):
    """ZeRO (modelled, as if deepspeed were installed): the single-GPU run's activations, ZeRO's model states."""
    import advisor.parallelism as par_mod
    from advisor.estimator import architecture
    from advisor.measurement import Category
    from advisor.parallelism import Parallelism
    from advisor.physics import zero_bytes
    from advisor.simulator import simulate, simulate_per_rank

    monkeypatch.setattr(par_mod, "deepspeed_available", lambda: True)
    wl = _workload()
    cand = Candidate(**SMALL_BATCH)
    one = simulate(wl, cand, "cpu", layers=None)
    rank = simulate_per_rank(wl, cand, 4, Parallelism(strategy=strategy), gpu="cpu", layers=None)
    p = architecture(wl.model).total
    terms = zero_bytes(2 if strategy == "zero2" else 3, p, p, 4, param_bytes=4, mixed=False)  # fp32: no master copy
    assert rank.breakdown[Category.OPTIMIZER.value] == terms.optimizer_state
    states = sum(one.breakdown.get(c.value, 0) for c in (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER))
    assert rank.peak_bytes - one.peak_bytes == terms.total - states
    assert any("ZeRO" in n and "closed form" in n for n in rank.notes)
