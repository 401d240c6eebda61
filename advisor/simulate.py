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
from typing import Any

from .errors import ConfigError
from .measurement import Category, Measurement, Source, Status
from .space import Attention, Candidate, Optimizer, Precision, Quantization, WeightsDtype
from .workload import GPUSpec, ModelSpec, Workload

__all__ = ["simulate", "simulate_depth", "DepthRun"]


@dataclass(frozen=True)
class DepthRun:
    """One fake run at one depth: the numbers that are extrapolated."""

    layers: int
    peak_bytes: int
    breakdown: dict[str, int]
    allocated_bytes: int  # CUDA rules applied (== peak_bytes on the CPU)
    reserved_bytes: int
    time_s: float  # roofline time of one optimizer step
    trained_tokens: int  # per micro-batch
    batch_shape: tuple[int, int]
    unpadded: bool
    # the run's allocation events by decoder layer (advisor/_sim/layers.py): what a deeper run is built from
    stream: Any = field(default=None, compare=False, repr=False)


def simulate(
    workload: Workload,
    candidate: Candidate,
    gpu: str | GPUSpec | None = None,
    *,
    layers: tuple[int, int] | None = (2, 3),
    steps: int = 2,
) -> Measurement:
    """Peak bytes of `steps` real SFT optimizer steps of `candidate` on the target, predicted on fake tensors."""
    started = time.perf_counter()
    target = _resolve_target(gpu, workload)
    candidate.check(target, workload.model)
    run_cand, notes = _runnable(candidate, target)
    depth = workload.model.num_layers
    depths, layer_note = _depths(workload.model, layers, run_cand)
    runs = [simulate_depth(workload, run_cand, target, n, steps=steps) for n in depths]
    try:
        combined = _extrapolate(runs, depth, cuda=target.is_cuda, expandable_segments=run_cand.expandable_segments)
    except _NotSeparable as e:
        layer_note = f"the {depths[0]}- and {depths[1]}-layer runs do not split into identical layers ({e}): " \
                     f"simulated at full depth"
        combined = simulate_depth(workload, run_cand, target, depth, steps=steps)
    if layer_note:
        notes.append(layer_note)
    if candidate.group_by_length:
        notes.append(
            "group_by_length: transformers' LengthGroupedSampler puts the batch with the longest row first in every "
            "epoch, so from the second epoch on the optimizer state meets it: simulated with the longest rows at "
            "every step; a run of one epoch or less never puts them together and peaks lower (this is its bound)"
        )
    peak, allocated, reserved = combined.peak_bytes, combined.allocated_bytes, combined.reserved_bytes
    breakdown = dict(combined.breakdown)
    step_time = combined.time_s

    adjust = _modelled_adjustments(candidate, workload.model, breakdown, step_time)
    notes.extend(adjust.notes)
    peak += adjust.bytes_delta
    allocated += adjust.bytes_delta
    reserved += adjust.bytes_delta
    step_time = adjust.step_time_s
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
    ga = candidate.gradient_accumulation_steps
    trained = combined.trained_tokens * ga
    step_time *= 1.0  # already one optimizer step (all micro-batches)
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
        tokens_per_second=trained / step_time if step_time > 0 else None,
        trained_tokens_per_step=int(trained),
        peak_batch=f"{b} x {s} ({'unpadded' if combined.unpadded else 'padded'}; the longest rows)",
        message="" if status is Status.OK else f"device peak {device_bytes} B over budget {workload.budget_bytes} B",
        notes=tuple(notes),
        wall_time_s=time.perf_counter() - started,
    )


