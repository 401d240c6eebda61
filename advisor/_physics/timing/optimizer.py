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
