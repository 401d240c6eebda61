"""Online RL (GRPO, RLOO) and on-policy distillation in closed form: the estimate of a step that generates (a
trainer's `StepShape.generates`).

The step's shape is built from the workload, the candidate and the trainer's knob view (TRL 1.16's names, the
trainer's defaults resolved: advisor/trainers/online_knobs.py), its phases counted by the physics package
(advisor/physics/online_step.py, online_costs.py: the KV cache of transformers' generate, TRL's fused log-prob head,
the scoring forwards, the reference, ZeRO-3's gathers, colocated vLLM's pool and refusals; distillation.py: the
resident teacher (the model input the trainer's step distills from, `StepShape.distills_from`), its no-grad forward
and the chunked divergence over the vocabulary), and the training
micro-batch's own parts (parameters, gradients, optimizer state, saved activations) by the SFT estimate's
`memory_parts` on the rows GRPO trains: `per_device_train_batch_size` completions of the longest prompt +
`max_completion_length` tokens, the completion trained. The step time adds online RL's terms (generation, weight sync,
scoring forwards) to the training passes of the shared step-time model; the objective is trained completion tokens
per second end to end.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..data import TokenizedDataset
from ..errors import ConfigError
from ..measurement import Category, Measurement, Source, Status
from ..physics import (
    DTYPE_BYTES,
    architecture,
    estimate_rank_moments,
    estimate_rank_time,
    online_build_step,
    online_constants,
    online_Loss,
    online_phase_allocator_bytes,
    online_step_time_on,
    online_TrainingState,
    online_vllm_terms,
    online_VllmRefusal,
    peak_flops,
    resident_bytes,
    step_divergence,
    teacher_of,
    teacher_train_flops,
    time_constants,
    vllm_Mode,
    vllm_Sleep,
    vllm_TRL_SLEEP_LEVEL,
    vocabulary_note,
)
from ..physics import online_device_peak as device_peak
from ..space import Optimizer, Precision
from .memory import RESERVED_FACTOR, memory_parts, outside_allocator_bytes
from .step_time import expected_step_time

if TYPE_CHECKING:
    from ..space import Candidate
    from ..trainers import Trainer
    from ..workload import Workload

# where each part of a phase goes in a Measurement's breakdown
_CATEGORY = {
    "parameters": Category.PARAMETERS, "reference": Category.PARAMETERS, "reward_model": Category.PARAMETERS,
    "zero3_gather": Category.PARAMETERS, "optimizer_state": Category.OPTIMIZER, "gradients": Category.GRADIENTS,
    "activations": Category.ACTIVATIONS, "kv_cache": Category.ACTIVATIONS, "lm_head": Category.LM_HEAD,
    "scoring_forward": Category.TEMPORARIES, "generate_temporaries": Category.TEMPORARIES,
    "temporaries": Category.TEMPORARIES, "buffered_batch": Category.OTHER, "completion_ids": Category.OTHER,
    "teacher": Category.PARAMETERS, "teacher_forward": Category.TEMPORARIES,
}


def _completions(workload: Workload, rows: int, prompt: int, completion: int) -> Any:
    """The training micro-batch as the rows the estimate's parts count: `rows` sequences of prompt + completion,
    the completion trained."""
    row = {"input_ids": [0] * (prompt + completion), "completion_mask": [0] * prompt + [1] * completion}
    data = TokenizedDataset(name=f"{workload.dataset.name} (completions as rows)", source="synthetic",
                            rows=(row,) * rows, completion_only_loss=True)
    return dataclasses.replace(workload, dataset=data)


def _longest_prompt(workload: Workload) -> int:
    lengths = workload.dataset.lengths
    if len(lengths) == 0:
        raise ValueError("online RL's estimate needs the prompts' lengths (workload.dataset.lengths)")
    return int(max(lengths))


def build_step(workload: Workload, candidate: Candidate, knobs: Any, trainer: Trainer
               ) -> tuple[Any, Any, Any, Any]:
    """(the physics' OnlineStep, the training micro-batch's MemoryParts, its rows' workload, the candidate they are
    counted with), from the trainer's knob view `knobs` and its step's declaration (`step_shape`: the training pass
    without autocast, the model input it distills from; `input_dtype`: each model input's dtype)."""
    c, k = candidate, knobs
    shape = trainer.step_shape(c)
    gpu = workload.gpu
    arch = architecture(workload.model)
    b = c.per_device_train_batch_size
    world = max(1, workload.num_gpus)
    prompt = _longest_prompt(workload)
    completion = int(k.max_completion_length)
    rows = _completions(workload, b, prompt, completion)
    rows_c = c.replace(max_length=prompt + completion, packing=False, padding_free=False)
    if not shape.train_autocast:  # the training passes compute in the weights' dtype (DistillationTrainer)
        rows_c = rows_c.replace(precision=Precision.FP32)
    parts = memory_parts(rows, rows_c)
    weight_bytes = DTYPE_BYTES[c.weights_dtype]
    params, grads, optim = parts.parameters, parts.gradients, parts.optimizer
    separate = float(k.kl_beta) != 0 and not c.use_lora
    ref_bytes = arch.total * weight_bytes + arch.buffer_bytes if separate else 0
    beside = [(role, spec) for role, spec in workload.models if role != shape.distills_from]
    beside_bytes = sum(resident_bytes([spec], DTYPE_BYTES[trainer.input_dtype(c, role)]) for role, spec in beside)
    teacher_spec = workload.model_of(shape.distills_from) if shape.distills_from else None
    teacher_element = DTYPE_BYTES[trainer.input_dtype(c, shape.distills_from)] if teacher_spec is not None else 0
    teacher_arch = architecture(teacher_spec) if teacher_spec is not None else None
    teacher_bytes = teacher_arch.total * teacher_element + teacher_arch.buffer_bytes if teacher_arch else 0
    zero3 = False
    if world > 1:  # one rank of N: the model states as the candidate's parallelism shards them

        P, G, OPT = Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER
        one = {P: params, G: grads, OPT: optim, Category.ACTIVATIONS: 0, Category.LM_HEAD: 0,
               Category.TEMPORARIES: 0}
        sharded, _ = estimate_rank_moments(rows, rows_c, {"state": one}, parts)
        params, grads, optim = sharded["state"][P], sharded["state"][G], sharded["state"][OPT]
        strategy = c.parallelism.parallelism.strategy.value
        zero3 = strategy == "zero3"
        if zero3 or strategy == "fsdp2":  # the reference and the teacher are prepared (sharded) like the policy
            ref_bytes = -(-ref_bytes // world)
            teacher_bytes = -(-teacher_bytes // world)
    state = online_TrainingState(
        weights_bytes=params, gradient_bytes=grads, optimizer_bytes=optim, trainable=parts.trainable,
        prompt_length=prompt, reference_bytes=ref_bytes,
        model_inputs_bytes=beside_bytes,
        teacher=teacher_of(teacher_arch, weights_bytes=teacher_bytes, weight_element_bytes=teacher_element)
        if teacher_arch is not None else None,
        optimizer_temporary_bytes=_optimizer_temporaries(arch, c, gpu.is_cuda, parts.optimizer_temporaries),
        train_activation_bytes=parts.activations, train_recompute_bytes=parts.recompute, world_size=world,
        zero3=zero3)
    step = online_build_step(arch, workload.model.config, c, k, state, gpu,
                             # when vLLM snapshots the device no backward has run: the Python thread's cuBLAS
                             # workspace only
                             context_bytes=outside_allocator_bytes(gpu, threads=1) if gpu.is_cuda else 0)
    return step, parts, rows, rows_c


def _optimizer_temporaries(arch: Any, c: Candidate, cuda: bool, foreach_bytes: int) -> int:
    """The optimizer step's temporaries. `memory_parts` counts torch's foreach AdamW (one parameter-sized list: the
    CUDA path). On the CPU `adamw_torch` (transformers 5: AdamW with foreach=None) runs the single-tensor for-loop
    (torch/optim/optimizer.py _default_to_fused_or_foreach: foreach only when every tensor is on CUDA), whose
    `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` (torch/optim/adamw.py _single_tensor_adam) holds
    two temporaries of one parameter at a time: twice the largest trained tensor."""
    if cuda or c.optim is not Optimizer.ADAMW_TORCH:
        return foreach_bytes
    if c.use_lora:
        targets = set(c.lora_target_modules)
        largest = max((c.lora_r * max(i, o) for name, i, o in arch.linears if name in targets), default=0)
        return 2 * largest * 4
    largest = max([arch.vocab * arch.hidden] + [i * o for _, i, o in arch.linears])
    return 2 * largest * DTYPE_BYTES[c.weights_dtype]


def estimate_online_rl(workload: Workload, candidate: Candidate, knobs: Any, trainer: Trainer) -> Measurement:
    """Peak memory by phase and category, what vLLM holds outside the allocator, and the step time of one online
    optimizer step (`knobs`: the trainer's view of the candidate; `trainer`: its step's declaration); status OOM
    with vLLM's own refusal when colocated vLLM would not start."""
    c = candidate
    gpu = workload.gpu
    cuda = gpu.is_cuda
    if knobs.use_vllm and not cuda:
        return Measurement(status=Status.ERROR, source=Source.ESTIMATE,
                           message=f"use_vllm=True on {gpu.name}: vLLM generates on CUDA GPUs only; set "
                                   "use_vllm=False (transformers' generate) for a CPU target")
    try:
        step, parts, rows, rows_c = build_step(workload, c, knobs, trainer)
    except ConfigError as e:  # TRL's own rules (num_generations dividing the generation batch, ...): named, not run
        return Measurement(status=Status.ERROR, source=Source.ESTIMATE, message=str(e))
    phases = online_phase_allocator_bytes(step)
    vllm = online_vllm_terms(step)
    notes = [
        f"online RL (closed form, advisor/physics/online_costs.py): generation batch {step.generation_batch} "
        f"completions (per_device_train_batch_size {step.per_device_train_batch_size} x steps_per_generation "
        f"{step.steps_per_generation}), every completion at max_completion_length {step.max_completion_length} after "
        f"the longest prompt ({step.prompt_length} tokens): the bound",
    ]
    if isinstance(vllm, online_VllmRefusal):
        return Measurement(status=Status.OOM, source=Source.ESTIMATE, message=vllm.message,
                           notes=(*notes, f"colocated vLLM refused: {vllm.cause.value} ({vllm.refused.source})"))
    dp = device_peak({k: v.total for k, v in phases.items()}, vllm)
    factor = RESERVED_FACTOR[bool(c.expandable_segments)] if cuda else 1.0
    per_phase_device = {p: int(dp.allocator[p] * factor) + dp.outside_allocator[p] for p in dp.allocator}
    at = max(per_phase_device, key=lambda p: per_phase_device[p])
    peak = dp.allocator_peak_bytes
    reserved = int(peak * factor)
    context = outside_allocator_bytes(gpu) if cuda else 0
    device = per_phase_device[at] + context if cuda else max(peak, per_phase_device[at])
    outside = dp.outside_allocator[at]
    breakdown = _breakdown(phases[at].parts, outside)
    sleep_note = _sleep_note(step, vllm, dp, factor, context, device)
    # step time: the training passes of the shared step-time model, plus online RL's own terms
    arch = architecture(workload.model)
    train = expected_step_time(rows, arch, rows_c, parts.batch, parts.offload_volume)
    distilling = step.loss is online_Loss.DIVERGENCE
    extra_s = _teacher_s(step, gpu) if distilling else 0.0
    timed = online_step_time_on(step, gpu, arch, precision=c.precision.value, train_s=train.step_s + extra_s,
                                vllm=vllm)
    notes += [
        f"peak in the {phases[at].phase} phase; per phase (allocator + outside it, bytes): "
        + ", ".join(f"{p} {dp.allocator[p]:,} + {dp.outside_allocator[p]:,}" for p in dp.allocator),
        *_step_notes(step, vllm, cuda), *sleep_note, *timed.notes,
        "objective: trained completion tokens per optimizer step (per_device_train_batch_size x "
        "gradient_accumulation_steps x max_completion_length) over the step's time end to end",
    ]
    terms = {**{k: v for k, v in train.terms.items()}, **{k: v for k, v in timed.terms.items() if k != "training"}}
    if distilling:
        terms["teacher_and_divergence"] = extra_s
    step_s, trained = timed.step_s, timed.trained_tokens_per_step
    if workload.num_gpus > 1:  # global throughput, as the SFT estimate: every training rank's completions, plus
        # the collectives' time the training passes do not hide (generation and scoring hide none of it)

        with_comm, trained, exposed, comm_note = estimate_rank_time(workload, c, train.step_s, trained)
        step_s += with_comm - train.step_s
        terms["communication_exposed"] = exposed
        notes.append(comm_note)
    return Measurement(
        status=Status.OK, source=Source.ESTIMATE, peak_bytes=peak, reserved_bytes=reserved, device_bytes=device,
        breakdown=breakdown, step_time_s=step_s,
        tokens_per_second=trained / step_s if step_s > 0 else None, trained_tokens_per_step=trained,
        time_breakdown=terms, worst_step_time_s=step_s,
        peak_batch=f"{step.per_device_train_batch_size}x{step.sequence_length} ({step.generation_batch} generated)",
        notes=tuple(notes), outside_allocator_bytes=outside,
    )


def _breakdown(parts: dict[str, int], outside: int) -> dict[str, int]:
    """The peak phase's parts by category, and what is outside the allocator then."""
    breakdown: dict[str, int] = {}
    for name, nbytes in parts.items():
        key = _CATEGORY.get(name, Category.OTHER).value
        breakdown[key] = breakdown.get(key, 0) + int(nbytes)
    if outside:
        breakdown[Category.OUTSIDE_ALLOCATOR.value] = outside
    return breakdown


def _sleep_note(step: Any, vllm: Any, dp: Any, factor: float, context: int, device: int) -> list[str]:
    """Colocated vLLM without sleep mode: what the device peak would be with it, when lower."""
    if vllm is None or vllm.split is None or step.sleep is not vllm_Sleep.OFF:
        return []
    slept = dataclasses.replace(vllm, sleep=vllm_TRL_SLEEP_LEVEL)
    with_sleep = max(int(dp.allocator[p] * factor) + slept.held_bytes(p) for p in dp.allocator) + context
    if with_sleep >= device:
        return []
    return [f"vllm_enable_sleep_mode would give the pool back outside generation: device peak "
            f"{with_sleep / 2**30:.2f} GiB instead of {device / 2**30:.2f} GiB (vllm.py asleep)"]


def _step_notes(step: Any, vllm: Any, cuda: bool) -> list[str]:
    """What the notes say of the step: what stays resident, how it generates, scores and trains, ZeRO-3's gathers."""
    return [
        "training state resident throughout (weights, optimizer state"
        + (", a separate reference" if step.reference_bytes else "")
        + (", reward models" if step.reward_model_bytes else "")
        + (", the teacher" if step.teacher_bytes else "") + ")",
        "generate: transformers' DynamicCache of the generation batch at prompt + max_completion_length - 1 "
        "positions, values in the compute dtype, keys float32 under autocast over float32 weights (rotary "
        "promotes them) (cache_utils.py DynamicLayer.update; counted as activations)"
        if step.engine is vllm_Mode.GENERATE else
        f"generate: vLLM ({step.engine.value}); " + (
            f"its pool {vllm.split.pool_bytes:,} B outside PyTorch's allocator "
            + ("in every phase" if step.sleep is vllm_Sleep.OFF else
               f"while generating, {vllm.held_bytes('train'):,} B kept asleep (sleep level {step.sleep.value})")
            + " (vllm/v1/worker/gpu_worker.py Worker.init_device: utilization x total; profile run and non-torch "
            "memory modelled, profiles/measurements/online_rl_constants.json)"
            if vllm.split is not None else "server mode: no pool on the training GPUs"),
        *(_distillation_notes(step) if step.loss is online_Loss.DIVERGENCE else [
            f"scoring: {step.scoring_forwards} no-grad forward(s) of the generation batch (old policy: "
            f"{step.old_logps_forward}, reference {step.reference.value}) through TRL's fused log-prob head "
            "(trl/kernels/chunked_logprob.py; no [B, T, V] logits)",
            "train: the SFT estimate's parts of the micro-batch (advisor/estimator/memory.py) with TRL's fused head "
            "on " + ("the completion tokens (CUDA)" if cuda else "every position (no Triton)")]),
        *(["ZeRO-3: the whole model gathered to generate (ds3_gather_for_generation)"
           if step.ds3_gather_for_generation else "ZeRO-3: a layer at a time gathered to generate"]
          if step.zero3 else []),
    ]


def _teacher_s(step: Any, gpu: Any) -> float:
    """Seconds a distillation step adds to the SFT passes of its micro-batches: the teacher's no-grad forward and
    the divergence's projections through both heads (advisor/physics/distillation.py teacher_train_flops), at the
    step-time model's GEMM efficiency, in the teacher's weights' dtype (no autocast reaches the training pass)."""
    precision = "fp32" if step.teacher.weight_element_bytes == 4 else "bf16"
    flops = teacher_train_flops(step.teacher, rows=step.per_device_train_batch_size, sequence=step.sequence_length,
                                completion=step.max_completion_length, vocab=step.vocab, student_hidden=step.hidden,
                                beta=step.divergence_beta)
    return step.gradient_accumulation_steps * flops / (peak_flops(gpu, precision) * time_constants(gpu).gemm_eff)


def _distillation_notes(step: Any) -> list[str]:
    """What the estimate of a distillation step says of the teacher and of the vocabulary's logits."""
    gib = 2**30
    teacher = step.teacher
    div = step_divergence(step, step.per_device_train_batch_size,
                          cpu_fold_tiles=int(online_constants()["cpu_divergence_fold_tiles"]["value"]))
    return [
        f"teacher: resident, {teacher.weights_bytes / gib:.2f} GiB ({teacher.layers} layers x hidden "
        f"{teacher.hidden}, {teacher.weight_element_bytes}-byte weights); its backbone runs under no_grad on every "
        "training micro-batch (DistillationTrainer._compute_loss); no reference, nothing scored",
        vocabulary_note(div, vocab=step.vocab, beta=step.divergence_beta),
        "train: the SFT estimate's parts of the student's micro-batch (advisor/estimator/memory.py) in the weights' "
        "dtype (no autocast reaches DistillationTrainer's training pass), without its LM head's logits, the "
        "teacher's forward and the divergence (advisor/physics/distillation.py)",
    ]
