"""advisor baseline -> advisor check on a tiny local model: same config passes, memory-hungrier configs fail."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import TINY_QWEN2

from advisor.assertions import assert_peak_memory
from advisor.cli import main
from advisor.emit import to_yaml
from advisor.regress import check, load_baseline
from advisor.space import Candidate, Precision

BACKEND = "simulate"
BASE = Candidate(max_length=2048, per_device_train_batch_size=2, precision=Precision.FP32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-qwen2")
    (d / "config.json").write_text(json.dumps(TINY_QWEN2))
    return d


def _run_yaml(path, candidate: Candidate):
    path.write_text(to_yaml(candidate, model_name_or_path=None))
    return str(path)


def _record(directory, model_dir, backend: str) -> str:
    config = _run_yaml(directory / "RUN.yaml", BASE)
    out = directory / f"baseline-{backend}.json"
    rc = main(["baseline", "--model", str(model_dir), "--gpu", "cpu", "--config", config, "--backend", backend,
               "--out", str(out)])
    assert rc == 0
    return str(out)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, model_dir):
    """One simulate baseline shared by the module (each simulation of the tiny model costs seconds)."""
    return _record(tmp_path_factory.mktemp("baseline"), model_dir, BACKEND)


def test_baseline_file_holds_what_check_needs(recorded, model_dir):
    b = load_baseline(recorded)
    assert b.backend == BACKEND and b.source == BACKEND
    assert b.peak_bytes > 0 and b.breakdown
    assert b.workload.model == str(model_dir) and b.workload.gpu == "cpu" and b.workload.dataset is None
    assert b.candidate == BASE
    from advisor._versions import TRACKED

    assert set(b.versions) == set(TRACKED)  # the one list the study key uses too


def test_check_of_the_same_config_exits_0(recorded, capsys, tmp_path, monkeypatch):
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert main(["check", "--baseline", recorded]) == 0
    out = capsys.readouterr().out
    assert "within tolerance" in out and "peak_bytes" in out
    md = summary.read_text()
    assert "Peak-memory check: ok" in md and "| peak_bytes" in md


def test_checkpointing_off_exits_1_and_activations_grew(recorded, tmp_path, capsys):
    config = _run_yaml(tmp_path / "nockpt.yaml", BASE.replace(activation_checkpointing=False))
    assert main(["check", "--baseline", recorded, "--config", config]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out
    assert "activation_checkpointing True -> False" in out
    act = next(line for line in out.splitlines() if line.startswith("activations"))
    assert "grew" in act


def test_packing_with_doubled_max_length_exits_1(recorded, tmp_path, capsys):
    config = _run_yaml(tmp_path / "packed.yaml", BASE.replace(packing=True, max_length=2 * BASE.max_length))
    assert main(["check", "--baseline", recorded, "--config", config, "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["regressed"] is True
    assert "peak_bytes" in result["grown"]
    assert any(m != "peak_bytes" and m not in ("reserved_bytes", "device_bytes") for m in result["grown"])


def test_a_library_version_change_is_reported(recorded):
    b = load_baseline(recorded)
    old = dataclasses.replace(b, versions={**b.versions, "trl": "1.15.0"})
    result = check(old)
    assert not result.regressed
    assert [(v.package, v.was) for v in result.version_changes] == [("trl", "1.15.0")]
    from advisor.render import check_markdown, check_text

    assert "trl 1.15.0 -> " in check_text(result) and "trl 1.15.0 -> " in check_markdown(result)
    assert result.notes == ()  # the rebuilt workload has the recorded fingerprint


@pytest.mark.slow
def test_assert_peak_memory_passes_and_fails_with_the_table(model_dir, tmp_path):
    m = assert_peak_memory(BASE, model=str(model_dir), max_bytes=2**40, backend=BACKEND)
    assert m.ok and m.peak_bytes > 0
    config = _run_yaml(tmp_path / "RUN.yaml", BASE)
    with pytest.raises(AssertionError) as exc:
        assert_peak_memory(config, model=str(model_dir), max_bytes=m.device_bytes - 1, backend=BACKEND)
    msg = str(exc.value)
    assert "exceeds max_bytes" in msg and "device_bytes" in msg and "limit" in msg


def test_estimate_backend_round_trip(tmp_path, model_dir, capsys):
    """The closed-form backend works the same way (instant, coarser)."""
    baseline = _record(tmp_path, model_dir, "estimate")
    assert load_baseline(baseline).source == "estimate"
    assert main(["check", "--baseline", baseline]) == 0
    config = _run_yaml(tmp_path / "nockpt.yaml", BASE.replace(activation_checkpointing=False))
    assert main(["check", "--baseline", baseline, "--config", config, "--tolerance", "0.01"]) == 1
    assert "activations" in capsys.readouterr().out


@pytest.mark.slow
def test_cpu_probe_backend_records_a_real_measurement(tmp_path, model_dir):
    """The real-step backend: the baseline says it was measured, not predicted."""
    small = BASE.replace(max_length=128, per_device_train_batch_size=1)
    config = _run_yaml(tmp_path / "RUN.yaml", small)
    out = tmp_path / "cpu.json"
    assert main(["baseline", "--model", str(model_dir), "--gpu", "cpu", "--config", config, "--backend", "cpu",
                 "--out", str(out)]) == 0
    b = load_baseline(out)
    assert b.backend == "cpu" and b.source == "probe-cpu" and b.peak_bytes > 0


@pytest.mark.gpu
def test_cuda_probe_baseline_then_check(tmp_path, model_dir):
    config = _run_yaml(tmp_path / "RUN.yaml", BASE.replace(precision=Precision.BF16))
    out = tmp_path / "cuda.json"
    # no --gpu: the local GPU, through NVML
    assert main(["baseline", "--model", str(model_dir), "--config", config, "--backend", "cuda",
                 "--out", str(out)]) == 0
    assert load_baseline(out).source == "probe-cuda"
    assert main(["check", "--baseline", str(out), "--tolerance", "5%"]) == 0
