"""What each `optim` runs on the target and what one optimizer step (with gradient clipping) costs, analytically
from the trainable tensors (the package docstring: "Optimizer")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from .constants import TimeConstants


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


def adam_kernels(impl: OptimizerImpl, tc: TimeConstants, weight_decay: float = 0.0) -> list[dict]:
    """The kernels one AdamW step runs per tensor list (foreach, fused) or per tensor (the for-loop), each with its
    tensor-sized reads + writes per element by operand (time_constants.json optimizer.<impl>.ops, counted from
    torch/optim/adam.py); the parameters' decay pass only with weight_decay != 0."""
    return [k for k in tc.raw["optimizer"][impl.value]["ops"] if weight_decay or not k.get("weight_decay_only")]


def adam_bytes_per_element(impl: OptimizerImpl, param_bytes: int, grad_bytes: int, tc: TimeConstants,
                           weight_decay: float = 0.0) -> float:
    """Bytes one AdamW step reads and writes per trainable element: every kernel's passes over the parameter, the
    moments (in the parameter's dtype) and the gradient."""
    return float(sum(k.get("param", 0) * param_bytes + k.get("state", 0) * param_bytes + k.get("grad", 0) * grad_bytes
                     for k in adam_kernels(impl, tc, weight_decay)))


def bnb_bytes(sizes: np.ndarray, param_bytes: int, grad_bytes: int, spec: dict) -> np.ndarray:
    """Bytes of bitsandbytes' 8-bit AdamW kernel per tensor: parameter read and written, gradient read, both moments
    read and written as uint8 with a float32 absmax per block, or as float32 below min_8bit_size elements."""
    small = sizes < float(spec["min_8bit_size"])
    state = np.where(small, float(spec["small_state_bytes_per_element"]), float(spec["state_bytes_per_element"])
                     + 2 * 2 * 4.0 / float(spec["block_size"]))
    return sizes * (spec["param_passes"] * param_bytes + spec["grad_passes"] * grad_bytes + state)


def optimizer_cost(
    impl: OptimizerImpl, sizes: Any, param_bytes: int, grad_bytes: int, tc: TimeConstants, clip: bool = True,
    weight_decay: float = 0.0,
) -> OptimizerCost:
    """One optimizer step (plus gradient clipping) over trainable tensors of `sizes` elements each.

    AdamW's moments are in the parameter's dtype; Adafactor works in fp32; bitsandbytes keeps 8-bit moments (fp32
    below 4096 elements). Each kernel as it runs: a per-tensor kernel (the for-loop, Adafactor, bitsandbytes) costs
    max(its bytes / bandwidth, the kernel floor); a foreach op max(its bytes over every tensor / bandwidth, its
    launches x the floor): foreach AdamW is one pass (a read and a write) per elementwise op over the states, the
    fused kernel one pass over parameter, gradient and moments."""
    o = tc.raw["optimizer"]
    spec = o[impl.value]
    sizes = np.asarray(sizes, dtype=np.float64)
    tensors, numel = len(sizes), float(sizes.sum())
    p, g = param_bytes, grad_bytes
    host = tensors * float(o["python_tensor_us"]) * 1e-6  # _init_group / the per-parameter Python loop
    if impl in (OptimizerImpl.FOREACH, OptimizerImpl.FUSED):
        per_op = _foreach_launches(tensors, int(numel), int(spec["list_depth"]), tc)
        device = 0.0
        kernels = adam_kernels(impl, tc, weight_decay)
        for k in kernels:  # each foreach op streams its lists once
            k_bytes = numel * (k.get("param", 0) * p + k.get("state", 0) * p + k.get("grad", 0) * g)
            device += max(k_bytes / tc.mem_bw, per_op * tc.floor_s)
        nbytes = numel * adam_bytes_per_element(impl, p, g, tc, weight_decay)
        calls = len(kernels) + int(spec.get("step_kernels", 0))
        device += int(spec.get("step_kernels", 0)) * _foreach_launches(tensors, tensors, 1, tc) * tc.floor_s
        launches = calls * per_op
        host += calls * _foreach_host_s(tensors, o)
    else:
        if impl is OptimizerImpl.FOR_LOOP:
            k = len(adam_kernels(impl, tc, weight_decay))
            per_tensor = sizes * adam_bytes_per_element(impl, p, g, tc, weight_decay)
        elif impl is OptimizerImpl.ADAFACTOR:
            k = int(spec["kernels_per_tensor"])
            per_tensor = sizes * (spec["param_passes"] * p + spec["fp32_passes"] * 4 + spec["grad_passes"] * g)
        else:  # bitsandbytes: one blockwise kernel per tensor
            k = 1
            per_tensor = bnb_bytes(sizes, p, g, spec)
        nbytes = float(per_tensor.sum())
        launches = k * tensors
        device = float(np.sum(k * np.maximum(per_tensor / k / tc.mem_bw, tc.floor_s)))
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
