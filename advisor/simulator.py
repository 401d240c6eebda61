"""Predict the peak memory (and a step time) of a real TRL training step without a GPU, on fake tensors.

`simulate()` runs TRL's own `SFTTrainer.train()` for `steps` optimizer steps on the batch that needs the most
memory (the longest rows), with every storage tracked (advisor/_sim). Decoder layers are identical, so it runs
two shallow depths and extrapolates linearly to the model's depth (exact, see tests). For a CUDA target it follows
the CUDA path and replays the caching allocator's rules; what fake tensors cannot run is modelled and noted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .measurement import Category, Measurement, Source, Status
from .space import Candidate, Optimizer, Precision, Quantization, WeightsDtype
from .workload import GPUSpec, ModelSpec, Workload

if TYPE_CHECKING:
    from ._sim.timing import StepCost
    from .trainers import Trainer

__all__ = ["simulate", "simulate_depth", "DepthRun"]


@dataclass(frozen=True)
class DepthRun:
    """One fake run at one depth: the numbers that are extrapolated."""

    layers: int
    peak_bytes: int
    breakdown: dict[str, int]
    allocated_bytes: int  # CUDA rules applied (== peak_bytes on the CPU)
    reserved_bytes: int
    time_s: float  # predicted time of one optimizer step on the worst batch (advisor/_sim/timing.py)
    trained_tokens: int  # per micro-batch
    batch_shape: tuple[int, int]
    unpadded: bool
    cost: StepCost | None = None  # the step-time model's terms at this depth (extrapolated by extrapolate_cost)
    # the run's allocation events by decoder layer (advisor/_sim/layers.py): what a deeper run is built from
    stream: Any = field(default=None, compare=False, repr=False)
    padding_free_sequences: int = 0  # the sequences of a padding-free batch (no attention mask); 0: padded rows


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
    from .trainers import get_trainer

    started = time.perf_counter()
    spec = get_trainer(trainer or getattr(workload, "trainer", "sft"))
    target = _resolve_target(gpu, workload)
    candidate = candidate.for_model(workload.model)
    problems = spec.problems(candidate, target, workload.model)
    if problems:
        raise ConfigError(problems, context="configuration rejected")
    spec.check_dataset(workload)
    max_steps = candidate.base.get("max_steps")
    if isinstance(max_steps, int) and 0 < max_steps < steps:
        steps = max_steps
    _check_simulable(candidate, workload.model)
    run_cand, notes = _runnable(candidate, target)
    depth = workload.model.num_layers
    depths, layer_note = _depths(workload.model, layers, run_cand)
    runs = [simulate_depth(workload, run_cand, target, n, steps=steps, original=candidate, trainer=spec)
            for n in depths]
    try:
        combined = _extrapolate(runs, depth, cuda=target.is_cuda, expandable_segments=run_cand.expandable_segments)
    except _NotSeparable as e:
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

    activations_before = breakdown.get(Category.ACTIVATIONS.value, 0)
    adjust = _modelled_adjustments(candidate, workload.model, breakdown, step_time, batch_shape=combined.batch_shape,
                                   cuda=target.is_cuda)
    notes.extend(adjust.notes)
    peak += adjust.bytes_delta
    allocated += adjust.bytes_delta
    reserved += adjust.bytes_delta
    for cat, delta in adjust.breakdown_delta.items():
        breakdown[cat] = breakdown.get(cat, 0) + delta

    if target.is_cuda:
        from ._sim.cuda_rules import context_bytes, cublas_workspace_bytes

        ws = cublas_workspace_bytes(target.compute_capability)
        peak_bytes, reserved_bytes = allocated + ws, reserved + ws
        device_bytes = reserved_bytes + context_bytes(target.compute_capability)
        breakdown[Category.OTHER.value] = breakdown.get(Category.OTHER.value, 0) + ws
        notes.append(
            "device_bytes = reserved + CUDA context + cuBLAS workspace (profiles/measurements/cuda_constants.json)"
        )
    else:
        peak_bytes = reserved_bytes = device_bytes = peak
    timed = _expected_time(workload, candidate, target, combined.cost, activations_before) if spec.name == "sft" \
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
        peak_batch=_batch_label(b, s, combined.unpadded, runs[-1].padding_free_sequences),
        message="" if status is Status.OK else f"device peak {device_bytes} B over budget {workload.budget_bytes} B",
        notes=tuple(notes),
        wall_time_s=time.perf_counter() - started,
    )


def simulate_depth(
    workload: Workload, candidate: Candidate, target: GPUSpec, layers: int, *, steps: int = 2,
    original: Candidate | None = None, trainer: str | Trainer = "sft",
) -> DepthRun:
    """One fake run of `candidate` (already runnable on fake tensors) with `layers` decoder layers.

    `original` is the candidate as the user runs it (its attention, quantization and optimizer are what the
    step-time model costs, where the runnable one stands in for kernels fake tensors cannot run)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from ._sim.fake_step import make_trainer_class, run_fake_training
    from ._sim.timing import TimingHook, layout_of
    from .trainers import get_trainer

    kind = get_trainer(trainer)
    spec = with_depth(workload.model, layers)
    model = kind.build_model(spec, candidate, device="meta")
    rows = kind.worst_rows(workload, candidate)
    with tempfile.TemporaryDirectory(prefix="advisor-sim-") as tmp, _quiet():
        args = kind.build_config(
            candidate, workload, measured=True, use_cpu=True, output_dir=tmp, max_steps=steps, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True, dataset_num_proc=None, seed=0,
            model_init_kwargs=None,
        )
        with kind.construction(spec, candidate):
            trainer = make_trainer_class(kind)(
                model=model, args=args, train_dataset=kind.train_dataset(workload, rows),
                processing_class=_tokenizer(spec), peft_config=kind.peft_config(candidate, spec),
            )
        for callback in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(callback)
        batch = kind.worst_batch(trainer, candidate.per_device_train_batch_size)
        timed = original or candidate
        hook = TimingHook(target, layout_of({**batch, "labels": kind.labels(batch)}), timed.attn_implementation.value,
                          quantized=timed.quantization.value if timed.quantization.value != "none" else None,
                          model=trainer.model)
        _record_last_step(trainer, hook, steps, candidate.gradient_accumulation_steps)
        result = run_fake_training(
            trainer, batch, steps=steps, cuda=target.is_cuda, on_op=hook, record_events=target.is_cuda,
            num_layers=layers, spec=kind,
        )
        cost = _step_cost(trainer, hook, timed, target)
    from ._sim.layers import LayerStream

    stream = LayerStream.from_run(layers, result.events, result.event_layers, result.event_categories)
    peak, allocated, reserved, breakdown = _stream_peaks(
        list(stream.events), list(stream.categories), cuda=target.is_cuda,
        expandable_segments=candidate.expandable_segments,
    )
    return DepthRun(
        layers=layers,
        peak_bytes=peak,
        breakdown=breakdown,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        time_s=_worst_step_s(cost),
        trained_tokens=result.facts.labelled,
        batch_shape=result.facts.shape,
        unpadded=result.facts.unpadded,
        cost=cost,
        stream=stream,
        padding_free_sequences=0 if batch.get("attention_mask") is not None else len(result.facts.seq_lengths),
    )


