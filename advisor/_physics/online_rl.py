"""Online RL's step (GRPO, RLOO; TRL 1.16) in closed form: each phase's device bytes, vLLM's refusals, the step time.
Shared by the estimate (advisor/_estimate/online_rl.py) and the simulator's glue (which measures the phases'
allocator peaks itself and combines them here with what vLLM holds outside the allocator: `device_peak`). Part of the
physics package: it imports the package's own modules (vllm.py, timing/) and advisor.errors, nothing above them; the
phases are keyed by the values of advisor/trainers/phases.py PhaseKind ("generate", "score", "train"; a str-Enum, so
PhaseKind members key the same mappings) without importing it.

What a GRPO / RLOO step holds (TRL 1.16 as installed; file and function of each term):
- The training state stays resident through every phase: the policy's weights, its optimizer state (created in the
  first step; the peak is a later step's), a separate reference when `beta != 0` without PEFT
  (trl/trainer/grpo_trainer.py GRPOTrainer.__init__: `create_model_from_path(..., dtype=self.model.dtype)`; under PEFT
  the reference is the policy with its adapters disabled, `use_adapter(model, None)` in
  `_generate_and_score_completions`), and a reward model given as a model. Gradients exist from the backward to the
  optimizer step (Trainer's `zero_grad(set_to_none=True)`).
- GENERATE, transformers' engine (`_generate_single_turn`, `use_vllm=False`): the local generation batch
  (`per_device_train_batch_size x steps_per_generation` completions) goes through one `unwrapped_model.generate`
  call, left-padded to its longest prompt; its `DynamicCache` grows by `torch.cat` per layer (transformers
  cache_utils.py DynamicLayer.update) to prompt + max_completion_length - 1 positions (the last sampled token is not
  fed back). accelerate's autocast wrapper stays on the unwrapped model (`accelerator.unwrap_model(
  keep_fp32_wrapper=True)`), so the values are in the compute dtype under mixed precision; over float32 weights the
  keys are float32 (rotary's cos/sin follow the float32 residual and promote them: `hf_kv_cache_bytes`). ZeRO-3 with
  `ds3_gather_for_generation` gathers every parameter (trl/models/utils.py _unwrap_model_for_generation:
  `deepspeed.zero.GatheredParameters(model.parameters())`); without it each layer is gathered as it runs.
- GENERATE, vLLM (`vllm_generation.py` VLLMGeneration.sync_weights / generate): the weights are pushed to vLLM once
  per optimizer step (`load_weights` one parameter at a time; PEFT + ZeRO-3 gathers the whole model to merge the
  adapters first: `_iter_named_params`); colocated vLLM's pool (advisor/_physics/vllm.py) is outside PyTorch's
  allocator.
- SCORE (`_generate_and_score_completions`, no grad): the old policy's log-probs when `gradient_accumulation_steps %
  (steps_per_generation x num_iterations) != 0` or vLLM's importance-sampling correction is on; the reference's
  when `beta != 0`; each a forward in chunks of `per_device_train_batch_size` rows
  (`_get_per_token_logps_and_entropies`) through TRL's fused log-prob head (trl/kernels/chunked_logprob.py
  ChunkedLogProbFunction: `mm_buf` of min(N, 4096) x 32768 columns in the compute dtype, never the [B, T, V]
  logits; on CUDA N = the completion tokens, elsewhere every position:
  `add_fused_lm_head`'s `compact = _use_triton(device)`).
- TRAIN: one micro-batch of `per_device_train_batch_size` completions of prompt + completion positions, its saved
  activations (the backend's count: `train_activation_bytes`), the fused head's forward and backward, the gradients,
  the optimizer step.
Colocated vLLM holds its pool in every phase without sleep mode; with sleep (TRL sleeps at level 2 after each
generate) only in GENERATE, plus what sleep keeps (vllm.py `asleep`); server mode puts vLLM on GPUs of its own.

Step time: generation (prefill compute-bound, decode bandwidth-bound: the weights and the KV cache read per decode
step; transformers' generate also host-bound per op), the weight sync, the extra no-grad forwards and the training
passes (the backend's step-time model for those: advisor/_physics/timing/). Every constant is in
profiles/measurements/online_rl_constants.json with its source.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import lru_cache
from typing import Any

from ..errors import ConfigError
from .distillation import Teacher, teacher_of, train_moments
from .vllm import (
    KVLayout,
    Mode,
    Pool,
    PoolSplit,
    Refusal,
    Refused,
    Sleep,
    Started,
    asleep,
    batch_kv_bytes,
    cudagraph_graphs,
    min_utilization,
    start,
)

# the phases' keys: advisor/trainers/phases.py PhaseKind values (a str-Enum: its members key these mappings too)
GENERATE, SCORE, TRAIN = "generate", "score", "train"
PHASES = (GENERATE, SCORE, TRAIN)


def _constants_path():
    from ..profiles import PROFILES_DIR

    return PROFILES_DIR / "measurements" / "online_rl_constants.json"


@lru_cache(maxsize=1)
def constants() -> dict[str, Any]:
    """profiles/measurements/online_rl_constants.json: each constant with its source."""
    return json.loads(_constants_path().read_text())


def _c(name: str) -> float:
    return float(constants()[name]["value"])


class Reference(str, Enum):
    """The reference of the KL term (`beta != 0`)."""

    NONE = "none"  # beta == 0: no reference forward
    SEPARATE = "separate"  # a second copy of the model (full fine-tuning)
    ADAPTERS_DISABLED = "adapters_disabled"  # PEFT: the policy with its adapters disabled


class Loss(str, Enum):
    """What the training pass computes on the completions."""

    LOGPROB = "logprob"  # GRPO / RLOO: TRL's fused log-prob head (trl/kernels/chunked_logprob.py)
    DIVERGENCE = "divergence"  # distillation: the teacher's forward and the chunked divergence (distillation.py)


@dataclass(frozen=True)
class VllmSide:
    """What vLLM loads and reserves, as plain numbers (advisor/_physics/vllm.py derives them from the config)."""

    weights_bytes: int  # the checkpoint at vLLM's dtype="auto" (vllm.py vllm_dtype)
    layout: KVLayout  # vLLM's KV pages per token (vllm.py kv_layout)
    max_model_len: int  # vllm.py derived_max_model_len: TRL's vllm_max_model_length or the model's own
    activation_bytes: int  # profile_run's torch peak increase (vllm_profile_activation_bytes, or measured)
    non_torch_bytes: int  # non_torch_increase (profiles/measurements/online_rl_constants.json, or measured)
    context_bytes: int = 0  # the training process's CUDA context and workspaces when vLLM snapshots the device
    cudagraph_bytes: int = 0  # vLLM's CUDA-graph estimate, inside the pool (vllm_cudagraph_bytes, or measured)


@dataclass(frozen=True)
class OnlineStep:
    """One GRPO / RLOO optimizer step's shape, as plain numbers (no Candidate: both backends build it)."""

    # the model
    parameters: int
    trainable: int
    layers: int
    hidden: int
    intermediate: int
    kv_heads: int
    head_dim: int
    vocab: int
    # the training state on this rank (bytes): the backend's counts (quantized weights, adapters, ZeRO shards)
    weights_bytes: int  # the policy as resident: weights, adapters, buffers
    gradient_bytes: int  # every trained parameter's gradient
    optimizer_bytes: int  # the optimizer's state
    # element sizes
    kv_dtype_bytes: int  # DynamicCache's values: v_proj's output (autocast's dtype, else the weights')
    compute_bytes: int  # the forwards' activations (autocast's dtype, else the weights')
    head_weight_bytes: int  # the LM head's weight element (cast per tile when it differs from the compute dtype)
    # the batch (TRL's names)
    prompt_length: int  # the longest prompt of a generation batch (left-padded to it)
    max_completion_length: int
    per_device_train_batch_size: int  # completions per micro-batch
    steps_per_generation: int
    num_generations: int
    num_iterations: int = 1
    gradient_accumulation_steps: int = 1
    beta: float = 0.0
    reference: Reference = Reference.NONE
    reference_bytes: int = 0  # a separate reference's weights on this rank
    reward_model_bytes: int = 0  # reward models given as models (resident); reward functions cost nothing here
    # the engine
    engine: Mode = Mode.GENERATE
    vllm_gpu_memory_utilization: float = 0.3
    sleep: Sleep = Sleep.OFF
    vllm_importance_sampling_correction: bool = True
    old_logps_always: bool = False  # RLOOTrainer._generate_and_score_completions scores the old policy every time
    vllm: VllmSide | None = None
    # distribution and knobs
    world_size: int = 1
    zero3: bool = False
    ds3_gather_for_generation: bool = True
    full_weights_bytes: int = 0  # the whole policy gathered (ZeRO-3), in the compute dtype
    cast_lm_head_to_fp32: bool = False
    key_dtype_bytes: int = 0  # DynamicCache's keys (0: as the values); float32 under autocast over float32 weights
    lora: bool = False
    gradient_checkpointing: bool = False
    optimizer_temporary_bytes: int = 0
    # the training micro-batch's saved activations (decoder layers and final norm, not the LM head) and one
    # checkpointed layer's recompute: the backend's count
    train_activation_bytes: int = 0
    train_recompute_bytes: int = 0
    # distillation: the loss, the resident teacher and the divergence's beta (0 forward KL .. 1 reverse KL)
    loss: Loss = Loss.LOGPROB
    teacher: Teacher | None = None
    divergence_beta: float = 1.0
    # the target
    card_bytes: int = 0
    cuda: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss", Loss(self.loss))
        object.__setattr__(self, "reference", Reference(self.reference))
        object.__setattr__(self, "engine", Mode(self.engine))
        object.__setattr__(self, "sleep", Sleep(self.sleep))
        problems = []
        for name in ("layers", "hidden", "intermediate", "kv_heads", "head_dim", "vocab", "prompt_length",
                     "max_completion_length", "per_device_train_batch_size", "steps_per_generation",
                     "num_generations", "num_iterations", "gradient_accumulation_steps", "world_size",
                     "kv_dtype_bytes", "compute_bytes", "head_weight_bytes"):
            if int(getattr(self, name)) < 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        if not problems and self.global_generation_batch % self.num_generations:
            problems.append(
                f"num_generations={self.num_generations} does not divide the generation batch "
                f"({self.per_device_train_batch_size} x {self.world_size} processes x steps_per_generation "
                f"{self.steps_per_generation} = {self.global_generation_batch}; TRL's GRPOConfig rule): pick "
                "num_generations dividing it, or change per_device_train_batch_size / steps_per_generation")
        if self.beta != 0 and self.reference is Reference.NONE:
            problems.append(f"beta={self.beta} needs a reference (separate, or adapters disabled under PEFT)")
        if self.engine is Mode.COLOCATE and self.vllm is None:
            problems.append("vllm_mode=colocate needs vLLM's side (VllmSide: its weights, KV layout, max_model_len)")
        if self.engine is Mode.COLOCATE and self.card_bytes <= 0:
            problems.append("vllm_mode=colocate needs the card's total memory (card_bytes)")
        if (self.loss is Loss.DIVERGENCE) != (self.teacher is not None):
            problems.append(f"loss={self.loss.value} with teacher={self.teacher!r}: the divergence is against a "
                            "teacher, and only it has one")
        if problems:
            raise ConfigError(problems, context="online RL step")

    # ---- the batch as TRL forms it ---------------------------------------------------------------------------
    @property
    def generation_batch(self) -> int:
        """Completions one process generates in one call: per_device_train_batch_size x steps_per_generation."""
        return self.per_device_train_batch_size * self.steps_per_generation

    @property
    def global_generation_batch(self) -> int:
        """GRPOConfig.generation_batch_size: per_device_train_batch_size x processes x steps_per_generation."""
        return self.generation_batch * self.world_size

    @property
    def sequence_length(self) -> int:
        """Prompt + max_completion_length: every completion at its maximum (the bound)."""
        return self.prompt_length + self.max_completion_length

    @property
    def old_logps_forward(self) -> bool:
        """GRPOTrainer._generate_and_score_completions: old-policy log-probs when gradient_accumulation_steps %
        (steps_per_generation x num_iterations) != 0, or with vLLM's importance-sampling correction; RLOOTrainer's
        always (`old_logps_always`)."""
        if self.old_logps_always:
            return True
        every = self.steps_per_generation * self.num_iterations
        uses_vllm = self.engine is not Mode.GENERATE
        return self.gradient_accumulation_steps % every != 0 or (uses_vllm and self.vllm_importance_sampling_correction)

    @property
    def reference_forward(self) -> bool:
        return self.beta != 0

    @property
    def scoring_forwards(self) -> int:
        """No-grad forwards over the generation batch: the old policy's, the reference's (reward models apart)."""
        return int(self.old_logps_forward) + int(self.reference_forward)

    @property
    def generations_per_step(self) -> float:
        """Generation calls per optimizer step: one every steps_per_generation x num_iterations micro-steps."""
        return self.gradient_accumulation_steps / (self.steps_per_generation * self.num_iterations)

    @property
    def trained_tokens_per_step(self) -> int:
        """Completion tokens trained per optimizer step (every completion at max_completion_length)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.max_completion_length

    @property
    def gradients_while_generating(self) -> bool:
        """Whether a generation call falls inside an accumulation (micro-step k x steps_per_generation x
        num_iterations not a multiple of gradient_accumulation_steps): the earlier micro-steps' gradients are then
        resident while generating and scoring (Trainer zeroes them only after the optimizer step)."""
        return (self.steps_per_generation * self.num_iterations) % self.gradient_accumulation_steps != 0

    @property
    def teacher_bytes(self) -> int:
        return self.teacher.weights_bytes if self.teacher is not None else 0

    @property
    def resident_bytes(self) -> int:
        """Held in every phase: the policy, its optimizer state, a separate reference, reward models, a teacher."""
        return self.weights_bytes + self.optimizer_bytes + self.reference_bytes + self.reward_model_bytes + \
            self.teacher_bytes


# ---- the step from the workload's shape and the backend's training-state bytes ----------------------------------
def build_step(arch: Any, model_config: Mapping[str, Any], *, weights_bytes: int, gradient_bytes: int,
               optimizer_bytes: int, trainable: int, weight_element_bytes: int, mixed: bool, prompt_length: int,
               max_completion_length: int, per_device_train_batch_size: int, gradient_accumulation_steps: int,
               steps_per_generation: int | None, generation_batch_size: int | None, num_generations: int,
               num_iterations: int, beta: float, lora: bool, use_vllm: bool, vllm_mode: str,
               vllm_enable_sleep_mode: bool, vllm_gpu_memory_utilization: float,
               vllm_importance_sampling_correction: bool, vllm_max_model_length: int | None,
               ds3_gather_for_generation: bool, cast_lm_head_to_fp32: bool, gradient_checkpointing: bool,
               old_logps_always: bool, reference_bytes: int, reward_model_bytes: int, card_bytes: int, cuda: bool,
               context_bytes: int = 0, supports_bf16: bool = True, world_size: int = 1, zero3: bool = False,
               optimizer_temporary_bytes: int = 0, train_activation_bytes: int = 0,
               train_recompute_bytes: int = 0, loss: str = Loss.LOGPROB.value, divergence_beta: float = 1.0,
               teacher_arch: Any = None, teacher_bytes: int = 0,
               teacher_weight_element_bytes: int = 0) -> OnlineStep:
    """The step's `OnlineStep` from the architecture (advisor/_physics/shapes.py `Architecture`), the knobs by TRL
    1.16's names (each trainer's defaults already resolved by the caller) and the training state's bytes as the
    backend counts them (the estimate: the SFT estimate's parts; the simulator: the fake run's models). With vLLM,
    its side (`vllm_side`) from the model's config. The element sizes follow autocast: the compute dtype is 16-bit
    under mixed precision or 16-bit weights, the DynamicCache's keys float32 under autocast over float32 weights.
    Distillation (`loss="divergence"`): the teacher's architecture, its bytes on this rank and its weights' element."""
    b, ga, world = per_device_train_batch_size, gradient_accumulation_steps, max(1, world_size)
    spg = steps_per_generation
    if spg is None:  # GRPOConfig.__post_init__: generation_batch_size // (B x processes), else GA
        spg = generation_batch_size // (b * world) if generation_batch_size else ga
    float32_weights = weight_element_bytes == 4
    compute = 2 if (mixed or not float32_weights) else 4
    if use_vllm and vllm_mode not in (Mode.COLOCATE.value, Mode.SERVER.value):
        raise ConfigError(f"vllm_mode={vllm_mode!r}: TRL takes 'colocate' or 'server'", context="vllm_mode")
    engine = Mode(vllm_mode) if use_vllm else Mode.GENERATE
    from .vllm import TRL_SLEEP_LEVEL

    sleep = TRL_SLEEP_LEVEL if (use_vllm and vllm_enable_sleep_mode) else Sleep.OFF
    reference = Reference.NONE if beta == 0 else (Reference.ADAPTERS_DISABLED if lora else Reference.SEPARATE)
    step = OnlineStep(
        parameters=arch.total, trainable=trainable, layers=arch.layers, hidden=arch.hidden,
        intermediate=arch.intermediate, kv_heads=max(1, arch.kv_dim // max(1, arch.head_dim)),
        head_dim=arch.head_dim, vocab=arch.vocab, weights_bytes=weights_bytes, gradient_bytes=gradient_bytes,
        optimizer_bytes=optimizer_bytes, kv_dtype_bytes=compute,
        key_dtype_bytes=4 if (mixed and float32_weights) else compute, compute_bytes=compute,
        head_weight_bytes=weight_element_bytes, prompt_length=prompt_length,
        max_completion_length=max_completion_length, per_device_train_batch_size=b, steps_per_generation=int(spg),
        num_generations=int(num_generations), num_iterations=int(num_iterations), gradient_accumulation_steps=ga,
        beta=float(beta), reference=reference, reference_bytes=reference_bytes,
        reward_model_bytes=reward_model_bytes, vllm_gpu_memory_utilization=float(vllm_gpu_memory_utilization),
        sleep=sleep, vllm_importance_sampling_correction=bool(vllm_importance_sampling_correction),
        old_logps_always=old_logps_always, world_size=world, zero3=zero3,
        ds3_gather_for_generation=bool(ds3_gather_for_generation), full_weights_bytes=arch.total * compute,
        cast_lm_head_to_fp32=bool(cast_lm_head_to_fp32), lora=lora, gradient_checkpointing=gradient_checkpointing,
        optimizer_temporary_bytes=optimizer_temporary_bytes, train_activation_bytes=train_activation_bytes,
        train_recompute_bytes=train_recompute_bytes, card_bytes=card_bytes, cuda=cuda, loss=Loss(loss),
        divergence_beta=float(divergence_beta),
        teacher=teacher_of(teacher_arch, weights_bytes=teacher_bytes, weight_element_bytes=teacher_weight_element_bytes)
        if teacher_arch is not None else None,
    )
    if engine is not Mode.GENERATE:
        side = vllm_side(model_config, parameters=arch.total, generation_batch=step.generation_batch,
                         vllm_max_model_length=vllm_max_model_length, context_bytes=context_bytes,
                         supports_bf16=supports_bf16)
        step = replace(step, engine=engine, vllm=side)
    return step


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


def vllm_profile_activation_bytes(*, hidden: int, intermediate: int, vocab: int, max_num_seqs: int,
                                  dtype_bytes: int) -> int:
    """vLLM's profile run in closed form (online_rl_constants.json vllm_profile_activation_tokens: modelled,
    unverified): one layer's transients over max_num_batched_tokens tokens and the sampler's fp32 logits and
    probabilities of max_num_seqs (TRL: the generation batch) rows."""
    tokens = int(_c("vllm_profile_activation_tokens"))
    return tokens * (3 * intermediate + 4 * hidden) * dtype_bytes + 2 * max_num_seqs * vocab * 4


def vllm_cudagraph_bytes(*, hidden: int, intermediate: int, max_num_seqs: int, dtype_bytes: int) -> int:
    """vLLM's estimate of its CUDA graphs' memory (vllm.py `cudagraph_graphs`, `CudaGraphs.estimate_bytes`: the
    graphs of its default FULL_AND_PIECEWISE mode for TRL's max_num_seqs), its measured inputs modelled
    (online_rl_constants.json vllm_cudagraph_per_graph_bytes; unverified): the first capture holds the graph pool's
    working set at the largest capture size, one decoder layer's transients per token (3 x intermediate + 4 x hidden,
    the weights' dtype: the profile run's per-token term); every further graph its per-graph bytes."""
    graphs = cudagraph_graphs(max_num_seqs)
    first = graphs.largest_tokens * (3 * intermediate + 4 * hidden) * dtype_bytes
    return graphs.estimate_bytes(first, int(_c("vllm_cudagraph_per_graph_bytes")))


def vllm_side(config: Mapping[str, Any], *, parameters: int, generation_batch: int,
              vllm_max_model_length: int | None = None, context_bytes: int = 0, supports_bf16: bool = True,
              activation_bytes: int | None = None, non_torch_bytes: int | None = None,
              cudagraph_bytes: int | None = None) -> VllmSide:
    """What colocated vLLM loads for a transformers `config` (vllm.py: `vllm_dtype`, `kv_layout`,
    `derived_max_model_len`): the checkpoint's `parameters` at vLLM's dtype, its KV layout, its max_model_len, and
    the profile run's activations, non-torch memory and CUDA graphs (measured values win over the modelled ones).
    `generation_batch`: TRL's max_num_seqs (the local generation batch, tensor-parallel 1)."""
    from .vllm import DTYPE_BYTES as _VLLM_BYTES
    from .vllm import derived_max_model_len, kv_layout, vllm_dtype

    name = vllm_dtype(config, supports_bf16=supports_bf16)
    nbytes = _VLLM_BYTES[name]
    c = config.get("text_config") or config
    hidden, intermediate = int(c["hidden_size"]), int(c["intermediate_size"])
    if activation_bytes is None:
        activation_bytes = vllm_profile_activation_bytes(
            hidden=hidden, intermediate=intermediate, vocab=int(c["vocab_size"]), max_num_seqs=generation_batch,
            dtype_bytes=nbytes)
    if cudagraph_bytes is None:
        cudagraph_bytes = vllm_cudagraph_bytes(hidden=hidden, intermediate=intermediate,
                                               max_num_seqs=max(1, int(generation_batch)), dtype_bytes=nbytes)
    return VllmSide(
        weights_bytes=parameters * nbytes, layout=kv_layout(config, supports_bf16=supports_bf16),
        max_model_len=derived_max_model_len(config, vllm_max_model_length), activation_bytes=int(activation_bytes),
        non_torch_bytes=int(_c("vllm_non_torch_bytes") if non_torch_bytes is None else non_torch_bytes),
        context_bytes=context_bytes, cudagraph_bytes=int(cudagraph_bytes))


