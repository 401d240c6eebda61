"""The simulate backend for online RL (GRPO, RLOO) and on-policy distillation (the teacher resident): TRL's own
`train()` on fake tensors (online_rl.py's `run_online_fake`), built through the trainer seam, its per-phase allocator
peaks combined with what vLLM holds outside the allocator by the physics (advisor/_physics/online_rl.py), and the step
time of the physics' online terms around the training passes the fake run's own ops cost.

`advisor.simulator.simulate` routes here by what the trainer declares (`closed_form is ClosedForm.ONLINE_RL`: a
step with generation inside it), never by its name.

Construction (as the cpu probe builds the measured run, advisor/probing/worker.py): the policy on `meta` at full
depth (`kind.build_model`), the measured config (`kind.build_config(measured=True)`: every completion forced to
max_completion_length by `generation_kwargs.min_new_tokens`, the prompts in the order given), the prompts of the
generation batch that needs the most memory (`kind.worst_rows`: the longest), advisor.modeling's placeholder
tokenizer (the prompts are its placeholder text of the token ids), the trainer's own kwargs (the reward functions)
plus a reward model given as a model (`Workload.reward_model`, resident: built on `meta` as a one-label sequence
classifier, as `trl grpo` loads `reward_model_name_or_path`), inside `online_construction` (the reference TRL builds
from the policy's name on `meta`; vLLM not started).

The full depth runs (the decode loop is extrapolated inside `run_online_fake`), so depth.py's layer-by-layer
extrapolation is not used here.

Memory: each phase's allocator peak from the fake run (GENERATE, SCORE, TRAIN), plus the closed forms simulate()
applies to SFT for what fake tensors cannot run (bitsandbytes' weights, 8-bit optimizer state), combined by
`online_device_peak` with what vLLM holds outside the allocator in that phase (colocated: its pool, utilization x the
card, in every phase without sleep mode, only while generating with it; server mode: nothing on this GPU). vLLM's
refusal to start (its pool over the free memory at start-up, or no room for one full-length sequence) is an OOM
Measurement with vLLM's rule and the fix. On a CUDA target: the estimate's reserved-over-allocated factor (no
allocation stream to replay), the CUDA context and cuBLAS workspace.

Time: the training passes from the fake run's own ops (advisor/_sim/timing_hook.py over the TRAIN-phase ops of the
last optimizer step's micro-steps: generation and scoring run inside `training_step` and are filtered out by phase),
costed by the step-time model (advisor/_physics/timing/); generation, the weight sync (with sleep, the wake-up) and
the scoring forwards from advisor/_physics/online_rl.py `step_time`. The objective: trained completion tokens per
second.

Checked (tests/test_simulate_online.py): on the CPU the glue's peak equals a GRPOTrainer built by hand with TRL's
own GRPOConfig and run by run_online_fake, to the byte (itself checked against real CPU train() peaks,
tests/test_simulate_accuracy_grpo.py).
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..measurement import Category, Measurement, Source, Status

if TYPE_CHECKING:
    from ..space import Candidate
    from ..trainers import Trainer
    from ..workload import GPUSpec, Workload

__all__ = ["simulate_online"]


def simulate_online(workload: Workload, candidate: Candidate, target: GPUSpec, kind: Trainer, *,
                    steps: int = 2, decode_lengths: tuple[int, int] | None = None) -> Measurement:
    """Peak device bytes and step time of `steps` optimizer steps of the online trainer `kind` on `target`, from a
    fake `train()`. `candidate` is the user's (already `for_model`); `decode_lengths`: run_online_fake's short
    decode lengths (None: its default)."""
    from .._physics import (
        RESERVED_FACTOR,
        architecture,
        context_bytes,
        cublas_workspace_bytes,
        online_build_step,
        online_device_peak,
        online_step_time_on,
        online_vllm_terms,
        online_VllmRefusal,
    )
    from .modelled import runnable

    started = time.perf_counter()
    k = kind.knobs(candidate)
    if k.use_vllm and not target.is_cuda:
        return Measurement(status=Status.ERROR, source=Source.SIMULATE,
                           message=f"use_vllm=True on {target.name}: vLLM generates on CUDA GPUs only; set "
                                   "use_vllm=False (transformers' generate) for a CPU target")
    if candidate.attn_implementation.is_flash:
        # the FlashAttention stand-in (_sim/flash.py) answers the varlen kernel's data-dependent shapes from one
        # batch's facts; an online step runs several shapes (prefill, each decode step, the scoring and training
        # batches), which it does not describe yet: a typed ERROR the search skips, never a KeyError or a guess
        return Measurement(status=Status.ERROR, source=Source.SIMULATE,
                           message=f"attn_implementation={candidate.attn_implementation.value}: the simulate "
                                   "backend does not run FlashAttention's kernels in an online RL step yet (its "
                                   "generate / score / train shapes); simulate attn_implementation=sdpa, or measure "
                                   "this one with --backend estimate or --backend cuda")
    run_cand, notes = runnable(candidate, target)
    engine = "vllm" if k.use_vllm else "generate"
    built = _build_and_run(workload, run_cand, candidate, target, kind, steps=steps, engine=engine,
                           decode_lengths=decode_lengths)
    result = built.result
    notes.extend(result.notes)
    rm = getattr(workload, "reward_model", None)  # --reward-model: the trainer's notes read it as trl grpo's key
    notes.extend(kind.notes(candidate if rm is None else candidate.replace(
        base={**candidate.base.as_dict(), "reward_model_name_or_path": rm.name})))

    cuda = target.is_cuda
    ctx = context_bytes(target.compute_capability) if cuda else 0
    ws = cublas_workspace_bytes(target.compute_capability) if cuda else 0
    arch = architecture(workload.model)
    b, ga = candidate.per_device_train_batch_size, candidate.gradient_accumulation_steps
    prompt = built.prompt_length
    completion = int(k.max_completion_length)
    from .._physics import DTYPE_BYTES
    from ..space import Precision

    phase_peaks, adjust = _modelled(candidate, workload, result, b, prompt + completion, cuda, notes)
    teacher = getattr(workload, "teacher", None)
    step = online_build_step(
        arch, workload.model.config, weights_bytes=built.policy_bytes + adjust.get(Category.PARAMETERS.value, 0),
        gradient_bytes=built.trainable_bytes,
        optimizer_bytes=int(result.breakdown.get(Category.OPTIMIZER, 0)) + adjust.get(Category.OPTIMIZER.value, 0),
        trainable=built.trainable,
        weight_element_bytes=DTYPE_BYTES[candidate.weights_dtype], mixed=candidate.precision is not Precision.FP32,
        prompt_length=prompt, max_completion_length=completion, per_device_train_batch_size=b,
        gradient_accumulation_steps=ga, lora=candidate.use_lora,
        gradient_checkpointing=candidate.activation_checkpointing, reference_bytes=built.reference_bytes,
        reward_model_bytes=built.reward_model_bytes, card_bytes=target.memory_bytes, cuda=cuda,
        # when vLLM snapshots the device no backward has run: the Python thread's cuBLAS workspace only
        context_bytes=ctx + (cublas_workspace_bytes(target.compute_capability, threads=1) if cuda else 0),
        supports_bf16=target.supports_bf16,
        teacher_arch=architecture(teacher) if teacher is not None else None, teacher_bytes=built.teacher_bytes,
        teacher_weight_element_bytes=built.teacher_element_bytes, **kind.step_knobs(candidate),
    )
    if step.teacher is not None:  # distillation: the divergence's vocabulary-sized parts, named
        from .._physics import online_constants, step_divergence, vocabulary_note

        div = step_divergence(step, b, cpu_fold_tiles=int(online_constants()["cpu_divergence_fold_tiles"]["value"]))
        notes.append(vocabulary_note(div, vocab=step.vocab, beta=step.divergence_beta) + " (sizes from TRL's code; "
                     "the fake run allocated them)")
    vllm = online_vllm_terms(step)
    if isinstance(vllm, online_VllmRefusal):
        return Measurement(
            status=Status.OOM, source=Source.SIMULATE, message=vllm.message,
            notes=(*notes, f"colocated vLLM refused: {vllm.cause.value} ({vllm.refused.source}); the training side "
                           f"ran on fake tensors (allocator peak {result.peak_bytes:,d} B)"),
            wall_time_s=time.perf_counter() - started)
    dp = online_device_peak(phase_peaks, vllm)
    at = dp.peak_phase
    outside = dp.outside_at_peak
    peak = dp.allocator_peak_bytes
    breakdown = {c.value if isinstance(c, Category) else str(c): int(v) for c, v in result.breakdown.items()}
    for cat, delta in adjust.items():
        breakdown[cat] = breakdown.get(cat, 0) + delta
    if cuda:
        # no allocation stream from the online fake run to replay: the caching allocator's reserved over allocated
        # in closed form (the estimate's factor), per phase, before what vLLM holds outside the allocator
        factor = RESERVED_FACTOR[bool(candidate.expandable_segments)]
        per_phase = {p: int(dp.allocator[p] * factor) + dp.outside_allocator[p] for p in dp.allocator}
        at = max(per_phase, key=lambda p: per_phase[p])
        outside = dp.outside_allocator[at]
        peak_bytes = peak + ws
        reserved_bytes = int(peak * factor) + ws
        device_bytes = per_phase[at] + ws + ctx
        breakdown[Category.OTHER.value] = breakdown.get(Category.OTHER.value, 0) + ws
        notes.append(f"device_bytes = the peak phase's allocator bytes x {factor} (the caching allocator's reserved "
                     "over allocated, advisor/_physics/cuda_rules.py RESERVED_FACTOR: the online fake run records no "
                     "allocation stream to replay) + what vLLM holds outside the allocator then + CUDA context + "
                     "cuBLAS workspaces, one per thread issuing GEMMs (profiles/measurements/cuda_constants.json)")
    else:
        peak_bytes = reserved_bytes = peak
        device_bytes = dp.peak_bytes
    if outside:
        breakdown[Category.OUTSIDE_ALLOCATOR.value] = breakdown.get(Category.OUTSIDE_ALLOCATOR.value, 0) + outside
    notes.append("per phase (allocator peak + outside the allocator, bytes): "
                 + ", ".join(f"{p} {dp.allocator[p]:,} + {dp.outside_allocator[p]:,}" for p in dp.allocator)
                 + f"; the device peaks in {at}; the breakdown's allocator part is at the allocator's peak")
    if vllm is not None:
        if vllm.split is None:
            notes.append("vLLM server mode: its weights and KV pool live on GPUs of its own; none on this one")
        else:
            notes.append(
                f"vLLM colocated (modelled in closed form, advisor/_physics/vllm.py: vllm/v1/worker/gpu_worker.py "
                "Worker.init_device, utilization x total; its weights, profile run and non-torch memory inside the "
                f"pool, profiles/measurements/online_rl_constants.json): its pool {vllm.split.pool_bytes:,} B = "
                f"vllm_gpu_memory_utilization {step.vllm_gpu_memory_utilization:g} x the card, outside PyTorch's "
                "allocator, "
                + ("held in every phase (no sleep mode)" if not k.vllm_enable_sleep_mode else
                   f"held while generating, {vllm.held_bytes('train'):,} B kept asleep otherwise (sleep level "
                   f"{step.sleep.value}: vllm.py asleep, vLLM's CuMemAllocator.sleep unmaps its weights and KV cache)")
                + f"; its KV cache takes the generation batch in {vllm.waves} round(s)")
    # step time: the training passes costed from the fake run's own ops, online RL's terms from the physics
    timed = online_step_time_on(step, target, arch, precision=candidate.precision.value, train_s=built.train_s,
                                vllm=vllm)
    notes.append(f"time: the training passes ({built.train_s:.4g} s a step) from the fake run's ops of the last "
                 f"optimizer step's micro-steps ({built.timed_ops:,d} ops in {built.timed_micro_steps}), TRAIN phase "
                 "only (advisor/_sim/timing_hook.py, the step-time model "
                 "of advisor/_physics/timing/); generation, weight sync (and wake-up with sleep mode) and the scoring "
                 "forwards from advisor/_physics/online_rl.py step_time")
    notes.extend(timed.notes)
    notes.append("objective: trained completion tokens per optimizer step (per_device_train_batch_size x "
                 "gradient_accumulation_steps x max_completion_length) over the step's time end to end")
    status = Status.OK if device_bytes <= workload.budget_bytes else Status.OOM
    step_s = timed.step_s
    return Measurement(
        status=status, source=Source.SIMULATE, peak_bytes=int(peak_bytes), reserved_bytes=int(reserved_bytes),
        device_bytes=int(device_bytes), breakdown={kk: int(v) for kk, v in breakdown.items() if v},
        step_time_s=step_s if step_s > 0 else None, tokens_per_second=timed.tokens_per_second,
        trained_tokens_per_step=timed.trained_tokens_per_step, time_breakdown=dict(timed.terms),
        worst_step_time_s=step_s if step_s > 0 else None,
        peak_batch=f"{b}x{step.sequence_length} ({step.generation_batch} generated)",
        message="" if status is Status.OK else f"device peak {device_bytes} B over budget {workload.budget_bytes} B",
        notes=tuple(notes), wall_time_s=time.perf_counter() - started, outside_allocator_bytes=int(outside),
    )


_RESIDENT = (Category.PARAMETERS.value, Category.OPTIMIZER.value, Category.TEMPORARIES.value)


def _modelled(candidate: Candidate, workload: Workload, result: Any, rows: int, seq: int, cuda: bool,
              notes: list[str]) -> tuple[dict, dict[str, int]]:
    """The closed forms for what fake tensors cannot run (advisor/_sim/modelled.py `modelled_adjustments`, as
    simulate() applies them to SFT), per phase: bitsandbytes' stored weights and one dequantized weight, and an 8-bit
    optimizer's state, are held in every phase; what a knob frees of the saved activations (use_kernels,
    checkpoint_offload) only in the training phase. Returns the phases' allocator peaks and the breakdown's delta
    (at the allocator's peak phase)."""
    from ..trainers.phases import PhaseKind
    from .modelled import modelled_adjustments

    cats = {c.value if isinstance(c, Category) else str(c): int(v) for c, v in result.breakdown.items()}
    adj = modelled_adjustments(candidate, workload.model, cats, 0.0, batch_shape=(rows, seq), cuda=cuda)
    notes.extend(adj.notes)
    if candidate.activation_offloading:
        notes.append("activation offloading is not modelled for online RL: the training passes simulated with "
                     "every saved activation on the device (an upper bound)")
    resident = sum(adj.breakdown_delta.get(c, 0) for c in _RESIDENT)
    train_only = adj.bytes_delta - resident
    peaks = {p: int(v) + resident + (train_only if p is PhaseKind.TRAIN else 0)
             for p, v in result.phase_peaks.items()}
    top = max(result.phase_peaks, key=lambda p: result.phase_peaks[p])
    delta = {c: v for c, v in adj.breakdown_delta.items() if c in _RESIDENT or top is PhaseKind.TRAIN}
    return peaks, delta


class _Built:
    """The fake run's result and what the glue read off the built trainer."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _model_bytes(model: Any) -> int:
    if model is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _element_bytes(model: Any) -> int:
    if model is None:
        return 0
    return next(model.parameters()).element_size()


def _reward_model(workload: Workload, dtype: Any) -> tuple[Any, Any]:
    """A reward model given as a model: `trl grpo` loads `reward_model_name_or_path` with
    AutoModelForSequenceClassification(num_labels=1); built here on `meta` (resident, counted) with its placeholder
    tokenizer."""
    spec = getattr(workload, "reward_model", None)
    if spec is None:
        return None, None
    import torch
    from transformers import AutoModelForSequenceClassification

    from ..modeling import reward_model_config
    from .depth import _tokenizer

    tok = _tokenizer(spec)
    config = reward_model_config(spec, tok.pad_token_id)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    model.config._name_or_path = spec.name
    return model, tok


@contextlib.contextmanager
def _train_ops_timed(hook: Any) -> Iterator[None]:
    """The timing hook on the fake run's ops in the TRAIN phase: run_online_fake builds its own phase tracker, so
    its class is extended for the run with `on_op` filtered by phase (generation and scoring run inside
    `training_step`, through `_prepare_inputs`, and are costed by the physics instead)."""
    from ..trainers.phases import PhaseKind
    from . import online_rl

    base = online_rl._PhaseTracker

    class _Timed(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.on_op = self._train_op

        def _train_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
            if self.phase is PhaseKind.TRAIN and not self.suspended:
                hook(func, args, kwargs, out)

    online_rl._PhaseTracker = _Timed
    try:
        yield
    finally:
        online_rl._PhaseTracker = base


def _build_and_run(workload: Workload, run_cand: Candidate, original: Candidate, target: GPUSpec, kind: Trainer, *,
                   steps: int, engine: str, decode_lengths: tuple[int, int] | None) -> _Built:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from .depth import _quiet, _record_last_step, _step_cost, _tokenizer, _worst_step_s
    from .online_rl import SHORT_DECODES, make_online_trainer_class, online_construction, run_online_fake
    from .timing_hook import BatchLayout, TimingHook

    spec = workload.model
    model = kind.build_model(spec, run_cand, device="meta")
    model.config._name_or_path = spec.name  # TRL builds the reference from this name: on meta (online_construction)
    rows = kind.worst_rows(workload, run_cand)
    prompt = max(len(r) for r in rows)
    k = kind.knobs(run_cand)
    completion = int(k.max_completion_length)
    kwargs = dict(getattr(kind, "trainer_kwargs", lambda w, c: {})(workload, run_cand))
    tok = _tokenizer(spec)
    rm, rm_tok = _reward_model(workload, next(model.parameters()).dtype)
    if rm is not None:
        funcs = list(kwargs.get("reward_funcs") or [])
        kwargs["reward_funcs"] = [*funcs, rm]
        kwargs["reward_processing_classes"] = [None] * len(funcs) + [rm_tok]
    configs = {}
    teacher = getattr(workload, "teacher", None)  # --teacher: TRL builds it from its name, on meta here
    if teacher is not None:
        kwargs["teacher_model"] = teacher.name
        configs[teacher.name] = teacher.hf_config()
    hf_config = copy.deepcopy(model.config)
    with tempfile.TemporaryDirectory(prefix="advisor-sim-") as tmp, _quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = kind.build_config(
            run_cand, workload, measured=True, use_cpu=True, output_dir=tmp, max_steps=steps, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
            model_init_kwargs=None,
        )
        with online_construction(hf_config, engine=engine, configs=configs):
            trainer = make_online_trainer_class(kind.trainer_class())(
                model=model, args=args, train_dataset=kind.train_dataset(workload, rows), processing_class=tok,
                peft_config=kind.peft_config(run_cand, spec), **kwargs,
            )
        for callback in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(callback)
        b = run_cand.per_device_train_batch_size
        seq = prompt + completion
        layout = BatchLayout(b, seq, (seq,) * b, b * completion, False)
        hook = TimingHook(target, layout, original.attn_implementation.value,
                          quantized=original.quantization.value if original.quantization.value != "none" else None,
                          model=trainer.model)
        _record_last_step(trainer, hook, steps, run_cand.gradient_accumulation_steps)
        policy = _model_bytes(trainer.model)
        trainable_params = [p for p in trainer.model.parameters() if p.requires_grad]
        with _train_ops_timed(hook):
            result = run_online_fake(trainer, steps=steps, cuda=target.is_cuda, engine=engine,
                                     decode_lengths=SHORT_DECODES if decode_lengths is None else decode_lengths)
        if not hook.micro_steps or not hook.ops:  # the tracker's ops never reached the hook: a defect, not a time
            from ..errors import AdvisorError

            raise AdvisorError("simulate: no op of the training passes reached the timing hook (advisor/_sim/"
                               "online_simulate.py _train_ops_timed no longer matches online_rl.py's tracker)")
        cost = _step_cost(trainer, hook, original, target)
        train_s = _worst_step_s(cost)
    return _Built(
        result=result, prompt_length=prompt, policy_bytes=policy,
        trainable=sum(p.numel() for p in trainable_params),
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable_params),
        reference_bytes=_model_bytes(getattr(trainer, "ref_model", None)), reward_model_bytes=_model_bytes(rm),
        teacher_bytes=_model_bytes(getattr(trainer, "teacher_model", None)),
        teacher_element_bytes=_element_bytes(getattr(trainer, "teacher_model", None)),
        train_s=train_s, timed_ops=hook.ops, timed_micro_steps=hook.micro_steps,
    )
