"""The estimate's parts, private to `advisor/estimator.py`, which places them at the moments of a step: the
micro-batches, the memory parts and the step-time terms counted in closed form. What the estimate shares with the
simulator (the model's shapes, the modelled knobs, the step-time model, the allocator's rules, the multi-GPU closed
forms) lives in `advisor/physics/`, below both; nothing here imports the simulator. Import from here, never from
the modules inside."""

from .memory import (
    LM_HEAD_FP32_VECTORS,
    RESERVED_FACTOR,
    TOKEN_CHUNK,
    VOCAB_CHUNK,
    MemoryParts,
    MiB,
    memory_parts,
    outside_allocator_bytes,
)
from .micro_batches import BatchShape, batches
from .no_grad import no_grad_adjustment, no_grad_forwards
from .online_step import estimate_online_rl
from .step_time import expected_step_time

__all__ = [  # noqa: RUF022
    "BatchShape", "batches",
    "MemoryParts", "memory_parts", "outside_allocator_bytes", "MiB", "RESERVED_FACTOR", "TOKEN_CHUNK", "VOCAB_CHUNK",
    "LM_HEAD_FP32_VECTORS",
    "expected_step_time",
    "estimate_online_rl",
    "no_grad_adjustment", "no_grad_forwards",
]