def _check_simulable(candidate: Candidate, model: ModelSpec) -> None:
    """What fake tensors cannot run, refused by name before a traceback from deep inside torch."""
    text = model.config.get("text_config") or model.config
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    if experts and candidate.weights_dtype is not WeightsDtype.BFLOAT16:
        raise ConfigError(
            [f"dtype={candidate.weights_dtype.value} on the mixture-of-experts model {model.name}: transformers runs "
             "its experts with torch's grouped_mm, whose fake-tensor kernel accepts bfloat16 only, so this run "
             "cannot be simulated; set dtype: bfloat16, or measure it with `advisor probe`"],
            context="simulate",
        )


def _record_last_step(trainer, hook, steps: int, ga: int) -> None:
    """The timing hook records the micro-steps (forward + backward) of the last optimizer step: the steady state."""
    inner = trainer.training_step
    calls = [0]

    def training_step(*args, **kwargs):
        calls[0] += 1
        hook.begin_micro(calls[0] > (steps - 1) * ga)
        try:
            return inner(*args, **kwargs)
        finally:
            hook.end_micro()

    trainer.training_step = training_step


def _step_cost(trainer, hook, candidate: Candidate, target: GPUSpec):
    """The micro-step's costs from the fake run, the optimizer step's from the trainable tensors as the target
    runs them, and the model FLOPs for the MFU."""
    import torch

    from ._sim.timing import model_flops, optimizer_cost, optimizer_impl

    model = trainer.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    size = trainable[0].element_size() if trainable else 4
    max_norm = getattr(trainer.args, "max_grad_norm", 1.0)
    opt = optimizer_cost(optimizer_impl(candidate.optim, target.is_cuda), [p.numel() for p in trainable], size, size,
                         hook.tc, clip=bool(max_norm and max_norm > 0))
    trained = frozen = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            if mod.weight.requires_grad:
                trained += mod.weight.numel()
            else:
                frozen += mod.weight.numel()
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = int(getattr(cfg, "num_attention_heads", 1))
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    flops = model_flops(trained, frozen, int(cfg.num_hidden_layers), heads * head_dim)
    return hook.cost(accumulation=candidate.gradient_accumulation_steps, optimizer=opt, flops=flops)


