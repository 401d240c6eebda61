"""The analytic estimate: peak memory by category and step time of one candidate, in microseconds.

It follows the path TRL 1.16's SFTTrainer really takes (the fused, tiled LM head of `trl/kernels/chunked_logprob.py`;
the parts are counted in `advisor/_estimate/`: the micro-batches, the memory parts and the step-time terms; the
architecture, the knobs modelled in closed form and the step-time model itself come from the physics package
`advisor/_physics/`, which the simulator shares). Here they are placed at the moments of a training step; the peak is
the largest:
- the end of the forward (activations saved for backward, the autocast weight cache, the LM head's tiles and,
  when gradients accumulate over micro-batches, the previous micro-batches' gradients);
- the start of the backward (the last checkpointed layer recomputed while the others' activations are held);
- the optimizer step (every gradient, the optimizer state and the optimizer's own temporaries).
Backward lies between them: activations are freed layer by layer as gradients appear.

Step time: the step-time model both backends share (advisor/_physics/timing/) with its terms in closed form
(`_estimate/step_time.py`), expected over the same batch distribution, so the two backends rank alike. DPO and
reward modelling are approximated from the SFT estimate of their pairs (below).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._estimate import (
    LM_HEAD_FP32_VECTORS,
    RESERVED_FACTOR,
    TOKEN_CHUNK,
    VOCAB_CHUNK,
    BatchShape,
    MemoryParts,
    MiB,
    estimate_online_rl,
    expected_step_time,
    kto_adjustment,
    memory_parts,
    outside_allocator_bytes,
)
from ._physics import (
    DTYPE_BYTES,
    Architecture,
    architecture,
    knob_memory_savings,
    knob_time,
    lora_parameters,
    quantized_linear_bytes,
)
from .measurement import Category, Measurement, Source, Status
from .space import Precision, WeightsDtype
from .trainers.phases import ClosedForm

if TYPE_CHECKING:
    from .space import Candidate
    from .workload import Workload

__all__ = [  # noqa: RUF022
    "estimate", "memory_parts", "MemoryParts", "architecture", "Architecture", "lora_parameters",
    "quantized_linear_bytes", "BatchShape", "knob_memory_savings", "knob_time", "MiB", "RESERVED_FACTOR",
    "TOKEN_CHUNK", "VOCAB_CHUNK", "LM_HEAD_FP32_VECTORS", "estimate_online_rl",
]


def estimate(workload: Workload, candidate: Candidate) -> Measurement:
    """Peak memory by category and step time of `candidate`; status ok (the search decides what fits). What the
    step's phases reserve outside PyTorch's allocator (Category.OUTSIDE_ALLOCATOR) is in its device bytes."""
    trainer = _trainer(workload)
    m = _CLOSED_FORMS[trainer.closed_form](workload, candidate)  # the kind the trainer declares
    if trainer.closed_form in _PLACES_OUTSIDE_ALLOCATOR:
        return m
    return m.plus_outside_allocator(trainer.outside_allocator_bytes(candidate, workload.gpu.memory_bytes))


def _sft_closed_form(workload: Workload, candidate: Candidate, adjust: Any = None) -> Measurement:
    """SFT's step; `adjust(moments, parts)`: a trainer's own step around the policy's (KTO: the reference, the KL
    batch), applied to the moments before they are sharded over ranks."""
    c = candidate
    gpu = workload.gpu
    cuda = gpu.is_cuda
    arch = architecture(workload.model)
    p = memory_parts(workload, c)
    worst = p.batch
    act_bytes = 2 if (c.precision is not Precision.FP32 or c.weights_dtype is not WeightsDtype.FLOAT32) else 4
    grad_bytes = 4 if c.use_lora else DTYPE_BYTES[c.weights_dtype]
    params, optimizer, grads, activations = p.parameters, p.optimizer, p.gradients, p.activations
    lm_saved, lm_peak = p.lm_head_saved, p.lm_head_temporaries
    recompute, opt_temp = p.recompute, p.optimizer_temporaries

    grads_before = grads if c.gradient_accumulation_steps > 1 else 0
    head_grad = 0 if c.use_lora else arch.vocab * arch.hidden * grad_bytes
    forward_end = {
        Category.PARAMETERS: params,
        Category.OPTIMIZER: optimizer,
        Category.GRADIENTS: grads_before,
        Category.ACTIVATIONS: activations,
        Category.LM_HEAD: lm_saved + lm_peak,
        Category.TEMPORARIES: 0,
    }
    # after the LM head's backward, the last checkpointed layer is recomputed while every other layer's
    # activations are still held
    backward_start = {
        Category.PARAMETERS: params,
        Category.OPTIMIZER: optimizer,
        Category.GRADIENTS: max(grads_before, head_grad),
        Category.ACTIVATIONS: activations,
        Category.LM_HEAD: worst.rows * worst.seq * arch.hidden * act_bytes,
        Category.TEMPORARIES: recompute,
    }
    step_end = {
        Category.PARAMETERS: params,
        Category.OPTIMIZER: optimizer,
        Category.GRADIENTS: grads,
        Category.ACTIVATIONS: 0,
        Category.LM_HEAD: 0,
        Category.TEMPORARIES: opt_temp,
    }
    moments = {"end of the forward": forward_end, "start of the backward": backward_start, "optimizer step": step_end}
    if adjust is not None:
        moments = adjust(moments, p)
    rank_notes: list[str] = []
    if workload.num_gpus > 1:  # one rank of N: the model states sharded as the candidate's parallelism shards them
        from ._physics import estimate_rank_moments

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
        from ._physics import estimate_rank_time

        step_time, trained_per_step, exposed, comm_note = estimate_rank_time(workload, c, step_time,
                                                                              trained_per_step)
        terms["communication_exposed"] = exposed
        rank_notes.append(comm_note)
    notes = [
        f"LM head: TRL's fused tiled head, {'labelled positions only (CUDA)' if cuda else 'every position (CPU)'}",
        f"peak at the {when}",
        f"step time: the step-time model's terms in closed form (advisor/_physics/timing/) on {gpu.name}, expected "
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
        peak_batch=f"{worst.rows}x{worst.seq}",
        notes=tuple(notes),
    )


# ---- DPO (approximate) -----------------------------------------------------------------------------------------
_PAIR_ROWS: dict[int, tuple[Any, Any]] = {}  # id(preference data) -> (the data, its rows as SFT rows)


def _trainer(workload: Workload) -> Any:
    from .trainers import get_trainer

    return get_trainer(workload.trainer)


def _pair_rows(data: Any) -> Any:
    """Preference pairs as SFT rows: prompt + chosen and prompt + rejected, each its own row, the completion
    trained. A micro-batch of 2B such rows pads as DPO's B pairs do (chosen and rejected share the batch)."""
    held = _PAIR_ROWS.get(id(data))
    if held is not None and held[0] is data:
        return held[1]
    from .data import TokenizedDataset

    rows = []
    for p, ch, rj in zip(data.prompt_lengths, data.chosen_lengths, data.rejected_lengths, strict=True):
        for full in (int(ch), int(rj)):
            rows.append({"input_ids": [0] * full, "completion_mask": [0] * int(p) + [1] * (full - int(p))})
    proxy = TokenizedDataset(name=f"{data.name} (pairs as rows)", source=data.source, rows=tuple(rows),
                             completion_only_loss=True)
    if len(_PAIR_ROWS) > 4:
        _PAIR_ROWS.clear()
    _PAIR_ROWS[id(data)] = (data, proxy)
    return proxy


