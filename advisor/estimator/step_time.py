"""Step time in closed form: the shared step-time model (advisor/physics/timing/) with its terms counted from
the architecture and the candidate, expected over the same batch distribution, so the two backends rank alike."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np

from .. import physics as tm
from ..physics import DTYPE_BYTES, Architecture, knob_time, lora_parameters
from ..space import Attention, Candidate, Precision, Quantization, WeightsDtype
from .memory import TOKEN_CHUNK, VOCAB_CHUNK
from .micro_batches import BatchShape

if TYPE_CHECKING:
    from ..workload import Workload


def expected_step_time(workload: Workload, arch: Architecture, c: Candidate, worst: BatchShape, activations: int):
    """The expected step time from the same terms as the simulator's (advisor/physics/timing/), in closed form.

    The micro-step's kernels are the decoder's GEMMs (forward, grad-input, weight gradient when trained, the
    recomputed forward under checkpointing; LoRA's rank-r products), attention per tile, the memory-bound ops
    (bytes per token per layer, counted on the fake run: time_constants.json "estimate"), the LM head's tiles and
    folds, bitsandbytes' dequantisation; host ops per layer from the same counts; the optimizer as the target runs
    it. Evaluated over the same batch distribution as the simulator's, so the two backends rank alike.
    """
    gpu = workload.gpu
    tc = tm.time_constants(gpu)
    cuda = gpu.is_cuda
    mixed = c.precision is not Precision.FP32
    act = 2 if (mixed or c.weights_dtype is not WeightsDtype.FLOAT32) else 4
    peak = tc.peak["fp32"] if act == 4 else tc.peak["fp16" if c.precision is Precision.FP16 else "bf16"]
    autocast = mixed and c.weights_dtype is WeightsDtype.FLOAT32
    # FSDP2's MixedPrecisionPolicy gathers the parameters in the compute dtype: the module runs as with 16-bit weights
    # (no autocast casts; the float32 shards are cast at the gather, in the layout's copies below)
    fsdp2_mp = (workload.num_gpus > 1 and autocast and not c.use_lora
                and c.parallelism.parallelism.strategy.value == "fsdp2")
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
    fwd_dev = np.zeros_like(dev)  # the part the forward runs (before TRL's metrics drain the queue)
    T_, B_ = list(tm.Term), tm.Basis

    def add(term, basis, seconds, forward=0.0):
        dev[T_.index(term), int(basis)] += seconds
        fwd_dev[T_.index(term), int(basis)] += seconds * forward

    # GEMMs of the decoder (seconds at the worst batch, per token)
    gemm = gemm_fwd = 0.0
    fixed = fixed_fwd = 0.0
    dequants = dequants_fwd = 0.0  # bitsandbytes' dequantize launches per layer (forward, and in all)
    for name, i, o in arch.linears:
        fwd = tm.gemm_s(T, o, i, act, peak, tc)
        gemm_fwd += fwd
        # torch's non-reentrant checkpoint stops recomputing once every saved tensor is rebuilt: the layer's last
        # projection (down_proj, whose output only joins the residual) is not recomputed
        redo = 0.0 if name == arch.linears[-1][0] else f
        gemm += (1 + redo) * fwd + tm.gemm_s(T, i, o, act, peak, tc)
        if not c.use_lora:
            gemm += tm.gemm_s(o, i, T, act, peak, tc)
        if name in targets:
            r = c.lora_r
            lora_fwd = tm.gemm_s(T, r, i, act, peak, tc) + tm.gemm_s(T, o, r, act, peak, tc)
            gemm_fwd += lora_fwd
            gemm += (1 + redo) * lora_fwd
            gemm += tm.gemm_s(T, r, o, act, peak, tc) + tm.gemm_s(T, i, r, act, peak, tc)  # grad-inputs
            gemm += tm.gemm_s(r, i, T, act, peak, tc) + tm.gemm_s(o, r, T, act, peak, tc)  # grad-weights
        if quant:
            uses = 2 + redo
            extra = 0.0
            if c.quantization is Quantization.INT8:
                extra = fwd * (float(tc.raw["dequantization"]["int8_matmul_factor"]) - 1.0)
            fixed += uses * tm.dequant_s(i * o, c.quantization.value, tc) + extra
            fixed_fwd += tm.dequant_s(i * o, c.quantization.value, tc) + extra
            dequants += uses
            dequants_fwd += 1
    add(tm.Term.MATMUL, B_.TOKENS, L * gemm / T, gemm_fwd / gemm)
    add(tm.Term.DEQUANT, B_.FIXED, L * fixed, fixed_fwd / fixed if fixed else 0.0)
    # attention: per tile (CAUSAL/FULL) of one call; eager: per score element of one head
    if c.attn_implementation is Attention.EAGER:
        d = arch.q_dim // max(1, arch.heads)
        per = arch.heads * (12.0 * d / (peak * tc.gemm_eff) + 24.0 / tc.mem_bw)
        add(tm.Term.ATTENTION, B_.ATTENTION, L * per * (1 + f / 3), (1 / 3) / (1 + f / 3))
    else:
        heads, d = arch.heads, arch.q_dim // max(1, arch.heads)
        fwd_t = tm.attention_tile_s(heads, d, peak, tc, backward=False)
        bwd_t = tm.attention_tile_s(heads, d, peak, tc, backward=True)
        add(tm.Term.ATTENTION, B_.ATTENTION, L * ((1 + f) * fwd_t + bwd_t), fwd_t / ((1 + f) * fwd_t + bwd_t))
    # memory-bound ops, host ops (counted on the fake run)
    cal = tc.raw["estimate"]["per_layer"]
    key = "lora" if c.use_lora else ("autocast" if autocast and not fsdp2_mp else "base")
    lo, hi = cal[key], cal[key + "_ckpt"]

    def at(field_a, field_b=None):
        a = lo[field_a] if field_b is None else lo[field_a][field_b]
        b = hi[field_a] if field_b is None else hi[field_a][field_b]
        return a + f * (b - a)

    scale = 2.0 if act == 4 else 1.0
    per_token = scale * (at("bytes_per_token", "hidden") * arch.hidden
                         + at("bytes_per_token", "intermediate") * arch.intermediate)
    launches = L * at("launches") + float(tc.raw["estimate"]["outside_launches"])
    fwd_bytes = lo["forward_memory_share"] * (lo["bytes_per_token"]["hidden"] * arch.hidden
                                              + lo["bytes_per_token"]["intermediate"] * arch.intermediate) * scale
    add(tm.Term.MEMORY, B_.TOKENS, tm.memory_s(L * per_token * T, tc, kernels=round(launches)) / T,
        min(1.0, fwd_bytes / per_token))
    # several GPUs: the layout's device copies (FSDP2's / ZeRO's gathers, the gradients' buckets), the closed form the
    # simulator adds for the layouts it does not run (advisor/physics/ranks_closed.layout_traffic)
    layout = None
    if workload.num_gpus > 1:
        layout = tm.layout_traffic(workload, c)
        ga_ = c.gradient_accumulation_steps
        add(tm.Term.MEMORY, B_.FIXED, (layout.per_micro_bytes + layout.per_step_bytes / ga_) / tc.mem_bw, 0.5)
    if autocast and not fsdp2_mp:
        casts = arch.decoder_linear * 6.0 * (1 + f)  # fp32 read + bf16 write of every weight, per forward
        add(tm.Term.MEMORY, B_.FIXED, casts / tc.mem_bw, 1 / (1 + f))
    grad_bytes = 4 if c.use_lora else DTYPE_BYTES[c.weights_dtype]
    trainable = lora_parameters(arch, c) if c.use_lora else arch.total
    ga = c.gradient_accumulation_steps
    if ga > 1:  # gradient accumulation: grad += new grad on every micro-step but the first
        add(tm.Term.MEMORY, B_.FIXED, (ga - 1) / ga * trainable * 3 * grad_bytes / tc.mem_bw)
    if not c.use_lora:  # the embedding's dense gradient (16-bit under FSDP2's mixed precision: unsharded, gathered)
        add(tm.Term.MEMORY, B_.FIXED, arch.vocab * arch.hidden * (2 if fsdp2_mp else grad_bytes) / tc.mem_bw)
    # TRL's LM head: tiles of 4096 rows x 32768 vocabulary columns, forward, recompute, grad hidden (+ grad W)
    n = n_trained if cuda else T
    chunk_t, chunk_v = min(n, TOKEN_CHUNK), min(arch.vocab, VOCAB_CHUNK)
    tiles = math.ceil(n / chunk_t) * math.ceil(arch.vocab / chunk_v)
    per_tile = 3 * tm.gemm_s(chunk_t, chunk_v, arch.hidden, act, peak, tc)
    if not c.use_lora:
        per_tile += tm.gemm_s(chunk_v, arch.hidden, chunk_t, act, peak, tc)
    per_tile += tm.memory_s(3.0 * chunk_t * chunk_v * act, tc)  # folds: 1.5 passes per tile GEMM, two GEMMs
    add(tm.Term.LM_HEAD, B_.TRAINED if cuda else B_.TOKENS, tiles * per_tile / n, 1 / 3)
    head_host = tiles * (2 * float(tc.raw["host"]["triton_launch_us"]) * 1e-6 + tc.issue_s(tm.OpClass.GRAD, 6, 6))
    # the optimizer step as the target runs it
    opt = tm.optimizer_cost(tm.optimizer_impl(c.optim, cuda), _trainable_sizes(arch, c), grad_bytes, grad_bytes, tc)
    if layout is not None and layout.optimizer_fraction != 1.0:  # this rank's shard, or none on the device (offload)
        frac = layout.optimizer_fraction
        opt = dataclasses.replace(opt, device_s=opt.device_s * frac, host_s=opt.host_s if frac else 0.0,
                                  launches=opt.launches if frac else 0, bytes=opt.bytes * frac)
    dense = arch.decoder_linear + arch.vocab * arch.hidden  # the matmul weights (the LM head included)
    flops = tm.model_flops(lora_parameters(arch, c) if c.use_lora else dense, dense if c.use_lora else 0, L,
                           arch.q_dim)
    kind = tm.attention_kind(c.attn_implementation.value, masked=bool(worst.mask_bytes))
    dequant_host = tc.issue_s(tm.OpClass.NOGRAD, L * dequants, L * dequants)
    head_host = (head_host, dequant_host * dequants_fwd / dequants if dequants else 0.0, dequant_host)
    segments, host, views, syncs = _micro_segments(tc, L, lo, hi, f, dev, fwd_dev, head_host)
    cost = tm.StepCost(
        device=dev, host_s=host, serial_host_s=tc.micro_step_s, collate_row_s=tc.collate_row_s,
        optimizer=opt, step_host_s=tc.step_s, serial=not cuda, accumulation=ga, flops_per_token=flops[0],
        flops_per_sq=flops[1], peak_flops=tm.peak_flops(gpu, c.precision.value),
        worst=tm.BatchPoint(float(worst.rows * worst.seq), float(max(1, worst.trained)), float(
            dist.attention.max()), float(worst.rows)), attention_kind=kind,
        launches=launches, segments=segments, sync_s=tc.sync_s, views=views, syncs=syncs,
    )
    if c.activation_offloading:
        cost = cost.with_(copy_s_per_token=tm.offload_copy_s_per_token(activations, worst.rows * worst.seq, tc))
    cost = knob_time(cost, workload.model, c, gpu)
    return tm.evaluate(cost, dist)


def _micro_segments(tc, layers: int, lo: dict, hi: dict, f: float, dev: np.ndarray, fwd_dev: np.ndarray,
                 extra_host: tuple[float, float, float]):
    """The micro-step as the host issues it, in closed form: the forward (the layers' ops with grad on, what runs
    outside them), TRL's metrics draining the queue, the backward (autograd's engine, a checkpointed recompute with
    grad on), the Trainer's nan check draining it again. Ops per layer and class from the fake run
    (time_constants.json "estimate"). `extra_host`: TRL's head's host time, bitsandbytes' dequantize launches' in the
    forward and in all. Returns (the segments, host seconds, ops without a kernel, syncs)."""
    grad, back, nograd = tm.OpClass.GRAD, tm.OpClass.BACKWARD, tm.OpClass.NOGRAD
    head_host, dequant_fwd, dequant_all = extra_host

    def at(a: str, k: str) -> float:
        return lo[a][k] + f * (hi[a][k] - lo[a][k])

    fwd_ops, fwd_kernels = layers * lo["ops"]["grad"], layers * lo["kernel_ops"]["grad"]
    redo_ops, redo_kernels = layers * (at("ops", "grad") - lo["ops"]["grad"]), layers * (
        at("kernel_ops", "grad") - lo["kernel_ops"]["grad"])
    bwd_ops, bwd_kernels = layers * at("ops", "backward"), layers * at("kernel_ops", "backward")
    out = {k: lo["outside_ops"][k] for k in ("nograd", "grad", "backward")}
    out_k = {k: lo["outside_kernel_ops"][k] for k in ("nograd", "grad", "backward")}
    host_f = (tc.issue_s(grad, fwd_ops + out["grad"], fwd_kernels + out_k["grad"])
              + tc.issue_s(nograd, out["nograd"], out_k["nograd"]) + head_host / 3 + dequant_fwd)
    host_b = (tc.issue_s(back, bwd_ops + out["backward"], bwd_kernels + out_k["backward"])
              + tc.issue_s(grad, redo_ops, redo_kernels) + head_host * 2 / 3 + dequant_all - dequant_fwd)
    n_f = fwd_ops + out["grad"] + out["nograd"]
    n_b = bwd_ops + redo_ops + out["backward"]
    k_f = fwd_kernels + out_k["grad"] + out_k["nograd"]
    k_b = bwd_kernels + redo_kernels + out_k["backward"]
    syncs = int(round(at("syncs", "syncs") if isinstance(lo["syncs"], dict) else lo["syncs"]))
    segments = (
        tm.Segment(host_f, fwd_dev, pieces=max(1, round(k_f)), syncs=max(1, syncs - 2)),  # TRL's metrics' .item()
        tm.Segment(host_b, dev - fwd_dev, pieces=max(1, round(k_b)), syncs=2),  # the nan check: isnan, isinf
    )
    views = n_f + n_b - k_f - k_b
    return segments, host_f + host_b, views, syncs


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