def simulate_depth(
    workload: Workload, candidate: Candidate, target: GPUSpec, layers: int, *, steps: int = 2
) -> DepthRun:
    """One fake run of `candidate` (already runnable on fake tensors) with `layers` decoder layers."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from ._sim.fake_step import make_trainer_class, run_fake_training, worst_batch
    from ._sim.flops import Roofline
    from .emit import build_sft_config, peft_config
    from .modeling import build_model

    spec = with_depth(workload.model, layers)
    model = build_model(spec, candidate, device="meta")
    rows = _worst_rows(workload, candidate)
    with tempfile.TemporaryDirectory(prefix="advisor-sim-") as tmp, _quiet():
        args = build_sft_config(
            candidate, workload, use_cpu=True, output_dir=tmp, max_steps=steps, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True, dataset_num_proc=None, seed=0,
            model_init_kwargs=None,
        )
        trainer = make_trainer_class()(
            model=model, args=args, train_dataset=workload.dataset.to_hf(rows),
            processing_class=_tokenizer(spec), peft_config=peft_config(candidate, spec),
        )
        for callback in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(callback)
        batch = worst_batch(trainer, candidate.per_device_train_batch_size)
        roofline = Roofline(target)
        result = run_fake_training(
            trainer, batch, steps=steps, cuda=target.is_cuda, on_op=roofline, record_events=target.is_cuda,
            num_layers=layers,
        )
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
        time_s=roofline.time_s / steps,
        trained_tokens=result.facts.labelled,
        batch_shape=result.facts.shape,
        unpadded=result.facts.unpadded,
        stream=stream,
    )


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
    )


def _worst_rows(workload: Workload, candidate: Candidate) -> list[dict]:
    """Enough of the longest rows to fill one micro-batch (packed rows when packing).

    Rows whose trained tokens all fall past `max_length` are skipped: TRL drops them as fully masked.
    """
    import numpy as np

    b = candidate.per_device_train_batch_size
    data = workload.dataset
    cap = candidate.max_length
    kept = np.flatnonzero(data.trained_after_truncation(cap) > 0) if data.completion_only_loss else np.arange(
        len(data.rows))
    lengths = np.minimum(data.lengths[kept], cap) if cap else data.lengths[kept]
    order = [int(kept[i]) for i in np.argsort(-lengths, kind="stable")]
    if not candidate.packing or not cap:
        return [data.rows[i] for i in order[:b]]
    need = b * cap
    rows, total = [], 0
    for i in order:
        rows.append(data.rows[i])
        total += min(len(data.rows[i]["input_ids"]), cap)
        if total >= need + cap:
            break
    return rows


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
    if candidate.attn_implementation is Attention.FLASH_ATTENTION_2:
        changes["attn_implementation"] = Attention.SDPA
        notes.append("FlashAttention kernels cannot run on fake tensors: simulated with sdpa (same O(seq) memory)")
    if candidate.activation_offloading:
        changes["activation_offloading"] = False
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
    candidate: Candidate, model: ModelSpec, breakdown: dict[str, int], step_time: float
) -> _Adjustment:
    """Closed-form corrections for what fake tensors cannot run (bitsandbytes, activation offloading)."""
    from ._sim.flops import offload_transfer_s

    adj = _Adjustment(step_time_s=step_time)
    params = Category.PARAMETERS.value
    if candidate.quantization is not Quantization.NONE:
        n = quantized_linear_params(model)
        bits = 4.127 if candidate.quantization is Quantization.NF4 else 8.0 + 32.0 / model.hidden_size
        saved = int(n * 2 - n * bits / 8)  # simulated in 16-bit
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
        transfer = offload_transfer_s(acts)
        adj.step_time_s = step_time + max(0.0, transfer - step_time)
        adj.notes.append(
            "activation offloading's CUDA streams cannot run on fake tensors: saved activations modelled as moved "
            "to host except two layers in flight; transfer time over PCIe overlapped with compute"
        )
    return adj


def quantized_linear_params(model: ModelSpec) -> int:
    """Parameters of the decoder's linear layers (what bitsandbytes quantizes; embeddings and lm_head stay)."""
    h = model.hidden_size
    inter = int(model.text_value("intermediate_size", 4 * h))
    heads = int(model.text_value("num_attention_heads", 1))
    kv = int(model.text_value("num_key_value_heads", heads))
    head_dim = int(model.text_value("head_dim", h // heads) or h // heads)
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    mlp = 3 * h * inter
    return model.num_layers * (attn + mlp)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The library never prints: silence datasets' progress bars and transformers' info logs while simulating."""
    import datasets
    import transformers

    bars = datasets.utils.logging.is_progress_bar_enabled()
    level = transformers.logging.get_verbosity()
    datasets.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        if bars:
            datasets.utils.logging.enable_progress_bar()
        transformers.logging.set_verbosity(level)