def _estimate_dpo(workload: Workload, candidate: Candidate) -> Measurement:
    """DPO in closed form, approximately: the SFT estimate of 2B sequences a micro-batch of B pairs (chosen and
    rejected), plus the reference: a second copy of the weights (full fine-tuning without precompute), nothing
    (LoRA: the policy with its adapters disabled; precompute_ref_log_probs: log-probs computed before training),
    and its no-grad forward's time (about a third of a forward + backward) unless precomputed."""
    import dataclasses

    from .trainers.dpo import DPOKnobs, Reference

    c = candidate
    ref = DPOKnobs.of(c).reference(c)
    proxy = dataclasses.replace(workload, dataset=_pair_rows(workload.dataset), trainer="sft")
    base = {k: v for k, v in c.base.as_dict().items() if k not in ("precompute_ref_log_probs",
                                                                   "precompute_ref_batch_size", "sync_ref_model")}
    sft_c = c.replace(per_device_train_batch_size=2 * c.per_device_train_batch_size, packing=False,
                      padding_free=False, base=base)
    m = estimate(proxy, sft_c)
    arch = architecture(workload.model)
    ref_bytes = arch.total * DTYPE_BYTES[c.weights_dtype] + arch.buffer_bytes if ref is Reference.SEPARATE_COPY \
        else 0
    cuda = workload.gpu.is_cuda
    peak = int(m.peak_bytes + ref_bytes)
    reserved = int(peak * RESERVED_FACTOR[bool(c.expandable_segments)]) if cuda else peak
    device = reserved + outside_allocator_bytes(workload.gpu) if cuda else peak
    breakdown = dict(m.breakdown)
    breakdown[Category.PARAMETERS.value] = breakdown.get(Category.PARAMETERS.value, 0) + ref_bytes
    slow = 1.0 if ref is Reference.PRECOMPUTED else 4.0 / 3.0
    step = m.step_time_s * slow if m.step_time_s else m.step_time_s
    notes = [f"dpo (approximate): SFT's closed form on 2B sequences a micro-batch of B pairs; the reference: "
             f"{ref.value.replace('_', ' ')}" + (f" (+{ref_bytes / 2**30:.2f} GiB of weights)" if ref_bytes else "")
             + ("" if ref is Reference.PRECOMPUTED else "; its no-grad forward taken as a third of the step's "
                "compute"), *m.notes]
    return dataclasses.replace(
        m, peak_bytes=peak, reserved_bytes=reserved, device_bytes=device, breakdown=breakdown, step_time_s=step,
        tokens_per_second=(m.trained_tokens_per_step / step) if step and m.trained_tokens_per_step else None,
        worst_step_time_s=m.worst_step_time_s * slow if m.worst_step_time_s else m.worst_step_time_s,
        peak_batch=f"{c.per_device_train_batch_size} pairs ({m.peak_batch})", notes=tuple(notes))


