"""The cpu probe runs the real DistillationTrainer: the teacher loaded by TRL from a saved directory of its
architecture (random weights, `teacher_model_init_kwargs`' dtype), generate (every completion forced to
max_completion_length), the teacher's forward and the divergence, the optimizer step; `simulate()` (the trainer
built through the seam, the teacher built on meta and given built) predicts that real peak."""

from __future__ import annotations

import dataclasses

import pytest

from advisor.measurement import Status
from advisor.space import Candidate, with_knobs


def test_simulate_predicts_the_cpu_probe_with_a_wider_teacher(tiny_model, cpu_target):
    """The whole chain against an independent measurement (the probe's peak from the allocator's own events), the
    teacher 96 wide and 3 deep beside the 64-wide student; the teacher's bytes are in both (the same run with the
    student as its own teacher peaks lower in both)."""
    from advisor.probing.runner import probe
    from advisor.simulator import simulate
    from advisor.trainers.prompts import synthetic_prompts
    from advisor.workload import Goals, Workload

    teacher = dataclasses.replace(tiny_model, name="org/teacher", config={
        **tiny_model.config, "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3,
        "num_attention_heads": 6})
    data = synthetic_prompts(1024, rows=16, median=32, max_len=64)
    wl = Workload(model=tiny_model, gpu=cpu_target, dataset=data, goals=Goals(), trainer="distillation",
                  models=(("teacher", teacher),))
    cand = with_knobs(Candidate(per_device_train_batch_size=4, expandable_segments=False, optim="adamw_torch"),
                      max_completion_length=8, beta=0.5)
    sim = simulate(wl, cand)
    real = probe(wl, cand, "cpu", steps=1, warmup=1, timeout_s=300)
    assert sim.status is Status.OK and real.status is Status.OK, (sim.message, real.message)
    assert any(n.startswith("--teacher org/teacher: one of its architecture") for n in real.notes)
    assert sim.peak_bytes == pytest.approx(real.peak_bytes, rel=0.01)
    assert real.trained_tokens_per_step == 4 * 8
    own = simulate(dataclasses.replace(wl, models=(("teacher", tiny_model),)), cand)
    assert own.peak_bytes < sim.peak_bytes
