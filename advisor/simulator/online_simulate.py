"""The simulate backend for online RL (GRPO, RLOO): TRL's own `train()` on fake tensors (online_rl.py's
`run_online_fake`), built through the trainer seam, its per-phase allocator peaks combined with what vLLM holds
outside the allocator by the physics (advisor/physics/online_costs.py), and the step time of the physics' online
terms around the training passes the fake run's own ops cost.

`advisor.simulator.simulate` routes here by what the trainer declares (`StepShape.generates`: a step with
generation inside it), never by its name.

Construction (as the cpu probe builds the measured run, advisor/probing/worker.py): the policy on `meta` at full
depth (`kind.build_model`), the measured config (`kind.build_config(measured=True)`: every completion forced to
max_completion_length by `generation_kwargs.min_new_tokens`, the prompts in the order given), the prompts of the
generation batch that needs the most memory (`kind.worst_rows`: the longest), advisor.modeling's placeholder
tokenizer (the prompts are its placeholder text of the token ids), the trainer's own kwargs (`kind.trainer_kwargs`:
the reward functions, and the models given beside the policy, `Workload.models`, each built on `meta` as its
declaration says, advisor/modeling.py `input_model`: a reward model as `trl grpo` loads
`reward_model_name_or_path`, resident), inside `online_construction` (the reference TRL builds from the policy's
name on `meta`; vLLM not started).

The full depth runs (the decode loop is extrapolated inside `run_online_fake`), so depth.py's layer-by-layer
extrapolation is not used here.

Memory: each phase's allocator peak from the fake run (GENERATE, SCORE, TRAIN), plus the closed forms simulate()
applies to SFT for what fake tensors cannot run (bitsandbytes' weights, 8-bit optimizer state), combined by
`online_device_peak` with what vLLM holds outside the allocator in that phase (colocated: its pool, utilization x the
card, in every phase without sleep mode, only while generating with it; server mode: nothing on this GPU). vLLM's
refusal to start (its pool over the free memory at start-up, or no room for one full-length sequence) is an OOM
Measurement with vLLM's rule and the fix. On a CUDA target: the estimate's reserved-over-allocated factor (no
allocation stream to replay), the CUDA context and cuBLAS workspace.

Time: the training passes from the fake run's own ops (advisor/simulator/timing_hook.py over the TRAIN-phase ops of the
last optimizer step's micro-steps: generation and scoring run inside `training_step` and are filtered out by phase),
costed by the step-time model (advisor/physics/timing/); generation, the weight sync (with sleep, the wake-up) and
the scoring forwards from advisor/physics/online_costs.py `step_time`. The objective: trained completion tokens per
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

from ..errors import AdvisorError
from ..measurement import Category, Measurement, Source, Status
from ..modeling import input_model
from ..physics import architecture, online_constants, step_divergence, teacher_of, vocabulary_note
from ..physics import online_PhaseKind as PhaseKind
from .depth import _quiet, _record_last_step, _step_cost, _tokenizer, _worst_step
from .modelled import modelled_adjustments, runnable

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
    from ..physics import (
        architecture,
        context_bytes,
        cublas_workspace_bytes,
        online_build_step,
        online_TrainingState,
        online_vllm_terms,
        online_VllmRefusal,
    )  # lazy: loads yaml

    started = time.perf_counter()
    k = kind.knobs(candidate)
    refused = _not_run(candidate, k, target)
    if refused is not None:
        return refused
    run_cand, notes = runnable(candidate, target)
    engine = "vllm" if k.use_vllm else "generate"
    built = _build_and_run(workload, run_cand, candidate, target, kind, steps=steps, engine=engine,
                           decode_lengths=decode_lengths)
    result = built.result
    notes.extend(result.notes)
    notes.extend(kind.notes(candidate, workload))
    cuda = target.is_cuda
    ctx = context_bytes(target.compute_capability) if cuda else 0
    ws = cublas_workspace_bytes(target.compute_capability) if cuda else 0
    arch = architecture(workload.model)
    b = candidate.per_device_train_batch_size
    phase_peaks, adjust = _modelled(candidate, workload, result, b, built.prompt_length + int(k.max_completion_length),
                                    cuda, notes)
    state = online_TrainingState(
        weights_bytes=built.policy_bytes + adjust.get(Category.PARAMETERS.value, 0),
        gradient_bytes=built.trainable_bytes,
        optimizer_bytes=int(result.breakdown.get(Category.OPTIMIZER, 0)) + adjust.get(Category.OPTIMIZER.value, 0),
        trainable=built.trainable, prompt_length=built.prompt_length, reference_bytes=built.reference_bytes,
        model_inputs_bytes=built.model_inputs_bytes, teacher=built.teacher)
    step = online_build_step(arch, workload.model.config, candidate, k, state, target,
                             # when vLLM snapshots the device no backward has run: the Python thread's cuBLAS
                             # workspace only
                             context_bytes=ctx + (cublas_workspace_bytes(target.compute_capability, threads=1)
                                                  if cuda else 0))
    if step.teacher is not None:  # a divergence against a teacher: its vocabulary-sized parts, named

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
    peak_bytes, reserved_bytes, device_bytes, breakdown, outside = _device(
        candidate, result, phase_peaks, adjust, vllm, cuda=cuda, ws=ws, ctx=ctx, notes=notes)
    notes.extend(_vllm_notes(vllm, step, k))
    timed = _timed(step, target, arch, candidate, built, vllm, engine, notes)
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
        time_detail=_time_detail(built, target, step.generations_per_step),
        message="" if status is Status.OK else f"device peak {device_bytes} B over budget {workload.budget_bytes} B",
        notes=tuple(notes), wall_time_s=time.perf_counter() - started, outside_allocator_bytes=int(outside),
    )


def _timed(step: Any, target: GPUSpec, arch: Any, candidate: Candidate, built: Any, vllm: Any, engine: str,
           notes: list[str]) -> Any:
    """The step's time: the training passes costed from the fake run's own ops, generation and scoring from its
    GENERATE and SCORE phases' ops (transformers' generate), online RL's other terms from the physics."""
    from ..physics import online_step_time_on  # lazy: loads numpy

    phases = built.phases
    timed = online_step_time_on(
        step, target, arch, precision=candidate.precision.value, train_s=built.train_s, vllm=vllm,
        generation_s=phases.generation_s if phases is not None and engine == "generate" else None,
        scoring_s=phases.scoring_s if phases is not None else None)
    if phases is not None and engine == "generate":
        notes.append(f"generate: {phases.per_token_s * 1e3:.3g} ms a decode step ({phases.decode_ops:,d} ops, "
                     f"{phases.decode_syncs} sync(s)), prefill {phases.prefill_s * 1e3:.3g} ms; scoring "
                     f"{phases.scoring_s * 1e3:.3g} ms a generation ({phases.scoring_ops:,d} ops)")
    notes.append(f"time: the training passes ({built.train_s:.4g} s a step) from the fake run's ops of the last "
                 f"optimizer step's micro-steps ({built.timed_ops:,d} ops in {built.timed_micro_steps}), TRAIN phase "
                 "only (advisor/simulator/timing_hook.py, the step-time model "
                 "of advisor/physics/timing/); generation and scoring from the GENERATE and SCORE phases' ops "
                 "(advisor/simulator/phase_timing.py; vLLM's generation and the weight sync in closed form, "
                 "advisor/physics/online_costs.py step_time)")
    return timed