def _worst_step_s(cost) -> float:
    from ._sim.timing import BatchDistribution, evaluate

    return evaluate(cost, BatchDistribution.single(cost.worst)).step_s


def _expected_time(workload: Workload, candidate: Candidate, target: GPUSpec, cost, activation_bytes: int):
    """The expected step time over the batches the sampler makes (the worst batch stays the memory case)."""
    if cost is None:
        return None
    from ._sim.timing import batch_distribution, evaluate, offload_copy_s_per_token, peak_flops, time_constants

    tc = time_constants(target)
    cost = cost.with_(peak_flops=peak_flops(target, candidate.precision.value))
    if candidate.activation_offloading:
        cost = cost.with_(copy_s_per_token=offload_copy_s_per_token(activation_bytes, cost.worst.tokens, tc))
    cost = _knob_time(cost, workload.model, candidate, target)
    return evaluate(cost, batch_distribution(workload.dataset, candidate, tc.attn_block))


def _knob_time(cost, model: ModelSpec, candidate: Candidate, target: GPUSpec):
    """The modelled knobs' step-time terms (use_kernels, checkpoint_offload): advisor/estimate.py's closed form."""
    from .estimator import knob_time

    return knob_time(cost, model, candidate, target)


def _stream_peaks(events: list, categories: list, *, cuda: bool, expandable_segments: bool):
    """(peak, allocated, reserved, breakdown at the peak) of one allocation stream; on CUDA the caching allocator's
    rules replayed on it, on the CPU all three the highest sum of live bytes."""
    from ._sim.layers import stream_peak

    top = stream_peak(events, categories)
    allocated = reserved = top.peak_bytes
    if cuda:
        from ._sim.cuda_rules import replay

        peaks = replay(events, expandable_segments=expandable_segments)
        allocated, reserved = peaks.allocated, peaks.reserved
    return top.peak_bytes, allocated, reserved, top.by_category


_TOKENIZERS: dict[tuple, object] = {}


def _tokenizer(spec: ModelSpec):
    """The placeholder tokenizer, built once per vocabulary: with a 150k vocabulary building it and SFTTrainer's
    `get_vocab()` check cost ~0.3 s a depth. SFTTrainer only reads it here (the config sets no eos/pad token)."""
    from .modeling import placeholder_tokenizer

    key = (spec.vocab_size, repr(spec.text_value("pad_token_id")), repr(spec.text_value("eos_token_id")))
    tok = _TOKENIZERS.get(key)
    if tok is None:
        tok = placeholder_tokenizer(spec)
        vocab = tok.get_vocab()
        tok.get_vocab = lambda: vocab
        if len(_TOKENIZERS) >= 4:
            _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
        _TOKENIZERS[key] = tok
    return tok


