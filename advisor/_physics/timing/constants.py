"""The step-time model's terms and bases, and its constants resolved for one target (with fitted multipliers).

See the package docstring (advisor/_physics/timing/__init__.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    from ...profiles import PROFILES_DIR

    return PROFILES_DIR / "measurements" / "time_constants.json"


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
    op_s: float
    view_s: float
    sync_s: float
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

    def peak_for(self, dtype: Any) -> float:
        import torch

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


@lru_cache(maxsize=32)
def time_constants(gpu: GPUSpec) -> TimeConstants:
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
    op_us = float(h["op_us"] if cuda else cpu["op_us"])
    tiles = tuple((int(a), int(b), float(e)) for a, b, e in _by_arch(r["gemm"]["tiles"], gpu))
    return TimeConstants(
        cuda=cuda,
        sms=int(r["sms"].get(gpu.name, r["sms"]["default"])) if cuda else 1,
        tiles=tiles,
        gemm_eff=gemm_eff / fit.get(Term.MATMUL.value, 1.0),
        k_half=float(r["gemm"]["k_half"]),
        split_k_min_k=int(r["gemm"]["split_k_min_k"]),
        mem_bw=gpu.memory_bandwidth_gbs * 1e9 * mem_eff / fit.get(Term.MEMORY.value, 1.0),
        floor_s=float(r["kernel_floor_us"]["value"]) * 1e-6 if cuda else 0.0,
        op_s=op_us * 1e-6 * fit.get(Term.HOST.value, 1.0),
        view_s=float(h["view_us"]) * 1e-6 * fit.get(Term.HOST.value, 1.0),
        sync_s=float(h["sync_us"]) * 1e-6 if cuda else 0.0,
        micro_step_s=float(h["micro_step_us"]) * 1e-6 * fit.get(Term.HOST.value, 1.0),
        collate_row_s=float(h["collate_row_us"]) * 1e-6,
        step_s=float(h["step_us"]) * 1e-6,
        attn_block=int(a["block"]),
        attn_fwd_eff=float(_by_arch(a["forward_efficiency"], gpu)) / fit.get(Term.ATTENTION.value, 1.0),
        attn_bwd_eff=float(_by_arch(a["backward_efficiency"], gpu)) / fit.get(Term.ATTENTION.value, 1.0),
        attn_bwd_factor=float(a["backward_flops_factor"]),
        pcie_bw=float(r["pcie_bandwidth_gbs"]["value"]) * 1e9,
        peak=peak,
        raw=r,
        fitted=bool(fit),
    )


def fitted_multipliers(gpu_name: str) -> dict[str, float]:
    """Multipliers per term fitted by scripts/gpu_validate.py on this GPU (measured / predicted), if it ran."""
    import re

    from ...profiles import PROFILES_DIR

    path = PROFILES_DIR / "measurements" / (re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") + ".json")
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return {}
    fit = data.get("fitted_time_constants") or {}
    return {k: float(v) for k, v in (fit.get("multipliers") or {}).items() if v and float(v) > 0}