def startup_bytes(step: OnlineStep) -> int:
    """The training process's bytes when vLLM snapshots the device (GRPOTrainer.__init__, before train(): no
    optimizer state yet): its CUDA context, the policy, a reference, reward models, a teacher (DistillationTrainer
    loads it before VLLMGeneration starts)."""
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
              vllm_waves: int = 1) -> OnlineTime:
    """One optimizer step: `train_s` (the training passes of gradient_accumulation_steps micro-batches, from the
    step-time model, advisor/_physics/timing/) plus, per generation call (`generations_per_step` of them):
    - generation: prefill (2 x dense params FLOPs per prompt token, compute-bound at the GEMM efficiency) and
      max_completion_length decode steps, each reading the weights once and the KV cache of the batch at its mean
      length (bandwidth-bound); transformers' eager generate also pays its host ops per decode step (max of host and
      device, as the step-time model overlaps them); vLLM's decode at online_rl_constants.json
      vllm_decode_efficiency (1.0: unverified), in `vllm_waves` rounds when its KV cache cannot hold the batch;
    - the weight sync (once per optimizer step): colocated, `load_weights` copies every weight (read + write over
      the device's bandwidth); served, the weights over the interconnect to the server; with sleep, wake-up
      (vllm_wake_up_s, unverified) and the same re-push;
    - the scoring forwards (old policy, reference): 2 x dense params FLOPs per token over the generation batch.
    `tc`: advisor/_physics/timing TimeConstants of the target."""
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
    if step.engine is Mode.GENERATE:
        host = c * step.layers * _c("hf_generate_host_ops_per_layer") * tc.op_s
        decode = (decode_dev + host) if not tc.cuda else max(decode_dev, host)
        notes.append("generation: transformers' generate, prefill compute-bound, decode bandwidth-bound (weights + "
                     "KV read per token) against its host ops per step (online_rl_constants.json "
                     "hf_generate_host_ops_per_layer, unverified)")
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
    scoring = step.scoring_forwards * 2.0 * dense_params * g * step.sequence_length / eff_peak
    syncs = min(1.0, gens)
    terms = {"generation": gens * (prefill + decode), "weight_sync": syncs * sync, "scoring_forwards": gens * scoring,
             "training": float(train_s)}
    return OnlineTime({k: v for k, v in terms.items()}, step.trained_tokens_per_step, tuple(notes))


def step_time_on(step: OnlineStep, gpu: Any, arch: Any, *, precision: str, train_s: float,
                 vllm: VllmTerms | None = None) -> OnlineTime:
    """`step_time` on the target `gpu` (a GPUSpec): its time constants, peak FLOPs at `precision`, its interconnect
    (a served vLLM's weight sync; None on a CPU target), the dense parameters of `arch` (decoder linears + the head),
    vLLM's weights and KV-cache rounds from `step` and `vllm`. What the estimate and the simulator both call."""
    from . import interconnect, peak_flops, time_constants

    return step_time(step, time_constants(gpu), train_s=train_s,
                     dense_params=arch.decoder_linear + arch.vocab * arch.hidden,
                     interconnect_bytes_s=interconnect(gpu).intra_gbs * 1e9 if gpu.is_cuda else None,
                     peak_flops=peak_flops(gpu, precision),
                     vllm_weights_bytes=step.vllm.weights_bytes if step.vllm is not None else None,
                     vllm_waves=getattr(vllm, "waves", 1))
