"""KTO's step in closed form, around the policy's: what KTOTrainer adds to an SFT-like step over the same B
examples (`estimator._sft_closed_form` places the policy's parts at the moments of the step, then this adjusts them).

Per micro-batch (KTOTrainer._compute_loss): the policy under no_grad on the KL batch (the same prompts, the
micro-batch's completions rotated by one: B sequences bounded by the same `max_length`; counted at the examples'
shape), then the policy's trained forward and backward on the B examples, with, between them, the reference under
no_grad on the KL batch and on the examples while the policy's activations are held. A no-grad forward holds, beyond
the weights, the residual stream and one decoder layer's intermediates at a time, or TRL's fused head's tile: the
larger. A separate reference adds its weights to every moment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .._physics import DTYPE_BYTES, architecture
from ..measurement import Category
from ..space import Precision, WeightsDtype
from .memory import MemoryParts, _layer_activation_bytes, _lm_head_bytes

if TYPE_CHECKING:
    from ..space import Candidate
    from ..workload import Workload

Moments = dict[str, dict[Category, int]]


def no_grad_forward_bytes(workload: Workload, c: Candidate, parts: MemoryParts) -> int:
    """The most a no-grad forward of the worst micro-batch holds beyond the weights."""
    arch = architecture(workload.model)
    batch = parts.batch
    mixed = c.precision is not Precision.FP32
    a = 2 if (mixed or c.weights_dtype is not WeightsDtype.FLOAT32) else 4
    autocast = mixed and c.weights_dtype is WeightsDtype.FLOAT32
    resid = 4 if autocast else a
    tokens = batch.rows * batch.seq
    layer = _layer_activation_bytes(arch, c, batch, a, resid) + 2 * tokens * arch.hidden * resid + batch.mask_bytes
    head = _lm_head_bytes(arch, c, batch, workload.gpu.is_cuda, a, DTYPE_BYTES[c.weights_dtype], autocast)[1]
    return int(max(layer, head))


def reference_bytes(workload: Workload, c: Candidate) -> int:
    """A separate reference copy: the policy's weights in its dtype, and its buffers."""
    arch = architecture(workload.model)
    return int(arch.total * DTYPE_BYTES[c.weights_dtype] + arch.buffer_bytes)


def kto_adjustment(workload: Workload, c: Candidate, *, reference_copy: bool, reference_forwards: bool, kl: bool
                   ) -> tuple[Callable[[Moments, MemoryParts], Moments], float]:
    """(what turns the policy's moments into KTO's, the step time's factor for the extra no-grad forwards: each a
    third of a forward and backward's compute)."""
    ref = reference_bytes(workload, c) if reference_copy else 0

    def adjust(moments: Moments, parts: MemoryParts) -> Moments:
        forward = no_grad_forward_bytes(workload, c, parts)
        out = {when: {**m, Category.PARAMETERS: m[Category.PARAMETERS] + ref} for when, m in moments.items()}
        end = out["end of the forward"]
        if reference_forwards:  # the reference's forwards while the policy's activations are held
            end[Category.TEMPORARIES] = end.get(Category.TEMPORARIES, 0) + forward
        if kl:  # the policy's no-grad forward of the KL batch, before its trained forward
            out["the KL batch's forward"] = {**{k: 0 for k in end}, Category.PARAMETERS: end[Category.PARAMETERS],
                                              Category.OPTIMIZER: end[Category.OPTIMIZER],
                                              Category.GRADIENTS: end[Category.GRADIENTS],
                                              Category.TEMPORARIES: forward}
        return out

    extra = int(kl) + (1 + int(kl) if reference_forwards else 0)
    return adjust, 1.0 + extra / 3.0
