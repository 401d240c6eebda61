"""One fake run at one depth (`simulate_depth`), the two shallow depths a full depth is built from
(`plan_depths`), and the full depth built from their runs (`extrapolate`).

Decoder layers are identical, so `advisor.simulator.simulate` runs two shallow depths and builds the full depth's
allocation stream from theirs layer by layer (advisor/simulator/layers.py); its peaks are taken on that stream, on
CUDA through the caching allocator's rules (advisor/physics/cuda_rules.py). The step time comes from the kernels
the fake run's ops would launch (advisor/simulator/timing_hook.py, costed by advisor/physics/timing/).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._messages import capture
from ..modeling import placeholder_tokenizer
from ..space import Candidate
from ..workload import GPUSpec, ModelSpec, Workload
from .layers import LayerStream, NotSeparable, offload_peak, stream_peak, synthesize_checked

if TYPE_CHECKING:
    from ..physics import StepCost
    from ..trainers import Trainer

__all__ = ["DepthRun", "simulate_depth", "with_depth", "plan_depths", "extrapolate", "worst_rows", "worst_batch"]


@dataclass(frozen=True)
class DepthRun:
    """One fake run at one depth: the numbers that are extrapolated."""

    layers: int
    peak_bytes: int
    breakdown: dict[str, int]
    allocated_bytes: int  # CUDA rules applied (== peak_bytes on the CPU)
    reserved_bytes: int
    time_s: float  # predicted time of one optimizer step on the worst batch (advisor/physics/timing/)
    trained_tokens: int  # per micro-batch
    batch_shape: tuple[int, int]
    unpadded: bool
    cost: StepCost | None = None  # the step-time model's terms at this depth (extrapolated by extrapolate_cost)
    # the run's allocation events by decoder layer (advisor/simulator/layers.py): what a deeper run is built from
    stream: Any = field(default=None, compare=False, repr=False)
    padding_free_sequences: int = 0  # the sequences of a padding-free batch (no attention mask); 0: padded rows
    saved_bytes: int = 0  # what one micro-batch's forward saves for backward (counted when offloading)
    offload: Any = None  # layers.OffloadPeak: activation offloading replayed on the stream (None: not offloaded)


def simulate_depth(
    workload: Workload, candidate: Candidate, target: GPUSpec, layers: int, *, steps: int = 2,
    original: Candidate | None = None, trainer: str | Trainer | None = None,
) -> DepthRun:
    """One fake run of `candidate` (already runnable on fake tensors) with `layers` decoder layers.

    `original` is the candidate as the user runs it (its attention, quantization and optimizer are what the
    step-time model costs, where the runnable one stands in for kernels fake tensors cannot run). `trainer`: the
    workload's unless given."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback  # lazy: loads transformers

    from ..trainers import get_trainer, trainer_of  # lazy: loads numpy
    from .fake_step import make_trainer_class, run_fake_training  # lazy: loads torch
    from .timing_hook import TimingHook, layout_of  # lazy: loads numpy

    kind = get_trainer(trainer) if trainer is not None else trainer_of(workload)
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
            trainer, batch, steps=steps, cuda=target.is_cuda, on_op=hook, on_sync=hook.sync, on_tracker=hook.bind,
            record_events=target.is_cuda, num_layers=layers, spec=kind,
            count_saved=(original or candidate).activation_offloading,
        )
        cost = _step_cost(trainer, hook, timed, target, layers)

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
        saved_bytes=result.saved_bytes,
        offload=_offload(stream.events, stream.categories, layers, (original or candidate).activation_offloading,
                         result.saved_bytes),
    )


def _offload(events, categories, layers: int, offloading: bool, saved_bytes: int):
    """Activation offloading over the whole stream (fake tensors run without it: its CUDA streams cannot run)."""
    if not offloading:
        return None

    return offload_peak(events, categories, layers, saved_bytes)


def _record_last_step(trainer, hook, steps: int, ga: int) -> None:
    """The timing hook records the micro-steps of the last optimizer step (the steady state), each from its
    `training_step` (forward, loss and metrics, backward) through the Trainer's nan check of its loss, to the next
    micro-step or to where the gradient norm is taken (clipping and the optimizer are costed analytically)."""
    inner = trainer.training_step
    calls = [0]

    def training_step(*args, **kwargs):
        calls[0] += 1
        hook.begin_micro(calls[0] > (steps - 1) * ga)
        return inner(*args, **kwargs)

    trainer.training_step = training_step
    for name in ("_clip_grad_norm", "_get_grad_norm"):
        method = getattr(trainer, name)

        def ended(*args, _method=method, **kwargs):
            hook.end_micro()
            return _method(*args, **kwargs)

        setattr(trainer, name, ended)


