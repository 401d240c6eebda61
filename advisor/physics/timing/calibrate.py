"""The target's timing constants measured where it runs, and read back where they were measured (the package
docstring: "Calibration").

`scripts/gpu_calibrate.py` runs these measurements on a device (a GPU, or this host's CPU with `--device cpu`) and
writes each as it finishes (a crash loses only the measurement running); the step-time model reads the file when it
is there: a GPU's from `profiles/measurements/<gpu>.json` ("calibration"), this host's CPU from the advisor's cache
(`$ADVISOR_CACHE_DIR/calibration/cpu-<host>.json`, since the CPU target is the machine itself). Each value is a
measurement, never a constant fitted to a case:

- `gemm_<dtype>_flops`: the achieved FLOP/s of a large square GEMM; `gemm_<dtype>_<m>x<n>x<k>_s` the time of each
  shape measured (small shapes show the GEMM's floor, `gemm_floor_s`: a tiny GEMM less a tiny elementwise op);
- `memory_bandwidth`: bytes/s of a large elementwise op (its read and its write, into an output allocated before);
  on a CPU also `cache_bandwidth` over a working set of `cache_bytes` (what a small model's ops move);
- `attention_<fwd|bwd>_eff`: scaled-dot-product attention's causal FLOPs over its time, relative to the GEMM rate;
  `attention_<fwd|bwd>_floor_s` a tiny call's time past an op's dispatch (the CPU kernel's fixed cost);
- `host_<class>_s`: the host's cost per op on this device (advisor/physics/timing/host.py's microbenchmark with
  the model on it: on CUDA the launch included), `launch_s` / `sync_s`: an empty kernel's host time back to back, a
  sync's round trip;
- `decode_token_s`: one decode step of transformers' generate (a 2-layer Llama at batch 1), for the record.

`ADVISOR_CALIBRATION=off` ignores every calibration file (the tests: every prediction from the shipped constants).
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ... import profiles
from ..._files import cache_dir, write_atomic
from .host import measure

OFF_ENV = "ADVISOR_CALIBRATION"
CACHE_BYTES = 1 << 20  # the working set of the in-cache bandwidth (a small model's tensors on a CPU)
GEMM_SHAPES = ((16, 64, 64), (256, 256, 256), (1024, 1024, 1024), (4096, 4096, 4096))
BANDWIDTH_BYTES = 1 << 27


def _sync(device: str) -> None:
    import torch  # lazy: loads torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str, *, repeats: int = 20, warmup: int = 3) -> float:
    """The median seconds of `fn()` on `device` (synchronized around each call on CUDA)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_s(device: str, dtype: Any, m: int, n: int, k: int) -> float:
    import torch  # lazy: loads torch

    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    flops = 2.0 * m * n * k
    return timed(lambda: a @ b, device, repeats=max(3, min(50, int(2e10 / flops))))


def elementwise_s(device: str, numel: int) -> float:
    """An elementwise op over `numel` floats into an output already allocated (as a training step's reuse the
    allocator's cached blocks: a fresh large allocation would time the page faults)."""
    import torch  # lazy: loads torch

    x = torch.randn(numel, device=device)
    y = torch.empty_like(x)
    return timed(lambda: torch.mul(x, 2.0, out=y), device, repeats=10)


def attention_s(device: str, dtype: Any, heads: int = 8, seq: int = 512, head_dim: int = 64) -> tuple[float, ...]:
    """(forward, backward) seconds of causal sdpa on (1, heads, seq, head_dim)."""
    import torch  # lazy: loads torch
    import torch.nn.functional as F  # lazy: loads torch

    q, k, v = (torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, repeats=10)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.ones_like(out)

    def both():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o, (q, k, v), grad)

    total = timed(both, device, repeats=10)
    return fwd, max(total - fwd, 1e-9)