def _not_run(candidate: Candidate, k: Any, target: GPUSpec) -> Measurement | None:
    """A typed ERROR for what the online fake run does not run (the search skips it), never a KeyError or a guess:
    vLLM on a CPU target; FlashAttention (the stand-in, simulator/flash.py, answers the varlen kernel's data-dependent
    shapes from one batch's facts, and an online step runs several: prefill, each decode step, the scoring and
    training batches)."""
    if k.use_vllm and not target.is_cuda:
        return Measurement(status=Status.ERROR, source=Source.SIMULATE,
                           message=f"use_vllm=True on {target.name}: vLLM generates on CUDA GPUs only; set "
                                   "use_vllm=False (transformers' generate) for a CPU target")
    if candidate.attn_implementation.is_flash:
        return Measurement(status=Status.ERROR, source=Source.SIMULATE,
                           message=f"attn_implementation={candidate.attn_implementation.value}: the simulate "
                                   "backend does not run FlashAttention's kernels in an online RL step yet (its "
                                   "generate / score / train shapes); simulate attn_implementation=sdpa, or measure "
                                   "this one with --backend estimate or --backend cuda")
    return None


def _device(candidate: Candidate, result: Any, phase_peaks: dict, adjust: dict[str, int], vllm: Any, *, cuda: bool,
            ws: int, ctx: int, notes: list[str]) -> tuple[int, int, int, dict[str, int], int]:
    """(peak, reserved, device bytes, the breakdown, what is outside the allocator at the device's peak): the
    phases' allocator peaks combined with what vLLM holds outside the allocator in each (`online_device_peak`)."""
    from ..physics import RESERVED_FACTOR, online_device_peak  # lazy: loads yaml

    dp = online_device_peak(phase_peaks, vllm)
    at, outside, peak = dp.peak_phase, dp.outside_at_peak, dp.allocator_peak_bytes
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
        peak_bytes, reserved_bytes, device_bytes = peak + ws, int(peak * factor) + ws, per_phase[at] + ws + ctx
        breakdown[Category.OTHER.value] = breakdown.get(Category.OTHER.value, 0) + ws
        notes.append(f"device_bytes = the peak phase's allocator bytes x {factor} (the caching allocator's reserved "
                     "over allocated, advisor/physics/cuda_rules.py RESERVED_FACTOR: the online fake run records no "
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
    return peak_bytes, reserved_bytes, device_bytes, breakdown, outside


def _vllm_notes(vllm: Any, step: Any, k: Any) -> list[str]:
    """What the notes say of vLLM's side: none without it, server mode on GPUs of its own, colocated its pool."""
    if vllm is None:
        return []
    if vllm.split is None:
        return ["vLLM server mode: its weights and KV pool live on GPUs of its own; none on this one"]
    return [
        f"vLLM colocated (modelled in closed form, advisor/physics/vllm.py: vllm/v1/worker/gpu_worker.py "
        "Worker.init_device, utilization x total; its weights, profile run and non-torch memory inside the "
        f"pool, profiles/measurements/online_rl_constants.json): its pool {vllm.split.pool_bytes:,} B = "
        f"vllm_gpu_memory_utilization {step.vllm_gpu_memory_utilization:g} x the card, outside PyTorch's "
        "allocator, "
        + ("held in every phase (no sleep mode)" if not k.vllm_enable_sleep_mode else
           f"held while generating, {vllm.held_bytes('train'):,} B kept asleep otherwise (sleep level "
           f"{step.sleep.value}: vllm.py asleep, vLLM's CuMemAllocator.sleep unmaps its weights and KV cache)")
        + f"; its KV cache takes the generation batch in {vllm.waves} round(s)"]


def _time_detail(built: Any, target: GPUSpec, generations: float) -> dict[str, Any]:
    """The training passes' two queues (per optimizer step), the ops of one decode step and its time."""
    from ..physics import time_constants, time_detail  # lazy: loads numpy

    out = time_detail(built.train_timed, time_constants(target))
    phases = built.phases
    if phases is not None:
        out.update(decode_token_s=phases.per_token_s, decode_ops=phases.decode_ops,
                   generation_s=generations * phases.generation_s, scoring_s=generations * phases.scoring_s)
    return out


_RESIDENT = (Category.PARAMETERS.value, Category.OPTIMIZER.value, Category.TEMPORARIES.value)


def _modelled(candidate: Candidate, workload: Workload, result: Any, rows: int, seq: int, cuda: bool,
              notes: list[str]) -> tuple[dict, dict[str, int]]:
    """The closed forms for what fake tensors cannot run (advisor/simulator/modelled.py `modelled_adjustments`, as
    simulate() applies them to SFT), per phase: bitsandbytes' stored weights and one dequantized weight, and an 8-bit
    optimizer's state, are held in every phase; what a knob frees of the saved activations (use_kernels,
    checkpoint_offload) only in the training phase. Returns the phases' allocator peaks and the breakdown's delta
    (at the allocator's peak phase)."""
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


def _teacher(workload: Workload, models: dict[str, tuple[Any, Any]], role: str | None) -> Any:
    """The model input the step distills from (`StepShape.distills_from`) as the physics counts it: its architecture
    and its bytes and weight element as built; None without one."""
    if role is None or role not in models:
        return None

    model = models[role][0]
    return teacher_of(architecture(workload.model_of(role)), weights_bytes=_model_bytes(model),
                      weight_element_bytes=next(model.parameters()).element_size())


def _model_bytes(model: Any) -> int:
    if model is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _model_inputs(workload: Workload, kind: Trainer, candidate: Candidate, dtype: Any
                  ) -> dict[str, tuple[Any, Any]]:
    """The models given beside the policy (`workload.models`), each built on `meta` as the trainer's declaration
    says (advisor/modeling.py `input_model`: a reward model as `trl grpo` loads `reward_model_name_or_path`,
    AutoModelForSequenceClassification with num_labels=1; a teacher as a causal LM), in the dtype the trainer loads
    it in (`input_dtype`; `dtype`, the policy's as built, where that is the policy's), resident, counted; with its
    placeholder tokenizer."""
    import torch  # lazy: loads torch


    out = {}
    for inp in kind.model_inputs:
        spec = workload.model_of(inp.role)
        if spec is not None:
            tok = _tokenizer(spec)
            own = kind.input_dtype(candidate, inp.role)
            at = dtype if own is candidate.weights_dtype else getattr(torch, own.value)
            out[inp.role] = (input_model(spec, inp.head, dtype=at, pad_token_id=tok.pad_token_id,
                                         device="meta"), tok)
    return out


@contextlib.contextmanager
def _phases_timed(hook: Any, timers: Any) -> Iterator[None]:
    """The fake run's ops and syncs by phase: the TRAIN phase's to the timing hook (the training passes), the
    GENERATE and SCORE phases' to `timers` (advisor/simulator/phase_timing.py). run_online_fake builds its own phase
    tracker, so its class is extended for the run (generation and scoring run inside `training_step`, through
    `_prepare_inputs`); the short decode runs of the extrapolated generate (suspended for memory) are what is timed
    of generation."""
    from . import online_rl  # lazy: loads torch

    base = online_rl._PhaseTracker

    class _Timed(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.on_op = self._phase_op
            self.on_sync = self._phase_sync
            hook.bind(self)

        def _phase_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
            if self.phase is PhaseKind.GENERATE:
                timers.generate_op(func, args, kwargs, out)
                return
            timers.generate_end()
            if self.phase is PhaseKind.SCORE:
                timers.score_op(func, args, kwargs, out)
                return
            timers.score_end()
            if not self.suspended:
                hook(func, args, kwargs, out)

        def _phase_sync(self, func: Any) -> None:
            if self.phase is PhaseKind.GENERATE:
                timers.generate_sync(func)
            elif self.phase is PhaseKind.SCORE:
                timers.score_sync(func)
            elif not self.suspended:
                hook.sync(func)

    online_rl._PhaseTracker = _Timed
    try:
        yield
    finally:
        online_rl._PhaseTracker = base


def _build_and_run(workload: Workload, run_cand: Candidate, original: Candidate, target: GPUSpec, kind: Trainer, *,
                   steps: int, engine: str, decode_lengths: tuple[int, int] | None) -> _Built:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback  # lazy: loads transformers

    from .decode_extrapolation import _hf_model  # lazy: loads torch
    from .online_rl import (  # lazy: loads torch
        SHORT_DECODES,
        make_online_trainer_class,
        online_construction,
        run_online_fake,
    )
    from .phase_timing import PhaseTimers  # lazy: loads numpy
    from .timing_hook import BatchLayout, TimingHook  # lazy: loads numpy

    spec = workload.model
    model = kind.build_model(spec, run_cand, device="meta")
    model.config._name_or_path = spec.name  # TRL builds the reference from this name: on meta (online_construction)
    rows = kind.worst_rows(workload, run_cand)
    prompt = max(len(r) for r in rows)
    k = kind.knobs(run_cand)
    completion = int(k.max_completion_length)
    tok = _tokenizer(spec)
    models = _model_inputs(workload, kind, run_cand, next(model.parameters()).dtype)
    kwargs = kind.trainer_kwargs(workload, run_cand, models)
    # a model given built (on meta) takes no from_pretrained kwargs from the config, as the policy takes none
    built_inputs = {m.init_kwargs_key: None for m in kind.model_inputs if m.init_kwargs_key and m.role in models}
    distills_from = kind.step_shape(run_cand).distills_from
    hf_config = copy.deepcopy(model.config)
    with tempfile.TemporaryDirectory(prefix="advisor-sim-") as tmp, _quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = kind.build_config(
            run_cand, workload, measured=True, use_cpu=True, output_dir=tmp, max_steps=steps, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
            model_init_kwargs=None, **built_inputs,
        )
        with online_construction(hf_config, engine=engine, trainer_class=kind.trainer_class()):
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
        timers = PhaseTimers(target, original.attn_implementation.value,
                             quantized=original.quantization.value if original.quantization.value != "none" else None,
                             model=trainer.model)
        forward = _hf_model(trainer.model).register_forward_pre_hook(
            lambda module, args, kw: timers.forward(kw.get("input_ids", args[0] if args else None)), with_kwargs=True)
        policy = _model_bytes(trainer.model)
        trainable_params = [p for p in trainer.model.parameters() if p.requires_grad]
        with _phases_timed(hook, timers):
            result = run_online_fake(trainer, steps=steps, cuda=target.is_cuda, engine=engine,
                                     decode_lengths=SHORT_DECODES if decode_lengths is None else decode_lengths,
                                     beside=tuple(kind.extra_models(trainer)))
        forward.remove()
        if not hook.micro_steps or not hook.ops:  # the tracker's ops never reached the hook: a defect, not a time

            raise AdvisorError("simulate: no op of the training passes reached the timing hook (advisor/simulator/"
                               "online_simulate.py _phases_timed no longer matches online_rl.py's tracker)")
        cost = _step_cost(trainer, hook, original, target, spec.num_layers)
        train_timed = _worst_step(cost)
        train_s = train_timed.step_s
    return _Built(
        result=result, prompt_length=prompt, policy_bytes=policy,
        trainable=sum(p.numel() for p in trainable_params),
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable_params),
        reference_bytes=_model_bytes(getattr(trainer, "ref_model", None)),
        model_inputs_bytes=sum(_model_bytes(m) for role, (m, _) in models.items() if role != distills_from),
        teacher=_teacher(workload, models, distills_from),
        train_s=train_s, timed_ops=hook.ops, timed_micro_steps=hook.micro_steps,
        phases=timers.timed(completion), train_timed=train_timed,
    )
