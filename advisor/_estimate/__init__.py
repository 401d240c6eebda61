"""The estimate's parts, private to `advisor/estimator.py` (which places them at the moments of a step) and to the
simulator, which shares the closed forms of what fake tensors cannot run: the architecture's shapes, the
micro-batches, the memory parts, the step-time terms and the modelled knobs. Import from here, never from the
modules inside."""

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
from .modelled import knob_memory_savings, knob_time
from .shapes import DTYPE_BYTES, Architecture, architecture, lora_parameters, quantized_linear_bytes
from .step_time import expected_step_time

__all__ = [  # noqa: RUF022
    "Architecture", "architecture", "lora_parameters", "quantized_linear_bytes", "DTYPE_BYTES",
    "BatchShape", "batches",
    "MemoryParts", "memory_parts", "outside_allocator_bytes", "MiB", "RESERVED_FACTOR", "TOKEN_CHUNK", "VOCAB_CHUNK",
    "LM_HEAD_FP32_VECTORS",
    "knob_memory_savings", "knob_time",
    "expected_step_time",
]
