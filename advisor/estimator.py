"""The analytic estimate: peak memory by category and step time of one candidate, in microseconds.

It follows the path TRL 1.16's SFTTrainer really takes: the loss goes through `add_fused_lm_head`
(`trl/kernels/chunked_logprob.py`), which projects hidden states through the LM head in tiles of
4096 tokens x 32768 vocabulary columns and never builds (batch, seq, vocab) logits. On CUDA (Triton) only the
positions with a label are scored; elsewhere every position is, through fp32 copies of each tile.

The peak is the larger of two moments of a training step:
- the end of the forward (activations saved for backward, the autocast weight cache, the LM head's tiles and,
  when gradients accumulate over micro-batches, the previous micro-batches' gradients);
- the optimizer step (every gradient, the optimizer state and the optimizer's own temporaries).
Backward lies between the two: activations are freed layer by layer as gradients appear.

Step time: the simulator's step-time model (advisor/_sim/timing.py) with its terms in closed form (`_step_time`),
expected over the same batch distribution, so the two backends rank alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from .measurement import Category, Measurement, Source, Status
from .space import Attention, Candidate, Optimizer, PackingStrategy, Precision, Quantization, WeightsDtype

if TYPE_CHECKING:
    from .data import TokenizedDataset
    from .workload import GPUSpec, ModelSpec, Workload

MiB = 2**20
# Caching allocator: reserved over allocated at the peak (fragmentation), with and without expandable segments.
RESERVED_FACTOR = {True: 1.02, False: 1.10}

# trl/kernels/chunked_logprob.py and trl/trainer/utils.py (TRL 1.16)
TOKEN_CHUNK = 4096
VOCAB_CHUNK = 32768
# SFTTrainer asks add_fused_lm_head for log_probs, entropy and is_top1: seven fp32 per-token vectors.
LM_HEAD_FP32_VECTORS = 7

_DTYPE_BYTES = {WeightsDtype.FLOAT32: 4, WeightsDtype.BFLOAT16: 2, WeightsDtype.FLOAT16: 2}


# ---- the architecture ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Architecture:
    """Shapes that memory and FLOPs depend on, read from a transformers config."""

    layers: int
    hidden: int
    intermediate: int
    vocab: int
    q_dim: int
    kv_dim: int
    heads: int
    tied: bool
    # parameter counts
    embedding: int
    lm_head: int  # 0 when tied to the embedding
    per_layer: int
    final_norm: int
    # (module name, in_features, out_features) of each decoder layer's linear projections
    linears: tuple[tuple[str, int, int], ...]
    head_dim: int = 0

    @property
    def buffer_bytes(self) -> int:
        """The rotary embedding's inv_freq and original_inv_freq, float32 whatever the weights' dtype."""
        return 2 * (self.head_dim // 2) * 4

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.layers * self.per_layer + self.final_norm

    @property
    def decoder_linear(self) -> int:
        """Weights of all decoder linear projections (what autocast casts and what bitsandbytes quantizes)."""
        return self.layers * sum(i * o for _, i, o in self.linears)


def quantized_linear_bytes(arch: Architecture, c: Candidate) -> float:
    """The decoder's linear weights as bitsandbytes stores them (advisor/_bnb.py)."""
    from ._bnb import weight_bytes

    double = bool(c.base.get("use_bnb_nested_quant", False))
    return arch.layers * sum(weight_bytes(i, o, c.quantization.value, double_quant=double) for _, i, o in arch.linears)