def with_depth(model: ModelSpec, layers: int) -> ModelSpec:
    """The same architecture with `layers` decoder layers (per-layer lists cut to match)."""
    config = dict(model.config)
    text = dict(config.get("text_config") or {})
    target = text if text else config
    target["num_hidden_layers"] = layers
    if isinstance(target.get("layer_types"), list):
        target["layer_types"] = target["layer_types"][:layers]
    if text:
        config["text_config"] = text
    return dataclasses.replace(model, config=config)


def _depths(model: ModelSpec, layers: tuple[int, int] | None, candidate: Candidate | None = None
            ) -> tuple[list[int], str]:
    """The two shallow depths whose runs build the full depth's stream: a = 2 + (N - 2) mod p and a + p, where p is
    the period of the layers (layer types, checkpointing every n layers); [N] where that is no shallower."""
    depth = model.num_layers
    if layers is None or depth <= 3:
        return [depth], ""
    types = model.text_value("layer_types")
    period = 1
    if isinstance(types, list) and len(set(types)) > 1:
        period = next((p for p in range(1, len(types)) if all(types[i] == types[i % p] for i in range(len(types)))), 0)
        if not period:
            return [depth], "layer types do not repeat: simulated at full depth"
    if candidate is not None and candidate.activation_checkpointing and candidate.checkpoint_every_n_layers > 1:
        period = math.lcm(period, candidate.checkpoint_every_n_layers)
    base = max(2, layers[0])
    a = base + (depth - base) % period
    b = a + period
    if b >= depth:
        return [depth], ""
    return [a, b], (
        f"simulated {a} and {b} decoder layers, extrapolated to {depth} layer by layer: the {depth}-layer run's "
        f"allocation stream built from theirs (checked against the {a}-layer run), its peaks taken on it"
    )


class _NotSeparable(Exception):
    pass


def _extrapolate(runs: list[DepthRun], depth: int, *, cuda: bool = False, expandable_segments: bool = True
                 ) -> DepthRun:
    """The full depth from the two shallow runs: peaks exact on the built stream (advisor/_sim/layers.py); the step
    time linear in depth."""
    if len(runs) == 1:
        return runs[0]
    from ._sim.layers import NotSeparable, synthesize_checked

    lo, hi = runs
    k = (depth - lo.layers) / (hi.layers - lo.layers)

    def lin(a: float, b: float) -> float:
        return a + k * (b - a)

    if lo.stream is None or hi.stream is None:
        raise _NotSeparable("no allocation stream recorded")
    try:
        events, cats = synthesize_checked(lo.stream, hi.stream, depth)
    except NotSeparable as e:
        raise _NotSeparable(str(e)) from e
    peak, allocated, reserved, breakdown = _stream_peaks(
        events, cats, cuda=cuda, expandable_segments=expandable_segments
    )
    return DepthRun(
        layers=depth,
        peak_bytes=peak,
        breakdown=breakdown,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        time_s=lin(lo.time_s, hi.time_s),
        trained_tokens=hi.trained_tokens,
        batch_shape=hi.batch_shape,
        unpadded=hi.unpadded,
        cost=_extrapolate_time(lo, hi, k),
    )


def _extrapolate_time(lo: DepthRun, hi: DepthRun, k: float):
    """The step-time model's terms at full depth (each is linear in the number of layers)."""
    from ._sim.timing import extrapolate_cost

    return extrapolate_cost(lo.cost, hi.cost, k)


def _worst_rows(workload: Workload, candidate: Candidate) -> list[dict]:
    """SFT's rows of the longest micro-batch (advisor.trainers.sft.SFT.worst_rows)."""
    from .trainers import get_trainer

    return get_trainer("sft").worst_rows(workload, candidate)


def _resolve_target(gpu: str | GPUSpec | None, workload: Workload) -> GPUSpec:
    if gpu is None:
        return workload.gpu
    if isinstance(gpu, GPUSpec):
        return gpu
    from .profiles import resolve_gpu

    return resolve_gpu(gpu)


