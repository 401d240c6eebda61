"""The analytic estimate: peak memory by category and step time of one candidate, in microseconds.

It follows the path TRL 1.16's SFTTrainer really takes (the fused, tiled LM head of `trl/kernels/chunked_logprob.py`;
the parts are counted in this package's modules: the micro-batches, the memory parts and the step-time terms; the
architecture, the knobs modelled in closed form and the step-time model itself come from the physics package
`advisor/physics/`, which the simulator shares). Here they are placed at the moments of a training step; the peak is
the largest:
- the end of the forward (activations saved for backward, the autocast weight cache, the LM head's tiles and,
  when gradients accumulate over micro-batches, the previous micro-batches' gradients);
- the start of the backward (the last checkpointed layer recomputed while the others' activations are held);
- the optimizer step (every gradient, the optimizer state and the optimizer's own temporaries).
Backward lies between them: activations are freed layer by layer as gradients appear.

Step time: the step-time model both backends share (advisor/physics/timing/) with its terms in closed form
(`step_time.py`), expected over the same batch distribution, so the two backends rank alike.

Each trainer is estimated as its step declares itself (`Trainer.step_shape`, advisor/trainers/protocol.py
`StepShape`): the step over the data's sequences (`Dataset.sequences`: a preference pair is two, so a micro-batch of
B pairs runs 2B), its LM head's logits or a one-label score, a resident reference copy and the reference's no-grad
forward; a step that generates is online RL's closed form (`online_step.py`).

The package's modules (`micro_batches`, `memory`, `no_grad`, `step_time`, `online_step`) are private to it: the rest of
advisor, scripts and tests use the names in `__all__` (tests/test_privacy.py). Nothing here imports the simulator.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..measurement import Category, Measurement, Source, Status
from ..physics import (
    DTYPE_BYTES,
    Architecture,
    architecture,
    estimate_rank_moments,
    estimate_rank_time,
    knob_memory_savings,
    knob_time,
    lora_parameters,
    quantized_linear_bytes,
    resident_bytes,
    time_constants,
    time_detail,
)
from ..space import Precision, WeightsDtype
from ..trainers import trainer_of
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

if TYPE_CHECKING:
    from ..space import Candidate
    from ..trainers import StepShape
    from ..workload import Workload

__all__ = [  # noqa: RUF022
    "estimate", "memory_parts", "MemoryParts", "architecture", "Architecture", "lora_parameters",
    "quantized_linear_bytes", "BatchShape", "knob_memory_savings", "knob_time", "MiB", "RESERVED_FACTOR",
    "TOKEN_CHUNK", "VOCAB_CHUNK", "LM_HEAD_FP32_VECTORS", "estimate_online_rl",
    # the estimate's parts (micro_batches, memory, no_grad, step_time), for the search, the simulator's tests, scripts
    "batches", "outside_allocator_bytes", "expected_step_time", "no_grad_adjustment", "no_grad_forwards",
]


def estimate(workload: Workload, candidate: Candidate) -> Measurement:
    """Peak memory by category and step time of `candidate`; status ok (the search decides what fits). What the
    step reserves outside PyTorch's allocator (colocated vLLM: Category.OUTSIDE_ALLOCATOR) is in its device bytes."""
    trainer = trainer_of(workload)
    shape = trainer.step_shape(candidate)
    if shape.generates:
        return estimate_online_rl(workload, candidate, trainer.knobs(candidate), trainer)
    m = _rows_closed_form(workload, candidate) if shape.plain else \
        _sequences_closed_form(workload, candidate, shape, trainer.name)
    return _with_models(workload, candidate, m) if workload.models else m


def _with_models(workload: Workload, candidate: Candidate, m: Measurement) -> Measurement:
    """The models given beside the policy (`Workload.models`, a trainer's ModelInputs), resident through the step:
    their weights at the policy's element size added to every moment's bytes."""
    c = candidate
    extra = resident_bytes((spec for _, spec in workload.models), DTYPE_BYTES[c.weights_dtype])
    cuda = workload.gpu.is_cuda
    peak = int(m.peak_bytes + extra)
    reserved = int(peak * RESERVED_FACTOR[bool(c.expandable_segments)]) if cuda else peak
    device = reserved + outside_allocator_bytes(workload.gpu) if cuda else peak
    breakdown = {**m.breakdown, Category.PARAMETERS.value: m.breakdown.get(Category.PARAMETERS.value, 0) + extra}
    note = (f"models beside the policy ({', '.join(spec.name for _, spec in workload.models)}): resident, "
            f"+{extra / 2**30:.2f} GiB of weights")
    return dataclasses.replace(m, peak_bytes=peak, reserved_bytes=reserved, device_bytes=device, breakdown=breakdown,
                               notes=(*m.notes, note))


