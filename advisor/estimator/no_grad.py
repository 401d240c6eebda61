"""The no-grad forwards a step runs besides its trained one (a trainer's `StepShape`: `no_grad_batches`,
`reference_forward`, `reference_held`), in closed form around the policy's step (`estimator._rows_closed_form`
places the policy's parts at the moments of the step, then this adjusts them).

A no-grad forward of a batch of the micro-batch's shape holds, beyond the weights, the residual stream and one
decoder layer's intermediates at a time, or TRL's fused head's tile: the larger. The policy's no-grad forwards of
the further batches (`no_grad_batches`: KTO's KL batch) run before its trained forward: a moment of their own, with
the model states. The reference's, while the policy's activations are held (`reference_held`), add one such forward
to the end of the forward. Each no-grad forward costs a third of a forward and backward's compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..measurement import Category
from ..physics import DTYPE_BYTES, architecture
from ..space import Precision, WeightsDtype
from .memory import MemoryParts, _layer_activation_bytes, _lm_head_bytes

if TYPE_CHECKING:
    from ..space import Candidate
    from ..trainers import StepShape
    from ..workload import Workload

Moments = dict[str, dict[Category, int]]
BEFORE_THE_FORWARD = "the no-grad forwards before the trained one"


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


def no_grad_forwards(shape: StepShape) -> int:
    """The no-grad forwards a step runs besides its trained one: the policy's of the further batches, the
    reference's of the micro-batch and of those batches."""
    return shape.no_grad_batches + ((1 + shape.no_grad_batches) if shape.reference_forward else 0)


def no_grad_adjustment(workload: Workload, c: Candidate, shape: StepShape
                       ) -> Callable[[Moments, MemoryParts], Moments] | None:
    """What turns the policy's moments into the step's with its no-grad forwards (None: nothing to count)."""
    held = shape.reference_forward and shape.reference_held
    if not (held or shape.no_grad_batches):
        return None

    def adjust(moments: Moments, parts: MemoryParts) -> Moments:
        forward = no_grad_forward_bytes(workload, c, parts)
        out = {when: dict(m) for when, m in moments.items()}
        end = out["end of the forward"]
        if held:  # the reference's forwards while the policy's activations are held
            end[Category.TEMPORARIES] = end.get(Category.TEMPORARIES, 0) + forward
        if shape.no_grad_batches:  # the policy's no-grad forwards, before its trained forward: the model states
            out[BEFORE_THE_FORWARD] = {**{k: 0 for k in end}, Category.PARAMETERS: end[Category.PARAMETERS],
                                       Category.OPTIMIZER: end[Category.OPTIMIZER],
                                       Category.GRADIENTS: end[Category.GRADIENTS], Category.TEMPORARIES: forward}
        return out

    return adjust
