"""The step-time model: what one optimizer step of a candidate costs on the target, by term.

Kernels (device time). Every aten op of the fake run's micro-step is costed as the kernel a GPU runs for it:
- matmul (mm/addmm/bmm/baddbmm): a roofline per GEMM with wave quantisation. The output is cut into tiles
  (128x128, 128x256 on Hopper); the tiles run in waves of one tile per SM; the compute efficiency is the useful
  area over the provisioned area of all waves times K / (K + k_half), with split-K when the output has fewer
  tiles than SMs. The time is max(FLOPs / (peak x gemm_efficiency x that), bytes / (bandwidth x memory
  efficiency)), never under one kernel's floor. So a 64-row GEMM, a rank-16 LoRA product or a skinny weight
  gradient is slow or memory-bound where a 16k-row one runs near the cuBLAS efficiency.
- attention: FlashAttention and sdpa cost per 128x128 tile of query x key a sequence really computes:
  a causal sequence of s tokens n(n+1)/2 tiles (n = ceil(s / 128)); FlashAttention's varlen kernel the sum of
  those per-sequence terms (`_flash_attention_forward/backward` with `cu_seqlens`, lengths from the batch's
  `position_ids`); sdpa with a mask (padding, or the block-diagonal mask of a packed row) the whole row squared,
  n^2 tiles, no causal skip. Eager attention materialises the scores: its ops with a (seq, seq) tensor are
  costed as the kernels they are (GEMMs, softmax) and scale with rows x seq^2.
- memory-bound ops (everything else): bytes read and written over the bandwidth, never under the floor.
- TRL's fused LM head (CUDA): its tile GEMMs as GEMMs; its Triton fold kernels (invisible to the fake run,
  they allocate nothing) as 1.5 passes over each logits tile (one read forward, a read and a write backward).
- bitsandbytes dequantisation (QLoRA): every GEMM that reads a frozen quantized weight (forward, backward's
  grad-input, the checkpointed recompute) first dequantizes it: 4-bit codes + absmax read, 16-bit weight written.

Host and device as two queues. Eager PyTorch spends host time on every op it dispatches (the Python of the module
that calls it, the dispatcher, autograd's node, on CUDA the kernel launch) and the GPU runs the kernels as they
arrive: a micro-step is the fake run's ops in the order the host issues them (queues.OpTrace), each at the host's
cost for its class (host.py: issued from Python with grad off or on, or by autograd's engine; measured by a
microbenchmark of transformers' eager code on the machine that runs the advisor, cached per host and versions; on
CUDA plus a kernel launch) and each kernel at max(FLOPs / achievable rate, bytes / bandwidth, its floor); the device
starts a kernel when the host has issued it and the stream is free, and the host waits where the real step reads a
value back (`.item()`: TRL's metrics after the forward, the Trainer's nan check; nonzero and boolean indexing;
generate's stopping check each token). The step ends when its last kernel ends; the time the device waits on the
host is `launch_host` (host-bound), the rest the kernels' terms (device-bound). Before each micro-step the Trainer's
Python and the collator run while the device idles (the previous micro-step ended in a sync). Activation offloading's
copies run on a side stream: a third lane. On the CPU target host and device are one thread: their times add.

Calibration. scripts/gpu_calibrate.py measures the constants on a device (GEMM rates by shape, bandwidth, attention,
the host's cost per op with the model on the device, a launch and a sync, a decode loop) into
profiles/measurements/<gpu>.json (this host's CPU: the advisor's cache); the model reads them when present
(calibrate.py: "calibrated on <date>, <host>", else "uncalibrated").

Optimizer. What each `optim` really runs on the target (transformers 5 maps adamw_torch to torch's AdamW with
foreach=None: foreach on CUDA, a per-tensor for-loop on the CPU; adamw_torch_fused to fused=True): launches (per
tensor, per foreach call in chunks of MultiTensorApply's tensor lists, or one fused call) and the bytes every kernel
reads and writes (time_constants.json optimizer.<impl>.ops, counted from torch/optim/adam.py: foreach streams the
states once per elementwise op, fused once; bitsandbytes' 8-bit moments with their absmax); gradient clipping
likewise. On several GPUs a rank steps its shard (FSDP2's local DTensors, ZeRO's partition). Costed analytically
from the trainable tensors, not from the fake run (whose CPU fake tensors take the for-loop path whatever the
target).

Expectation over batches. The fake run measures the worst batch (the memory case). Its micro-step time is split
into parts that scale with the padded tokens the device computes, with the trained tokens (the CUDA LM head
scores only those), with the attention tiles, and fixed per micro-step (weight casts, gradient accumulation,
dequantisation, host). `batch_distribution` gives the batches the sampler really makes (random padded batches
exactly from order statistics of the lengths, length-grouped batches in transformers' own order, packed rows
from TRL's pack_dataset, padding-free batches of a seeded epoch), and the throughput is
E[trained tokens per step] / E[step time] over them. The coefficients are taken at the worst batch (the GEMM
efficiency of a smaller typical batch is assumed the same).

Every constant is in profiles/measurements/time_constants.json with its source, unverified until
scripts/gpu_validate.sh fits it on a GPU.

The package: constants.py (terms, bases, TimeConstants), kernels.py (GEMM, memory, attention, dequantisation),
host.py (the host's cost per op), queues.py (OpTrace, the two queues), calibrate.py (measured constants),
optimizer.py, step.py (StepCost, evaluate), sampler.py (batch_distribution). The fake run's ops are observed by
advisor/simulator/timing_hook.py (TimingHook), the estimate counts the same terms in closed form
(advisor/estimator/step_time.py). Outside advisor/physics everything is imported from `advisor.physics`.
"""