@lru_cache(maxsize=64)
def architecture(model: ModelSpec) -> Architecture:
    """From the config alone; Llama-style decoders (Llama, Qwen2/3, Mistral, Gemma 1/2/3 text)."""
    t = model.text_value
    h = int(t("hidden_size"))
    heads = int(t("num_attention_heads"))
    kv_heads = int(t("num_key_value_heads") or heads)
    head_dim = int(t("head_dim") or h // heads)
    inter = int(t("intermediate_size"))
    vocab = int(t("vocab_size"))
    layers = int(t("num_hidden_layers"))
    mt = str(model.config.get("model_type", ""))
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    qkv_bias = mt.startswith("qwen2") or bool(t("attention_bias", False))
    o_bias = bool(t("attention_bias", False))
    mlp_bias = bool(t("mlp_bias", False))
    linears = (
        ("q_proj", h, q_dim), ("k_proj", h, kv_dim), ("v_proj", h, kv_dim), ("o_proj", q_dim, h),
        ("gate_proj", h, inter), ("up_proj", h, inter), ("down_proj", inter, h),
    )
    biases = (q_dim + 2 * kv_dim if qkv_bias else 0) + (h if o_bias else 0) + (2 * inter + h if mlp_bias else 0)
    norms = 4 * h if mt in ("gemma2", "gemma3", "gemma3_text") else 2 * h
    if mt in ("qwen3", "gemma3", "gemma3_text", "olmo2"):
        norms += 2 * head_dim  # q_norm / k_norm
    per_layer = sum(i * o for _, i, o in linears) + biases + norms
    tied = bool(t("tie_word_embeddings", mt.startswith("gemma")))
    return Architecture(
        layers=layers, hidden=h, intermediate=inter, vocab=vocab, q_dim=q_dim, kv_dim=kv_dim, heads=heads,
        tied=tied, embedding=vocab * h, lm_head=0 if tied else vocab * h, per_layer=per_layer, final_norm=h,
        linears=linears, head_dim=head_dim,
    )


def lora_parameters(arch: Architecture, candidate: Candidate) -> int:
    """Adapter parameters: r x (in + out) for each targeted projection of every layer."""
    targets = set(candidate.lora_target_modules)
    return arch.layers * sum(candidate.lora_r * (i + o) for name, i, o in arch.linears if name in targets)


# ---- the batch -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchShape:
    """One micro-batch as the model sees it: rows x sequence length, and what the loss scores."""

    rows: int
    seq: int
    trained: int  # labelled positions (what the CUDA LM head scores)
    attention_sq: float  # sum over sequences of length^2 (attention FLOPs and eager scores)
    mask_bytes: int  # the materialised attention mask, when there is one


def _batches(dataset: TokenizedDataset, c: Candidate) -> tuple[BatchShape, BatchShape]:
    """The worst micro-batch (the longest rows, truncated) and a typical one (for throughput)."""
    flash = c.attn_implementation is not None and c.attn_implementation.is_flash
    return _batch_shapes(
        dataset, c.per_device_train_batch_size, c.max_length, c.packing, c.packing_strategy,
        c.effective_padding_free, c.padding_free, c.pad_to_multiple_of, c.group_by_length, flash,
    )


@lru_cache(maxsize=256)
def _length_stats(dataset: TokenizedDataset, max_length: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row order longest first, trained tokens per row after truncation, lengths after truncation)."""
    order = np.argsort(-dataset.lengths, kind="stable")
    cap = max_length if max_length is not None else np.iinfo(np.int64).max
    return order, dataset.trained_after_truncation(max_length), np.minimum(dataset.lengths, cap)


@lru_cache(maxsize=256)
def _packed_per_row(dataset: TokenizedDataset, c: Candidate) -> float:
    return dataset.trained_tokens_per_row(c)


@lru_cache(maxsize=4096)
def _batch_shapes(
    dataset: TokenizedDataset, b: int, ml: int | None, packing: bool, strategy: PackingStrategy, flat: bool,
    padding_free: bool, multiple: int | None, group_by_length: bool, flash: bool,
) -> tuple[BatchShape, BatchShape]:
    order, trained_rows, lengths = _length_stats(dataset, ml)
    if packing:
        assert ml is not None
        per_row = _packed_per_row(dataset, Candidate(max_length=ml, packing=True, packing_strategy=strategy))
        mean_doc = float(lengths.mean()) if len(lengths) else float(ml)
        attn = b * (ml * ml if strategy is PackingStrategy.WRAPPED else ml * mean_doc)
        wrapped_rows = strategy is PackingStrategy.WRAPPED and not padding_free
        rows, seq = (1, b * ml) if flat else (b, ml)
        mask = 0 if (flash or wrapped_rows) else rows * seq * seq
        shape = BatchShape(rows, seq, int(round(b * per_row)), float(attn), mask)
        return shape, shape
    top = order[:b]
    lens = lengths[top]
    trained_worst = int(trained_rows[top].sum())
    if flat:
        total = int(lens.sum())
        worst = BatchShape(1, total, trained_worst, float((lens.astype(float) ** 2).sum()),
                           0 if flash else total * total)
        mean_len = float(lengths.mean())
        typical = BatchShape(1, int(b * mean_len), int(b * trained_rows.mean()), b * mean_len**2, 0)
        return worst, typical
    seq = _round_up(int(lens.max()) if len(lens) else 1, multiple)
    worst = BatchShape(b, seq, trained_worst, float(b * seq * seq), 0 if flash else b * seq * seq)
    if group_by_length or b == 1:
        typ_seq = float(lengths.mean())
    else:
        # E[max of b random lengths] ~ the b/(b+1) quantile
        typ_seq = float(np.quantile(lengths, b / (b + 1.0)))
    typ_seq = float(_round_up(int(math.ceil(typ_seq)), multiple))
    typical = BatchShape(b, int(typ_seq), int(b * trained_rows.mean()), b * typ_seq**2, 0)
    return worst, typical


def _round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple


# ---- the estimate ----------------------------------------------------------------------------------------------


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


def memory_parts(workload: Workload, candidate: Candidate) -> MemoryParts:
    """Every byte count the estimate adds up, for the worst micro-batch of the workload's data."""
    c = candidate
    arch = architecture(workload.model)
    worst, _ = _batches(workload.dataset, c)

    weight_bytes = _DTYPE_BYTES[c.weights_dtype]
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
    if c.activation_offloading:
        # TRL's offloader moves saved tensors to pinned host memory, keeping about two layers in flight.
        layer_acts = min(layer_acts, 2 * max(per_layer, resid))
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
        trainable=int(trainable), batch=worst,
    )


