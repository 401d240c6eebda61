"""The step-time model: what one optimizer step of a candidate costs on the target, by term.

Kernels (device time). Every aten op of the fake run's micro-step is costed as the kernel a GPU runs for it:
- matmul (mm/addmm/bmm/baddbmm): a roofline per GEMM with wave quantisation. The output is cut into tiles
  (128x128, 128x256 on Hopper); the tiles run in waves of one tile per SM; the compute efficiency is the useful
  area over the provisioned area of all waves times K / (K + k_half), with split-K when the output has fewer
  tiles than SMs. The time is max(FLOPs / (peak x gemm_efficiency x that), bytes / (bandwidth x memory
  efficiency)), never under one kernel's floor. So a 64-row GEMM, a rank-16 LoRA product or a skinny weight
  gradient is slow or memory-bound where a 16k-row one runs near the cuBLAS efficiency.
- attention: FlashAttention and sdpa cost per 128x128 tile of query x key a sequence really computes:
  a causal sequence of s tokens n(n+1)/2 tiles (n = ceil(s / 128)); FlashAttention's varlen kernel the sum of
  those per-sequence terms (`_flash_attention_forward/backward` with `cu_seqlens`, lengths from the batch's
  `position_ids`); sdpa with a mask (padding, or the block-diagonal mask of a packed row) the whole row squared,
  n^2 tiles, no causal skip. Eager attention materialises the scores: its ops with a (seq, seq) tensor are
  costed as the kernels they are (GEMMs, softmax) and scale with rows x seq^2.
- memory-bound ops (everything else): bytes read and written over the bandwidth, never under the floor.
- TRL's fused LM head (CUDA): its tile GEMMs as GEMMs; its Triton fold kernels (invisible to the fake run,
  they allocate nothing) as 1.5 passes over each logits tile (one read forward, a read and a write backward).
- bitsandbytes dequantisation (QLoRA): every GEMM that reads a frozen quantized weight (forward, backward's
  grad-input, the checkpointed recompute) first dequantizes it: 4-bit codes + absmax read, 16-bit weight written.

Host and overlap. Eager PyTorch spends CPU time on every op (Python, autograd, dispatcher, launch); the GPU runs
the queue asynchronously, so a micro-step takes max(host, device): a small model, short rows or a micro-batch
of 1 is host-bound. The Trainer syncs once per micro-step (its nan/inf check of the loss) and TRL reads its
metrics, so the queue drains every micro-step: collation and the Trainer's Python per micro-step are serial.
Activation offloading's copies run on a side stream: a third lane, max(host, compute, copies).
On the CPU target host and device are one thread: their times add.

Optimizer. What each `optim` really runs on the target (transformers 5 maps adamw_torch to torch's AdamW with
foreach=None: foreach on CUDA, a per-tensor for-loop on the CPU; adamw_torch_fused to fused=True): launches
(per tensor, per foreach call in chunks of MultiTensorApply's tensor lists, or one fused call) and the bytes
every pass reads and writes; gradient clipping likewise. Costed analytically from the trainable tensors, not
from the fake run (whose CPU fake tensors take the for-loop path whatever the target).

Expectation over batches. The fake run measures the worst batch (the memory case). Its micro-step time is split
into parts that scale with the padded tokens the device computes, with the trained tokens (the CUDA LM head
scores only those), with the attention tiles, and fixed per micro-step (weight casts, gradient accumulation,
dequantisation, host). `batch_distribution` gives the batches the sampler really makes (random padded batches
exactly from order statistics of the lengths, length-grouped batches in transformers' own order, packed rows
from TRL's pack_dataset, padding-free batches of a seeded epoch), and the throughput is
E[trained tokens per step] / E[step time] over them. The coefficients are taken at the worst batch (the GEMM
efficiency of a smaller typical batch is assumed the same).

Every constant is in profiles/measurements/time_constants.json with its source, unverified until
scripts/gpu_validate.sh fits it on a GPU.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field, replace
from enum import Enum, IntEnum
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..data import TokenizedDataset
    from ..space import Candidate
    from ..workload import GPUSpec


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
    from ..profiles import PROFILES_DIR

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

    from ..profiles import PROFILES_DIR

    path = PROFILES_DIR / "measurements" / (re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") + ".json")
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return {}
    fit = data.get("fitted_time_constants") or {}
    return {k: float(v) for k, v in (fit.get("multipliers") or {}).items() if v and float(v) > 0}


# ---- kernels ---------------------------------------------------------------------------------------------------


def gemm_s(m: int, n: int, k: int, itemsize: int, peak: float, tc: TimeConstants, batch: int = 1) -> float:
    """One (batched) GEMM C[m,n] = A[m,k] B[k,n]: roofline with wave quantisation (module docstring).

    Like cuBLAS' heuristics, the fastest of the threadblock tiles is taken; a smaller tile reuses less data, so it
    runs at a lower fraction of the peak (the tile table's relative efficiency)."""
    if m <= 0 or n <= 0 or k <= 0:
        return tc.floor_s
    flops = 2.0 * m * n * k * batch
    if not tc.cuda:
        compute = flops / (peak * tc.gemm_eff)
        return max(compute, (m * k + k * n + m * n) * batch * itemsize / tc.mem_bw)
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
    return max(nbytes / tc.mem_bw, kernels * tc.floor_s)


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


# ---- the optimizer ---------------------------------------------------------------------------------------------


class OptimizerImpl(str, Enum):
    FOR_LOOP = "adamw_for_loop"
    FOREACH = "adamw_foreach"
    FUSED = "adamw_fused"
    ADAFACTOR = "adafactor"
    BNB_8BIT = "bnb_8bit"


def optimizer_impl(optim: Any, cuda: bool) -> OptimizerImpl:
    """What `optim` really runs on the target (transformers 5 trainer_optimizer.py, torch AdamW's defaults)."""
    value = getattr(optim, "value", optim)
    if value == "adamw_torch_fused":
        return OptimizerImpl.FUSED
    if value == "adamw_torch":
        return OptimizerImpl.FOREACH if cuda else OptimizerImpl.FOR_LOOP
    if value == "adafactor":
        return OptimizerImpl.ADAFACTOR
    if value in ("adamw_bnb_8bit", "paged_adamw_8bit"):
        return OptimizerImpl.BNB_8BIT
    return OptimizerImpl.FOREACH if cuda else OptimizerImpl.FOR_LOOP


@dataclass(frozen=True)
class OptimizerCost:
    device_s: float
    host_s: float
    launches: int
    bytes: float

    def time_s(self, serial: bool) -> float:
        return self.device_s + self.host_s if serial else max(self.device_s, self.host_s)


def _foreach_launches(n_tensors: int, numel: int, depth: int, tc: TimeConstants) -> int:
    per = tc.raw["optimizer"]["foreach_tensors_per_launch"]
    tensors = int(per.get(str(depth), per["5"]))
    return max(1, math.ceil(n_tensors / tensors), math.ceil(numel / (65536 * 320)))


def _foreach_host_s(tensors: int, o: dict) -> float:
    return float(o["foreach_op_us"]) * 1e-6 + tensors * float(o["foreach_tensor_us"]) * 1e-6


def optimizer_cost(
    impl: OptimizerImpl, sizes: Any, param_bytes: int, grad_bytes: int, tc: TimeConstants, clip: bool = True,
) -> OptimizerCost:
    """One optimizer step (plus gradient clipping) over trainable tensors of `sizes` elements each.

    AdamW's moments are in the parameter's dtype; Adafactor works in fp32; bitsandbytes keeps 8-bit moments.
    A per-tensor kernel (the for-loop, Adafactor, bitsandbytes) costs max(its bytes / bandwidth, the kernel floor)
    each; a foreach or fused call max(all its bytes / bandwidth, its launches x the floor)."""
    o = tc.raw["optimizer"]
    spec = o[impl.value]
    sizes = np.asarray(sizes, dtype=np.float64)
    tensors, numel = len(sizes), float(sizes.sum())
    p, g = param_bytes, grad_bytes
    host = tensors * float(o["python_tensor_us"]) * 1e-6  # _init_group / the per-parameter Python loop
    if impl is OptimizerImpl.ADAFACTOR:
        per_elem = spec["param_passes"] * p + spec["fp32_passes"] * 4 + spec["grad_passes"] * g
    elif impl is OptimizerImpl.BNB_8BIT:
        per_elem = spec["param_passes"] * p + spec["state_bytes_per_element"] + spec["grad_passes"] * g
    else:
        per_elem = spec["param_passes"] * p + spec["state_passes"] * p + spec["grad_passes"] * g
    nbytes = numel * per_elem
    if impl in (OptimizerImpl.FOREACH, OptimizerImpl.FUSED):
        per_op = _foreach_launches(tensors, int(numel), int(spec["list_depth"]), tc)
        launches = int(spec["foreach_ops"]) * per_op
        device = max(nbytes / tc.mem_bw, launches * tc.floor_s)
        host += spec["foreach_ops"] * _foreach_host_s(tensors, o)
    else:
        k = int(spec["kernels_per_tensor"])
        launches = k * tensors
        device = float(np.sum(k * np.maximum(sizes * per_elem / k / tc.mem_bw, tc.floor_s)))
        host += int(spec["host_ops_per_tensor"]) * tensors * tc.op_s
    if clip:
        c = o["clip_grad_norm_foreach" if tc.cuda else "clip_grad_norm_for_loop"]
        clip_bytes = numel * c["grad_passes"] * g
        nbytes += clip_bytes
        if tc.cuda:
            n = c["foreach_ops"] * _foreach_launches(tensors, int(numel), 1, tc) + c["small_ops"]
            device += max(clip_bytes / tc.mem_bw, n * tc.floor_s)
            host += c["foreach_ops"] * _foreach_host_s(tensors, o)
        else:
            n = c["kernels_per_tensor"] * tensors + c["small_ops"]
            device += float(np.sum(c["kernels_per_tensor"] * np.maximum(
                sizes * c["grad_passes"] * g / c["kernels_per_tensor"] / tc.mem_bw, tc.floor_s)))
            host += c["kernels_per_tensor"] * tensors * tc.op_s
        launches += n
        host += c["small_ops"] * tc.op_s
    host += tensors * float(o["python_tensor_us"]) * 1e-6  # zero_grad(set_to_none=True)
    return OptimizerCost(device_s=device, host_s=host, launches=int(launches), bytes=float(nbytes))


# ---- the cost of one step, by basis ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchPoint:
    """One micro-batch as the device sees it (for the worst batch), the values of the bases."""

    tokens: float
    trained: float
    attention: float  # tiles (CAUSAL / FULL) or score elements (DENSE)
    rows: float = 1.0
    real: float = 0.0  # non-padding tokens (model FLOPs, MFU)
    sq: float = 0.0  # sum of squared sequence lengths (model FLOPs of causal attention)


@dataclass(frozen=True, eq=False)
class StepCost:
    """Seconds of one micro-step by (term, basis) per unit of the basis, host time, the optimizer step."""

    device: np.ndarray  # (terms, bases): seconds per unit of each basis
    host_s: float  # host time of one micro-step's ops (async with the device)
    serial_host_s: float  # per micro-step, serial with the device: syncs, the Trainer's Python
    collate_row_s: float
    copy_s_per_token: float = 0.0  # activation offloading's copies, per padded token
    optimizer: OptimizerCost = OptimizerCost(0.0, 0.0, 0, 0.0)
    step_host_s: float = 0.0
    serial: bool = False  # CPU: host and device are one thread
    accumulation: int = 1
    flops_per_token: float = 0.0  # model FLOPs per real token (PaLM convention, see mfu())
    flops_per_sq: float = 0.0  # model FLOPs per squared sequence length (causal attention, fwd + bwd)
    peak_flops: float = 0.0
    worst: BatchPoint = BatchPoint(0.0, 0.0, 0.0)
    attention_kind: AttentionKind = AttentionKind.CAUSAL
    launches: float = 0.0  # kernels launched per micro-step

    def with_(self, **changes: Any) -> StepCost:
        return replace(self, **changes)


@dataclass(frozen=True)
class StepTime:
    """The expected time of one optimizer step and its parts (seconds), the throughput and MFU."""

    step_s: float
    terms: dict[str, float]
    tokens_per_second: float
    trained_per_step: float
    mfu: float | None
    worst_step_s: float  # the worst batch at every micro-step (the memory case)


def extrapolate_cost(lo: StepCost | None, hi: StepCost | None, k: float) -> StepCost | None:
    """The cost at full depth from two depths: every per-layer quantity is linear in depth."""
    if lo is None or hi is None:
        return hi

    def lin(a: float, b: float) -> float:
        return a + k * (b - a)

    opt = OptimizerCost(
        device_s=lin(lo.optimizer.device_s, hi.optimizer.device_s),
        host_s=lin(lo.optimizer.host_s, hi.optimizer.host_s),
        launches=round(lin(lo.optimizer.launches, hi.optimizer.launches)),
        bytes=lin(lo.optimizer.bytes, hi.optimizer.bytes),
    )
    return hi.with_(
        device=np.maximum(0.0, lo.device + k * (hi.device - lo.device)),
        host_s=lin(lo.host_s, hi.host_s),
        launches=lin(lo.launches, hi.launches),
        copy_s_per_token=max(0.0, lin(lo.copy_s_per_token, hi.copy_s_per_token)),
        optimizer=opt,
        flops_per_token=lin(lo.flops_per_token, hi.flops_per_token),
        flops_per_sq=lin(lo.flops_per_sq, hi.flops_per_sq),
    )


@dataclass(frozen=True)
class BatchDistribution:
    """The micro-batches the sampler makes, with their probabilities."""

    weights: np.ndarray
    tokens: np.ndarray
    trained: np.ndarray
    attention: np.ndarray
    rows: np.ndarray
    real: np.ndarray
    sq: np.ndarray

    @classmethod
    def single(cls, p: BatchPoint) -> BatchDistribution:
        one = np.ones(1)
        return cls(one, one * p.tokens, one * p.trained, one * p.attention, one * p.rows, one * p.real, one * p.sq)

    def mean(self, values: np.ndarray) -> float:
        return float(np.dot(self.weights, values))


def evaluate(cost: StepCost, dist: BatchDistribution) -> StepTime:
    """Expected step time over `dist`, by term, with the overlap of host, device and copies (module docstring)."""
    bases = np.stack([dist.tokens, dist.trained, dist.attention, np.ones_like(dist.tokens)], axis=1)  # (P, B)
    per_term = bases @ cost.device.T  # (P, T)
    device = per_term.sum(axis=1)
    copies = cost.copy_s_per_token * dist.tokens
    if cost.serial:
        lane = device + cost.host_s
        lanes = lane
    else:
        lane = np.maximum(device, cost.host_s)
        lanes = np.maximum(lane, copies)
    serial = cost.serial_host_s + cost.collate_row_s * dist.rows
    micro = lanes + serial
    ga = cost.accumulation
    terms = {t.value: ga * dist.mean(per_term[:, i]) for i, t in enumerate(_TERMS)}
    # copies on the compute stream (offloaded checkpoints, in the device terms) plus what the side stream's copies
    # (activation offloading) add beyond the compute lane
    terms[Term.OFFLOAD.value] += ga * (dist.mean(lanes) - dist.mean(lane))
    host = dist.mean(lane) - dist.mean(device) + dist.mean(serial)
    opt = cost.optimizer.time_s(cost.serial)
    terms[Term.HOST.value] = ga * host + cost.step_host_s
    terms[Term.OPTIMIZER.value] = opt
    step = ga * dist.mean(micro) + opt + cost.step_host_s
    trained = ga * dist.mean(dist.trained)
    useful = ga * (cost.flops_per_token * dist.mean(dist.real) + cost.flops_per_sq * dist.mean(dist.sq))
    mfu = useful / (step * cost.peak_flops) if step > 0 and cost.peak_flops > 0 and useful > 0 else None
    w = cost.worst
    worst_dev = float(np.array([w.tokens, w.trained, w.attention, 1.0]) @ cost.device.sum(axis=0))
    if cost.serial:
        worst_lane = worst_dev + cost.host_s
    else:
        worst_lane = max(worst_dev, cost.host_s, cost.copy_s_per_token * w.tokens)
    worst = ga * (worst_lane + cost.serial_host_s + cost.collate_row_s * w.rows) + opt + cost.step_host_s
    return StepTime(
        step_s=step, terms={k: v for k, v in terms.items() if abs(v) > 0}, tokens_per_second=trained / step,
        trained_per_step=trained, mfu=mfu, worst_step_s=worst,
    )


def model_flops(trained_params: float, frozen_params: float, layers: int, q_dim: int) -> tuple[float, float]:
    """(FLOPs per real token, FLOPs per squared sequence length): the PaLM convention (6N for trained weights,
    4N for frozen ones: forward and grad-input, no weight gradient; causal attention 6 L q_dim s^2 fwd + bwd).
    Recompute, padding and masked tiles are not useful work, so they lower the MFU."""
    return 6.0 * trained_params + 4.0 * frozen_params, 6.0 * layers * q_dim


# ---- the fake run's ops ----------------------------------------------------------------------------------------

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addmm_", "addbmm"}
_GATHERS = {"embedding", "index_select", "gather", "index", "take_along_dim"}
_NO_KERNEL = {"empty", "new_empty", "empty_like", "empty_strided", "lift_fresh", "_local_scalar_dense", "detach",
              "alias", "_unsafe_view", "set_", "resize_", "new_empty_strided", "lift_fresh_copy"}


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


def _in_trl_kernels(depth: int = 10) -> bool:
    """Called from TRL's chunked log-prob head (its frames sit within a few of the dispatch)."""
    frame = sys._getframe(2)
    while frame is not None and depth:
        if frame.f_globals.get("__name__", "").startswith("trl.kernels"):
            return True
        frame = frame.f_back
        depth -= 1
    return False


@dataclass(frozen=True)
class BatchLayout:
    """The worst batch as the kernels see it: rows x seq positions, its sequences and labelled positions."""

    rows: int
    seq: int
    sequences: tuple[int, ...]  # lengths of the attention sequences (per row, or per packed document)
    trained: int
    flat: bool  # padding-free: one row of concatenated sequences

    @property
    def tokens(self) -> int:
        return self.rows * self.seq


def layout_of(batch: dict) -> BatchLayout:
    """From the collated (real) batch: the sequences come from the attention mask, or from `position_ids` resets
    (padding-free), as FlashAttention's varlen path derives `cu_seqlens`."""
    import torch

    ids = batch["input_ids"]
    rows, seq = int(ids.shape[0]), int(ids.shape[1])
    labels = batch["labels"][:, 1:]
    trained = int((labels != -100).sum())
    mask = batch.get("attention_mask")
    if mask is not None:
        seqs = tuple(int(x) for x in mask.sum(-1).tolist())
        return BatchLayout(rows, seq, seqs, trained, False)
    pos = batch.get("position_ids")
    if pos is None:
        return BatchLayout(rows, seq, (seq,) * rows, trained, False)
    seqs: list[int] = []
    for row in pos:
        starts = torch.nonzero(row == 0).flatten().tolist() or [0]
        bounds = [*starts, len(row)]
        seqs.extend(int(b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a)
    return BatchLayout(rows, seq, tuple(seqs), trained, True)


def attention_units(kind: AttentionKind, sequences: np.ndarray, rows: int, seq: int, block: int) -> float:
    """Tiles (or score elements) one attention call computes on a micro-batch (module docstring)."""
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


def _is_flash(name: str) -> bool:
    return ("flash_attention" in name or "flash_attn" in name) and "scaled_dot_product" not in name


def _is_attention(name: str) -> bool:
    return _is_flash(name) or "scaled_dot_product" in name or "efficient_attention" in name


class TimingHook:
    """Costs every op of the recorded micro-steps (hook it into StorageTracker.on_op), by term and basis.

    Only the micro-steps of the last optimizer step are recorded (`begin_micro`); ops outside a micro-step
    (clipping, the optimizer, zero_grad) are costed analytically (optimizer_cost), because the CPU fake run takes
    the for-loop path whatever the target.
    """

    def __init__(self, gpu: GPUSpec, layout: BatchLayout, attn: str, quantized: str | None = None,
                 model: Any = None) -> None:
        self.tc = time_constants(gpu)
        self.gpu = gpu
        self.layout = layout
        self.attn = attn
        self.quantized = quantized
        self.model = model
        self.recording = False
        self.micro_steps = 0
        self.device = np.zeros((_NT, _NB))
        self.host = 0.0
        self.ops = 0
        self.launches = 0
        self.kind: AttentionKind | None = None
        self._param_shapes: set[tuple[int, ...]] | None = None
        self._quant_keys: dict[int, int] | None = None
        self._attn_dims = {layout.seq}
        self._upcast: dict[int, Any] = {}
        # the head's row counts: every position (CPU), or the labelled ones (CUDA), in chunks of 4096
        counts = {layout.trained, layout.tokens, layout.tokens - layout.rows}
        self._head_dims = {d for n in counts if n > 0 for d in (n, min(n, 4096), n % 4096) if d > 0}

    # -- phases --
    def begin_micro(self, record: bool) -> None:
        self.recording = record
        self._upcast.clear()
        if record:
            self.micro_steps += 1

    def end_micro(self) -> None:
        self.recording = False

    # -- classification --
    def _weights(self) -> set[tuple[int, ...]]:
        if self._param_shapes is None:
            shapes: set[tuple[int, ...]] = set()
            if self.model is not None:
                for p in self.model.parameters():
                    s = _shape(p)
                    shapes.add(s)
                    shapes.add(s[::-1])
            self._param_shapes = shapes
        return self._param_shapes

    def _quant(self) -> dict[int, int]:
        if self._quant_keys is None:
            import torch

            keys: dict[int, int] = {}
            if self.quantized and self.model is not None:
                for name, mod in self.model.named_modules():
                    w = getattr(mod, "weight", None)
                    if (isinstance(mod, torch.nn.Linear) and w is not None and not w.requires_grad
                            and "lm_head" not in name):
                        keys[w.untyped_storage()._cdata] = w.numel()
            self._quant_keys = keys
        return self._quant_keys

    def __call__(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if not self.recording:
            return
        from .tracker import tensors_in

        tc = self.tc
        self.ops += 1
        if getattr(func, "is_view", False):
            self.host += tc.view_s
            return
        name = func._overloadpacket.__name__
        if name in _NO_KERNEL:
            self.host += tc.view_s
            return
        self.host += tc.op_s
        self.launches += 1
        if _is_attention(name):
            self._attention(name, args, kwargs)
            return
        ins = tensors_in(args) + tensors_in(kwargs)
        outs = tensors_in(out)
        tensors = ins + outs
        if not tensors:
            return
        if _in_trl_kernels():
            self._lm_head(name, args, ins, outs)
            return
        if name in _MATMULS:
            t, extra = self._matmul(name, args, ins)
            basis = self._basis(tensors)
            self._add(Term.ATTENTION if basis is Basis.ATTENTION else Term.MATMUL, basis, t)
            if extra:
                self._add(Term.DEQUANT, Basis.FIXED, extra)
            return
        if name in _GATHERS:  # reads only the rows it gathers (or scatters)
            nbytes = float(sum(2 * x.numel() * x.element_size() for x in outs) + sum(
                x.numel() * x.element_size() for x in ins if not x.is_floating_point()))
        else:
            nbytes = float(sum(x.numel() * x.element_size() for x in tensors))
        t = memory_s(nbytes, tc)
        basis = self._basis(tensors)
        self._add(Term.ATTENTION if basis is Basis.ATTENTION else Term.MEMORY, basis, t)

    def _lm_head(self, name: str, args: tuple, ins: list, outs: list) -> None:
        """TRL's chunked log-prob head. On CUDA it runs bf16 GEMMs with fp32 accumulation
        (`torch.addmm(..., out_dtype=float32)`) and Triton folds; the fake run on the CPU takes the torch fallback,
        whose fp32 upcasts of tiles and weight chunks a GPU never runs: skipped, and their GEMMs costed in 16-bit."""
        import torch

        tc = self.tc
        tensors = ins + outs
        per_token = any(d in self._head_dims for x in tensors for d in _shape(x))
        basis = (Basis.TRAINED if tc.cuda else Basis.TOKENS) if per_token else Basis.FIXED
        if tc.cuda and name == "_to_copy" and outs and outs[0].dtype is torch.float32 and ins and \
                ins[0].dtype in (torch.bfloat16, torch.float16):
            self.host -= tc.op_s
            self.launches -= 1
            self._upcast[outs[0].untyped_storage()._cdata] = ins[0].dtype
            return
        if name in _MATMULS:
            t, _ = self._matmul(name, args, ins, upcast=self._upcast if tc.cuda else None)
            self._add(Term.LM_HEAD, basis, t)
            if tc.cuda and name == "mm" and outs:
                # the Triton fold over this logits tile: one read forward, a read and a write backward
                tile = outs[0].numel() * outs[0].element_size()
                self._add(Term.LM_HEAD, basis, memory_s(1.5 * tile, tc))
                self.host += float(tc.raw["host"]["triton_launch_us"]) * 1e-6
            return
        nbytes = float(sum(x.numel() * x.element_size() for x in tensors))
        self._add(Term.LM_HEAD, basis, memory_s(nbytes, tc))

    def _basis(self, tensors: list) -> Basis:
        weights = self._weights()
        weight_only = True
        for x in tensors:
            s = _shape(x)
            if len(s) >= 2 and s[-1] == s[-2] and s[-1] in self._attn_dims and s not in weights:
                return Basis.ATTENTION
            if x.numel() > 1 and s not in weights:
                weight_only = False
        return Basis.FIXED if weight_only else Basis.TOKENS

    def _matmul(self, name: str, args: tuple, ins: list, upcast: dict | None = None) -> tuple[float, float]:
        """(GEMM seconds, dequantisation seconds when a quantized weight is read)."""
        tc = self.tc
        mats = [x for x in ins if x.dim() >= 2]
        if name in ("addmm", "addmm_", "baddbmm", "addbmm"):
            mats = [x for x in tensors_of(args[1:3]) if x.dim() >= 2] or mats
        if len(mats) < 2:
            return tc.floor_s, 0.0
        a, b = mats[0], mats[1]
        batch = int(np.prod(a.shape[:-2])) if a.dim() > 2 else 1
        m, k = int(a.shape[-2]), int(a.shape[-1])
        n = int(b.shape[-1])
        dtype, size = a.dtype, a.element_size()
        if upcast:
            low = upcast.get(a.untyped_storage()._cdata) or upcast.get(b.untyped_storage()._cdata)
            if low is not None:
                dtype, size = low, 2
        peak = tc.peak_for(dtype)
        t = gemm_s(m, n, k, size, peak, tc, batch)
        extra = 0.0
        quant = self._quant()
        if quant:
            for x in (a, b):
                numel = quant.get(x.untyped_storage()._cdata)
                if numel:
                    extra += dequant_s(numel, self.quantized, tc) + (t * self._int8_extra())
                    self.host += tc.op_s
        return t, extra

    def _int8_extra(self) -> float:
        if self.quantized == "8bit":
            return float(self.tc.raw["dequantization"]["int8_matmul_factor"]) - 1.0
        return 0.0

    def _attention(self, name: str, args: tuple, kwargs: dict) -> None:
        tc = self.tc
        backward = "backward" in name
        q = args[1] if backward else args[0]
        layout = self.layout
        if _is_flash(name):
            # aten._flash_attention_forward/backward, or the simulator's FlashAttention stand-ins
            # (advisor/_sim/flash.py: advisor::_flash_attn[_varlen]_forward/backward, same argument order):
            # (T, H, D) varlen with cu_seqlens, or (B, S, H, D)
            heads, head_dim = int(q.shape[-2]), int(q.shape[-1])
            kind = AttentionKind.CAUSAL
            units = attention_units(kind, np.asarray(layout.sequences), layout.rows, layout.seq, tc.attn_block)
        else:
            # sdpa: (B, H, S, D); a mask (attn_mask given) means the whole row, is_causal the causal tiles
            heads, head_dim = int(q.shape[1]), int(q.shape[-1])
            rows, s = int(q.shape[0]), int(q.shape[2])
            masked = kwargs.get("attn_mask") is not None or any(
                getattr(x, "dim", lambda: 0)() == 4 and x is not q and _shape(x)[-1] == _shape(x)[-2]
                for x in args if hasattr(x, "shape")
            )
            kind = AttentionKind.FULL if masked else AttentionKind.CAUSAL
            units = attention_units(kind, np.full(rows, s), rows, s, tc.attn_block)
        if self.kind is None:
            self.kind = kind
        per_tile = attention_tile_s(heads, head_dim, tc.peak_for(q.dtype), tc, backward)
        self._add(Term.ATTENTION, Basis.ATTENTION, max(units * per_tile, tc.floor_s))

    def _add(self, term: Term, basis: Basis, seconds: float) -> None:
        self.device[_TERMS.index(term), int(basis)] += seconds

    # -- result --
    def cost(self, *, accumulation: int, optimizer: OptimizerCost, flops: tuple[float, float]) -> StepCost:
        """Per micro-step averages over the recorded micro-steps, divided by the worst batch's bases."""
        n = max(1, self.micro_steps)
        lay = self.layout
        kind = self.kind or (AttentionKind.DENSE if self.attn == "eager" else AttentionKind.CAUSAL)
        units = attention_units(kind, np.asarray(lay.sequences), lay.rows, lay.seq, self.tc.attn_block)
        worst = BatchPoint(
            tokens=float(lay.tokens), trained=float(max(lay.trained, 1)), attention=float(max(units, 1.0)),
            rows=float(lay.rows), real=float(sum(lay.sequences)), sq=float(sum(s * s for s in lay.sequences)),
        )
        scale = np.array([worst.tokens, worst.trained, worst.attention, 1.0])
        device = self.device / n / scale[None, :]
        tc = self.tc
        serial_host = tc.micro_step_s + 2 * tc.sync_s
        return StepCost(
            device=device, host_s=self.host / n, serial_host_s=serial_host, collate_row_s=tc.collate_row_s,
            optimizer=optimizer, step_host_s=tc.step_s, serial=not tc.cuda, accumulation=accumulation,
            flops_per_token=flops[0], flops_per_sq=flops[1], peak_flops=0.0, worst=worst, attention_kind=kind,
            launches=self.launches / n,
        )


def tensors_of(tree: Any) -> list:
    from .tracker import tensors_in

    return tensors_in(tree)


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


# ---- the batches the sampler makes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplerSpec:
    """What decides the batches: hashable, so distributions are cached per dataset."""

    batch: int
    max_length: int | None
    packing: bool
    strategy: str
    flat: bool  # effective padding-free
    group_by_length: bool
    multiple: int | None
    attn: str


def sampler_spec(c: Candidate) -> SamplerSpec:
    return SamplerSpec(
        batch=c.per_device_train_batch_size, max_length=c.max_length, packing=c.packing,
        strategy=c.packing_strategy.value, flat=c.effective_padding_free, group_by_length=c.group_by_length,
        multiple=c.pad_to_multiple_of, attn=c.attn_implementation.value,
    )


def batch_distribution(dataset: TokenizedDataset, c: Candidate, block: int = 128) -> BatchDistribution:
    return _distribution(dataset, sampler_spec(c), block)


def _round(n: np.ndarray, multiple: int | None) -> np.ndarray:
    return n if not multiple else -(-n // multiple) * multiple


def _kept(dataset: TokenizedDataset, ml: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(lengths after truncation, trained tokens) of the rows SFTTrainer keeps (those with a trained token)."""
    trained = np.asarray(dataset.trained_after_truncation(ml), dtype=np.int64)
    lengths = np.asarray(dataset.lengths, dtype=np.int64)
    if ml is not None:
        lengths = np.minimum(lengths, ml)
    keep = trained > 0
    return lengths[keep], trained[keep]


@lru_cache(maxsize=512)
def _distribution(dataset: TokenizedDataset, s: SamplerSpec, block: int) -> BatchDistribution:
    b = s.batch
    if s.packing and s.max_length:
        return _packed(dataset, s, block)
    lengths, trained = _kept(dataset, s.max_length)
    if len(lengths) == 0:
        return BatchDistribution.single(BatchPoint(1.0, 0.0, 1.0))
    if s.flat:
        order = _epoch(len(lengths), b, s.group_by_length, lengths)
        return _flat_batches(order, lengths, trained, b, s, block)
    if s.group_by_length:
        order = _epoch(len(lengths), b, True, lengths)
        chunks = [order[i:i + b] for i in range(0, len(order), b)]
        rows = np.array([len(ch) for ch in chunks], dtype=float)
        longest = _round(np.array([lengths[ch].max() for ch in chunks]), s.multiple).astype(float)
        tr = np.array([trained[ch].sum() for ch in chunks], dtype=float)
        real = np.array([lengths[ch].sum() for ch in chunks], dtype=float)
        sq = np.array([(lengths[ch].astype(float) ** 2).sum() for ch in chunks])
        att = np.array([_padded_units(s.attn, lengths[ch], int(m), block) for ch, m in zip(chunks, longest,
                                                                                           strict=True)])
        w = np.ones(len(chunks)) / len(chunks)  # every batch of the epoch once
        return BatchDistribution(w, rows * longest, tr, att, rows, real, sq)
    # random order: the longest row of a uniform random subset of b rows is the i-th smallest with probability
    # C(i-1, b-1) / C(n, b) (the same order statistics advisor.lengths uses for its padding report)
    n = len(lengths)
    order = np.argsort(lengths, kind="stable")
    ordered = lengths[order].astype(float)
    bb = min(b, n)
    i = np.arange(bb, n + 1, dtype=float)
    log_p = _log_comb(i - 1, bb - 1) - _log_comb(float(n), bb)
    p = np.exp(log_p)
    p = p / p.sum()
    longest = _round(ordered[bb - 1:].astype(np.int64), s.multiple).astype(float)
    mean_len = float(lengths.mean())
    mean_sq = float((lengths.astype(float) ** 2).mean())
    kind = attention_kind(s.attn, masked=bb > 1 and len(set(lengths.tolist())) > 1)
    if kind is AttentionKind.CAUSAL and "flash" in s.attn:
        # varlen unpads: the expected per-sequence tiles of bb random rows
        att = np.full(len(p), bb * float(np.mean(causal_tiles(lengths, block))))
    else:
        att = np.array([attention_units(kind, np.full(bb, m), bb, int(m), block) for m in longest])
    ones = np.ones(len(p))
    return BatchDistribution(p, bb * longest, ones * bb * float(trained.mean()), att, ones * bb, ones * bb * mean_len,
                             ones * bb * mean_sq)


def _padded_units(attn: str, lens: np.ndarray, longest: int, block: int) -> float:
    masked = len(lens) > 1 and bool((lens != longest).any())
    kind = attention_kind(attn, masked)
    if kind is AttentionKind.CAUSAL and "flash" in attn:
        return float(np.sum(causal_tiles(lens, block)))
    return attention_units(kind, np.full(len(lens), longest), len(lens), longest, block)


def _epoch(n: int, b: int, grouped: bool, lengths: np.ndarray) -> np.ndarray:
    """The order of one epoch: transformers' LengthGroupedSampler (seeded as advisor.lengths does) or a seeded
    random permutation (RandomSampler)."""
    if grouped:
        import torch
        from transformers.trainer_pt_utils import get_length_grouped_indices

        from ..lengths import GROUPED_SEED

        return np.asarray(get_length_grouped_indices(lengths.tolist(), b,
                                                     generator=torch.Generator().manual_seed(GROUPED_SEED)))
    return np.random.default_rng(0).permutation(n)


def _flat_batches(order: np.ndarray, lengths: np.ndarray, trained: np.ndarray, b: int, s: SamplerSpec,
                  block: int) -> BatchDistribution:
    chunks = [order[i:i + b] for i in range(0, len(order), b)]
    tokens = np.array([lengths[ch].sum() for ch in chunks], dtype=float)
    tr = np.array([trained[ch].sum() for ch in chunks], dtype=float)
    sq = np.array([(lengths[ch].astype(float) ** 2).sum() for ch in chunks])
    kind = attention_kind(s.attn, masked=True)
    if kind is AttentionKind.CAUSAL:
        att = np.array([float(np.sum(causal_tiles(lengths[ch], block))) for ch in chunks])
    else:
        att = np.array([attention_units(kind, np.array([t]), 1, int(t), block) for t in tokens])
    w = np.ones(len(chunks)) / len(chunks)
    return BatchDistribution(w, tokens, tr, att, np.ones(len(chunks)), tokens.copy(), sq)


def _packed(dataset: TokenizedDataset, s: SamplerSpec, block: int) -> BatchDistribution:
    """Packed rows from TRL's own pack_dataset; b random rows per micro-batch (one seeded epoch)."""
    rows_len, rows_trained, docs = _packed_rows(dataset, int(s.max_length), s.strategy)
    b = s.batch
    order = np.random.default_rng(0).permutation(len(rows_len))
    chunks = [order[i:i + b] for i in range(0, len(order), b)]
    wrapped = s.strategy == "wrapped"
    flat = s.flat
    tokens, tr, att, sq, rows = [], [], [], [], []
    for ch in chunks:
        lens = rows_len[ch]
        seqs = np.concatenate([docs[i] for i in ch]) if not wrapped else lens
        total = float(lens.sum())
        padded = total if flat else float(len(ch) * (lens.max() if not wrapped else s.max_length))
        tokens.append(padded)
        tr.append(float(rows_trained[ch].sum()))
        sq.append(float((seqs.astype(float) ** 2).sum()))
        rows.append(1.0 if flat else float(len(ch)))
        if flat:
            kind = attention_kind(s.attn, masked=True)
            if kind is AttentionKind.CAUSAL:
                att.append(float(np.sum(causal_tiles(seqs, block))))
            else:
                att.append(attention_units(kind, np.array([total]), 1, int(total), block))
        else:
            att.append(_padded_units(s.attn, lens, int(lens.max()), block))
    n = len(chunks)
    return BatchDistribution(np.ones(n) / n, np.array(tokens), np.array(tr), np.array(att), np.array(rows),
                             np.array([float(rows_len[ch].sum()) for ch in chunks]), np.array(sq))


@lru_cache(maxsize=32)
def _packed_rows(dataset: TokenizedDataset, max_length: int, strategy: str) -> tuple[np.ndarray, np.ndarray, list]:
    """(tokens per packed row, trained tokens per packed row, document lengths per row) from TRL's pack_dataset,
    on the same input_ids/labels columns SFTTrainer packs (advisor.lengths)."""
    import pyarrow.compute as pc
    from trl.data_utils import pack_dataset

    from ..data import progress_bars
    from ..lengths import _labelled

    hf = _labelled(dataset)
    with progress_bars(False):
        packed = pack_dataset(hf, max_length, strategy, {})
    lens = np.asarray(pc.list_value_length(packed.data.column("input_ids")).to_numpy(zero_copy_only=False),
                      dtype=np.int64)
    labels = packed.data.column("labels").to_pylist()
    trained = np.array([sum(1 for x in row[1:] if x != -100) for row in labels], dtype=np.int64)
    if "seq_lengths" in packed.column_names:
        docs = [np.asarray(x, dtype=np.int64) for x in packed.data.column("seq_lengths").to_pylist()]
    else:
        docs = [np.array([n]) for n in lens]
    return lens, trained, docs


def _log_comb(n: np.ndarray | float, k: int) -> np.ndarray:
    from ..lengths import _log_comb as log_comb

    return log_comb(np.asarray(n, dtype=np.float64), k)