def _runnable(candidate: Candidate, target: GPUSpec) -> tuple[Candidate, list[str]]:
    """The candidate fake tensors can run on the CPU, and what is modelled instead."""
    notes: list[str] = []
    changes: dict = {}
    if candidate.quantization is not Quantization.NONE:
        changes["quantization"] = Quantization.NONE
        fp16 = candidate.precision is Precision.FP16
        changes["weights_dtype"] = WeightsDtype.FLOAT16 if fp16 else WeightsDtype.BFLOAT16
    if candidate.optim.needs_bitsandbytes:
        changes["optim"] = Optimizer.ADAMW_TORCH
    if candidate.attn_implementation.is_flash:
        notes.append(
            "FlashAttention: transformers' flash path run as written (no mask; unpad/repad of padded rows; varlen "
            "cu_seqlens for padding-free rows); the kernel's tensors from aten's _flash_attention_forward/_backward "
            "meta kernels plus flash-attn 2's backward workspace (softmax_d, dq_accum, GQA dK/dV), FLOPs per sequence"
        )
    if candidate.attn_implementation.is_flash and candidate.attn_implementation.flash_version != 2:
        notes.append(f"{candidate.attn_implementation.value}: modelled as FlashAttention 2 (same flash path and "
                     "tensors); its own kernel's workspace and speed are not simulated")
    from .knobs import stand_ins

    changes.update(stand_ins(candidate))  # activation_offloading, checkpoint_offload (advisor/knobs.py)
    if candidate.precision is Precision.FP16:
        changes["precision"] = Precision.BF16
        notes.append("fp16 autocast simulated as bf16 (same sizes); the gradient scaler's few bytes are ignored")
    if target.is_cuda:
        notes.append("CUDA path: TRL's fused LM head scores labelled positions only (Triton), CUDA allocator rules")
        if candidate.precision is not Precision.FP32:
            notes.append(
                "autocast follows the CPU's op lists on fake tensors; CUDA's lists differ for a few ops, so the "
                "dtype of some temporaries may differ from a real GPU run"
            )
    if changes.get("weights_dtype") is WeightsDtype.FLOAT16 and changes.get("precision") is Precision.BF16:
        changes["weights_dtype"] = WeightsDtype.BFLOAT16
    try:
        return (candidate.replace(**changes) if changes else candidate), notes
    except ConfigError:  # pragma: no cover - the replacements are always valid
        raise


@dataclass
class _Adjustment:
    bytes_delta: int = 0
    breakdown_delta: dict[str, int] = dataclasses.field(default_factory=dict)
    step_time_s: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)


def _modelled_adjustments(
    candidate: Candidate, model: ModelSpec, breakdown: dict[str, int], step_time: float, *,
    batch_shape: tuple[int, int] = (0, 0), cuda: bool = True,
) -> _Adjustment:
    """Closed-form corrections for what fake tensors cannot run (bitsandbytes, activation offloading, Hub kernels,
    offloaded checkpoints)."""
    adj = _Adjustment(step_time_s=step_time)
    _modelled_knobs(adj, candidate, model, breakdown, batch_shape[0] * batch_shape[1], cuda)
    params = Category.PARAMETERS.value
    if candidate.quantization is not Quantization.NONE:
        from .estimator import architecture, quantized_linear_bytes

        arch = architecture(model)
        n = arch.decoder_linear
        stored = quantized_linear_bytes(arch, candidate)
        bits = 8 * stored / n
        saved = int(n * 2 - stored)  # simulated in 16-bit
        largest = 2 * model.hidden_size * int(model.text_value("intermediate_size", 4 * model.hidden_size))
        adj.bytes_delta += -saved + largest
        adj.breakdown_delta[params] = adj.breakdown_delta.get(params, 0) - saved
        adj.breakdown_delta[Category.TEMPORARIES.value] = largest
        adj.notes.append(
            f"bitsandbytes {candidate.quantization.value} kernels cannot run on fake tensors: decoder linear weights "
            f"modelled at {bits:.2f} bits (simulated in 16-bit), plus one dequantized weight as a temporary"
        )
    if candidate.optim.needs_bitsandbytes:
        state = breakdown.get(Category.OPTIMIZER.value, 0)
        saved = state * 3 // 4  # two fp32 moments -> two uint8 moments
        adj.bytes_delta -= saved
        adj.breakdown_delta[Category.OPTIMIZER.value] = -saved
        adj.notes.append(f"{candidate.optim.value}: 8-bit optimizer state modelled as 1/4 of AdamW's fp32 state")
    if candidate.activation_offloading:
        acts = breakdown.get(Category.ACTIVATIONS.value, 0)
        layers = max(1, model.num_layers)
        kept = 2 * acts // layers  # double-buffered: the layer being computed and the one in flight
        adj.bytes_delta -= acts - kept
        adj.breakdown_delta[Category.ACTIVATIONS.value] = kept - acts
        adj.notes.append(
            "activation offloading's CUDA streams cannot run on fake tensors: saved activations modelled as moved "
            "to host except two layers in flight; their PCIe copies run on a side stream, overlapped with compute "
            "(the step-time model's copy lane)"
        )
    return adj