def estimate(workload: Workload, candidate: Candidate) -> Measurement:
    """Peak memory by category and step time of `candidate`; status ok (the search decides what fits)."""
    if getattr(workload, "trainer", "sft") == "dpo":
        return _estimate_dpo(workload, candidate)
    if getattr(workload, "trainer", "sft") == "reward":
        return _estimate_reward(workload, candidate)
    c = candidate
    gpu = workload.gpu
    cuda = gpu.is_cuda
    arch = architecture(workload.model)
    p = memory_parts(workload, c)
    worst = p.batch
    act_bytes = 2 if (c.precision is not Precision.FP32 or c.weights_dtype is not WeightsDtype.FLOAT32) else 4
    grad_bytes = 4 if c.use_lora else _DTYPE_BYTES[c.weights_dtype]
    params, optimizer, grads, activations = p.parameters, p.optimizer, p.gradients, p.activations
    lm_saved, lm_peak = p.lm_head_saved, p.lm_head_temporaries
    recompute, opt_temp = p.recompute, p.optimizer_temporaries

    grads_before = grads if c.gradient_accumulation_steps > 1 else 0
    head_grad = 0 if c.use_lora else arch.vocab * arch.hidden * grad_bytes
    forward_end = {
        Category.PARAMETERS: params,
        Category.OPTIMIZER: optimizer,
        Category.GRADIENTS: grads_before,
        Category.ACTIVATIONS: activations,
        Category.LM_HEAD: lm_saved + lm_peak,
        Category.TEMPORARIES: 0,
    }
    # after the LM head's backward, the last checkpointed layer is recomputed while every other layer's
    # activations are still held
    backward_start = {
        Category.PARAMETERS: params,
        Category.OPTIMIZER: optimizer,
        Category.GRADIENTS: max(grads_before, head_grad),
        Category.ACTIVATIONS: activations,
        Category.LM_HEAD: worst.rows * worst.seq * arch.hidden * act_bytes,
        Category.TEMPORARIES: recompute,
    }
    step_end = {
        Category.PARAMETERS: params,
        Category.OPTIMIZER: optimizer,
        Category.GRADIENTS: grads,
        Category.ACTIVATIONS: 0,
        Category.LM_HEAD: 0,
        Category.TEMPORARIES: opt_temp,
    }
    moments = {"end of the forward": forward_end, "start of the backward": backward_start, "optimizer step": step_end}
    rank_notes: list[str] = []
    if workload.num_gpus > 1:  # one rank of N: the model states sharded as the candidate's parallelism shards them
        from .parallelism import estimate_per_rank

        moments, rank_notes = estimate_per_rank(workload, c, moments, p)
    when, moment = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    peak = int(sum(moment.values()))
    reserved = int(peak * RESERVED_FACTOR[bool(c.expandable_segments)]) if cuda else peak
    device = reserved + _outside_allocator_bytes(gpu) if cuda else peak

    timed = _step_time(workload, arch, c, worst, activations)
    step_time, trained_per_step = timed.step_s, int(round(timed.trained_per_step))
    terms = dict(timed.terms)
    if workload.num_gpus > 1:  # global throughput: every rank's tokens over the step with the collectives' time
        from .parallelism import rank_step_time

        step_time, trained_per_step, exposed, comm_note = rank_step_time(workload, c, step_time, trained_per_step)
        terms["communication_exposed"] = exposed
        rank_notes.append(comm_note)
    notes = [
        f"LM head: TRL's fused tiled head, {'labelled positions only (CUDA)' if cuda else 'every position (CPU)'}",
        f"peak at the {when}",
        f"step time: the step-time model's terms in closed form (advisor/_sim/timing.py) on {gpu.name}, expected "
        "over the batches the sampler makes",
        *rank_notes,
    ]
    return Measurement(
        status=Status.OK,
        source=Source.ESTIMATE,
        peak_bytes=peak,
        reserved_bytes=reserved,
        device_bytes=device,
        breakdown={k.value: int(v) for k, v in moment.items()},
        step_time_s=step_time,
        tokens_per_second=trained_per_step / step_time if step_time > 0 else None,
        trained_tokens_per_step=trained_per_step,
        time_breakdown=terms,
        mfu=timed.mfu,
        worst_step_time_s=timed.worst_step_s,
        peak_batch=f"{worst.rows}x{worst.seq}",
        notes=tuple(notes),
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
        # each adapter keeps its input (dropout output) and the r-dim projection
        targets = set(c.lora_target_modules)
        out += t * sum(4 * i + 4 * c.lora_r for name, i, _ in arch.linears if name in targets)
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


def _step_time(workload: Workload, arch: Architecture, c: Candidate, worst: BatchShape, activations: int):
    """The expected step time from the same terms as the simulator's (advisor/_sim/timing.py), in closed form.

    The micro-step's kernels are the decoder's GEMMs (forward, grad-input, weight gradient when trained, the
    recomputed forward under checkpointing; LoRA's rank-r products), attention per tile, the memory-bound ops
    (bytes per token per layer, counted on the fake run: time_constants.json "estimate"), the LM head's tiles and
    folds, bitsandbytes' dequantisation; host ops per layer from the same counts; the optimizer as the target runs
    it. Evaluated over the same batch distribution as the simulator's, so the two backends rank alike.
    """
    from . import costs as tm

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
    grad_bytes = 4 if c.use_lora else _DTYPE_BYTES[c.weights_dtype]
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


def _outside_allocator_bytes(gpu: GPUSpec) -> int:
    """CUDA context + cuBLAS workspace: the same calibrated constants the simulator uses
    (profiles/measurements/cuda_constants.json)."""
    from .costs import context_bytes, cublas_workspace_bytes

    return context_bytes(gpu.compute_capability) + cublas_workspace_bytes(gpu.compute_capability)


# ---- knobs modelled in closed form (the simulator uses the same: fake tensors cannot run them) -----------------


def knob_memory_savings(model: ModelSpec, c: Candidate, tokens: int, cuda: bool) -> dict[str, int]:
    """Device bytes each modelled knob frees at the peak of a step, for a micro-batch of `tokens` positions."""
    out = {"use_kernels": _kernels_saved_bytes(model, c, tokens, cuda),
           "checkpoint_offload": _checkpoint_offload_saved_bytes(model, c, tokens, cuda)}
    return {k: v for k, v in out.items() if v}


def knob_time(cost, model: ModelSpec, c: Candidate, gpu: GPUSpec):
    """The step-time model's cost with the modelled knobs' terms: the offloaded checkpoints' copies on the compute
    stream, Liger's fused RMSNorm in place of torch's elementwise ops."""
    from . import costs as tm

    tc = tm.time_constants(gpu)
    dev = cost.device.copy()
    terms = list(tm.Term)
    off, mem, tok = terms.index(tm.Term.OFFLOAD), terms.index(tm.Term.MEMORY), int(tm.Basis.TOKENS)
    dev[off, tok] += _checkpoint_offload_s_per_token(model, c, gpu.is_cuda, tc.pcie_bw)
    saved = _kernels_s_per_token(model, c, gpu.is_cuda, tc.mem_bw)
    dev[mem, tok] = max(0.5 * dev[mem, tok], dev[mem, tok] - saved)  # never below half: the rest is not RMSNorm
    return cost.with_(device=dev)


def _residual_bytes(c: Candidate) -> int:
    """The residual stream's element size: float32 under autocast over float32 weights, else the compute dtype."""
    mixed = c.precision is not Precision.FP32
    low = mixed or c.weights_dtype is not WeightsDtype.FLOAT32
    return 4 if (mixed and c.weights_dtype is WeightsDtype.FLOAT32) else (2 if low else 4)


def _checkpointed_layers(model: ModelSpec, c: Candidate) -> int:
    """transformers checkpoints layer i when i % every_n_layers == 0 (PreTrainedModel._set_gradient_checkpointing)."""
    return math.ceil(model.num_layers / c.checkpoint_every_n_layers) if c.activation_checkpointing else 0


def _checkpoint_offload_saved_bytes(model: ModelSpec, c: Candidate, tokens: int, cuda: bool) -> int:
    """activation_checkpointing_kwargs offload: transformers wraps torch's checkpoint in save_on_cpu, so what the
    checkpoint saves for the recompute (each checkpointed layer's input hidden states, rows x seq x hidden in the
    residual dtype) waits in pinned host memory. During the backward the layer being recomputed has its input back
    on the device, so the saving at the peak is one layer fewer than the checkpointed layers (the others' inputs
    stay on the host). Nothing on the CPU: there the host is the device."""
    if not (c.activation_checkpointing and c.checkpoint_offload and cuda):
        return 0
    n = _checkpointed_layers(model, c)
    return max(0, n - 1) * tokens * model.hidden_size * _residual_bytes(c)


def _checkpoint_offload_s_per_token(model: ModelSpec, c: Candidate, cuda: bool, pcie_bw: float) -> float:
    """The device-to-host copy of every checkpointed input in the forward and its way back in the backward, both
    on the compute stream (transformers' docstring of activation_checkpointing_enable), over PCIe."""
    if not (c.activation_checkpointing and c.checkpoint_offload and cuda):
        return 0.0
    per_token = _checkpointed_layers(model, c) * model.hidden_size * _residual_bytes(c)
    return 2.0 * per_token / pcie_bw


@lru_cache(maxsize=64)
def _rmsnorm_is_hub_kernel(model_type: str) -> bool:
    """Whether transformers marks this architecture's RMSNorm for Hub kernels (`@use_kernel_forward_from_hub
    ("RMSNorm")` in its modeling file): what `kernelize` swaps for Liger's RMSNorm when training on CUDA."""
    import importlib
    import inspect

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    try:
        module = importlib.import_module(f"transformers.models.{model_type_to_module_name(model_type)}."
                                         f"modeling_{model_type_to_module_name(model_type)}")
        return '@use_kernel_forward_from_hub("RMSNorm")' in inspect.getsource(module)
    except (ImportError, OSError, TypeError):
        return False


def _rmsnorm_elements(model: ModelSpec) -> int:
    """Elements each token's RMSNorm calls normalise in one decoder layer: the two layer norms (four in Gemma 2/3)
    and, where the architecture has them, q_norm / k_norm over every query and key head."""
    arch = architecture(model)
    mt = str(model.config.get("model_type", ""))
    out = (4 if mt in ("gemma2", "gemma3", "gemma3_text") else 2) * arch.hidden
    if mt in ("qwen3", "gemma3", "gemma3_text", "olmo2"):
        out += arch.q_dim + arch.kv_dim
    return out


def _kernels_saved_bytes(model: ModelSpec, c: Candidate, tokens: int, cuda: bool) -> int:
    """use_kernels: Liger's fused RMSNorm saves its input and one fp32 rstd per row; torch's LlamaRMSNorm also
    saves the fp32 normalised product (float32 input) or the fp32 upcast and the low-precision product (16-bit
    input): 4 bytes more per normalised element either way (counted with saved_tensors_hooks on the CPU; see
    tests/test_knobs.py). Counted for the layers whose activations stay saved (not checkpointed); the final norm
    and a recomputed layer are left out, since the peak may fall after their backward. Nothing on the CPU
    (transformers' mapping has no CPU training kernel) or where the architecture's RMSNorm is not a Hub layer."""
    if not (c.use_kernels and cuda and _rmsnorm_is_hub_kernel(str(model.config.get("model_type", "")))):
        return 0
    kept = model.num_layers - _checkpointed_layers(model, c)
    return 4 * tokens * _rmsnorm_elements(model) * kept


# torch's eager LlamaRMSNorm, bytes read + written per normalised element in its forward: pow (4 + 4), mean (4),
# the multiply by rsqrt (4 + 4) and by the weight (4 + 4) in float32, plus the casts in and out of a 16-bit input
_TORCH_RMSNORM_FWD = {4: 28, 2: 36}


def _kernels_s_per_token(model: ModelSpec, c: Candidate, cuda: bool, mem_bw: float) -> float:
    """use_kernels: Liger's RMSNorm reads its input and writes its output once in the forward (2 passes) and reads
    the output gradient and input, writes the input gradient in the backward (3); torch's elementwise chain moves
    _TORCH_RMSNORM_FWD bytes an element in the forward and about twice that in the backward. The forward runs again
    for checkpointed layers. Kernel launches saved are not counted."""
    if not (c.use_kernels and cuda and _rmsnorm_is_hub_kernel(str(model.config.get("model_type", "")))):
        return 0.0
    r = _residual_bytes(c)
    f = _checkpointed_layers(model, c) / max(1, model.num_layers)
    torch_b = _TORCH_RMSNORM_FWD[r] * (1 + f) + 2 * _TORCH_RMSNORM_FWD[r]
    liger_b = 2 * r * (1 + f) + 3 * r
    return model.num_layers * _rmsnorm_elements(model) * (torch_b - liger_b) / mem_bw


# ---- DPO (approximate) -----------------------------------------------------------------------------------------
_PAIR_ROWS: dict[int, tuple[Any, Any]] = {}  # id(preference data) -> (the data, its rows as SFT rows)


def _pair_rows(data: Any) -> Any:
    """Preference pairs as SFT rows: prompt + chosen and prompt + rejected, each its own row, the completion
    trained. A micro-batch of 2B such rows pads as DPO's B pairs do (chosen and rejected share the batch)."""
    held = _PAIR_ROWS.get(id(data))
    if held is not None and held[0] is data:
        return held[1]
    from .data import TokenizedDataset

    rows = []
    for p, ch, rj in zip(data.prompt_lengths, data.chosen_lengths, data.rejected_lengths, strict=True):
        for full in (int(ch), int(rj)):
            rows.append({"input_ids": [0] * full, "completion_mask": [0] * int(p) + [1] * (full - int(p))})
    proxy = TokenizedDataset(name=f"{data.name} (pairs as rows)", source=data.source, rows=tuple(rows),
                             completion_only_loss=True)
    if len(_PAIR_ROWS) > 4:
        _PAIR_ROWS.clear()
    _PAIR_ROWS[id(data)] = (data, proxy)
    return proxy


def _estimate_dpo(workload: Workload, candidate: Candidate) -> Measurement:
    """DPO in closed form, approximately: the SFT estimate of 2B sequences a micro-batch of B pairs (chosen and
    rejected), plus the reference: a second copy of the weights (full fine-tuning without precompute), nothing
    (LoRA: the policy with its adapters disabled; precompute_ref_log_probs: log-probs computed before training),
    and its no-grad forward's time (about a third of a forward + backward) unless precomputed."""
    import dataclasses

    from .trainers.dpo import DPOKnobs, Reference

    c = candidate
    ref = DPOKnobs.of(c).reference(c)
    proxy = dataclasses.replace(workload, dataset=_pair_rows(workload.dataset), trainer="sft")
    base = {k: v for k, v in c.base.as_dict().items() if k not in ("precompute_ref_log_probs",
                                                                   "precompute_ref_batch_size", "sync_ref_model")}
    sft_c = c.replace(per_device_train_batch_size=2 * c.per_device_train_batch_size, packing=False,
                      padding_free=False, base=base)
    m = estimate(proxy, sft_c)
    arch = architecture(workload.model)
    ref_bytes = arch.total * _DTYPE_BYTES[c.weights_dtype] + arch.buffer_bytes if ref is Reference.SEPARATE_COPY \
        else 0
    cuda = workload.gpu.is_cuda
    peak = int(m.peak_bytes + ref_bytes)
    reserved = int(peak * RESERVED_FACTOR[bool(c.expandable_segments)]) if cuda else peak
    device = reserved + _outside_allocator_bytes(workload.gpu) if cuda else peak
    breakdown = dict(m.breakdown)
    breakdown[Category.PARAMETERS.value] = breakdown.get(Category.PARAMETERS.value, 0) + ref_bytes
    slow = 1.0 if ref is Reference.PRECOMPUTED else 4.0 / 3.0
    step = m.step_time_s * slow if m.step_time_s else m.step_time_s
    notes = [f"dpo (approximate): SFT's closed form on 2B sequences a micro-batch of B pairs; the reference: "
             f"{ref.value.replace('_', ' ')}" + (f" (+{ref_bytes / 2**30:.2f} GiB of weights)" if ref_bytes else "")
             + ("" if ref is Reference.PRECOMPUTED else "; its no-grad forward taken as a third of the step's "
                "compute"), *m.notes]
    return dataclasses.replace(
        m, peak_bytes=peak, reserved_bytes=reserved, device_bytes=device, breakdown=breakdown, step_time_s=step,
        tokens_per_second=(m.trained_tokens_per_step / step) if step and m.trained_tokens_per_step else None,
        worst_step_time_s=m.worst_step_time_s * slow if m.worst_step_time_s else m.worst_step_time_s,
        peak_batch=f"{c.per_device_train_batch_size} pairs ({m.peak_batch})", notes=tuple(notes))


def _estimate_reward(workload: Workload, candidate: Candidate) -> Measurement:
    """Reward modelling in closed form, approximately: the SFT estimate of 2B sequences a micro-batch of B pairs
    (RewardTrainer runs chosen and rejected together) without the LM head's logits (a one-label score head)."""
    import dataclasses

    c = candidate
    proxy = dataclasses.replace(workload, dataset=_pair_rows(workload.dataset), trainer="sft")
    m = estimate(proxy, c.replace(per_device_train_batch_size=2 * c.per_device_train_batch_size, packing=False,
                                  padding_free=False))
    head = int(m.breakdown.get(Category.LM_HEAD.value, 0))
    cuda = workload.gpu.is_cuda
    peak = int(m.peak_bytes - head)
    reserved = int(peak * RESERVED_FACTOR[bool(c.expandable_segments)]) if cuda else peak
    device = reserved + _outside_allocator_bytes(workload.gpu) if cuda else peak
    breakdown = {**m.breakdown, Category.LM_HEAD.value: 0}
    notes = ("reward (approximate): SFT's closed form on 2B sequences a micro-batch of B pairs, the LM head's "
             "logits left out (a one-label score head)", *m.notes)
    return dataclasses.replace(m, peak_bytes=peak, reserved_bytes=reserved, device_bytes=device, breakdown=breakdown,
                               peak_batch=f"{c.per_device_train_batch_size} pairs ({m.peak_batch})", notes=notes)
