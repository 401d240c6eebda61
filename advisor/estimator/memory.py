"""Peak memory in closed form: the bytes of each thing a training step holds (parameters, gradients, optimizer
state and temporaries, saved activations, TRL's fused LM head), for the worst micro-batch.

TRL 1.16's SFTTrainer computes the loss through `add_fused_lm_head` (`trl/kernels/chunked_logprob.py`), which
projects hidden states through the LM head in tiles of 4096 tokens x 32768 vocabulary columns and never builds
(batch, seq, vocab) logits. On CUDA (Triton) only the positions with a label are scored; elsewhere every
position is, through fp32 copies of each tile. `estimator.estimate` places these parts at the moments of a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..physics import (
    DTYPE_BYTES,
    Architecture,
    architecture,
    context_bytes,
    cublas_workspace_bytes,
    knob_memory_savings,
    lora_parameters,
    quantized_linear_bytes,
)
from ..physics import RESERVED_FACTOR as _RESERVED_FACTOR
from ..space import Attention, Candidate, Optimizer, Precision, Quantization, WeightsDtype
from .micro_batches import BatchShape, batches

if TYPE_CHECKING:
    from ..workload import GPUSpec, Workload

MiB = 2**20
# Caching allocator: reserved over allocated at the peak (fragmentation): advisor/physics/cuda_rules.py
RESERVED_FACTOR = _RESERVED_FACTOR

# trl/kernels/chunked_logprob.py and trl/trainer/utils.py (TRL 1.16)
TOKEN_CHUNK = 4096
VOCAB_CHUNK = 32768
# SFTTrainer asks add_fused_lm_head for log_probs, entropy and is_top1: seven fp32 per-token vectors.
LM_HEAD_FP32_VECTORS = 7


@dataclass(frozen=True)
class MemoryParts:
    """Bytes of each thing the estimate counts, before they are placed at a moment of the step."""

    parameters: int
    gradients: int
    optimizer: int
    optimizer_temporaries: int
    activations: int  # saved for backward at the end of the forward, outside the LM head
    lm_head_saved: int
    lm_head_temporaries: int
    recompute: int  # one checkpointed layer rebuilt during backward
    trainable: int  # parameters that get gradients
    batch: BatchShape  # the worst micro-batch
    offloaded: int = 0  # activation offloading: saved bytes that leave the device (activations are what stays)
    offload_volume: int = 0  # activation offloading: what the forward saves through the offloader's hooks (copied)


def memory_parts(workload: Workload, candidate: Candidate) -> MemoryParts:
    """Every byte count the estimate adds up, for the worst micro-batch of the workload's data."""
    c = candidate
    arch = architecture(workload.model)
    worst, _ = batches(workload.dataset, c)

    weight_bytes = DTYPE_BYTES[c.weights_dtype]
    mixed = c.precision is not Precision.FP32
    act_bytes = 2 if (mixed or c.weights_dtype is not WeightsDtype.FLOAT32) else 4
    autocast = mixed and c.weights_dtype is WeightsDtype.FLOAT32

    # parameters
    quant = c.use_lora and c.quantization is not Quantization.NONE
    base_linear = arch.decoder_linear
    other = arch.total - base_linear
    if quant:
        params = int(quantized_linear_bytes(arch, c)) + other * weight_bytes
    else:
        params = arch.total * weight_bytes
    adapters = lora_parameters(arch, c) if c.use_lora else 0
    params += adapters * 4  # PEFT keeps adapters in float32 (autocast_adapter_dtype)
    params += arch.buffer_bytes

    # gradients and optimizer state, of what is trained
    trainable = adapters if c.use_lora else arch.total
    grad_bytes = 4 if c.use_lora else weight_bytes
    grads = trainable * grad_bytes
    optimizer, opt_temp = _optimizer_bytes(c, arch, trainable, grad_bytes)

    # activations saved for backward, at the end of the forward
    tokens = worst.rows * worst.seq
    per_layer = _layer_activation_bytes(arch, c, worst, act_bytes, residual_bytes=4 if autocast else act_bytes)
    resid = tokens * arch.hidden * (4 if autocast else act_bytes)
    if c.activation_checkpointing:
        n_ckpt = math.ceil(arch.layers / c.checkpoint_every_n_layers)
        kept = arch.layers - n_ckpt
        per_ckpt = resid + (tokens * arch.hidden * act_bytes if c.checkpoint_selective else 0)
        layer_acts = n_ckpt * per_ckpt + kept * per_layer
        recompute = per_layer
    else:
        layer_acts = arch.layers * per_layer
        recompute = 0
    offloaded = volume = 0
    if c.activation_offloading:
        # the copies move what autograd saves through the offloader's hooks: inside a checkpointed layer torch's
        # own hooks take precedence (only its input is seen), so the autocast weight copies those layers' matmuls
        # save are not moved; the final norm's input and output are (the simulator counts them the same way:
        # advisor/simulator/fake_step._SavedCounter)
        plain = (arch.layers - math.ceil(arch.layers / c.checkpoint_every_n_layers)
                 if c.activation_checkpointing else arch.layers)
        cast = base_linear * 2 * plain // arch.layers if autocast and (not c.use_lora or not quant) else 0
        volume = layer_acts + tokens * arch.hidden * (4 + act_bytes) + cast
        # TRL's offloader moves saved tensors to pinned host memory, keeping about two layers in flight; every
        # saved byte crosses PCIe twice (the copies' time counts what is moved, not what stays).
        kept_acts = min(layer_acts, 2 * max(per_layer, resid))
        offloaded, layer_acts = layer_acts - kept_acts, kept_acts
    # the final norm keeps its fp32 input and normalised output; the attention mask, when there is one
    activations = layer_acts + tokens * arch.hidden * (4 + act_bytes) + worst.mask_bytes
    activations -= sum(knob_memory_savings(workload.model, c, tokens, workload.gpu.is_cuda).values())
    # the autocast cache holds a low-precision copy of every trainable weight until the forward ends
    if autocast and not c.use_lora:
        activations += base_linear * 2
    elif autocast and not quant and not c.activation_checkpointing:
        activations += base_linear * 2  # frozen weights are cast per call, and saved by each matmul

    lm_saved, lm_peak = _lm_head_bytes(arch, c, worst, workload.gpu.is_cuda, act_bytes, weight_bytes, autocast)
    return MemoryParts(
        parameters=int(params), gradients=int(grads), optimizer=int(optimizer), optimizer_temporaries=int(opt_temp),
        activations=int(activations), lm_head_saved=lm_saved, lm_head_temporaries=lm_peak, recompute=int(recompute),
        trainable=int(trainable), batch=worst, offloaded=int(offloaded), offload_volume=int(volume),
    )



