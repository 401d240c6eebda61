"""The target's cost model shared by the two predicting backends (`estimate` and `simulate`), public.

The step-time model (kernels by tile and wave, attention per tile, memory-bound ops, host dispatch, the
optimizer as the target runs it; its constants in profiles/measurements/time_constants.json) and the memory
that lives outside the caching allocator (CUDA context, cuBLAS workspace; profiles/measurements/
cuda_constants.json) are implemented in the simulator's private package `advisor._sim`; this module is the
one way in for everything outside it (the estimate, scripts, tests).
"""

from __future__ import annotations

from ._sim.cuda_rules import constants as cuda_constants
from ._sim.cuda_rules import context_bytes, cublas_workspace_bytes, replay, round_size
from ._sim.timing import (
    Basis,
    BatchDistribution,
    BatchLayout,
    BatchPoint,
    OptimizerImpl,
    StepCost,
    Term,
    TimingHook,
    attention_kind,
    attention_tile_s,
    batch_distribution,
    dequant_s,
    evaluate,
    gemm_s,
    memory_s,
    model_flops,
    offload_copy_s_per_token,
    optimizer_cost,
    optimizer_impl,
    peak_flops,
    time_constants,
)

__all__ = [
    "Basis", "BatchDistribution", "BatchLayout", "BatchPoint", "OptimizerImpl", "StepCost", "Term", "TimingHook",
    "attention_kind", "attention_tile_s", "batch_distribution", "context_bytes", "cublas_workspace_bytes",
    "cuda_constants", "dequant_s", "evaluate", "gemm_s", "memory_s", "model_flops", "offload_copy_s_per_token",
    "optimizer_cost", "optimizer_impl", "peak_flops", "replay", "round_size", "time_constants",
]
