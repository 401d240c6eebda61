"""Online RL's step (GRPO, RLOO; TRL 1.16) in closed form, phase by phase: the KV cache of transformers' generate,
TRL's fused log-prob head, each phase's allocator bytes (`phase_allocator_bytes`), colocated vLLM's pool and typed
refusals (`vllm_terms`), the device's peak across the phases (`device_peak`: the simulator's measured phase peaks
combined with vLLM's bytes) and the step-time terms of generation, weight sync and scoring (`step_time`). The step
itself (`OnlineStep`, what each term reads) is online_step.py's; what the step holds and its sources are in its
docstring. Every constant is in profiles/measurements/online_rl_constants.json with its source.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from . import interconnect, peak_flops, time_constants
from .distillation import train_moments
from .online_step import GENERATE, PHASES, SCORE, TRAIN, Loss, OnlineStep, VllmSide, _c, _constants_block
from .timing import OpClass
from .vllm import (
    Mode,
    Pool,
    PoolSplit,
    Refusal,
    Refused,
    Sleep,
    Started,
    asleep,
    batch_kv_bytes,
    min_utilization,
    start,
)


# ---- transformers' generate: the KV cache ------------------------------------------------------------------------
def hf_kv_cache_bytes(sequences: int, prompt_length: int, new_tokens: int, *, layers: int, kv_heads: int,
                      head_dim: int, dtype_bytes: int, key_dtype_bytes: int | None = None) -> int:
    """transformers' DynamicCache after `generate(max_new_tokens=new_tokens)` of `sequences` rows left-padded to
    `prompt_length`: every layer's keys and values [sequences, kv_heads, prompt_length + new_tokens - 1, head_dim]
    (cache_utils.py DynamicLayer.update concatenates each step's K/V; the last sampled token is never fed back).

    `dtype_bytes`: the values' element (v_proj's output: autocast's dtype, else the weights'); `key_dtype_bytes`
    (default the same): the keys', which rotary may promote: under autocast over float32 weights the rotary
    embedding's cos/sin are in the residual stream's float32 (modeling_qwen2.py / modeling_llama.py RotaryEmbedding
    returns `cos.to(x.dtype)`), and `k * cos` promotes the bf16 projection to float32 (measured in GRPOTrainer's own
    generate: keys float32, values bfloat16; tests/test_online_rl_physics.py)."""
    if new_tokens < 1:
        return 0
    positions = prompt_length + new_tokens - 1
    key = dtype_bytes if key_dtype_bytes is None else key_dtype_bytes
    return layers * sequences * kv_heads * positions * head_dim * (key + dtype_bytes)


# ---- TRL's fused log-prob head -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadBytes:
    """trl/kernels/chunked_logprob.py ChunkedLogProbFunction on one micro-batch: what it saves for the backward and
    its peak temporaries in the forward and the backward."""

    scored: int  # N: positions scored
    saved: int
    forward_peak: int
    backward_peak: int


def lm_head_bytes(step: OnlineStep, rows: int, *, entropy: bool = True, trained: bool = True) -> HeadBytes:
    """The fused head on `rows` sequences of `step.sequence_length`.

    N = rows x max_completion_length on CUDA (Triton: only the labelled positions, `hidden_states[mask]`, a copy),
    rows x (sequence_length - 1) elsewhere (`hidden_states.reshape(-1, H)` of the shifted, non-contiguous states: a
    copy). `mm_buf` is min(N, 4096) x 32768 columns in the compute dtype (fp32 with cast_lm_head_to_fp32) whatever
    the vocabulary; the torch fallback's folds (CPU) add fp32 tiles of min(N, 4096) x min(V, 32768)
    (online_rl_constants.json cpu_forward_fold_tiles / cpu_backward_fold_tiles). The backward accumulates the
    hidden states' gradient in fp32 (N x H) and, when the head is trained, the weight's (V x H)."""
    chunk_t, chunk_v = int(_c("trl_token_chunk")), int(_c("trl_vocab_chunk"))
    n = rows * (step.max_completion_length if step.cuda else step.sequence_length - 1)
    h, v = step.hidden, step.vocab
    compute = 4 if step.cast_lm_head_to_fp32 else step.compute_bytes
    t = min(n, chunk_t)
    mm_buf = t * chunk_v * compute
    tile32 = t * min(v, chunk_v) * 4
    hidden_copy = n * h * compute  # hidden[mask] (CUDA) or the reshape of the shifted states (elsewhere)
    casts = (t * h * compute if step.cast_lm_head_to_fp32 or compute != step.compute_bytes else 0) + (
        min(v, chunk_v) * h * compute if step.head_weight_bytes != compute else 0)
    vectors = 7 * n * 4 + n * 8  # running max, sums, target logit (fp32), the targets (int64)
    saved = hidden_copy + (2 if entropy else 1) * n * 4 + n * 8
    fwd = mm_buf + casts + vectors + (0 if step.cuda else int(_c("cpu_forward_fold_tiles")) * tile32)
    bwd = mm_buf + casts + n * h * 4  # the fp32 gradient of the hidden states
    if trained and not step.lora:
        bwd += v * h * 4  # the fp32 gradient of the head's weight, accumulated over the tiles
    if not step.cuda:
        bwd += int(_c("cpu_backward_fold_tiles")) * tile32 + t * min(v, chunk_v)  # + the bool is_target tile
    return HeadBytes(scored=n, saved=saved, forward_peak=fwd, backward_peak=bwd if trained else 0)


def _forward_transient(step: OnlineStep, tokens: int) -> int:
    """A no-grad forward's transients besides its head: the final hidden states and one decoder layer's largest
    temporaries (the MLP's gate activation, up projection and their product, the residual and the normed input).
    A closed-form approximation, not counted from the run."""
    return tokens * (3 * step.intermediate + 4 * step.hidden) * step.compute_bytes


def _buffered_bytes(step: OnlineStep) -> int:
    """What `_generate_and_score_completions` keeps for the training micro-steps: prompt and completion ids and
    masks (int64) of the generation batch, and per completion token fp32 log-probs (old, reference) and advantages
    (distillation keeps the ids and masks only)."""
    g, t, c = step.generation_batch, step.sequence_length, step.max_completion_length
    return 2 * g * t * 8 + (step.scoring_forwards + int(step.loss is Loss.LOGPROB)) * g * c * 4


# ---- the phases' allocator bytes -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PhaseBytes:
    """One phase's allocator bytes at its peak, by part (each name says what it is)."""

    phase: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return int(sum(self.parts.values()))


def _gather_bytes(step: OnlineStep, generating: bool) -> int:
    """ZeRO-3's gathered parameters above this rank's shard while generating or syncing to vLLM."""
    if not step.zero3:
        return 0
    whole = max(0, step.full_weights_bytes - step.weights_bytes)
    if step.engine is Mode.GENERATE and generating:
        # ds3_gather_for_generation: every parameter at once; without it, a layer at a time as it runs
        return whole if step.ds3_gather_for_generation else whole // max(1, step.layers)
    if step.lora:  # PEFT + ZeRO-3: the whole model gathered to merge the adapters before the push
        return whole
    return step.vocab * step.hidden * step.compute_bytes  # one parameter at a time: the embedding is the largest


def phase_allocator_bytes(step: OnlineStep) -> dict[str, PhaseBytes]:
    """Each phase's allocator peak (PyTorch's caching allocator, allocated bytes), by part."""
    state = {"parameters": step.weights_bytes, "optimizer_state": step.optimizer_bytes,
             "reference": step.reference_bytes, "reward_model": step.reward_model_bytes,
             "teacher": step.teacher_bytes}
    g = step.generation_batch
    out: dict[str, PhaseBytes] = {}
    if step.gradients_while_generating:
        state["gradients"] = step.gradient_bytes
    # GENERATE
    gen = dict(state)
    gen["zero3_gather"] = _gather_bytes(step, generating=True)
    if step.engine is Mode.GENERATE:
        kv = hf_kv_cache_bytes(g, step.prompt_length, step.max_completion_length, layers=step.layers,
                               kv_heads=step.kv_heads, head_dim=step.head_dim, dtype_bytes=step.kv_dtype_bytes,
                               key_dtype_bytes=step.key_dtype_bytes or None)
        one_layer_k = kv // (2 * step.layers)  # the torch.cat that grows one layer's K (or V) holds old and new
        prefill = _forward_transient(step, g * step.prompt_length)
        decode = one_layer_k + 3 * g * step.vocab * 4  # the last position's logits: fp32, processed, probabilities
        gen["kv_cache"] = kv
        gen["generate_temporaries"] = max(prefill, decode)
    gen["completion_ids"] = g * step.sequence_length * 8
    out[GENERATE] = PhaseBytes(GENERATE, gen)
    # SCORE: no-grad forwards of per_device_train_batch_size rows each
    rows = step.per_device_train_batch_size
    score = dict(state)
    score["buffered_batch"] = _buffered_bytes(step)
    if step.scoring_forwards:
        head = lm_head_bytes(step, rows, entropy=step.old_logps_forward, trained=False)
        # the head's inputs (the copied hidden states, the per-token vectors) live through the call even without grad
        score["scoring_forward"] = _forward_transient(step, rows * step.sequence_length) + head.saved + \
            head.forward_peak
    out[SCORE] = PhaseBytes(SCORE, score)
    # TRAIN: one micro-batch's forward and backward, and the optimizer step
    acts = step.train_activation_bytes
    before = step.gradient_bytes if step.gradient_accumulation_steps > 1 else 0
    if step.loss is Loss.DIVERGENCE:
        moments = train_moments(step, rows, acts, before, cpu_fold_tiles=int(_c("cpu_divergence_fold_tiles")))
    else:
        head = lm_head_bytes(step, rows, entropy=True, trained=True)
        moments = {
            "end of the forward": {"gradients": before, "activations": acts,
                                   "lm_head": head.saved + head.forward_peak},
            "LM head's backward": {"gradients": before, "activations": acts,
                                   "lm_head": head.saved + head.backward_peak},
            "start of the backward": {"gradients": before, "activations": acts + step.train_recompute_bytes,
                                      "lm_head": rows * step.sequence_length * step.hidden * step.compute_bytes},
            "optimizer step": {"gradients": step.gradient_bytes, "temporaries": step.optimizer_temporary_bytes},
        }
    when, moment = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    state.pop("gradients", None)  # the train moments place the gradients themselves
    out[TRAIN] = PhaseBytes(f"{TRAIN} ({when})", {**state, "buffered_batch": _buffered_bytes(step), **moment})
    return out


# ---- vLLM's side: its pool, its refusals ---------------------------------------------------------------------------
@dataclass(frozen=True)
class VllmTerms:
    """Colocated vLLM on this GPU: its pool's split, what it holds per phase, and how its KV cache takes the batch."""

    mode: Mode
    sleep: Sleep
    split: PoolSplit | None  # None in server mode (nothing on the training GPUs)
    batch_kv_bytes: int  # the generation batch at full length, all at once (prefix sharing not subtracted)
    waves: int  # how many rounds vLLM's KV cache needs for the batch (1: all at once)

    def held_bytes(self, phase: str) -> int:
        """Bytes vLLM holds outside PyTorch's allocator in `phase`: the pool without sleep in every phase; with
        sleep the pool while generating and what sleep keeps otherwise (vllm.py asleep); none in server mode."""
        if self.split is None:
            return 0
        if self.sleep is Sleep.OFF or str(phase) == GENERATE:
            return self.split.pool_bytes
        return asleep(self.split, self.sleep).device_bytes


@dataclass(frozen=True)
class VllmRefusal:
    """A typed OOM outcome: colocated vLLM would not start (vllm.py's `Refused`: its cause, bytes and vLLM's rule)
    with the concrete fix for this step."""

    refused: Refused
    fix: str

    @property
    def cause(self) -> Refusal:
        return self.refused.cause

    @property
    def message(self) -> str:
        return f"{self.refused.message}. For this step: {self.fix}"


def startup_bytes(step: OnlineStep) -> int:
    """The training process's bytes when vLLM snapshots the device (GRPOTrainer.__init__, before train(): no
    optimizer state yet): its CUDA context, the policy, a reference, reward models."""
    ctx = step.vllm.context_bytes if step.vllm is not None else 0
    return ctx + step.weights_bytes + step.reference_bytes + step.reward_model_bytes + step.teacher_bytes


def vllm_terms(step: OnlineStep) -> VllmTerms | VllmRefusal | None:
    """vLLM's side of the step: None without vLLM; in server mode no pool here; colocated, `colocated_vllm`."""
    if step.engine is Mode.GENERATE:
        return None
    v = step.vllm
    if step.engine is Mode.SERVER:
        kv = batch_kv_bytes(v.layout, step.generation_batch, step.sequence_length) if v is not None else 0
        return VllmTerms(Mode.SERVER, step.sleep, None, kv, 1)
    assert v is not None
    return colocated_vllm(v, card_bytes=step.card_bytes, utilization=step.vllm_gpu_memory_utilization,
                          sleep=step.sleep, startup_bytes=startup_bytes(step), generation_batch=step.generation_batch,
                          prompt_length=step.prompt_length, max_completion_length=step.max_completion_length)


def colocated_vllm(side: VllmSide, *, card_bytes: int, utilization: float, sleep: Sleep, startup_bytes: int,
                   generation_batch: int, prompt_length: int, max_completion_length: int) -> VllmTerms | VllmRefusal:
    """Colocated vLLM's start-up by its own rules (vllm.py `start`: the free-memory check against utilization x
    total, the profile split, the one-sequence check), a `VllmRefusal` with the concrete fix when it would not
    start; `startup_bytes`: the training process's bytes at vLLM's snapshot (its context, the policy, a reference,
    reward models; the optimizer state comes later). The simulator's glue calls this with its own numbers."""
    pool = Pool(card_bytes, utilization)
    free = card_bytes - startup_bytes
    outcome = start(pool, free_at_startup=free, weights_bytes=side.weights_bytes,
                    activation_bytes=side.activation_bytes, non_torch_bytes=side.non_torch_bytes, layout=side.layout,
                    max_model_len=side.max_model_len, cudagraph_bytes=side.cudagraph_bytes)
    shape = _Shape(side, card_bytes, generation_batch, prompt_length, max_completion_length)
    if isinstance(outcome, Refused):
        return VllmRefusal(outcome, _fix(shape, outcome, free))
    assert isinstance(outcome, Started)
    need = batch_kv_bytes(side.layout, generation_batch, shape.sequence_length)
    waves = max(1, math.ceil(need / max(1, outcome.split.kv_cache_bytes)))
    return VllmTerms(Mode.COLOCATE, Sleep(sleep), outcome.split, need, waves)


@dataclass(frozen=True)
class _Shape:
    """What the fix of a refusal needs to know of the step."""

    vllm: VllmSide
    card_bytes: int
    generation_batch: int
    prompt_length: int
    max_completion_length: int

    @property
    def sequence_length(self) -> int:
        return self.prompt_length + self.max_completion_length


def _need(step: _Shape, sequences: int) -> Any:
    v = step.vllm
    length = min(step.sequence_length, v.max_model_len)
    return min_utilization(step.card_bytes, weights_bytes=v.weights_bytes, activation_bytes=v.activation_bytes,
                           non_torch_bytes=v.non_torch_bytes, layout=v.layout, sequences=sequences,
                           sequence_length=length, max_model_len=v.max_model_len, cudagraph_bytes=v.cudagraph_bytes)


def _fix(step: _Shape, refused: Refused, free: int) -> str:
    """The concrete fix: the utilization that would start (and hold the batch), or what frees the device."""
    total = step.card_bytes
    one, batch = _need(step, 1), _need(step, step.generation_batch)
    gib = 2**30
    if refused.cause is Refusal.POOL_EXCEEDS_FREE:
        most = math.floor(free / total * 100) / 100
        if batch.value <= most:
            return (f"lower vllm_gpu_memory_utilization to between {batch.value:.2f} (holds the generation batch of "
                    f"{step.generation_batch} at full length) and {most:.2f} (the most the {free / gib:.2f} GiB free "
                    "at startup allows)")
        if one.value <= most:
            return (f"lower vllm_gpu_memory_utilization to {most:.2f} (the most the {free / gib:.2f} GiB free at "
                    f"startup allows; it holds one full-length sequence, not the whole batch of "
                    f"{step.generation_batch} at once: vLLM then generates in rounds)")
        return (f"the {free / gib:.2f} GiB free at startup cannot hold even one full-length sequence's pool "
                f"({one.pool_bytes / gib:.2f} GiB): free the device (LoRA, a lower-precision dtype, no separate "
                "reference) or use vllm_mode=server (vLLM on GPUs of its own)")
    if refused.cause is Refusal.NO_KV_MEMORY:
        return (f"raise vllm_gpu_memory_utilization to {one.value:.2f} (one sequence) or {batch.value:.2f} (the "
                f"generation batch of {step.generation_batch} at once), and enable vllm_enable_sleep_mode to give it "
                "back while training")
    text = (f"raise vllm_gpu_memory_utilization to {one.value:.2f} (one sequence of max_model_len="
            f"{step.vllm.max_model_len}) or {batch.value:.2f} (the generation batch of {step.generation_batch} at "
            "once)")
    if step.vllm.max_model_len > step.sequence_length:
        text += (f", or set vllm_max_model_length={step.sequence_length} (prompt {step.prompt_length} + "
                 f"max_completion_length {step.max_completion_length})")
    return text + "; vllm_enable_sleep_mode gives the pool back while training"


# ---- the device's peak across the phases ------------------------------------------------------------------------
@dataclass(frozen=True)
class OnlineDevicePeak:
    """Per phase: the allocator's peak and what vLLM holds outside the allocator then; the peak is the largest sum."""

    allocator: dict[str, int]
    outside_allocator: dict[str, int]

    @property
    def per_phase(self) -> dict[str, int]:
        return {p: self.allocator.get(p, 0) + self.outside_allocator.get(p, 0) for p in self.allocator}

    @property
    def peak_phase(self) -> str:
        per = self.per_phase
        return max(per, key=lambda p: per[p])

    @property
    def peak_bytes(self) -> int:
        """Device bytes at the step's peak (allocator + outside), the CUDA context not included."""
        return max(self.per_phase.values(), default=0)

    @property
    def allocator_peak_bytes(self) -> int:
        return max(self.allocator.values(), default=0)

    @property
    def outside_at_peak(self) -> int:
        return self.outside_allocator.get(self.peak_phase, 0)


def device_peak(phase_allocator_peaks: Mapping[Any, int], vllm: VllmTerms | None = None) -> OnlineDevicePeak:
    """Combine each phase's allocator peak (measured by the simulator, or `phase_allocator_bytes`' totals) with what
    vLLM holds outside the allocator in that phase (`VllmTerms.held_bytes`). Keys: PhaseKind members or their values."""
    alloc = {str(getattr(k, "value", k)): int(v) for k, v in phase_allocator_peaks.items()}
    unknown = sorted(set(alloc) - set(PHASES))
    if unknown:
        raise ConfigError(f"unknown phase(s) {unknown}: one of {', '.join(PHASES)}", context="device_peak")
    outside = {p: (vllm.held_bytes(p) if vllm is not None else 0) for p in alloc}
    return OnlineDevicePeak(alloc, outside)


# ---- step time --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OnlineTime:
    """Seconds per optimizer step by term (online RL's own; the training passes are the caller's step-time model)."""

    terms: dict[str, float]
    trained_tokens_per_step: int
    notes: tuple[str, ...] = ()

    @property
    def step_s(self) -> float:
        return float(sum(self.terms.values()))

    @property
    def tokens_per_second(self) -> float | None:
        s = self.step_s
        return self.trained_tokens_per_step / s if s > 0 else None


def step_time(step: OnlineStep, tc: Any, *, train_s: float, dense_params: int, peak_flops: float,
              interconnect_bytes_s: float | None = None, vllm_weights_bytes: int | None = None,
              vllm_waves: int = 1, generation_s: float | None = None, scoring_s: float | None = None) -> OnlineTime:
    """One optimizer step: `train_s` (the training passes of gradient_accumulation_steps micro-batches, from the
    step-time model, advisor/physics/timing/) plus, per generation call (`generations_per_step` of them):
    - generation: prefill (2 x dense params FLOPs per prompt token, compute-bound at the GEMM efficiency) and
      max_completion_length decode steps, each reading the weights once and the KV cache of the batch at its mean
      length (bandwidth-bound); transformers' eager generate also pays its host ops per decode step (max of host and
      device, as the step-time model overlaps them); vLLM's decode at online_rl_constants.json
      vllm_decode_efficiency (1.0: unverified), in `vllm_waves` rounds when its KV cache cannot hold the batch;
    - the weight sync (once per optimizer step): colocated, `load_weights` copies every weight (read + write over
      the device's bandwidth); served, the weights over the interconnect to the server; with sleep, wake-up
      (vllm_wake_up_s, unverified) and the same re-push;
    - the scoring forwards (old policy, reference): 2 x dense params FLOPs per token over the generation batch,
      against the host's ops of each no-grad forward.
    `generation_s` / `scoring_s`: one generation call's generate / scoring timed from the simulator's fake run as two
    queues (advisor/simulator/phase_timing.py), in place of the closed forms (generate: transformers' engine only).
    `tc`: advisor/physics/timing TimeConstants of the target."""
    gens = step.generations_per_step
    g, p, c = step.generation_batch, step.prompt_length, step.max_completion_length
    eff_peak = peak_flops * tc.gemm_eff
    wbytes = vllm_weights_bytes if (step.engine is not Mode.GENERATE and vllm_weights_bytes) else (
        step.full_weights_bytes or step.weights_bytes)
    kv_token = step.layers * step.kv_heads * step.head_dim * (step.kv_dtype_bytes + (step.key_dtype_bytes or
                                                                                      step.kv_dtype_bytes))
    prefill = 2.0 * dense_params * g * p / eff_peak
    mean_len = p + (c - 1) / 2.0
    decode_device = c * (wbytes + g * mean_len * kv_token) / tc.mem_bw
    decode_flops = c * 2.0 * dense_params * g / eff_peak
    decode_dev = max(decode_device, decode_flops)
    notes = []
    if step.engine is Mode.GENERATE and generation_s is not None:
        prefill, decode = 0.0, generation_s
        notes.append("generation: transformers' generate timed from the fake run's own ops, per window of the "
                     "decode loop (the prefill, each decode step) as host and device queues with the host's read of "
                     "the stopping criteria each token (advisor/simulator/phase_timing.py)")
        sync = 0.0
    elif step.engine is Mode.GENERATE:
        decode = c * _hf_decode_token_s(step, tc, decode_dev / max(c, 1))
        notes.append("generation: transformers' generate, prefill compute-bound; each decode step the larger of its "
                     "kernels (weights + KV read) and the host's ops (online_rl_constants.json hf_generate_ops), "
                     "then the host's read of the stopping criteria")
        sync = 0.0
    else:
        decode = decode_dev / _c("vllm_decode_efficiency") * max(1, vllm_waves)
        eff = _c("vllm_decode_efficiency")
        notes.append(f"generation: vLLM, decode bandwidth-bound at vllm_decode_efficiency={eff}"
                     " of the roofline (unverified: no cited vLLM vs generate factor)"
                     + (f", in {vllm_waves} rounds (its KV cache holds part of the batch)" if vllm_waves > 1 else ""))
        if step.engine is Mode.COLOCATE:
            sync = 2.0 * wbytes / tc.mem_bw
            if step.sleep is not Sleep.OFF:
                sync += _c("vllm_wake_up_s")
            notes.append("weight sync: colocated load_weights, every weight read and written once per step"
                         + (" after wake_up (time not modelled, unverified)" if step.sleep is not Sleep.OFF else ""))
        else:
            bw = interconnect_bytes_s or tc.pcie_bw
            sync = wbytes / bw
            notes.append("weight sync: the weights to the vLLM server over the interconnect once per step")
    if scoring_s is not None:
        scoring = scoring_s
        notes.append("scoring (old policy / reference forwards, rewards, advantages): timed from the fake run's ops "
                     "as host and device queues")
    else:
        forward_host = tc.issue_s(OpClass.NOGRAD, step.layers * _c("forward_ops_per_layer"),
                                  step.layers * _c("forward_kernel_ops_per_layer"))
        ops = _constants_block("score_ops")
        scoring = step.scoring_forwards * max(2.0 * dense_params * g * step.sequence_length / eff_peak,
                                              forward_host) + tc.issue_s(OpClass.NOGRAD, ops["ops"], ops["kernel_ops"])
    syncs = min(1.0, gens)
    terms = {"generation": gens * (prefill + decode), "weight_sync": syncs * sync, "scoring_forwards": gens * scoring,
             "training": float(train_s)}
    return OnlineTime({k: v for k, v in terms.items()}, step.trained_tokens_per_step, tuple(notes))


def _hf_decode_token_s(step: OnlineStep, tc: Any, device_s: float) -> float:
    """One decode step of transformers' generate in closed form: the host issues its ops (per layer and outside the
    layers: the logits processors, sampling, the stopping criteria; online_rl_constants.json hf_generate_ops,
    counted on the fake run) while the device runs `device_s`, then waits for it (the stopping check)."""
    ops = _constants_block("hf_generate_ops")
    host = tc.issue_s(OpClass.NOGRAD, step.layers * ops["per_layer"] + ops["outside"],
                      step.layers * ops["kernel_per_layer"] + ops["kernel_outside"])
    if not tc.cuda:
        return host + device_s
    return max(host, device_s) + tc.sync_s


def step_time_on(step: OnlineStep, gpu: Any, arch: Any, *, precision: str, train_s: float,
                 vllm: VllmTerms | None = None, generation_s: float | None = None,
                 scoring_s: float | None = None) -> OnlineTime:
    """`step_time` on the target `gpu` (a GPUSpec): its time constants, peak FLOPs at `precision`, its interconnect
    (a served vLLM's weight sync; None on a CPU target), the dense parameters of `arch` (decoder linears + the head),
    vLLM's weights and KV-cache rounds from `step` and `vllm`. What the estimate and the simulator both call."""
    return step_time(step, time_constants(gpu), train_s=train_s,
                     dense_params=arch.decoder_linear + arch.vocab * arch.hidden,
                     interconnect_bytes_s=interconnect(gpu).intra_gbs * 1e9 if gpu.is_cuda else None,
                     peak_flops=peak_flops(gpu, precision),
                     vllm_weights_bytes=step.vllm.weights_bytes if step.vllm is not None else None,
                     vllm_waves=getattr(vllm, "waves", 1), generation_s=generation_s, scoring_s=scoring_s)
