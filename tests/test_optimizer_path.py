"""The optimizer takes the implementation it takes on the target: foreach for `adamw_torch` on CUDA.

torch picks `foreach` for `foreach=None` when every parameter is a CUDA tensor; its AdamW step then holds
whole-group temporaries (the `_foreach_sqrt` of every exp_avg_sq) that the CPU's per-tensor loop never holds at
once. The simulator's fake tensors are CPU tensors, so it makes that choice itself for a CUDA target."""

from __future__ import annotations

import pytest
from test_simulate_accuracy import BASE, _real_cpu_peak

from advisor.simulator import simulate
from advisor.space import Candidate


@pytest.fixture
def foreach_everywhere(monkeypatch):
    """Every SFTTrainer's optimizer (the real run's and the fake run's) takes the foreach path, as on CUDA."""
    from trl import SFTTrainer

    original = SFTTrainer.create_optimizer

    def create_optimizer(self, *args, **kwargs):
        opt = original(self, *args, **kwargs)
        for group in getattr(opt, "optimizer", opt).param_groups:
            group["foreach"] = True
        return opt

    monkeypatch.setattr(SFTTrainer, "create_optimizer", create_optimizer)


# short rows on a wide model: the peak is the optimizer step, where the foreach temporaries live
SHORT = {**BASE, "max_length": 16, "per_device_train_batch_size": 1}


@pytest.fixture
def wide_workload(tiny_workload):
    import dataclasses

    from conftest import TINY_QWEN2

    from advisor.workload import ModelSpec

    config = {**TINY_QWEN2, "hidden_size": 256, "intermediate_size": 1024}
    return dataclasses.replace(tiny_workload, model=ModelSpec(name="wide-qwen2", config=config, source="local"))


def test_fake_foreach_step_matches_a_real_foreach_step(foreach_everywhere, wide_workload):
    cand = Candidate(**SHORT)
    real = _real_cpu_peak(wide_workload, cand)
    sim = simulate(wide_workload, cand, "cpu")
    assert sim.peak_bytes == pytest.approx(real, rel=0.01), (sim.peak_bytes, real)
    assert sim.breakdown.get("temporaries", 0) >= sim.breakdown["parameters"] * 0.9  # the peak is the foreach step


def test_cuda_target_costs_adamw_torch_its_foreach_temporaries(wide_workload, h100_target):
    import dataclasses

    wl = dataclasses.replace(wide_workload, gpu=h100_target)
    base = Candidate(**SHORT)
    loop = simulate(wide_workload, base, "cpu")  # the CPU target keeps the per-tensor loop
    foreach, fused = simulate(wl, base), simulate(wl, base.replace(optim="adamw_torch_fused"))
    params = foreach.breakdown["parameters"]
    assert foreach.breakdown.get("temporaries", 0) >= params * 0.9  # a whole-group fp32 temporary
    assert foreach.peak_bytes > fused.peak_bytes
    assert loop.breakdown.get("temporaries", 0) < params * 0.5