from .calibrate import measurements as calibration_rows
from .calibrate import path_for as calibration_path
from .calibrate import read_path as read_calibration
from .calibrate import write_row as write_calibration_row
from .constants import (
    _TERMS,
    AttentionKind,
    Basis,
    Term,
    TimeConstants,
    fitted_multipliers,
    raw_constants,
    time_constants,
)
from .host import HostCost, OpClass, host_cost, host_name, op_class
from .kernels import (
    attention_kind,
    attention_tile_s,
    attention_units,
    causal_tiles,
    dequant_s,
    full_tiles,
    gemm_s,
    memory_s,
    offload_copy_s_per_token,
    peak_flops,
)
from .optimizer import OptimizerCost, OptimizerImpl, optimizer_cost, optimizer_impl
from .queues import OpTrace, QueueTimes, Segment, TraceBuilder, deepen, extrapolate_trace, run_queues, segment_times
from .sampler import SamplerSpec, batch_distribution, sampler_spec
from .step import (
    BatchDistribution,
    BatchPoint,
    QueueShare,
    StepCost,
    StepTime,
    evaluate,
    extrapolate_cost,
    model_flops,
    time_detail,
    uniform_trace,
)

__all__ = [
    "calibration_rows",
    "calibration_path",
    "read_calibration",
    "write_calibration_row",
    "host_name",
    "HostCost",
    "OpClass",
    "OpTrace",
    "QueueShare",
    "QueueTimes",
    "Segment",
    "segment_times",
    "TraceBuilder",
    "deepen",
    "extrapolate_trace",
    "host_cost",
    "op_class",
    "run_queues",
    "uniform_trace",
    "time_detail",
    "AttentionKind",
    "Basis",
    "BatchDistribution",
    "BatchPoint",
    "OptimizerCost",
    "OptimizerImpl",
    "SamplerSpec",
    "StepCost",
    "StepTime",
    "Term",
    "TimeConstants",
    "_TERMS",
    "attention_kind",
    "attention_tile_s",
    "attention_units",
    "batch_distribution",
    "causal_tiles",
    "dequant_s",
    "evaluate",
    "extrapolate_cost",
    "fitted_multipliers",
    "full_tiles",
    "gemm_s",
    "memory_s",
    "model_flops",
    "offload_copy_s_per_token",
    "optimizer_cost",
    "optimizer_impl",
    "peak_flops",
    "raw_constants",
    "sampler_spec",
    "time_constants",
]