def _step_cost(trainer, hook, candidate: Candidate, target: GPUSpec, layers: int = 0):
    """The micro-step's costs from the fake run, the optimizer step's from the trainable tensors as the target
    runs them, and the model FLOPs for the MFU."""
    import torch  # lazy: loads torch

    from ..physics import model_flops, optimizer_cost, optimizer_impl  # lazy: loads numpy

    model = trainer.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    max_norm = getattr(trainer.args, "max_grad_norm", 1.0)
    # FSDP2's parameters are DTensors: each rank's optimizer steps its local shard
    local = [getattr(p, "_local_tensor", p) for p in trainable]
    size = local[0].element_size() if local else 4
    opt = optimizer_cost(optimizer_impl(candidate.optim, target.is_cuda), [p.numel() for p in local], size, size,
                         hook.tc, clip=bool(max_norm and max_norm > 0),
                         weight_decay=float(getattr(trainer.args, "weight_decay", 0.0) or 0.0))
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
    return hook.cost(accumulation=candidate.gradient_accumulation_steps, optimizer=opt, flops=flops, layers=layers)


def _worst_step(cost):
    """The step-time model on the worst batch at every micro-step (a StepTime)."""
    from ..physics import BatchDistribution, evaluate  # lazy: loads numpy

    return evaluate(cost, BatchDistribution.single(cost.worst))


def _worst_step_s(cost) -> float:
    return _worst_step(cost).step_s


def _stream_peaks(events: list, categories: list, *, cuda: bool, expandable_segments: bool):
    """(peak, allocated, reserved, breakdown at the peak) of one allocation stream; on CUDA the caching allocator's
    rules replayed on it, on the CPU all three the highest sum of live bytes."""
    top = stream_peak(events, categories)
    allocated = reserved = top.peak_bytes
    if cuda:
        from ..physics import replay  # lazy: loads yaml

        peaks = replay(events, expandable_segments=expandable_segments)
        allocated, reserved = peaks.allocated, peaks.reserved
    return top.peak_bytes, allocated, reserved, top.by_category


_TOKENIZERS: dict[tuple, object] = {}


def _tokenizer(spec: ModelSpec):
    """The placeholder tokenizer, built once per vocabulary: with a 150k vocabulary building it and SFTTrainer's
    `get_vocab()` check cost ~0.3 s a depth. SFTTrainer only reads it here (the config sets no eos/pad token)."""
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


def plan_depths(model: ModelSpec, layers: tuple[int, int] | None, candidate: Candidate | None = None
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


def extrapolate(runs: list[DepthRun], depth: int, *, cuda: bool = False, expandable_segments: bool = True,
                offloading: bool = False) -> DepthRun:
    """The full depth from the two shallow runs: peaks exact on the built stream (advisor/simulator/layers.py); the step
    time linear in depth. Raises `layers.NotSeparable` where the runs do not split into identical layers."""
    if len(runs) == 1:
        return runs[0]
    from ..physics import extrapolate_cost  # lazy: loads numpy

    lo, hi = runs
    k = (depth - lo.layers) / (hi.layers - lo.layers)

    def lin(a: float, b: float) -> float:
        return a + k * (b - a)

    if lo.stream is None or hi.stream is None:
        raise NotSeparable("no allocation stream recorded")
    events, cats = synthesize_checked(lo.stream, hi.stream, depth)
    peak, allocated, reserved, breakdown = _stream_peaks(
        events, cats, cuda=cuda, expandable_segments=expandable_segments
    )
    saved = round(lin(lo.saved_bytes, hi.saved_bytes))  # linear in the layers, as the step's terms
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
        cost=extrapolate_cost(lo.cost, hi.cost, k),  # each term is linear in the number of layers
        saved_bytes=saved,
        offload=_offload(events, cats, depth, offloading, saved),
    )


def worst_rows(workload: Workload, candidate: Candidate, trainer: str | Trainer | None = None) -> list[dict]:
    """The rows of the longest micro-batch, the batch a simulated step runs (the trainer's `worst_rows`; the
    workload's trainer unless given)."""
    from ..trainers import get_trainer, trainer_of  # lazy: loads numpy

    kind = get_trainer(trainer) if trainer is not None else trainer_of(workload)
    return kind.worst_rows(workload, candidate)


def worst_batch(trainer: Any, batch_size: int, spec: str | Trainer | None = None) -> dict:
    """The batch that needs the most memory, as `trainer`'s collator builds it (`spec`: its
    advisor.trainers.Trainer or name; the default trainer when not given)."""
    from .fake_step import worst_batch as of_trainer  # lazy: loads torch

    return of_trainer(trainer, batch_size, spec)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The library never prints: datasets' progress bars off, and what TRL / transformers warn or log per trainer
    is collected (advisor._messages.capture: the search lists it once in its report) instead of printed."""
    import datasets  # lazy: loads datasets


    bars = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()
    try:
        with capture():
            yield
    finally:
        if bars:
            datasets.utils.logging.enable_progress_bar()
