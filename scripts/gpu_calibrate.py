"""Measure the step-time model's constants on a device and write them where the model reads them.

  python scripts/gpu_calibrate.py                        # the visible GPU: profiles/measurements/<its profile>.json
  python scripts/gpu_calibrate.py --gpu H200             # name the profile (else from the device's name)
  python scripts/gpu_calibrate.py --device cpu   # this host: $ADVISOR_CACHE_DIR/calibration/cpu-<host>.json
  python scripts/gpu_calibrate.py --out some.json        # anywhere else

What it measures (advisor/physics/timing/calibrate.py, one row at a time, each written to the file as soon as it
finishes, so a crash or a timeout keeps what was measured): GEMMs by shape and dtype (the achieved rate, and a tiny
one's floor), the bandwidth of a large elementwise op, sdpa's forward and backward, the host's cost per op with the
model on the device (the microbenchmark of advisor/physics/timing/host.py: on CUDA the launch is in it), on CUDA a
launch's and a sync's host time, and one decode loop of transformers' generate. The file's "calibration" block holds
the rows, the constants derived from them ("constants"), the date, the host and the versions; the step-time model
reads it when present (`advisor simulate` then says "calibrated on <date>, <host>"). Other keys of the file (e.g.
scripts/gpu_validate.py's) are kept.

Importable: `calibrate(device, out=None, gpu=None, echo=print) -> dict` runs the same and returns the block.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _profile_name(device: str) -> str:
    """The GPU profile whose name the visible device has (profiles/gpus/*.yaml nvml_names), else the device's name."""
    import torch

    from advisor.profiles import resolve_gpu

    name = torch.cuda.get_device_name(torch.device(device))
    try:
        return resolve_gpu(name).name
    except Exception:  # no profile lists it: the device's own name names the file
        return name


def calibrate(device: str = "cuda", *, out: str | Path | None = None, gpu: str | None = None,
              echo: Callable[[str], None] = print, quick: bool = False) -> dict[str, Any]:
    """Measure every row on `device` ("cuda", "cuda:N" or "cpu"), writing each to `out` as it finishes (`quick`: the
    small sizes only)."""
    import platform

    import torch
    import transformers

    from advisor.physics import calibration_path, calibration_rows, host_name, read_calibration, write_calibration_row

    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible here; run on the GPU machine, or --device cpu")
    name = gpu or (_profile_name(device) if cuda else "cpu")
    if out is None:
        from advisor.profiles import resolve_gpu
        from advisor.workload import GPUSpec

        spec = resolve_gpu("cpu") if not cuda else GPUSpec(
            name=name, kind="cuda", memory_bytes=1, bf16_tflops=1, fp16_tflops=1, fp32_tflops=1,
            memory_bandwidth_gbs=1, supports_bf16=True, supports_flash_attention=True)
        out = calibration_path(spec)
    out = Path(out)
    info = {"device": "cuda" if cuda else "cpu", "gpu": name, "host": host_name(),
            "measured": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(),
            "versions": f"python {platform.python_version()}, torch {torch.__version__}, "
                        f"transformers {transformers.__version__}"}
    if cuda:
        info["device_name"] = torch.cuda.get_device_name(torch.device(device))
    echo(f"calibrating {info.get('device_name', 'the CPU')} on {info['host']} into {out}")
    for row, measure in calibration_rows(device, quick):
        started = time.perf_counter()
        value = measure()
        write_calibration_row(out, info, row, value)
        echo(f"  {row:<32} {_show(value):<40} ({time.perf_counter() - started:.1f} s)")
    block = read_calibration(out)
    for key, value in sorted((block or {}).get("constants", {}).items()):
        echo(f"  -> {key:<28} {value:.6g}")
    return block or {}


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(f"{v:.6g}" for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {v:.3g}" for k, v in value.items() if isinstance(v, float))
    return str(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--gpu", help="the GPU profile the file is named for (default: the device's profile)")
    p.add_argument("--out", help="the file to write (default: where the step-time model reads it)")
    p.add_argument("--quick", action="store_true", help="the small sizes only (a check of the script, seconds)")
    a = p.parse_args(argv)
    calibrate(a.device, out=a.out, gpu=a.gpu, quick=a.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
