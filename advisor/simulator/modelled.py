"""What fake tensors cannot run, and what the simulate backend models instead in closed form.

`check_simulable` refuses by name what cannot be simulated; `runnable` swaps what fake tensors cannot run
(bitsandbytes, 8-bit optimizers, fp16, the knobs with a `stand_in` in advisor/knobs.py) for what they can and
says so; `modelled_adjustments` puts back in closed form what the swap changed (bitsandbytes' weight bytes, the
8-bit optimizer state, activation offloading, the modelled knobs: one model with the estimate,
advisor/physics/modelled.py); `expected_time` is the step time over the batches the sampler makes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError
from ..knobs import stand_ins
from ..measurement import Category
from ..physics import architecture, knob_memory_savings, knob_time, quantized_linear_bytes
from ..space import Candidate, Optimizer, Precision, Quantization, WeightsDtype
from ..workload import GPUSpec, ModelSpec, Workload

__all__ = ["check_simulable", "runnable", "Adjustment", "modelled_adjustments", "expected_time", "resolve_target",
           "batch_label"]


def check_simulable(candidate: Candidate, model: ModelSpec) -> None:
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


def expected_time(workload: Workload, candidate: Candidate, target: GPUSpec, cost, activation_bytes: int):
    """The expected step time over the batches the sampler makes (the worst batch stays the memory case)."""
    if cost is None:
        return None
    from ..physics import (  # lazy: loads numpy
        batch_distribution,
        evaluate,
        offload_copy_s_per_token,
        peak_flops,
        time_constants,
    )

    tc = time_constants(target)
    cost = cost.with_(peak_flops=peak_flops(target, candidate.precision.value))
    if candidate.activation_offloading:
        cost = cost.with_(copy_s_per_token=offload_copy_s_per_token(activation_bytes, cost.worst.tokens, tc))
    cost = _knob_time(cost, workload.model, candidate, target)
    return evaluate(cost, batch_distribution(workload.dataset, candidate, tc.attn_block))


def _knob_time(cost, model: ModelSpec, candidate: Candidate, target: GPUSpec):
    """The modelled knobs' step-time terms (use_kernels, checkpoint_offload): advisor/physics/modelled.py's closed
    form."""
    return knob_time(cost, model, candidate, target)


def resolve_target(gpu: str | GPUSpec | None, workload: Workload) -> GPUSpec:
    """The target: `gpu` (a name, resolved through the profiles, or a GPUSpec), else the workload's GPU."""
    if gpu is None:
        return workload.gpu
    if isinstance(gpu, GPUSpec):
        return gpu
    from ..profiles import resolve_gpu  # lazy: loads yaml

    return resolve_gpu(gpu)


def runnable(candidate: Candidate, target: GPUSpec) -> tuple[Candidate, list[str]]:
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
class Adjustment:
    """What the closed forms change in a simulated measurement."""

    bytes_delta: int = 0
    breakdown_delta: dict[str, int] = dataclasses.field(default_factory=dict)
    step_time_s: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)


def modelled_adjustments(
    candidate: Candidate, model: ModelSpec, breakdown: dict[str, int], step_time: float, *,
    batch_shape: tuple[int, int] = (0, 0), cuda: bool = True,
) -> Adjustment:
    """Closed-form corrections for what fake tensors cannot run (bitsandbytes, activation offloading, Hub kernels,
    offloaded checkpoints)."""
    adj = Adjustment(step_time_s=step_time)
    _modelled_knobs(adj, candidate, model, breakdown, batch_shape[0] * batch_shape[1], cuda)
    params = Category.PARAMETERS.value
    if candidate.quantization is not Quantization.NONE:
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
    if candidate.activation_offloading:  # its bytes: advisor/simulator/layers.offload_peak, on the simulated stream
        adj.notes.append(
            "activation offloading's CUDA streams cannot run on fake tensors: saved activations modelled as moved "
            "to host except two layers in flight, at every moment of the simulated step (the peak may move to "
            "another moment, e.g. the optimizer step); the PCIe copies of everything the forward saved run on a "
            "side stream, overlapped with compute (the step-time model's copy lane)"
        )
    return adj


_KNOB_NOTES = {
    "use_kernels": "use_kernels: Hub kernels cannot run on fake tensors (and need the `kernels` package and CUDA): "
                   "modelled, Liger's fused RMSNorm saving 4 bytes per normalised element of every layer whose "
                   "activations stay saved (advisor/physics/modelled.py _kernels_saved_bytes), and moving fewer bytes "
                   "than torch's elementwise chain (the step-time model's memory-bound term)",
    "checkpoint_offload": "activation_checkpointing_kwargs offload: transformers' save_on_cpu pins host memory, "
                          "which fake tensors cannot: modelled, the checkpointed layers' saved inputs in host "
                          "memory but for the layer being recomputed (advisor/physics/modelled.py "
                          "_checkpoint_offload_saved_bytes), their copies on the compute stream (the step-time "
                          "model's offload term); the peak is lowered where it was simulated, and another moment "
                          "of the step (the optimizer step) is not seen by this model",
}


def _modelled_knobs(adj: Adjustment, candidate: Candidate, model: ModelSpec, breakdown: dict[str, int],
                    tokens: int, cuda: bool) -> None:
    """The knobs fake tensors cannot run, from advisor/physics/modelled.py's closed forms (one model for both
    backends): what each frees of the activations held at the simulated peak, noted as modelled."""
    acts = Category.ACTIVATIONS.value
    for name in ("use_kernels", "checkpoint_offload"):
        if getattr(candidate, name):
            adj.notes.append(_KNOB_NOTES[name] + ("" if cuda else "; no effect on the CPU"))
    for _name, saved in knob_memory_savings(model, candidate, tokens, cuda).items():
        held = breakdown.get(acts, 0) + adj.breakdown_delta.get(acts, 0)
        saved = min(saved, max(0, held))  # no more than the activations held at the peak
        adj.bytes_delta -= saved
        adj.breakdown_delta[acts] = adj.breakdown_delta.get(acts, 0) - saved


def batch_label(rows: int, seq: int, unpadded: bool, padding_free_sequences: int) -> str:
    """`Measurement.peak_batch`: "ROWS x SEQ (KIND; the longest rows)", KIND one of padded, unpadded (an attention
    mask of all ones) or "padding-free, N sequences" (position_ids, no mask; N over all rows)."""
    if padding_free_sequences:
        n = padding_free_sequences
        kind = f"padding-free, {n} sequence{'s' if n != 1 else ''}"
    else:
        kind = "unpadded" if unpadded else "padded"
    return f"{rows} x {seq} ({kind}; the longest rows)"
