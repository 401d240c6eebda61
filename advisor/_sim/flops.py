"""A step-time estimate from the ops of the fake run: each op's FLOPs and bytes against the GPU's roofline.

FLOPs come from `torch.utils.flop_counter`'s per-op formulas (they work on fake tensors); checkpointing's
recompute is counted because the fake run really recomputes. This is a prediction (source `simulate`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from ..workload import GPUSpec
from .cuda_rules import constants
from .tracker import tensors_in

_LOW = {torch.bfloat16: "bf16_tflops", torch.float16: "fp16_tflops"}


class Roofline:
    """Accumulates flops, bytes and roofline time op by op (hook it into StorageTracker.on_op)."""

    def __init__(self, gpu: GPUSpec) -> None:
        r = constants()["roofline"]
        self.gpu = gpu
        self.matmul_eff = float(r["matmul_efficiency"])
        self.mem_bw = gpu.memory_bandwidth_gbs * 1e9 * float(r["memory_efficiency"])
        self.flops = 0.0
        self.bytes = 0.0
        self.time_s = 0.0

    def __call__(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if getattr(func, "is_view", False):
            return
        packet = func._overloadpacket
        flops = 0.0
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        tensors = tensors_in(args) + tensors_in(kwargs) + tensors_in(out)
        nbytes = float(sum(t.numel() * t.element_size() for t in tensors))
        dtype = tensors[0].dtype if tensors else torch.float32
        peak = getattr(self.gpu, _LOW.get(dtype, "fp32_tflops")) * 1e12 * self.matmul_eff
        self.flops += flops
        self.bytes += nbytes
        self.time_s += max(flops / peak if peak else 0.0, nbytes / self.mem_bw if self.mem_bw else 0.0)


def offload_transfer_s(activation_bytes: int) -> float:
    """Time to move saved activations to host and back over PCIe."""
    bw = float(constants()["roofline"]["pcie_bandwidth_gbs"]) * 1e9
    return 2.0 * activation_bytes / bw
