"""Predict the peak memory (and a step time) of a real TRL training step without a GPU, on fake tensors.

`simulate()` runs TRL's own `SFTTrainer.train()` (or the workload's trainer's) for `steps` optimizer steps on the
batch that needs the most memory (the longest rows), with every storage tracked. Decoder layers are identical, so
it runs two shallow depths and builds the full depth's allocation stream from theirs, layer by layer (exact, see
tests/test_simulate_depth.py). For a CUDA target it follows the CUDA path and replays the caching allocator's
rules; what fake tensors cannot run is modelled and noted.

This module is the simulator's public face; its parts live in the private package `advisor/_sim/` (one fake run
at one depth and the extrapolation: `depth.py`; what is modelled instead of run: `modelled.py`; the fake step,
the storage tracker, the allocator's rules, the layer streams, the FlashAttention stand-in, the step-time
model). The parts a caller or a test may use are re-exported here: one run at one depth (`simulate_depth`,
`DepthRun`, `plan_depths`, `with_depth`), the batch a simulated step runs (`worst_rows`, `worst_batch`), the
layer-by-layer build (`LayerStream`, `synthesize`, `synthesize_checked`, `NotSeparable`), the candidate as fake
tensors run it (`runnable`) and the FlashAttention stand-in (`fake_flash_attention`, `flash_attention_names`,
`attention_flops`, `batch_facts`, `materialise`). Each is imported on first use.
"""

from __future__ import annotations

import time
from importlib import import_module
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .measurement import Category, Measurement, Source, Status
from .space import Candidate

if TYPE_CHECKING:
    from .trainers import Trainer
    from .workload import GPUSpec, Workload

# the simulator's parts, re-exported from advisor._sim on first use (PEP 562: importing this module loads none)
_PARTS = ("simulate_depth", "DepthRun", "plan_depths", "with_depth", "worst_rows", "worst_batch", "runnable",
          "LayerStream", "NotSeparable", "synthesize", "synthesize_checked", "fake_flash_attention",
          "flash_attention_names", "attention_flops", "batch_facts", "materialise")

__all__ = ["simulate", *_PARTS]


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

    `trainer`: the TRL trainer that runs ("sft", "dpo", "reward"; advisor.trainers.get_trainer); default: the
    workload's (`Workload.trainer`).

    The candidate's base (the user's other keys) is part of the run; `max_steps` below `steps` is simulated as
    written. More steps than 2 change nothing: every simulated step gets the same worst batch, the first step
    allocates the optimizer state lazily in its optimizer step, and from the second on each step frees and
    reallocates the same tensors (tests/test_simulate_accuracy.py checks max_steps 1 and 3 against real runs).
    """
    from ._sim import (
        NotSeparable,
        batch_label,
        check_simulable,
        expected_time,
        extrapolate,
        modelled_adjustments,
        plan_depths,
        resolve_target,
        runnable,
        simulate_depth,
    )
    from .trainers import get_trainer

    started = time.perf_counter()
    spec = get_trainer(trainer or getattr(workload, "trainer", "sft"))
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
    notes.extend(spec.notes(candidate))
    if candidate.group_by_length:
        notes.append(
            "group_by_length: transformers' LengthGroupedSampler puts the batch with the longest row first in every "
            "epoch, so from the second epoch on the optimizer state meets it: simulated with the longest rows at "
            "every step; a run of one epoch or less never puts them together and peaks lower (this is its bound)"
        )
    peak, allocated, reserved = combined.peak_bytes, combined.allocated_bytes, combined.reserved_bytes
    breakdown = dict(combined.breakdown)
    step_time = combined.time_s

    # what the forward saves: the activation offloader's copy volume
    activations_saved = breakdown.get(Category.ACTIVATIONS.value, 0)
    if combined.offload is not None:  # offloading at every moment of the stream, not at the unoffloaded peak only
        off = combined.offload
        delta = off.peak_bytes - peak
        peak, allocated, reserved = peak + delta, allocated + delta, reserved + delta
        breakdown = dict(off.by_category)
        activations_saved = off.saved_bytes
    adjust = modelled_adjustments(candidate, workload.model, breakdown, step_time, batch_shape=combined.batch_shape,
                                   cuda=target.is_cuda)
    notes.extend(adjust.notes)
    peak += adjust.bytes_delta
    allocated += adjust.bytes_delta
    reserved += adjust.bytes_delta
    for cat, delta in adjust.breakdown_delta.items():
        breakdown[cat] = breakdown.get(cat, 0) + delta

    if target.is_cuda:
        from ._sim import context_bytes, cublas_workspace_bytes

        ws = cublas_workspace_bytes(target.compute_capability)
        peak_bytes, reserved_bytes = allocated + ws, reserved + ws
        device_bytes = reserved_bytes + context_bytes(target.compute_capability)
        breakdown[Category.OTHER.value] = breakdown.get(Category.OTHER.value, 0) + ws
        notes.append(
            "device_bytes = reserved + CUDA context + cuBLAS workspace (profiles/measurements/cuda_constants.json)"
        )
    else:
        peak_bytes = reserved_bytes = device_bytes = peak
    timed = expected_time(workload, candidate, target, combined.cost, activations_saved) if spec.timed_over_batches \
        else None
    if timed is not None:
        step_time, trained, tps = timed.step_s, timed.trained_per_step, timed.tokens_per_second
        notes.append(
            "time: the step-time model (advisor/_sim/timing.py) over the batches the sampler makes "
            f"(worst batch {timed.worst_step_s:.4g} s a step); constants unverified until gpu_validate fits them"
        )
    else:
        trained = combined.trained_tokens * candidate.gradient_accumulation_steps
        tps = trained / step_time if step_time > 0 else None
    outside = spec.outside_allocator_bytes(candidate, workload.gpu.memory_bytes)  # the phases' (0: SFT, DPO, Reward)
    if outside:
        device_bytes += outside
        breakdown[Category.OUTSIDE_ALLOCATOR.value] = breakdown.get(Category.OUTSIDE_ALLOCATOR.value, 0) + outside
    status = Status.OK if device_bytes <= workload.budget_bytes else Status.OOM
    b, s = combined.batch_shape
    return Measurement(
        status=status,
        source=Source.SIMULATE,
        peak_bytes=int(peak_bytes),
        reserved_bytes=int(reserved_bytes),
        device_bytes=int(device_bytes),
        breakdown={k: int(v) for k, v in breakdown.items() if v},
        step_time_s=step_time if step_time > 0 else None,
        tokens_per_second=tps if step_time > 0 else None,
        trained_tokens_per_step=int(round(trained)),
        time_breakdown=dict(timed.terms) if timed is not None else {},
        mfu=timed.mfu if timed is not None else None,
        worst_step_time_s=timed.worst_step_s if timed is not None else None,
        peak_batch=batch_label(b, s, combined.unpadded, runs[-1].padding_free_sequences),
        message="" if status is Status.OK else f"device peak {device_bytes} B over budget {workload.budget_bytes} B",
        notes=tuple(notes),
        wall_time_s=time.perf_counter() - started,
        outside_allocator_bytes=int(outside),
    )


def __getattr__(name: str) -> Any:
    if name not in _PARTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module("._sim", __package__), name)
    globals()[name] = value
    return value
