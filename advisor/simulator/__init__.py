"""Predict the peak memory (and a step time) of a real TRL training step without a GPU, on fake tensors.

`simulate()` runs TRL's own `SFTTrainer.train()` (or the workload's trainer's) for `steps` optimizer steps on the
batch that needs the most memory (the longest rows), with every storage tracked. Decoder layers are identical, so
it runs two shallow depths and builds the full depth's allocation stream from theirs, layer by layer (exact, see
tests/test_simulate_depth.py). For a CUDA target it follows the CUDA path and replays the caching allocator's
rules; what fake tensors cannot run is modelled and noted.

Online RL (GRPO, RLOO: a trainer whose step generates, `StepShape.generates`) runs TRL's own `train()` at full depth
instead, generation, scoring and training (online_simulate.py over online_rl.py), with
colocated vLLM's share of the card modelled by the physics (advisor/physics/online_costs.py); on several GPUs one
rank under DDP (`_online_rank`; what it does not run raises NotSimulated, which the simulate backend answers with the
estimate).

`simulate_per_rank()` is one rank of N GPUs: FSDP2 on the fake process group, DDP and ZeRO as the single-GPU
run with their model states in closed form, the collectives' time over the interconnect.

The package's modules are its insides: one fake run at one depth and the extrapolation (`depth.py`), what is
modelled instead of run (`modelled.py`), the fake step (`fake_step.py`), the storage tracker, the layer streams
(`layers.py`), the FlashAttention stand-in (`flash.py`), the fake run's timing hook, generation on fake tensors,
online RL's fake `train()`, the fake process group (`distributed.py`). The rest of advisor, scripts and tests use
only the names in `__all__` (`from advisor.simulator import X`; tests/test_privacy.py fails on an import of a
module inside), each imported from its module on first use (PEP 562), so importing the package loads no torch.
The physics it shares with the estimate (the allocator's rules, the step-time model, the multi-GPU closed forms,
the modelled knobs) is `advisor/physics/`, below both; nothing here imports the estimate.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from .._lazy import lazy_exports
from ..errors import ConfigError, NotSimulated
from ..measurement import Category, Measurement, Source, Status
from ..parallelism import Parallelism, Strategy
from ..space import Candidate
from ..workload import check_world

if TYPE_CHECKING:
    from ..trainers import Trainer
    from ..workload import GPUSpec, Workload

# name -> (module of this package, the name there)
_EXPORTS: dict[str, tuple[str, str]] = {
    # ---- one simulated run (the simulate backend: advisor.simulator) ----------------------------------------------
    "DepthRun": ("depth", "DepthRun"),  # one fake run at one depth: the numbers that are extrapolated
    "simulate_depth": ("depth", "simulate_depth"),
    "with_depth": ("depth", "with_depth"),  # the architecture with N decoder layers
    "plan_depths": ("depth", "plan_depths"),  # the two shallow depths a full depth is built from
    "extrapolate": ("depth", "extrapolate"),  # the full depth from the two shallow runs
    "worst_rows": ("depth", "worst_rows"),  # the rows of the longest micro-batch (what a simulated step runs)
    "worst_batch": ("depth", "worst_batch"),  # that micro-batch through the trainer's collator
    "check_simulable": ("modelled", "check_simulable"),  # what fake tensors cannot run, refused by name
    "runnable": ("modelled", "runnable"),  # the candidate fake tensors run, and what is modelled instead
    "modelled_adjustments": ("modelled", "modelled_adjustments"),  # closed forms for what is not run
    "expected_time": ("modelled", "expected_time"),  # the step time over the batches the sampler makes
    "resolve_target": ("modelled", "resolve_target"),
    "batch_label": ("modelled", "batch_label"),  # Measurement.peak_batch
    # ---- the layer-by-layer build of a deeper run's allocation stream (layers.py) ---------------------------------
    "LayerStream": ("layers", "LayerStream"),
    "offload_peak": ("layers", "offload_peak"),  # activation offloading replayed on a whole stream
    "OffloadPeak": ("layers", "OffloadPeak"),
    "NotSeparable": ("layers", "NotSeparable"),
    "synthesize": ("layers", "synthesize"),
    "synthesize_checked": ("layers", "synthesize_checked"),
    # ---- the fake step's FlashAttention stand-in (flash.py) and the facts of a batch (fake_step.py) --------------
    "fake_flash_attention": ("flash", "fake_flash_attention"),
    "flash_attention_names": ("flash", "flash_attention_names"),
    "attention_flops": ("flash", "attention_flops"),
    "batch_facts": ("fake_step", "batch_facts"),
    # the branches the fake run patches to the target's real path (transformers' masking, TRL's fused LM head on CUDA)
    "real_path_patches": ("fake_step", "real_path_patches"),
    "materialise": ("fake_step", "_materialise"),  # a meta model's parameters as fake tensors, ties kept
    "fake_out_dtype_matmuls": ("out_dtype", "fake_out_dtype_matmuls"),  # torch 2.11's fake addmm(out_dtype=)
    # ---- model.generate on fake tensors, every sequence at its maximum length (generation.py; online RL) -------
    **{name: ("generation", name) for name in ("simulate_generate", "GenerationRun", "full_length_generate",
                                                "IncompleteGeneration", "filler_token")},
    "DataShadow": ("shadow", "DataShadow"),  # the shadow a generating run enters above the tracker
    # ---- GRPOTrainer/RLOOTrainer.train() on fake tensors (online_rl.py), its generate extrapolated from short decode
    # loops (decode_extrapolation.py) ------------------------------------------------------------------------------
    **{name: ("online_rl", name) for name in ("make_online_trainer_class", "online_construction", "run_online_fake",
                                               "OnlineRunResult")},
    **{name: ("decode_extrapolation", name) for name in ("GenerateExtrapolation", "NotAffine")},
    # the simulate backend's online RL: the fake train() built through the trainer seam, vLLM's side, the step time
    "simulate_online": ("online_simulate", "simulate_online"),
    # ---- the fake run's ops costed by the step-time model (timing_hook.py; the model itself: advisor.physics) -----
    **{name: ("timing_hook", name) for name in ("TimingHook", "BatchLayout")},
    "StorageTracker": ("tracker", "StorageTracker"),  # what hands the hook each op (`on_op`) of a fake run
    # ---- one rank of N GPUs (distributed.py: advisor.simulator.simulate_per_rank, the real multi-process probe) ---
    **{name: ("distributed", name) for name in ("fake_process_group", "fsdp2_sharding", "prepare_fsdp2")},
}

__all__ = ["simulate", "simulate_per_rank", "shard_fsdp2", *sorted(_EXPORTS)]

__getattr__ = lazy_exports(__name__, _EXPORTS, globals())[0]  # its own __dir__ below names the face too


def __dir__() -> list[str]:
    return sorted(__all__)


def simulate(
    workload: Workload,
    candidate: Candidate,
    gpu: str | GPUSpec | None = None,
    *,
    layers: tuple[int, int] | None = (2, 3),
    steps: int = 2,
    trainer: str | Trainer | None = None,
) -> Measurement:
    """Peak bytes of `steps` real optimizer steps of `candidate` on the target, predicted on fake tensors.

    `trainer`: the TRL trainer that runs (a registered name or a Trainer, advisor.trainers.get_trainer); default:
    the workload's (`Workload.trainer`, its models checked: advisor.trainers.trainer_of). A trainer whose step
    generates (`StepShape.generates`) is simulated by advisor/simulator/online_simulate.py (`layers` unused: the full
    depth runs).

    The candidate's base (the user's other keys) is part of the run; `max_steps` below `steps` is simulated as
    written. More steps than 2 change nothing: every simulated step gets the same worst batch, the first step
    allocates the optimizer state lazily in its optimizer step, and from the second on each step frees and
    reallocates the same tensors (tests/test_simulate_accuracy.py checks max_steps 1 and 3 against real runs).
    """
    from ..trainers import get_trainer, trainer_of  # lazy: loads numpy
    from .modelled import check_simulable, resolve_target  # lazy: keeps start-up light

    started = time.perf_counter()
    spec = get_trainer(trainer) if trainer is not None else trainer_of(workload)
    target = resolve_target(gpu, workload)
    candidate = candidate.for_model(workload.model)
    problems = spec.problems(candidate, target, workload.model)
    if problems:
        raise ConfigError(problems, context="configuration rejected")
    spec.check_dataset(workload)
    max_steps = candidate.base.get("max_steps")
    if isinstance(max_steps, int) and 0 < max_steps < steps:
        steps = max_steps
    check_simulable(candidate, workload.model)
    if spec.step_shape(candidate).generates:  # generation inside the step
        from .online_simulate import simulate_online  # lazy: keeps start-up light

        m = simulate_online(workload, candidate, target, spec, steps=steps)
    else:
        m = _simulate_offline(workload, candidate, target, spec, layers=layers, steps=steps)
    return dataclasses.replace(m, wall_time_s=time.perf_counter() - started)


def _fake_runs(workload: Workload, candidate: Candidate, target: GPUSpec, spec: Trainer,
               layers: tuple[int, int] | None, steps: int) -> tuple[Any, list, list[str]]:
    """The fake runs of two shallow depths, the full depth built layer by layer from them (or the full depth run
    where they do not split into identical layers): (the combined run, the depth runs, the notes)."""
    from .depth import extrapolate, plan_depths, simulate_depth  # lazy: keeps start-up light
    from .layers import NotSeparable  # lazy: keeps start-up light
    from .modelled import runnable  # lazy: keeps start-up light

    run_cand, notes = runnable(candidate, target)
    depth = workload.model.num_layers
    depths, layer_note = plan_depths(workload.model, layers, run_cand)
    runs = [simulate_depth(workload, run_cand, target, n, steps=steps, original=candidate, trainer=spec)
            for n in depths]
    try:
        combined = extrapolate(runs, depth, cuda=target.is_cuda, expandable_segments=run_cand.expandable_segments,
                               offloading=candidate.activation_offloading)
    except NotSeparable as e:
        layer_note = f"the {depths[0]}- and {depths[1]}-layer runs do not split into identical layers ({e}): " \
                     f"simulated at full depth"
        combined = simulate_depth(workload, run_cand, target, depth, steps=steps, original=candidate, trainer=spec)
    if layer_note:
        notes.append(layer_note)
    return combined, runs, notes


def _device_bytes(workload: Workload, candidate: Candidate, target: GPUSpec, combined: Any, notes: list[str]
                  ) -> tuple[int, int, int, dict[str, int], int]:
    """(peak, reserved, device bytes, the breakdown, the activations the forward saves) of the combined run, with
    activation offloading at every moment of the stream, what is modelled instead of run, the models beside the
    policy, and on CUDA the cuBLAS workspace and the context."""
    from .modelled import modelled_adjustments  # lazy: keeps start-up light

    peak, allocated, reserved = combined.peak_bytes, combined.allocated_bytes, combined.reserved_bytes
    breakdown = dict(combined.breakdown)
    # what the forward saves: the activation offloader's copy volume
    activations_saved = breakdown.get(Category.ACTIVATIONS.value, 0)
    if combined.offload is not None:  # offloading at every moment of the stream, not at the unoffloaded peak only
        off = combined.offload
        delta = off.peak_bytes - peak
        peak, allocated, reserved = peak + delta, allocated + delta, reserved + delta
        breakdown = dict(off.by_category)
        activations_saved = off.saved_bytes
    adjust = modelled_adjustments(candidate, workload.model, breakdown, combined.time_s,
                                  batch_shape=combined.batch_shape, cuda=target.is_cuda)
    notes.extend(adjust.notes)
    peak, allocated, reserved = peak + adjust.bytes_delta, allocated + adjust.bytes_delta, reserved + adjust.bytes_delta
    for cat, delta in adjust.breakdown_delta.items():
        breakdown[cat] = breakdown.get(cat, 0) + delta
    if workload.models:  # the models beside the policy: resident, their weights in closed form (not run here)
        from ..physics import DTYPE_BYTES, resident_bytes  # lazy: keeps start-up light

        extra = resident_bytes((m for _, m in workload.models), DTYPE_BYTES[candidate.weights_dtype])
        peak, allocated, reserved = peak + extra, allocated + extra, reserved + extra
        breakdown[Category.PARAMETERS.value] = breakdown.get(Category.PARAMETERS.value, 0) + extra
        notes.append(f"models beside the policy ({', '.join(m.name for _, m in workload.models)}): resident, their "
                     f"weights ({extra:,} B) counted in closed form, not run by the fake step")
    if not target.is_cuda:
        return peak, peak, peak, breakdown, activations_saved
    from ..physics import context_bytes, cublas_workspace_bytes  # lazy: loads yaml

    ws = cublas_workspace_bytes(target.compute_capability)
    breakdown[Category.OTHER.value] = breakdown.get(Category.OTHER.value, 0) + ws
    notes.append(
        "device_bytes = reserved + CUDA context; peak and reserved include the cuBLAS workspaces, one per thread "
        "issuing GEMMs (the forward's, autograd's) (profiles/measurements/cuda_constants.json)"
    )
    device = reserved + ws + context_bytes(target.compute_capability)
    return allocated + ws, reserved + ws, device, breakdown, activations_saved


def _simulate_offline(workload: Workload, candidate: Candidate, target: GPUSpec, spec: Trainer, *,
                      layers: tuple[int, int] | None, steps: int) -> Measurement:
    """A step that does not generate: the trainer's own step on fake tensors at two shallow depths (`_fake_runs`),
    its bytes (`_device_bytes`) and its time (the step-time model over the sampler's batches where the trainer
    declares it, else the worst batch's step)."""
    from .modelled import batch_label, expected_time  # lazy: keeps start-up light

    combined, runs, notes = _fake_runs(workload, candidate, target, spec, layers, steps)
    notes.extend(spec.notes(candidate, workload))
    if candidate.group_by_length:
        notes.append(
            "group_by_length: transformers' LengthGroupedSampler puts the batch with the longest row first in every "
            "epoch, so from the second epoch on the optimizer state meets it: simulated with the longest rows at "
            "every step; a run of one epoch or less never puts them together and peaks lower (this is its bound)"
        )
    peak_bytes, reserved_bytes, device_bytes, breakdown, saved = _device_bytes(workload, candidate, target, combined,
                                                                                notes)
    step_time = combined.time_s
    timed = expected_time(workload, candidate, target, combined.cost, saved) if spec.timed_over_batches else None
    if timed is not None:
        step_time, trained, tps = timed.step_s, timed.trained_per_step, timed.tokens_per_second
        notes.append(
            "time: the step-time model (advisor/physics/timing/) over the batches the sampler makes "
            f"(worst batch {timed.worst_step_s:.4g} s a step), host and device as two queues"
        )
    else:
        trained = combined.trained_tokens * candidate.gradient_accumulation_steps
        tps = trained / step_time if step_time > 0 else None
    status = Status.OK if device_bytes <= workload.budget_bytes else Status.OOM
    b, s = combined.batch_shape
    return Measurement(
        status=status, source=Source.SIMULATE, peak_bytes=int(peak_bytes), reserved_bytes=int(reserved_bytes),
        device_bytes=int(device_bytes), breakdown={k: int(v) for k, v in breakdown.items() if v},
        step_time_s=step_time if step_time > 0 else None, tokens_per_second=tps if step_time > 0 else None,
        trained_tokens_per_step=int(round(trained)), time_breakdown=dict(timed.terms) if timed is not None else {},
        mfu=timed.mfu if timed is not None else None,
        worst_step_time_s=timed.worst_step_s if timed is not None else None,
        time_detail=_time_detail(timed if timed is not None else _worst(combined.cost), target),
        peak_batch=batch_label(b, s, combined.unpadded, runs[-1].padding_free_sequences),
        message="" if status is Status.OK else f"device peak {device_bytes} B over budget {workload.budget_bytes} B",
        notes=tuple(notes),
    )


# ---- one rank's Measurement ----------------------------------------------------------------------------------------

def _worst(cost: Any) -> Any:
    """The step-time model on the worst batch at every micro-step (a trainer not timed over the sampler's batches)."""
    if cost is None:
        return None
    from ..physics import BatchDistribution, evaluate  # lazy: loads numpy

    return evaluate(cost, BatchDistribution.single(cost.worst))


def _time_detail(timed: Any, target: Any) -> dict[str, Any]:
    if timed is None:
        return {}
    from ..physics import time_constants, time_detail  # lazy: loads numpy

    return time_detail(timed, time_constants(target))


def simulate_per_rank(workload: Any, candidate: Any, num_gpus: int | None = None,
                      parallelism: Parallelism | None = None, *, num_machines: int | None = None, gpu: Any = None,
                      layers: tuple[int, int] | None = (2, 3), steps: int = 2) -> Any:
    """One rank's Measurement of `candidate` trained on `num_gpus` GPUs (of `num_machines` machines; both default to
    the workload's).

    FSDP2 is simulated on fake tensors (the fake process group, accelerate's sharding, TRL's train()); DDP is the
    single-GPU simulation plus DDP's gradient buckets; ZeRO-2/3 replace the single-GPU run's model states with their
    closed form (`zero_bytes`). The CUDA allocator replay, the context and the workspace are the single-GPU path's
    (`simulate`). Throughput is global: every rank's trained tokens over the step time including the
    collectives' exposed time (`comm_time_s`)."""

    from ..physics import apply_layout_traffic, offload_time_s  # lazy: keeps start-up light
    from ..physics import rank_comm as _comm  # lazy: keeps start-up light
    from .modelled import resolve_target as _resolve_target  # lazy: keeps start-up light

    parallelism = parallelism or Parallelism()
    num_gpus = workload.num_gpus if num_gpus is None else num_gpus
    num_machines = workload.num_machines if num_machines is None else num_machines
    check_world(num_gpus, num_machines)
    parallelism.check(num_gpus)
    target = _resolve_target(gpu, workload)
    notes: list[str] = []
    if num_gpus == 1:
        return simulate(workload, candidate, target, layers=layers, steps=steps)
    from ..trainers import trainer_of  # lazy: loads numpy

    kind = trainer_of(workload)
    online = kind.step_shape(candidate).generates  # generation inside the step
    if online:
        m = _online_rank(workload, candidate, parallelism, num_gpus, target, kind, steps)
        m, more = _modelled_rank(m, workload, candidate, parallelism, num_gpus)
        notes.extend(more)
    elif parallelism.strategy is Strategy.FSDP2:
        m = _fsdp2_rank(workload, candidate, parallelism, num_gpus, target, steps, notes)
    else:
        m = simulate(workload, candidate, target, layers=layers, steps=steps)
        m, more = _modelled_rank(m, workload, candidate, parallelism, num_gpus)
        notes.extend(more)
    # the layout's device copies and this rank's optimizer share (the closed form for what the fake run does not do)
    m = apply_layout_traffic(m, workload, candidate, parallelism, num_gpus, target,
                             gathers_simulated=parallelism.strategy is Strategy.FSDP2)
    # the gradients' all-reduce overlaps the backward: online RL's generation and scoring hide none of it
    hiding = dataclasses.replace(m, step_time_s=m.time_breakdown.get("training")) if online else m
    comm = _comm(workload, candidate, parallelism, target, num_gpus, num_machines, hiding)
    host = offload_time_s(workload, candidate, parallelism, num_gpus) if target.is_cuda else 0.0
    if host:
        notes.append(f"CPU offload: {host:.3g} s a step added (the host optimizer step and the gradients' copies, "
                     "advisor/physics/ranks_closed.offload_time_s)")
    step = (m.step_time_s or 0.0) + comm.exposed_s + host
    trained = (m.trained_tokens_per_step or 0) * num_gpus
    notes.append(
        f"communication: all-gather {comm.all_gather_s:.3g} s, reduce {comm.reduce_s:.3g} s a step over the "
        f"{comm.link} link, {comm.exposed_s:.3g} s not hidden by compute; throughput counts all {num_gpus} ranks"
    )
    device = m.device_bytes or m.peak_bytes
    status = m.status if m.status is not Status.OK else (
        Status.OK if device <= workload.budget_bytes else Status.OOM)
    times = dict(m.time_breakdown)
    times["communication_exposed"] = comm.exposed_s
    return dataclasses.replace(
        m, status=status, step_time_s=step if step > 0 else None,
        tokens_per_second=trained / step if step > 0 else None, trained_tokens_per_step=trained,
        time_breakdown=times, notes=tuple(m.notes) + tuple(notes),
        message="" if status is Status.OK else f"device peak {device} B over budget {workload.budget_bytes} B per rank",
    )


def _fsdp2_rank(workload: Any, candidate: Any, parallelism: Parallelism, num_gpus: int, target: Any, steps: int,
                notes: list[str]) -> Any:
    """One rank of FSDP2 on fake tensors: the fake process group and accelerate's sharding, at full depth."""
    from .distributed import fake_process_group, fsdp2_sharding  # lazy: loads torch

    # at full depth: FSDP2's prefetch pairs each layer's gathered parameters with the next layer's work, which
    # the layer-by-layer extrapolation (advisor/simulator/layers.py) does not split (NotSeparable)
    with fake_process_group(num_gpus) as mesh, fsdp2_sharding(mesh, parallelism, candidate.precision.value):
        m = simulate(workload, candidate, target, layers=None, steps=steps)
    notes.append(
        f"FSDP2 on {num_gpus} ranks run on fake tensors: the fake process group and accelerate's "
        f"fsdp2_prepare_model (reshard_after_forward={parallelism.reshard_after_forward}, cpu offload="
        f"{parallelism.offload_params}) at full depth; all-gather and reduce-scatter buffers counted (as "
        "temporaries, the gathered parameters as parameters); NCCL's internal buffers are not"
    )
    notes.append("checked against real 2-process gloo runs on the CPU (tests/test_multigpu.py, "
                 "tests/test_multiprobe.py): the same peak within 0.15%; some rank-runs read higher by an FSDP "
                 "unit's bytes, frees made on gloo's worker threads that the CPU profiler does not see (with it "
                 "off the heap does not grow by them: advisor/probing/meters.memory_profiler), not memory a run "
                 "holds")
    if target.is_cuda:
        notes.append("FSDP2 all-gathers and reduce-scatters on its own CUDA streams, whose blocks the caching "
                     "allocator keeps in per-stream pools; the replay keeps one pool, so reserved bytes may be "
                     "somewhat higher on the GPU")
    if parallelism.offload_params:
        notes.append("CPU offload: the sharded parameters, gradients, optimizer state and the optimizer step live "
                     "in host memory and are not counted; the host-to-device copies of one unit's shards before "
                     "its all-gather (a no-op on fake CPU tensors) are not counted either")
    return m


def _online_rank(workload: Any, candidate: Any, parallelism: Parallelism, num_gpus: int, target: Any, kind: Any,
                 steps: int) -> Any:
    """One rank of an online RL run (GRPO, RLOO) on `num_gpus` ranks under DDP: each rank generates, scores and
    trains its own share, per_device_train_batch_size x steps_per_generation completions (TRL's RepeatSampler deals
    the prompts; colocated vLLM generates on each rank's share of its card; a served one is pushed to from rank 0),
    so the rank runs the single-GPU step at its per-device settings (`simulate`), to which `_modelled_rank` adds
    DDP's gradient buckets. What the fake run does not do yet raises NotSimulated (the simulate backend answers it
    with the estimate's closed form, saying so): a sharded layout (ZeRO-3's ds3_gather_for_generation, FSDP2's
    per-layer gathers while generating, which phase holds which shards), or a group of num_generations spanning
    ranks (TRL checks its rule on one process)."""
    k = kind.knobs(candidate)
    local = candidate.per_device_train_batch_size * k.steps(candidate)
    if parallelism.strategy is not Strategy.DDP:
        raise NotSimulated(f"num_gpus={num_gpus} with {parallelism.strategy.value}: the fake run of "
                           f"{kind.trainer_name}.train() on several GPUs is DDP's only (a sharded layout's gathers "
                           "for generation are not simulated yet)")
    if local % k.num_generations:
        raise NotSimulated(f"num_gpus={num_gpus}: a rank's generation batch of {local} completions is not a multiple "
                           f"of num_generations={k.num_generations}, so a group spans ranks, which the one-process "
                           "fake run does not run")
    m = simulate(workload, candidate, target, steps=steps)
    note = (f"online RL on {num_gpus} ranks under DDP: this rank's generation, scoring and training run as one GPU's "
            f"at the per-device settings ({local} completions a generation); the other ranks the same; the "
            "gradients' all-reduce below")
    return dataclasses.replace(m, notes=(*m.notes, note))


def _modelled_rank(m: Any, workload: Any, candidate: Any, parallelism: Parallelism, num_gpus: int):
    """DDP and ZeRO from the single-GPU simulation: the model states at its peak replaced by theirs."""
    from ..physics import model_counts as _model_counts  # lazy: keeps start-up light
    from ..physics import trainable_bytes as _trainable_bytes  # lazy: keeps start-up light
    from ..physics import zero_bytes  # lazy: keeps start-up light

    br = dict(m.breakdown)
    grads = br.get(Category.GRADIENTS.value, 0)
    notes: list[str] = []
    if parallelism.strategy is Strategy.DDP:
        delta = _trainable_bytes(workload, candidate)
        br[Category.GRADIENTS.value] = grads + delta
        notes.append("DDP: modelled as the single-GPU run plus the reducer's gradient buckets (one more copy of the "
                     "trainable gradients: accelerate's default gradient_as_bucket_view=False)")
    else:
        stage = 2 if parallelism.strategy is Strategy.ZERO2 else 3
        params, trainable = _model_counts(workload, candidate)
        # DeepSpeed casts the module to bf16/fp16 when mixed precision is on (fp32 master weights in the optimizer)
        mixed = candidate.precision.value in ("bf16", "fp16")
        terms = zero_bytes(stage, params, trainable, num_gpus, param_bytes=2 if mixed else 4, mixed=mixed,
                           offload_params=parallelism.offload_params, offload_optimizer=parallelism.offload_optimizer)
        old = sum(br.get(c.value, 0) for c in (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER))
        br[Category.PARAMETERS.value] = terms.parameters + terms.buffers
        br[Category.GRADIENTS.value] = terms.gradients
        br[Category.OPTIMIZER.value] = terms.optimizer_state
        delta = terms.total - old
        notes.append(f"DeepSpeed ZeRO-{stage}: modelled in closed form (advisor/physics/ranks_closed.zero_bytes: "
                     "the ZeRO paper's model-state terms, DeepSpeed's default bucket sizes); activations from the "
                     "simulation")
    return dataclasses.replace(
        m, peak_bytes=m.peak_bytes + delta, reserved_bytes=m.reserved_bytes + delta,
        device_bytes=(m.device_bytes + delta) if m.device_bytes else None, breakdown=br,
    ), notes


def shard_fsdp2(model: Any, mesh: Any, parallelism: Parallelism, precision: str) -> Any:
    """Shard a real model over a real process group's `mesh` exactly as the simulation shards its fake one
    (accelerate's own `fsdp2_prepare_model`; the CPU probe of several ranks uses it, since accelerate's FSDP path
    refuses a CPU process group)."""
    from .distributed import prepare_fsdp2  # lazy: loads torch

    return prepare_fsdp2(model, mesh, parallelism, precision)
