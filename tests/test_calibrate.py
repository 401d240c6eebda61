"""scripts/gpu_calibrate.py: the step-time model's constants measured on a device, written row by row, read back by the
model ("calibrated on <date>, <host>"). Run here on the CPU (`--device cpu`, the small sizes): no GPU is needed to
check that every row is written as it finishes, that a crash keeps the rows before it, and that the model reads them.
No wall-clock assertion: the rows' values are whatever this machine measured; what is checked is where they go."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared machine's other processes would stall a second BLAS thread's barrier
    yield
    torch.set_num_threads(threads)


def test_calibrating_the_cpu_writes_each_row_and_the_model_reads_them(tmp_path, monkeypatch, one_thread):
    import gpu_calibrate

    from advisor.physics import calibration_path, time_constants
    from advisor.profiles import resolve_gpu

    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path))
    cpu = resolve_gpu("cpu")
    out = calibration_path(cpu)
    assert str(out).startswith(str(tmp_path))  # the CPU target is this host: its calibration lives in the cache
    lines: list[str] = []
    block = gpu_calibrate.calibrate("cpu", quick=True, echo=lines.append)
    data = json.loads(out.read_text())["calibration"]
    assert data == block and data["device"] == "cpu" and data["measured"] and data["host"]
    rows = data["rows"]
    for name in ("gemm_fp32_16x64x64_s", "gemm_fp32_256x256x256_s", "elementwise_large_s", "attention_fwd_bwd_s",
                 "host", "decode_token_s"):
        assert name in rows and any(line.strip().startswith(name) for line in lines), name
    c = data["constants"]
    assert c["gemm_fp32_flops"] == pytest.approx(2 * 256 ** 3 / rows["gemm_fp32_256x256x256_s"])
    assert c["memory_bandwidth"] > 0 and c["attention_fwd_eff"] > 0
    # the model reads it (the tests' ADVISOR_CALIBRATION=off lifted): the CPU's rate is the one measured, the host's
    # cost per op the calibration's (unless pinned), and every prediction says so
    monkeypatch.setenv("ADVISOR_CALIBRATION", "on")
    monkeypatch.delenv("ADVISOR_HOST_COST")
    time_constants.cache_clear()
    try:
        tc = time_constants(cpu)
        assert tc.calibration == f"calibrated on {data['measured']}, {data['host']}"
        assert tc.peak["fp32"] == pytest.approx(c["gemm_fp32_flops"])
        assert tc.host.grad_s == pytest.approx(rows["host"]["grad_s"])
    finally:
        time_constants.cache_clear()
    monkeypatch.setenv("ADVISOR_CALIBRATION", "off")
    time_constants.cache_clear()
    assert time_constants(cpu).calibration == "uncalibrated"


def test_a_crash_keeps_the_rows_measured_before_it(tmp_path, monkeypatch, one_thread):
    import gpu_calibrate

    import advisor.physics as costs

    real = costs.calibration_rows

    def rows(device, quick=False):
        out = real(device, quick)[:3]
        return [*out, ("boom", lambda: 1 / 0)]

    monkeypatch.setattr(costs, "calibration_rows", rows)
    path = tmp_path / "h200.json"
    path.write_text(json.dumps({"fitted_time_constants": {"multipliers": {"matmul": 1.1}}}))  # another script's keys
    with pytest.raises(ZeroDivisionError):
        gpu_calibrate.calibrate("cpu", out=path, quick=True, echo=lambda _: None)
    data = json.loads(path.read_text())
    assert list(data["calibration"]["rows"]) == [name for name, _ in real("cpu", True)[:3]]
    assert data["fitted_time_constants"] == {"multipliers": {"matmul": 1.1}}  # kept


def test_no_cuda_device_is_named_with_the_fix():
    import gpu_calibrate

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(SystemExit, match="--device cuda.*--device cpu"):
        gpu_calibrate.calibrate("cuda", echo=lambda _: None)