def launch_and_sync_s(device: str) -> tuple[float, float]:
    """CUDA: (host seconds per back-to-back launch of a tiny kernel, seconds of a sync after one)."""
    import torch  # lazy: loads torch

    x = torch.zeros(1, device=device)
    n = 2000
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    launch = (time.perf_counter() - t0) / n
    _sync(device)
    sync = timed(lambda: (x.add_(1.0), _sync(device)), device, repeats=200) - launch
    return launch, max(sync, 0.0)


def decode_token_s(device: str, tokens: int = 32) -> float:
    """Seconds per decoded token of transformers' eager generate (greedy, batch 1) on a 2-layer Llama."""
    import torch  # lazy: loads torch
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: loads transformers

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512)
    model = LlamaForCausalLM(config).to(device).eval()
    ids = torch.randint(3, 1024, (1, 8), device=device)

    def run(n: int) -> None:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    # the two lengths interleaved and each one's fastest run taken, so a load that comes and goes on the host cannot
    # make the longer generate read faster than the shorter one (a negative per-token time)
    short, long_ = [], []
    run(2)
    run(tokens + 2)
    for _ in range(5):
        short.append(timed(lambda: run(2), device, repeats=1, warmup=0))
        long_.append(timed(lambda: run(tokens + 2), device, repeats=1, warmup=0))
    return max(0.0, (min(long_) - min(short)) / tokens)