def _optimizer_bytes(c: Candidate, arch: Architecture, trainable: int, grad_bytes: int) -> tuple[int, int]:
    """(state bytes, peak temporaries of one step)."""
    state_bytes = grad_bytes  # torch AdamW keeps its moments in the parameter's dtype
    if c.optim in (Optimizer.ADAMW_TORCH_FUSED,):
        return 2 * trainable * state_bytes, 0
    if c.optim is Optimizer.ADAMW_TORCH:
        # foreach: _foreach_sqrt(exp_avg_sq) and friends allocate one parameter-sized list
        return 2 * trainable * state_bytes, trainable * state_bytes
    if c.optim.needs_bitsandbytes:
        # two 8-bit moments + an fp32 absmax per block of 256 (tensors under 4096 elements stay 32-bit: ignored)
        return int(trainable * 2 * (1 + 4 / 256)), 0
    # Adafactor (transformers): factored second moment (row + column) for matrices, no first moment
    if c.use_lora:
        targets = [(i, o) for name, i, o in arch.linears if name in set(c.lora_target_modules)]
        state = arch.layers * sum(c.lora_r * 2 + i + o for i, o in targets) * 4
        largest = max((c.lora_r * max(i, o) for i, o in targets), default=0)
    else:
        state = (arch.layers * sum(i + o for _, i, o in arch.linears) + 2 * (arch.vocab + arch.hidden)) * 4
        state += (arch.layers * (arch.per_layer - sum(i * o for _, i, o in arch.linears)) + arch.final_norm) * 4
        largest = arch.vocab * arch.hidden
    return int(state), 3 * largest * 4  # grad**2, the update and its RMS, each the size of the largest parameter