_KNOB_NOTES = {
    "use_kernels": "use_kernels: Hub kernels cannot run on fake tensors (and need the `kernels` package and CUDA): "
                   "modelled, Liger's fused RMSNorm saving 4 bytes per normalised element of every layer whose "
                   "activations stay saved (advisor/estimate.py _kernels_saved_bytes), and moving fewer bytes "
                   "than torch's elementwise chain (the step-time model's memory-bound term)",
    "checkpoint_offload": "activation_checkpointing_kwargs offload: transformers' save_on_cpu pins host memory, "
                          "which fake tensors cannot: modelled, the checkpointed layers' saved inputs in host "
                          "memory but for the layer being recomputed (advisor/estimate.py "
                          "_checkpoint_offload_saved_bytes), their copies on the compute stream (the step-time "
                          "model's offload term); the peak is lowered where it was simulated, and another moment "
                          "of the step (the optimizer step) is not seen by this model",
}


def _modelled_knobs(adj: _Adjustment, candidate: Candidate, model: ModelSpec, breakdown: dict[str, int],
                    tokens: int, cuda: bool) -> None:
    """The knobs fake tensors cannot run, from advisor/estimate.py's closed forms (one model for both backends):
    what each frees of the activations held at the simulated peak, noted as modelled."""
    from .estimator import knob_memory_savings

    acts = Category.ACTIVATIONS.value
    for name in ("use_kernels", "checkpoint_offload"):
        if getattr(candidate, name):
            adj.notes.append(_KNOB_NOTES[name] + ("" if cuda else "; no effect on the CPU"))
    for _name, saved in knob_memory_savings(model, candidate, tokens, cuda).items():
        held = breakdown.get(acts, 0) + adj.breakdown_delta.get(acts, 0)
        saved = min(saved, max(0, held))  # no more than the activations held at the peak
        adj.bytes_delta -= saved
        adj.breakdown_delta[acts] = adj.breakdown_delta.get(acts, 0) - saved


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The library never prints: datasets' progress bars off, and what TRL / transformers warn or log per trainer
    is collected (advisor._messages.capture: the search lists it once in its report) instead of printed."""
    import datasets

    from ._messages import capture

    bars = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()
    try:
        with capture():
            yield
    finally:
        if bars:
            datasets.utils.logging.enable_progress_bar()


def _batch_label(rows: int, seq: int, unpadded: bool, padding_free_sequences: int) -> str:
    """`Measurement.peak_batch`: "ROWS x SEQ (KIND; the longest rows)", KIND one of padded, unpadded (an attention
    mask of all ones) or "padding-free, N sequences" (position_ids, no mask; N over all rows)."""
    if padding_free_sequences:
        n = padding_free_sequences
        kind = f"padding-free, {n} sequence{'s' if n != 1 else ''}"
    else:
        kind = "unpadded" if unpadded else "padded"
    return f"{rows} x {seq} ({kind}; the longest rows)"
