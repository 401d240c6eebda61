"""Step time in closed form: the shared step-time model (advisor/_physics/timing/) with its terms counted from
the architecture and the candidate, expected over the same batch distribution, so the two backends rank alike."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .._physics import DTYPE_BYTES, Architecture, knob_time, lora_parameters
from ..space import Attention, Candidate, Precision, Quantization, WeightsDtype
from .memory import TOKEN_CHUNK, VOCAB_CHUNK
from .micro_batches import BatchShape

if TYPE_CHECKING:
    from ..workload import Workload


def expected_step_time(workload: Workload, arch: Architecture, c: Candidate, worst: BatchShape, activations: int):
    """The expected step time from the same terms as the simulator's (advisor/_physics/timing/), in closed form.

    The micro-step's kernels are the decoder's GEMMs (forward, grad-input, weight gradient when trained, the
    recomputed forward under checkpointing; LoRA's rank-r products), attention per tile, the memory-bound ops
    (bytes per token per layer, counted on the fake run: time_constants.json "estimate"), the LM head's tiles and
    folds, bitsandbytes' dequantisation; host ops per layer from the same counts; the optimizer as the target runs
    it. Evaluated over the same batch distribution as the simulator's, so the two backends rank alike.
    """
    from .. import _physics as tm

    gpu = workload.gpu
    tc = tm.time_constants(gpu)
    cuda = gpu.is_cuda
    mixed = c.precision is not Precision.FP32
    act = 2 if (mixed or c.weights_dtype is not WeightsDtype.FLOAT32) else 4
    peak = tc.peak["fp32"] if act == 4 else tc.peak["fp16" if c.precision is Precision.FP16 else "bf16"]
    autocast = mixed and c.weights_dtype is WeightsDtype.FLOAT32
    L = arch.layers
    # the coefficients are taken at the mean micro-batch of the sampler's distribution (a GEMM's efficiency, the
    # kernel floors and the LM head's tiles depend on the size); the worst batch only scales the worst-case time
    dist = tm.batch_distribution(workload.dataset, c, tc.attn_block)
    T = max(1, round(dist.mean(dist.tokens)))
    n_trained = max(1, round(dist.mean(dist.trained)))
    f = (1.0 / c.checkpoint_every_n_layers) if c.activation_checkpointing else 0.0
    quant = c.use_lora and c.quantization is not Quantization.NONE
    targets = set(c.lora_target_modules) if c.use_lora else set()
    dev = np.zeros((len(tm.Term), len(tm.Basis)))
    T_, B_ = list(tm.Term), tm.Basis

    def add(term, basis, seconds):
        dev[T_.index(term), int(basis)] += seconds

    # GEMMs of the decoder (seconds at the worst batch, per token)
    gemm = 0.0
    fixed = 0.0
    for name, i, o in arch.linears:
        fwd = tm.gemm_s(T, o, i, act, peak, tc)
        # torch's non-reentrant checkpoint stops recomputing once every saved tensor is rebuilt: the layer's last
        # projection (down_proj, whose output only joins the residual) is not recomputed
        redo = 0.0 if name == arch.linears[-1][0] else f
        gemm += (1 + redo) * fwd + tm.gemm_s(T, i, o, act, peak, tc)
        if not c.use_lora:
            gemm += tm.gemm_s(o, i, T, act, peak, tc)
        if name in targets:
            r = c.lora_r
            gemm += (1 + redo) * (tm.gemm_s(T, r, i, act, peak, tc) + tm.gemm_s(T, o, r, act, peak, tc))
            gemm += tm.gemm_s(T, r, o, act, peak, tc) + tm.gemm_s(T, i, r, act, peak, tc)  # grad-inputs
            gemm += tm.gemm_s(r, i, T, act, peak, tc) + tm.gemm_s(o, r, T, act, peak, tc)  # grad-weights
        if quant:
            uses = 2 + redo
            extra = 0.0
            if c.quantization is Quantization.INT8:
                extra = fwd * (float(tc.raw["dequantization"]["int8_matmul_factor"]) - 1.0)
            fixed += uses * tm.dequant_s(i * o, c.quantization.value, tc) + extra
    add(tm.Term.MATMUL, B_.TOKENS, L * gemm / T)
    add(tm.Term.DEQUANT, B_.FIXED, L * fixed)
    # attention: per tile (CAUSAL/FULL) of one call; eager: per score element of one head
    if c.attn_implementation is Attention.EAGER:
        d = arch.q_dim // max(1, arch.heads)
        per = arch.heads * (12.0 * d / (peak * tc.gemm_eff) + 24.0 / tc.mem_bw)
        add(tm.Term.ATTENTION, B_.ATTENTION, L * per * (1 + f / 3))
    else:
        heads, d = arch.heads, arch.q_dim // max(1, arch.heads)
        fwd_t = tm.attention_tile_s(heads, d, peak, tc, backward=False)
        bwd_t = tm.attention_tile_s(heads, d, peak, tc, backward=True)
        add(tm.Term.ATTENTION, B_.ATTENTION, L * ((1 + f) * fwd_t + bwd_t))
    # memory-bound ops, host ops (counted on the fake run)
    cal = tc.raw["estimate"]["per_layer"]
    key = "lora" if c.use_lora else ("autocast" if autocast else "base")
    lo, hi = cal[key], cal[key + "_ckpt"]

    def at(field_a, field_b=None):
        a = lo[field_a] if field_b is None else lo[field_a][field_b]
        b = hi[field_a] if field_b is None else hi[field_a][field_b]
        return a + f * (b - a)

    scale = 2.0 if act == 4 else 1.0
    per_token = scale * (at("bytes_per_token", "hidden") * arch.hidden
                         + at("bytes_per_token", "intermediate") * arch.intermediate)
    launches = L * at("launches") + float(tc.raw["estimate"]["outside_launches"])
    add(tm.Term.MEMORY, B_.TOKENS, tm.memory_s(L * per_token * T, tc, kernels=round(launches)) / T)
    if autocast:
        casts = arch.decoder_linear * 6.0 * (1 + f)  # fp32 read + bf16 write of every weight, per forward
        add(tm.Term.MEMORY, B_.FIXED, casts / tc.mem_bw)
    grad_bytes = 4 if c.use_lora else DTYPE_BYTES[c.weights_dtype]
    trainable = lora_parameters(arch, c) if c.use_lora else arch.total
    ga = c.gradient_accumulation_steps
    if ga > 1:  # gradient accumulation: grad += new grad on every micro-step but the first
        add(tm.Term.MEMORY, B_.FIXED, (ga - 1) / ga * trainable * 3 * grad_bytes / tc.mem_bw)
    if not c.use_lora:  # the embedding's dense gradient
        add(tm.Term.MEMORY, B_.FIXED, arch.vocab * arch.hidden * grad_bytes / tc.mem_bw)
    host = (L * at("host_ops") + float(tc.raw["estimate"]["outside_launches"])) * tc.op_s
    # TRL's LM head: tiles of 4096 rows x 32768 vocabulary columns, forward, recompute, grad hidden (+ grad W)
    n = n_trained if cuda else T
    chunk_t, chunk_v = min(n, TOKEN_CHUNK), min(arch.vocab, VOCAB_CHUNK)
    tiles = math.ceil(n / chunk_t) * math.ceil(arch.vocab / chunk_v)
    per_tile = 3 * tm.gemm_s(chunk_t, chunk_v, arch.hidden, act, peak, tc)
    if not c.use_lora:
        per_tile += tm.gemm_s(chunk_v, arch.hidden, chunk_t, act, peak, tc)
    per_tile += tm.memory_s(3.0 * chunk_t * chunk_v * act, tc)  # folds: 1.5 passes per tile GEMM, two GEMMs
    add(tm.Term.LM_HEAD, B_.TRAINED if cuda else B_.TOKENS, tiles * per_tile / n)
    host += tiles * (2 * float(tc.raw["host"]["triton_launch_us"]) * 1e-6 + 6 * tc.op_s)
    # the optimizer step as the target runs it
    opt = tm.optimizer_cost(tm.optimizer_impl(c.optim, cuda), _trainable_sizes(arch, c), grad_bytes, grad_bytes, tc)
    dense = arch.decoder_linear + arch.vocab * arch.hidden  # the matmul weights (the LM head included)
    flops = tm.model_flops(lora_parameters(arch, c) if c.use_lora else dense, dense if c.use_lora else 0, L,
                           arch.q_dim)
    kind = tm.attention_kind(c.attn_implementation.value, masked=bool(worst.mask_bytes))
    cost = tm.StepCost(
        device=dev, host_s=host, serial_host_s=tc.micro_step_s + 2 * tc.sync_s, collate_row_s=tc.collate_row_s,
        optimizer=opt, step_host_s=tc.step_s, serial=not cuda, accumulation=ga, flops_per_token=flops[0],
        flops_per_sq=flops[1], peak_flops=tm.peak_flops(gpu, c.precision.value),
        worst=tm.BatchPoint(float(worst.rows * worst.seq), float(max(1, worst.trained)), float(
            dist.attention.max()), float(worst.rows)), attention_kind=kind,
        launches=launches,
    )
    if c.activation_offloading:
        cost = cost.with_(copy_s_per_token=tm.offload_copy_s_per_token(activations, worst.rows * worst.seq, tc))
    cost = knob_time(cost, workload.model, c, gpu)
    return tm.evaluate(cost, dist)


def _trainable_sizes(arch: Architecture, c: Candidate) -> list[int]:
    """Elements of each trainable tensor (what the optimizer loops over): LoRA's A and B per target and layer, or
    every weight, bias and norm of the model."""
    if c.use_lora:
        targets = set(c.lora_target_modules)
        per_layer = [n for name, i, o in arch.linears if name in targets for n in (c.lora_r * i, o * c.lora_r)]
        return per_layer * arch.layers
    weights = sum(i * o for _, i, o in arch.linears)
    biases = [o for name, _, o in arch.linears if name in ("q_proj", "k_proj", "v_proj")]
    per_layer = [i * o for _, i, o in arch.linears] + [arch.hidden, arch.hidden]
    if arch.per_layer - weights - 2 * arch.hidden >= sum(biases):  # Qwen2's q/k/v biases
        per_layer += biases
    return per_layer * arch.layers + [arch.embedding, arch.final_norm] + ([] if arch.tied else [arch.lm_head])

