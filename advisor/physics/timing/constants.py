"""The step-time model's terms and bases, and its constants resolved for one target (with fitted multipliers).

See the package docstring (advisor/physics/timing/__init__.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import profiles
from .calibrate import gpu_path, label, read
from .host import ENV, HostCost, OpClass, host_cost

if TYPE_CHECKING:
    from ...workload import GPUSpec


class Term(str, Enum):
    """The parts of a step's time (seconds per optimizer step in a Measurement's `time_breakdown`)."""

    MATMUL = "matmul"
    ATTENTION = "attention"
    MEMORY = "memory_bound"
    LM_HEAD = "lm_head"
    DEQUANT = "dequantization"
    OPTIMIZER = "optimizer"
    OFFLOAD = "offload_copies"
    HOST = "launch_host"


class Basis(IntEnum):
    """What a part of the micro-step's device time scales with."""

    TOKENS = 0  # positions the device computes (padding included)
    TRAINED = 1  # labelled positions (the CUDA LM head's compact rows)
    ATTENTION = 2  # attention tiles (see attention_units)
    FIXED = 3  # once per micro-step


class AttentionKind(str, Enum):
    CAUSAL = "causal"  # FlashAttention (varlen per sequence) or sdpa without a mask: the causal tiles
    FULL = "full"  # sdpa with a mask: every tile of the row
    DENSE = "dense"  # eager: the scores materialised, rows x seq^2 elements


_TERMS = tuple(Term)
_NT, _NB = len(_TERMS), len(Basis)


# ---- constants -------------------------------------------------------------------------------------------------


def _path() -> Path:
    return profiles.PROFILES_DIR / "measurements" / "time_constants.json"


@lru_cache(maxsize=1)
def raw_constants() -> dict[str, Any]:
    return json.loads(_path().read_text())


@dataclass(frozen=True)
class TimeConstants:
    """The constants of the model resolved for one target (fitted multipliers applied where a GPU measured them)."""

    cuda: bool
    sms: int
    tiles: tuple[tuple[int, int, float], ...]  # (rows, columns, efficiency relative to the largest tile)
    gemm_eff: float
    k_half: float
    split_k_min_k: int
    mem_bw: float  # bytes/s achievable
    floor_s: float
    host: HostCost  # this host's cost per dispatched op (host.py), the fitted host multiplier applied
    launch_s: float  # CUDA: the host time of one kernel launch (cudaLaunchKernel); 0 on the CPU
    host_scale: float  # the fitted multiplier of the host's times (1.0 unfitted)
    sync_s: float
    gemm_floor_s: float  # a GEMM's minimum time where measured (the CPU's BLAS call), 0 where the kernel floor rules
    attn_floor_s: tuple[float, float]  # an attention call's minimum (forward, backward) time where measured
    cache_bw: float  # bytes/s of an op whose bytes fit `cache_bytes` (a CPU's caches, where measured), else 0
    cache_bytes: float
    micro_step_s: float
    collate_row_s: float
    step_s: float
    attn_block: int
    attn_fwd_eff: float
    attn_bwd_eff: float
    attn_bwd_factor: float
    pcie_bw: float
    peak: dict[str, float]  # dtype name -> FLOP/s
    raw: dict[str, Any] = field(repr=False, hash=False, compare=False, default_factory=dict)
    fitted: bool = False
    calibration: str = "uncalibrated"  # "calibrated on <date>, <host>" where measured constants were read

    def op_host_s(self, cls: OpClass, kernel: bool) -> float:
        """Host seconds of one dispatched op of class `cls` (a kernel launch on CUDA pays the launch too)."""
        return self.host.per_op(cls) * self.host_scale + (self.launch_s if kernel else 0.0)

    def issue_s(self, cls: OpClass, ops: float, kernels: float) -> float:
        """Host seconds of `ops` ops of class `cls`, `kernels` of them launching a kernel."""
        return ops * self.host.per_op(cls) * self.host_scale + kernels * self.launch_s

    @property
    def op_s(self) -> float:
        """One op launched from torch's own Python loop over tensors (the for-loop optimizer, clipping)."""
        return self.host.loop_s * self.host_scale + self.launch_s

    def peak_for(self, dtype: Any) -> float:
        import torch  # lazy: loads torch

        name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
        return self.peak[name]


def _arch_key(gpu: GPUSpec) -> str:
    cc = gpu.compute_capability or ""
    return "sm" + cc.replace(".", "") if cc else "default"


def _by_arch(block: Any, gpu: GPUSpec) -> Any:
    if isinstance(block, dict):
        key = _arch_key(gpu)
        return block.get(key, block.get(key[:4], block["default"]))
    return block


def time_constants(gpu: GPUSpec) -> TimeConstants:
    """The constants for `gpu`: its calibration where one was measured (calibrate.py), with the host's cost per op
    (pinned by ADVISOR_HOST_COST, else the calibration's own, else this host's microbenchmark: host.py)."""
    block = read(gpu)
    host = None
    if block and not os.environ.get(ENV) and isinstance(block.get("rows", {}).get("host"), dict):
        row = block["rows"]["host"]
        host = HostCost(nograd_s=float(row["nograd_s"]), grad_s=float(row["grad_s"]),
                        backward_s=float(row["backward_s"]), loop_s=float(row["loop_s"]),
                        host=str(row.get("host", block.get("host", "?"))), measured=str(block.get("measured", "")),
                        versions=str(row.get("versions", "")), source="microbenchmark")
    return _time_constants(gpu, host or host_cost(), json.dumps(block, sort_keys=True) if block else "")


