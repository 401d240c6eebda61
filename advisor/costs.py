"""The target's cost model shared by the two predicting backends (`estimate` and `simulate`), public.

The step-time model (kernels by tile and wave, attention per tile, memory-bound ops, host dispatch, the
optimizer as the target runs it; its constants in profiles/measurements/time_constants.json) and the memory
that lives outside the caching allocator (CUDA context, cuBLAS workspace; profiles/measurements/
cuda_constants.json), and the multi-GPU closed forms (ZeRO's model states per rank, the collectives' time over
the interconnect) are implemented in the simulator's private package `advisor._sim`; this module is the one way
in for everything outside it (the estimate, scripts, tests).
"""

from __future__ import annotations

from typing import Any

from ._sim import (
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
    context_bytes,
    cublas_workspace_bytes,
    cuda_constants,
    dequant_s,
    evaluate,
    gemm_s,
    memory_s,
    model_flops,
    offload_copy_s_per_token,
    optimizer_cost,
    optimizer_impl,
    peak_flops,
    replay,
    round_size,
    time_constants,
)

# the multi-GPU closed forms (advisor/_sim/distributed.py imports torch): imported on first use (PEP 562)
_LAZY = ("zero_bytes", "ZeroTerms", "comm_time_s", "interconnect")

__all__ = [
    "Basis", "BatchDistribution", "BatchLayout", "BatchPoint", "OptimizerImpl", "StepCost", "Term", "TimingHook",
    "attention_kind", "attention_tile_s", "batch_distribution", "context_bytes", "cublas_workspace_bytes",
    "cuda_constants", "dequant_s", "evaluate", "gemm_s", "memory_s", "model_flops", "offload_copy_s_per_token",
    "optimizer_cost", "optimizer_impl", "peak_flops", "replay", "round_size", "time_constants", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import _sim

    value = getattr(_sim, name)
    globals()[name] = value
    return value

