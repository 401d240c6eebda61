"""Extrapolation, the CUDA path and its allocator rules, modelled kernels, and the CLI."""

from __future__ import annotations

import json

import pytest

from advisor.space import Candidate
from advisor.workload import Goals, ModelSpec, Workload

BASE = dict(max_length=128, per_device_train_batch_size=2, precision="fp32", optim="adamw_torch")


@pytest.fixture
def deep_workload(tiny_model, cpu_target, tiny_data):
    spec = ModelSpec(name="tiny6", config={**tiny_model.config, "num_hidden_layers": 6}, source="local")
    return Workload(model=spec, gpu=cpu_target, dataset=tiny_data, goals=Goals())


def test_extrapolation_equals_full_depth(deep_workload):
    from advisor.simulator import simulate

    cand = Candidate(**BASE)
    fast = simulate(deep_workload, cand, "cpu")
    full = simulate(deep_workload, cand, "cpu", layers=None)
    assert any("extrapolated" in n for n in fast.notes)
    assert fast.peak_bytes == pytest.approx(full.peak_bytes, rel=1e-4)
    for cat, n in full.breakdown.items():
        assert fast.breakdown[cat] == pytest.approx(n, rel=1e-3, abs=4096)


def test_cuda_path_rounds_and_adds_context(deep_workload, h100_target):
    from advisor.physics import context_bytes
    from advisor.simulator import simulate

    m = simulate(deep_workload, Candidate(**{**BASE, "precision": "bf16"}), h100_target)
    assert m.peak_bytes % 512 == 0
    assert m.reserved_bytes >= m.peak_bytes
    assert m.device_bytes == m.reserved_bytes + context_bytes("9.0")
    assert m.step_time_s and m.step_time_s > 0 and m.source.value == "simulate"


def test_allocator_replay_segments():
    from advisor.physics import replay, round_size

    assert round_size(1) == 512 and round_size(513) == 1024
    small = replay([(1, 100), (2, 100), (1, -100)], expandable_segments=False)
    assert small.allocated == 1024 and small.reserved == 2 * 2**20
    # 12 MiB fits the 17 MiB left in the first 20 MiB segment; 21 MiB gets its own segment rounded to 2 MiB
    big = replay([(1, 3 * 2**20), (2, 12 * 2**20), (3, 21 * 2**20 + 1)], expandable_segments=False)
    assert big.reserved == 20 * 2**20 + 22 * 2**20
    reuse = replay([(1, 3 * 2**20), (1, -3 * 2**20), (2, 3 * 2**20)], expandable_segments=False)
    assert reuse.reserved == 20 * 2**20


def test_modelled_kernels_are_noted_and_shrink_memory(deep_workload, h100_target):
    from advisor.simulator import simulate

    lora = Candidate(**{**BASE, "precision": "bf16", "use_lora": True, "weights_dtype": "bfloat16"})
    qlora = lora.replace(quantization="4bit")
    m_lora = simulate(deep_workload, lora, h100_target)
    m_q = simulate(deep_workload, qlora, h100_target)
    assert any("bitsandbytes" in n for n in m_q.notes)
    assert m_q.breakdown["parameters"] < m_lora.breakdown["parameters"]
    offload = Candidate(**{**BASE, "precision": "bf16", "activation_offloading": True})
    off = simulate(deep_workload, offload, h100_target)
    on = simulate(deep_workload, Candidate(**{**BASE, "precision": "bf16"}), h100_target)
    assert any("offloading" in n for n in off.notes)
    assert off.peak_bytes < on.peak_bytes
    fa = simulate(deep_workload, Candidate(**{**BASE, "precision": "bf16", "attn_implementation":
                                               "kernels-community/flash-attn2"}), h100_target)
    assert any("FlashAttention" in n for n in fa.notes)


def test_cli_simulate_json(tmp_path, tiny_model, capsys):
    from advisor.cli import main
    from advisor.emit import to_yaml

    (tmp_path / "config.json").write_text(json.dumps(dict(tiny_model.config)))
    run = tmp_path / "RUN.yaml"
    run.write_text(to_yaml(Candidate(**BASE), model_name_or_path=str(tmp_path / "config.json")))
    cfg = str(tmp_path / "config.json")
    rc = main(["simulate", "--model", cfg, "--config", str(run), "--gpu", "cpu", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    for key in ("status", "peak_bytes", "reserved_bytes", "device_bytes", "breakdown", "tokens_per_second", "source"):
        assert key in out
    assert out["source"] == "simulate" and out["peak_bytes"] > 0


def test_reserved_never_below_allocated_after_extrapolation(h100_target):
    """Qwen2.5-0.5B shape at TRL's defaults: linear extrapolation of reserved alone gave 8.57 GB < 9.03 GB."""
    from advisor.data import synthetic
    from advisor.profiles import resolve_model
    from advisor.simulator import simulate
    from advisor.space import Candidate
    from advisor.workload import Workload

    spec = resolve_model("Qwen/Qwen2.5-0.5B")
    wl = Workload(model=spec, gpu=h100_target, dataset=synthetic(spec.vocab_size, rows=256))
    m = simulate(wl, Candidate.trl_defaults())
    assert m.reserved_bytes >= m.peak_bytes
    assert m.device_bytes > m.reserved_bytes