def _layer_activation_bytes(arch: Architecture, c: Candidate, batch: BatchShape, a: int, residual_bytes: int) -> int:
    """Tensors one decoder layer saves for backward (Llama-style, SwiGLU, RMSNorm in fp32)."""
    t = batch.rows * batch.seq
    h, q, kv, inter = arch.hidden, arch.q_dim, arch.kv_dim, arch.intermediate
    casts = 2 if (a == 2 and residual_bytes == 4) else 0  # autocast casts the input of each projection anew
    norms = 2 * (4 * h + a * h)  # RMSNorm keeps its fp32 input and its normalised output
    qkv_in = a * h * (1 + casts)  # one input, or three casts under autocast
    # sdpa keeps q, k, v after rotary (k/v repeated to every head when a mask is present), its output and
    # logsumexp; rotary itself keeps only cos/sin
    kv_rep = q if batch.mask_bytes else kv
    attn = a * (q + 2 * kv_rep + q) + 4 * arch.heads
    o_in = a * q
    mlp_in = a * h * (1 + casts // 2)
    mlp = 4 * a * inter
    per_token = norms + qkv_in + attn + o_in + mlp_in + mlp
    out = t * per_token
    if c.attn_implementation is Attention.EAGER:
        out += int(arch.heads * batch.attention_sq * (4 + a))  # fp32 softmax + its low-precision copy
    if c.use_lora:
        # each adapter keeps the r-dim projection, and with lora_dropout > 0 its dropout's output (PEFT's
        # nn.Dropout); at lora_dropout 0 PEFT's dropout is nn.Identity and lora_A keeps the base layer's own input
        # (measured against the simulator, Qwen2.5-0.5B, 4 x 1024, bf16: the same activations +3.98 GB at 0.05 as at 0)
        targets = set(c.lora_target_modules)
        dropout = 4 if c.lora_dropout > 0 else 0
        out += t * sum(dropout * i + 4 * c.lora_r for name, i, _ in arch.linears if name in targets)
    return int(out)


def _lm_head_bytes(
    arch: Architecture, c: Candidate, batch: BatchShape, cuda: bool, a: int, weight_bytes: int, autocast: bool
) -> tuple[int, int]:
    """(saved for backward, peak temporaries) of TRL's chunked log-prob head."""
    positions = batch.rows * max(batch.seq - 1, 1)
    n = batch.trained if cuda else positions
    h, v = arch.hidden, arch.vocab
    chunk_t, chunk_v = min(n, TOKEN_CHUNK), min(v, VOCAB_CHUNK)
    saved = n * h * a + LM_HEAD_FP32_VECTORS * n * 4 + positions * 8  # hidden[mask] / reshape copy, stats, labels
    tile = chunk_t * chunk_v * a
    w_chunk = chunk_v * h * a if (autocast or weight_bytes != a) else 0
    h_chunk = chunk_t * h * a if autocast else 0
    fwd = tile + w_chunk + h_chunk
    bwd = tile + w_chunk + h_chunk + n * h * 4  # fp32 grad of the hidden states
    if not c.use_lora:
        bwd += v * h * 4  # fp32 grad of the head's weight, accumulated across tiles
    if not cuda:
        # torch fallback: tile.float(), the transformed logits, exp and products, each an fp32 tile;
        # _addmm_fp32 upcasts the tile and the weight chunk
        fwd += 4 * chunk_t * chunk_v * 4
        bwd += 5 * chunk_t * chunk_v * 4 + chunk_v * h * 4
    return int(saved), int(max(fwd, bwd))



def outside_allocator_bytes(gpu: GPUSpec, threads: int | None = None) -> int:
    """CUDA context + cuBLAS workspaces (one per thread issuing GEMMs, `threads`: default a training step's): the same
    calibrated constants the simulator uses (profiles/measurements/cuda_constants.json)."""
    return context_bytes(gpu.compute_capability) + cublas_workspace_bytes(gpu.compute_capability, threads)