def _moments(workload: Workload, c: Candidate, p: MemoryParts) -> dict[str, dict[Category, int]]:
    """What the step holds at its moments: the end of the forward, the start of the backward (after the LM head's
    backward, the last checkpointed layer recomputed while every other layer's activations are still held) and the
    optimizer step."""
    arch = architecture(workload.model)
    worst = p.batch
    act_bytes = 2 if (c.precision is not Precision.FP32 or c.weights_dtype is not WeightsDtype.FLOAT32) else 4
    grad_bytes = 4 if c.use_lora else DTYPE_BYTES[c.weights_dtype]
    grads_before = p.gradients if c.gradient_accumulation_steps > 1 else 0
    head_grad = 0 if c.use_lora else arch.vocab * arch.hidden * grad_bytes
    state = {Category.PARAMETERS: p.parameters, Category.OPTIMIZER: p.optimizer}
    return {
        "end of the forward": {**state, Category.GRADIENTS: grads_before, Category.ACTIVATIONS: p.activations,
                               Category.LM_HEAD: p.lm_head_saved + p.lm_head_temporaries, Category.TEMPORARIES: 0},
        "start of the backward": {**state, Category.GRADIENTS: max(grads_before, head_grad),
                                  Category.ACTIVATIONS: p.activations,
                                  Category.LM_HEAD: worst.rows * worst.seq * arch.hidden * act_bytes,
                                  Category.TEMPORARIES: p.recompute},
        "optimizer step": {**state, Category.GRADIENTS: p.gradients, Category.ACTIVATIONS: 0, Category.LM_HEAD: 0,
                           Category.TEMPORARIES: p.optimizer_temporaries},
    }


def _rows_closed_form(workload: Workload, candidate: Candidate, adjust: Any = None) -> Measurement:
    """The step over the dataset's rows as they are: the policy, its gradients and optimizer state, the
    activations and TRL's fused LM head, at the moments of a step; `adjust(moments, parts)`: what a step adds
    around the policy's (its no-grad forwards: `estimator/no_grad.py`), before the moments are sharded over ranks."""
    c = candidate
    gpu = workload.gpu
    cuda = gpu.is_cuda
    arch = architecture(workload.model)
    p = memory_parts(workload, c)
    worst = p.batch
    moments = _moments(workload, c, p)
    if adjust is not None:
        moments = adjust(moments, p)
    rank_notes: list[str] = []
    if workload.num_gpus > 1:  # one rank of N: the model states sharded as the candidate's parallelism shards them

        moments, rank_notes = estimate_rank_moments(workload, c, moments, p)
    when, moment = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    peak = int(sum(moment.values()))
    reserved = int(peak * RESERVED_FACTOR[bool(c.expandable_segments)]) if cuda else peak
    device = reserved + outside_allocator_bytes(gpu) if cuda else peak

    # the offloader's copies move every activation it is handed (MemoryParts.offload_volume), not only what stays
    timed = expected_step_time(workload, arch, c, worst, p.offload_volume)
    step_time, trained_per_step = timed.step_s, int(round(timed.trained_per_step))
    terms = dict(timed.terms)
    if workload.num_gpus > 1:  # global throughput: every rank's tokens over the step with the collectives' time

        step_time, trained_per_step, exposed, comm_note = estimate_rank_time(workload, c, step_time,
                                                                              trained_per_step)
        terms["communication_exposed"] = exposed
        rank_notes.append(comm_note)
    notes = [
        f"LM head: TRL's fused tiled head, {'labelled positions only (CUDA)' if cuda else 'every position (CPU)'}",
        f"peak at the {when}",
        f"step time: the step-time model's terms in closed form (advisor/physics/timing/) on {gpu.name}, expected "
        "over the batches the sampler makes",
        *rank_notes,
    ]
    return Measurement(
        status=Status.OK,
        source=Source.ESTIMATE,
        peak_bytes=peak,
        reserved_bytes=reserved,
        device_bytes=device,
        breakdown={k.value: int(v) for k, v in moment.items()},
        step_time_s=step_time,
        tokens_per_second=trained_per_step / step_time if step_time > 0 else None,
        trained_tokens_per_step=trained_per_step,
        time_breakdown=terms,
        mfu=timed.mfu,
        worst_step_time_s=timed.worst_step_s,
        time_detail=time_detail(timed, time_constants(gpu)),
        peak_batch=f"{worst.rows}x{worst.seq}",
        notes=tuple(notes),
    )