def _estimate_reward(workload: Workload, candidate: Candidate) -> Measurement:
    """Reward modelling in closed form, approximately: the SFT estimate of 2B sequences a micro-batch of B pairs
    (RewardTrainer runs chosen and rejected together) without the LM head's logits (a one-label score head)."""
    import dataclasses

    c = candidate
    proxy = dataclasses.replace(workload, dataset=_pair_rows(workload.dataset), trainer="sft")
    m = estimate(proxy, c.replace(per_device_train_batch_size=2 * c.per_device_train_batch_size, packing=False,
                                  padding_free=False))
    head = int(m.breakdown.get(Category.LM_HEAD.value, 0))
    cuda = workload.gpu.is_cuda
    peak = int(m.peak_bytes - head)
    reserved = int(peak * RESERVED_FACTOR[bool(c.expandable_segments)]) if cuda else peak
    device = reserved + outside_allocator_bytes(workload.gpu) if cuda else peak
    breakdown = {**m.breakdown, Category.LM_HEAD.value: 0}
    notes = ("reward (approximate): SFT's closed form on 2B sequences a micro-batch of B pairs, the LM head's "
             "logits left out (a one-label score head)", *m.notes)
    return dataclasses.replace(m, peak_bytes=peak, reserved_bytes=reserved, device_bytes=device, breakdown=breakdown,
                               peak_batch=f"{c.per_device_train_batch_size} pairs ({m.peak_batch})", notes=notes)


def _estimate_kto(workload: Workload, candidate: Candidate) -> Measurement:
    """KTO in closed form (advisor/_estimate/kto.py): the policy's step on B examples placed as SFT's, with the
    reference (a separate copy's weights; its no-grad forwards while the policy's activations are held) and the KL
    batch's no-grad forward; the extra forwards' time a third of a forward and backward's each."""
    import dataclasses

    from .trainers.dpo import Reference
    from .trainers.kto import KTOKnobs

    c = candidate
    k = KTOKnobs.of(c)
    ref = k.reference(c)
    adjust, slow = kto_adjustment(workload, c, reference_copy=ref is Reference.SEPARATE_COPY,
                                  reference_forwards=ref is not Reference.PRECOMPUTED, kl=k.kl)
    m = _sft_closed_form(workload, c, adjust)
    step = m.step_time_s * slow if m.step_time_s else m.step_time_s
    notes = (f"kto: the policy's step on {c.per_device_train_batch_size} examples, "
             + ("the KL batch's no-grad forward, " if k.kl else "no KL batch (apo_zero_unpaired), ")
             + f"the reference: {ref.value.replace('_', ' ')}"
             + ("" if ref is Reference.PRECOMPUTED else " (its no-grad forwards while the activations are held)")
             + f"; {slow:.2f}x the policy's step time for the no-grad forwards (each a third of a forward and "
             "backward)", *m.notes)
    return dataclasses.replace(
        m, step_time_s=step, notes=notes,
        tokens_per_second=(m.trained_tokens_per_step / step) if step and m.trained_tokens_per_step else None,
        worst_step_time_s=m.worst_step_time_s * slow if m.worst_step_time_s else m.worst_step_time_s,
        peak_batch=f"{c.per_device_train_batch_size} examples ({m.peak_batch})")


# The closed form of each kind of step a trainer declares (advisor/trainers/phases.py ClosedForm): the trainers
# name the kind and never import the estimate.
_CLOSED_FORMS = {
    ClosedForm.ROWS: _sft_closed_form,
    ClosedForm.PAIRS_WITH_REFERENCE: _estimate_dpo,
    ClosedForm.PAIRS_SCORED: _estimate_reward,
    ClosedForm.UNPAIRED_WITH_KL: _estimate_kto,
    ClosedForm.ONLINE_RL: estimate_online_rl,  # advisor/_estimate/online_rl.py over advisor/_physics/online_rl.py
}
# closed forms that place what the step holds outside PyTorch's allocator phase by phase themselves (colocated vLLM's
# pool while generating and, asleep, what it keeps while training: advisor/_physics/online_rl.py device_peak); the
# trainer's phase fractions would count the pool a second time
_PLACES_OUTSIDE_ALLOCATOR = frozenset({ClosedForm.ONLINE_RL})
