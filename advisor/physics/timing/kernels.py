"""The kernels' device time: GEMMs (roofline with wave quantisation), memory-bound ops, attention tiles,
dequantisation, the peak FLOP/s, activation offloading's copies (the package docstring: "Kernels")."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .constants import AttentionKind, TimeConstants

if TYPE_CHECKING:
    from ...workload import GPUSpec


def gemm_s(m: int, n: int, k: int, itemsize: int, peak: float, tc: TimeConstants, batch: int = 1) -> float:
    """One (batched) GEMM C[m,n] = A[m,k] B[k,n]: roofline with wave quantisation (the package docstring).

    Like cuBLAS' heuristics, the fastest of the threadblock tiles is taken; a smaller tile reuses less data, so it
    runs at a lower fraction of the peak (the tile table's relative efficiency)."""
    if m <= 0 or n <= 0 or k <= 0:
        return tc.floor_s
    flops = 2.0 * m * n * k * batch
    if not tc.cuda:
        compute = flops / (peak * tc.gemm_eff)
        return max(compute, memory_s((m * k + k * n + m * n) * batch * itemsize, tc), tc.gemm_floor_s)
    best = math.inf
    for tm, tn, rel in tc.tiles:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        split = 1
        if tiles < tc.sms and k >= 2 * tc.split_k_min_k:
            split = max(1, min(tc.sms // tiles, k // tc.split_k_min_k))
        waves = math.ceil(tiles * split / tc.sms)
        util = (m * n * batch * split) / (waves * tc.sms * tm * tn)
        kk = k / split
        compute = flops / (peak * tc.gemm_eff * rel * util * kk / (kk + tc.k_half))
        nbytes = (m * k + k * n + m * n * (2 * split - 1)) * batch * itemsize
        best = min(best, max(compute, nbytes / tc.mem_bw))
    return max(best, tc.floor_s)


def memory_s(nbytes: float, tc: TimeConstants, kernels: int = 1) -> float:
    """Bytes over the bandwidth (a CPU's cache bandwidth where they fit its measured working set), never under the
    kernels' floor."""
    bw = tc.cache_bw if tc.cache_bw and nbytes / max(kernels, 1) <= tc.cache_bytes else tc.mem_bw
    return max(nbytes / bw, kernels * tc.floor_s)


def causal_tiles(s: np.ndarray | int, block: int) -> np.ndarray | int:
    n = -(-np.asarray(s) // block)
    return n * (n + 1) // 2


def full_tiles(s: np.ndarray | int, block: int) -> np.ndarray | int:
    n = -(-np.asarray(s) // block)
    return n * n


def attention_tile_s(heads: int, head_dim: int, peak: float, tc: TimeConstants, backward: bool) -> float:
    """Seconds per 128x128 query x key tile of one attention call over `heads` heads."""
    b = tc.attn_block
    flops = 4.0 * b * b * head_dim * heads
    if backward:
        return flops * tc.attn_bwd_factor / (peak * tc.attn_bwd_eff)
    return flops / (peak * tc.attn_fwd_eff)


def attention_units(kind: AttentionKind, sequences: np.ndarray, rows: int, seq: int, block: int) -> float:
    """Tiles (or score elements) one attention call computes on a micro-batch (the package docstring)."""
    if kind is AttentionKind.CAUSAL:
        return float(np.sum(causal_tiles(sequences, block)))
    if kind is AttentionKind.FULL:
        return float(rows * full_tiles(seq, block))
    return float(rows) * seq * seq


def attention_kind(attn: str, masked: bool) -> AttentionKind:
    """FlashAttention: causal per sequence always (varlen unpads); sdpa: full tiles when a mask is passed
    (padding, or a packed row's block-diagonal mask), causal otherwise; eager: dense scores."""
    if "flash" in attn:
        return AttentionKind.CAUSAL
    if attn == "eager":
        return AttentionKind.DENSE
    return AttentionKind.FULL if masked else AttentionKind.CAUSAL


def dequant_s(numel: int, quantization: str | None, tc: TimeConstants) -> float:
    d = tc.raw["dequantization"]
    per = float(d["nf4_bytes_per_weight"] if quantization == "4bit" else d["int8_bytes_per_weight"])
    return memory_s(numel * (per + 2.0), tc)


def peak_flops(gpu: GPUSpec, precision: str) -> float:
    """The dense peak the MFU is quoted against: bf16/fp16 tensor cores under mixed precision, else fp32."""
    tflops = {"bf16": gpu.bf16_tflops, "fp16": gpu.fp16_tflops}.get(precision, gpu.fp32_tflops)
    return (tflops if tflops > 0 else gpu.fp32_tflops) * 1e12


def offload_copy_s_per_token(activation_bytes: float, tokens: float, tc: TimeConstants) -> float:
    """Saved activations go to pinned host memory in the forward and come back in the backward, on a side stream."""
    return 2.0 * activation_bytes / tc.pcie_bw / max(tokens, 1.0)