def measurements(device: str, quick: bool = False) -> list[tuple[str, Callable[[], Any]]]:
    """Each calibration row's name and how it is measured on `device`, in the order they run (`quick`: the small
    sizes only, seconds on a CPU; what a test runs)."""
    import torch  # lazy: loads torch


    rows: list[tuple[str, Callable[[], Any]]] = []
    dtypes = [("fp32", torch.float32), ("bf16", torch.bfloat16)]
    largest = 256 if quick else (1024 if device == "cpu" else 4096)  # a 4096 cube takes minutes on a CPU
    for name, dtype in dtypes:
        for m, n, k in GEMM_SHAPES:
            if m <= largest:
                rows.append((f"gemm_{name}_{m}x{n}x{k}_s",
                             lambda d=dtype, m=m, n=n, k=k: gemm_s(device, d, m, n, k)))
    rows.append(("elementwise_tiny_s", lambda: elementwise_s(device, 16)))
    big = BANDWIDTH_BYTES // (32 if quick else 1)
    rows.append(("elementwise_large_s", lambda: (elementwise_s(device, big // 4), big)))
    if device == "cpu":
        rows.append(("elementwise_cached_s", lambda: (elementwise_s(device, CACHE_BYTES // 8), CACHE_BYTES // 2)))
    attn_dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rows.append(("attention_fwd_bwd_s", lambda: attention_s(device, attn_dtype, seq=128 if quick else 512)
                 + (128 if quick else 512,)))
    rows.append(("attention_small_fwd_bwd_s", lambda: attention_s(device, attn_dtype, heads=2, seq=16, head_dim=16)))
    rows.append(("host", lambda: _host_row(measure(repeats=12 if quick else 60, device=device))))
    if device.startswith("cuda"):
        rows.append(("launch_sync_s", lambda: launch_and_sync_s(device)))
    rows.append(("decode_token_s", lambda: decode_token_s(device, tokens=4 if quick else 32)))
    return rows


def _host_row(cost: Any) -> dict[str, Any]:
    return {"nograd_s": cost.nograd_s, "grad_s": cost.grad_s, "backward_s": cost.backward_s, "loop_s": cost.loop_s,
            "host": cost.host, "versions": cost.versions}


def derived(rows: dict[str, Any]) -> dict[str, float]:
    """The step-time model's constants from the measured rows (those measured so far)."""
    out: dict[str, float] = {}
    for name in ("fp32", "bf16"):
        cubes = [(m, rows[f"gemm_{name}_{m}x{n}x{k}_s"]) for m, n, k in GEMM_SHAPES
                 if m == n == k and f"gemm_{name}_{m}x{n}x{k}_s" in rows]
        if cubes:
            m, t = max(cubes)
            out[f"gemm_{name}_flops"] = 2.0 * m ** 3 / t
    tiny = rows.get("gemm_fp32_16x64x64_s")
    if tiny is not None and "elementwise_tiny_s" in rows:
        out["gemm_floor_s"] = max(0.0, tiny - rows["elementwise_tiny_s"])
    if "elementwise_large_s" in rows:
        seconds, nbytes = rows["elementwise_large_s"]
        out["memory_bandwidth"] = 2.0 * nbytes / seconds
    if "elementwise_cached_s" in rows:  # read + write of half the working set each
        seconds, nbytes = rows["elementwise_cached_s"]
        out["cache_bandwidth"] = 2.0 * nbytes / seconds
        out["cache_bytes"] = float(CACHE_BYTES)
    if "attention_fwd_bwd_s" in rows and out:
        fwd, bwd, seq = rows["attention_fwd_bwd_s"]
        rate = out.get("gemm_bf16_flops" if "gemm_bf16_flops" in out and rows.get("device", "cpu") != "cpu"
                       else "gemm_fp32_flops", 0.0)
        flops = 4.0 * 8 * seq * seq * 64 / 2  # 8 heads of 64, causal: half the scores
        if rate > 0:
            out["attention_fwd_eff"] = flops / (fwd * rate)
            out["attention_bwd_eff"] = 2.5 * flops / (bwd * rate)
    if "attention_small_fwd_bwd_s" in rows and "elementwise_tiny_s" in rows:  # a call's floor past its dispatch
        fwd, bwd = rows["attention_small_fwd_bwd_s"][:2]
        out["attention_fwd_floor_s"] = max(0.0, fwd - rows["elementwise_tiny_s"])
        out["attention_bwd_floor_s"] = max(0.0, bwd - 3 * rows["elementwise_tiny_s"])
    if "launch_sync_s" in rows:
        out["launch_s"], out["sync_s"] = rows["launch_sync_s"]
    if "decode_token_s" in rows:
        out["decode_token_s"] = rows["decode_token_s"]
    return out


# ---- where a calibration lives --------------------------------------------------------------------------------------

def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def cpu_path() -> Path:
    return cache_dir() / "calibration" / f"cpu-{_slug(socket.gethostname())}.json"


def gpu_path(gpu_name: str) -> Path:
    return profiles.PROFILES_DIR / "measurements" / f"{_slug(gpu_name)}.json"


def path_for(gpu: Any) -> Path:
    return gpu_path(gpu.name) if gpu.is_cuda else cpu_path()


def read(gpu: Any) -> dict[str, Any] | None:
    """The calibration block of `gpu` (a GPUSpec) where one was measured: {"constants", "rows", "measured", "host",
    ...}; None where none is (or ADVISOR_CALIBRATION=off)."""
    if os.environ.get(OFF_ENV, "").lower() in ("off", "0", "false", "no"):
        return None
    return read_path(path_for(gpu))


def read_path(path: Path) -> dict[str, Any] | None:
    """The calibration block of the file at `path`, None where it has none."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    block = data.get("calibration") if isinstance(data, dict) else None
    if not isinstance(block, dict) or not block.get("constants"):
        return None
    return block


def write_row(path: Path, device_info: dict[str, Any], name: str, value: Any) -> None:
    """Add one measured row to the calibration block of `path` (the file's other keys kept), with the constants
    derived so far: a later crash loses only what was not measured yet."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    block = data.get("calibration") or {}
    block.update(device_info)
    rows = dict(block.get("rows") or {})
    rows[name] = value
    block["rows"] = rows
    block["constants"] = derived({**rows, "device": device_info.get("device", "cpu")})
    data["calibration"] = block
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=1) + "\n")


def label(block: dict[str, Any] | None) -> str:
    if not block:
        return "uncalibrated"
    return f"calibrated on {block.get('measured', '?')}, {block.get('host', '?')}"
