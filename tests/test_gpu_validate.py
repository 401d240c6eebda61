"""scripts/gpu_validate.py on the CPU: the dry run checks the matrix; the tiny CPU run takes the real code path
(probe + simulate side by side) and writes a measurement file that the profile checks accept."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_validate.py"


@pytest.fixture(scope="module")
def gv():
    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_validate"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_matrix_covers_the_issue(gv):
    matrix = gv.cases((2, 4), None)
    assert {c.batch for c in matrix} == {2, 4}
    fields = [c.candidate(1024) for c in matrix]
    assert any(not f.activation_checkpointing for f in fields) and any(f.activation_checkpointing for f in fields)
    assert any(f.use_lora for f in fields) and any(f.packing and not f.padding_free for f in fields)
    assert any(f.padding_free for f in fields)
    flash = [f for f in fields if f.attn_implementation.value == "kernels-community/flash-attn2"]
    assert any(f.packing and f.effective_padding_free for f in flash)
    assert any(f.padding_free and not f.packing and f.max_length is None for f in flash)
    assert any(f.activation_checkpointing and f.max_length and f.max_length >= 4096 for f in flash)  # a long run
    assert all(f.attn_implementation.value == "sdpa" for f in fields if f not in flash)


def test_dry_run_checks_every_candidate(gv, capsys):
    assert gv.main(["--dry-run", "--gpu", "H100-80GB"]) == 0
    out = capsys.readouterr().out
    assert "16 cases" in out and "Qwen/Qwen2.5-0.5B (24 layers)" in out and '"trl": "1.16' in out


def test_online_cases_take_vllm_only_where_it_imports(gv):
    assert gv.online_cases(None, vllm=False) == ["grpo-generate", "distillation-generate"]
    assert gv.online_cases(None, vllm=True) == list(gv.ONLINE_MATRIX)
    assert gv.online_cases((), vllm=True) == []  # --online with no name: none
    from advisor.profiles import resolve_gpu, resolve_model
    from advisor.trainers import get_trainer

    h100, qwen = resolve_gpu("H100-80GB"), resolve_model("Qwen/Qwen2.5-0.5B")
    for name in gv.ONLINE_MATRIX:  # every case is one TRL accepts (num_generations divides the generation batch)
        for batch in (1, 2, 4):
            assert get_trainer(gv.online_trainer(name)).problems(gv.online_candidate(name, batch), h100, qwen) == []


def test_cuda_without_gpu_is_a_usage_error(gv, monkeypatch):
    import advisor.profiles

    monkeypatch.setattr(advisor.profiles, "detect_gpu", lambda: None)
    assert gv.main(["--backend", "cuda"]) == 2


@pytest.mark.slow
def test_tiny_cpu_run_writes_a_valid_measurement(gv, tmp_path):
    out = tmp_path / "cpu.json"
    rc = gv.main(["--backend", "cpu", "--tiny", "--batch", "2", "--only", "full-ckpt", "lora-ckpt", "--steps", "1",
                  "--online", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1 and data["source"] == "scripts/gpu_validate.sh"
    assert data["versions"]["trl"] and data["date"]
    assert [r["case"] for r in data["rows"]] == ["full-ckpt", "lora-ckpt"]
    for row in data["rows"]:
        assert row["probe"]["status"] == "ok" and row["simulate"]["status"] == "ok"
        # on the CPU the simulator predicts the probe's allocator peak closely (the probe's steps see other rows)
        assert row["simulate_over_probe"]["peak_bytes"] == pytest.approx(1.0, abs=0.05)