def _cache_clear() -> None:
    _time_constants.cache_clear()


time_constants.cache_clear = _cache_clear  # type: ignore[attr-defined]


@lru_cache(maxsize=32)
def _time_constants(gpu: GPUSpec, host: HostCost, calibration: str) -> TimeConstants:
    r = raw_constants()
    fit = fitted_multipliers(gpu.name)
    cuda = gpu.is_cuda
    cpu = r["cpu"]
    h = r["host"]
    a = r["attention"]
    peak = {"bf16": gpu.bf16_tflops * 1e12, "fp16": gpu.fp16_tflops * 1e12, "fp32": gpu.fp32_tflops * 1e12}
    for k in ("bf16", "fp16"):
        if peak[k] <= 0:
            peak[k] = peak["fp32"]
    mem_eff = float(r["memory"]["efficiency"] if cuda else cpu["memory_efficiency"])
    gemm_eff = float(r["gemm"]["efficiency"] if cuda else cpu["matmul_efficiency"])
    tiles = tuple((int(a), int(b), float(e)) for a, b, e in _by_arch(r["gemm"]["tiles"], gpu))
    attn_fwd, attn_bwd = float(_by_arch(a["forward_efficiency"], gpu)), float(_by_arch(a["backward_efficiency"], gpu))
    launch_s = float(_by_arch(h["cuda_launch_us"], gpu)) * 1e-6 if cuda else 0.0
    sync_s = float(h["sync_us"]) * 1e-6 if cuda else 0.0
    gemm_floor_s = 0.0
    attn_floor = (0.0, 0.0)
    cache_bw = cache_bytes = 0.0
    attn_block = int(a["block"])
    block = json.loads(calibration) if calibration else None
    if block:  # measured where it runs (calibrate.py): every value it has replaces the shipped assumption
        c = block["constants"]
        rate = c.get("gemm_bf16_flops" if cuda else "gemm_fp32_flops")
        if cuda:
            if rate:
                gemm_eff = rate / peak["bf16"]
            if c.get("memory_bandwidth"):
                mem_eff = c["memory_bandwidth"] / (gpu.memory_bandwidth_gbs * 1e9)
            if "launch_s" in c and "host" in block.get("rows", {}):
                launch_s = 0.0  # the host's cost per op was measured on CUDA: the launch is in it
            sync_s = float(c.get("sync_s", sync_s))
        else:
            if rate:
                peak = {"fp32": rate, "bf16": c.get("gemm_bf16_flops", rate), "fp16": c.get("gemm_bf16_flops", rate)}
                gemm_eff = 1.0
            if c.get("memory_bandwidth"):
                mem_eff = c["memory_bandwidth"] / (gpu.memory_bandwidth_gbs * 1e9)
            gemm_floor_s = float(c.get("gemm_floor_s", 0.0))
            attn_floor = (float(c.get("attention_fwd_floor_s", 0.0)), float(c.get("attention_bwd_floor_s", 0.0)))
            cache_bw, cache_bytes = float(c.get("cache_bandwidth", 0.0)), float(c.get("cache_bytes", 0.0))
            attn_block = 1  # the CPU's sdpa has no 128-wide tiles to fill: every causal score is computed once
        if c.get("attention_fwd_eff"):
            attn_fwd = c["attention_fwd_eff"] * gemm_eff
            attn_bwd = c["attention_bwd_eff"] * gemm_eff
    return TimeConstants(
        cuda=cuda,
        sms=int(r["sms"].get(gpu.name, r["sms"]["default"])) if cuda else 1,
        tiles=tiles,
        gemm_eff=gemm_eff / fit.get(Term.MATMUL.value, 1.0),
        k_half=float(r["gemm"]["k_half"]),
        split_k_min_k=int(r["gemm"]["split_k_min_k"]),
        mem_bw=gpu.memory_bandwidth_gbs * 1e9 * mem_eff / fit.get(Term.MEMORY.value, 1.0),
        floor_s=float(r["kernel_floor_us"]["value"]) * 1e-6 if cuda else 0.0,
        host=host,
        launch_s=launch_s * fit.get(Term.HOST.value, 1.0),
        host_scale=fit.get(Term.HOST.value, 1.0),
        sync_s=sync_s,
        gemm_floor_s=gemm_floor_s,
        attn_floor_s=attn_floor,
        cache_bw=cache_bw,
        cache_bytes=cache_bytes,
        micro_step_s=float(h["micro_step_us"]) * 1e-6 * fit.get(Term.HOST.value, 1.0),
        collate_row_s=float(h["collate_row_us"]) * 1e-6,
        step_s=float(h["step_us"]) * 1e-6,
        attn_block=attn_block,
        attn_fwd_eff=attn_fwd / fit.get(Term.ATTENTION.value, 1.0),
        attn_bwd_eff=attn_bwd / fit.get(Term.ATTENTION.value, 1.0),
        attn_bwd_factor=float(a["backward_flops_factor"]),
        pcie_bw=float(r["pcie_bandwidth_gbs"]["value"]) * 1e9,
        peak=peak,
        raw=r,
        fitted=bool(fit),
        calibration=_label(block),
    )


def _label(block: dict | None) -> str:
    return label(block)


def fitted_multipliers(gpu_name: str) -> dict[str, float]:
    """Multipliers per term fitted by scripts/gpu_validate.py on this GPU (measured / predicted), if it ran."""
    path = gpu_path(gpu_name)
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return {}
    fit = data.get("fitted_time_constants") or {}
    return {k: float(v) for k, v in (fit.get("multipliers") or {}).items() if v and float(v) > 0}