# ---- a step over sequences a row, a score head, a reference (approximate) -----------------------------------------
_SEQUENCES: dict[int, tuple[Any, Any]] = {}  # id(dataset) -> (the dataset, its sequences as rows)


def _sequences(data: Any) -> Any:
    """`data.sequences()`, the same object for the same dataset (the micro-batch and sampler caches key on it)."""
    held = _SEQUENCES.get(id(data))
    if held is not None and held[0] is data:
        return held[1]
    rows = data.sequences()
    if len(_SEQUENCES) > 4:
        _SEQUENCES.clear()
    _SEQUENCES[id(data)] = (data, rows)
    return rows


def _sequences_closed_form(workload: Workload, candidate: Candidate, shape: StepShape, name: str) -> Measurement:
    """A step over `shape.sequences_per_row` sequences a row, approximately: the rows' closed form on the data's
    sequences (`Dataset.sequences`: a micro-batch of B pairs runs 2B sequences, padded together), with a resident
    reference copy of the weights (`reference_copy`), the LM head's logits left out for a one-label score head
    (`lm_head` False), and a reference's no-grad forward taken as a third of the step's compute
    (`reference_forward`); the further batches' no-grad forwards and the reference's held ones where the shape
    declares them (`no_grad_batches`, `reference_held`: advisor/estimator/no_grad.py), each a third of the step's
    compute."""
    c = candidate
    per_row = shape.sequences_per_row
    rows = dataclasses.replace(workload, dataset=_sequences(workload.dataset))
    seq = c.replace(per_device_train_batch_size=per_row * c.per_device_train_batch_size, packing=False,
                    padding_free=False)
    m = _rows_closed_form(rows, seq, no_grad_adjustment(rows, seq, shape))
    arch = architecture(workload.model)
    ref_bytes = arch.total * DTYPE_BYTES[c.weights_dtype] + arch.buffer_bytes if shape.reference_copy else 0
    head = 0 if shape.lm_head else int(m.breakdown.get(Category.LM_HEAD.value, 0))
    cuda = workload.gpu.is_cuda
    peak = int(m.peak_bytes + ref_bytes - head)
    reserved = int(peak * RESERVED_FACTOR[bool(c.expandable_segments)]) if cuda else peak
    device = reserved + outside_allocator_bytes(workload.gpu) if cuda else peak
    breakdown = dict(m.breakdown)
    if ref_bytes:
        breakdown[Category.PARAMETERS.value] = breakdown.get(Category.PARAMETERS.value, 0) + ref_bytes
    if not shape.lm_head:
        breakdown[Category.LM_HEAD.value] = 0
    unit = workload.dataset.unit
    reference = ""
    if shape.reference_precomputed:
        reference = "; the reference: its log-probs precomputed before training (no model kept)"
    elif shape.reference_copy or shape.reference_forward:
        reference = "; the reference: " + (f"a resident copy (+{ref_bytes / 2**30:.2f} GiB of weights)"
                                           if ref_bytes else "no copy resident (the adapters disabled)")
        reference += ", its no-grad forward taken as a third of the step's compute" if shape.reference_forward else ""
    further = (f"; {shape.no_grad_batches} further batch(es) of its shape through the policy under no_grad before "
               "its trained forward" if shape.no_grad_batches else "")
    held = "; the reference's forwards while the activations are held" if shape.reference_held and \
        shape.reference_forward else ""
    notes = [f"{name} (approximate): the rows' closed form on {per_row}B sequences a micro-batch of B {unit}"
             + ("; a one-label score head (the LM head's logits left out)" if not shape.lm_head else "")
             + further + reference + held, *m.notes]
    out = dataclasses.replace(m, peak_bytes=peak, reserved_bytes=reserved, device_bytes=device, breakdown=breakdown,
                              peak_batch=f"{c.per_device_train_batch_size} {unit} ({m.peak_batch})",
                              notes=tuple(notes))
    forwards = no_grad_forwards(shape)
    if not forwards:
        return out
    slow = 1.0 + forwards / 3.0
    step = m.step_time_s * slow if m.step_time_s else m.step_time_s
    return dataclasses.replace(
        out, step_time_s=step,
        tokens_per_second=(m.trained_tokens_per_step / step) if step and m.trained_tokens_per_step else None,
        worst_step_time_s=m.worst_step_time_s * slow if m.worst_step_time_s else m.worst_step_time_s)
