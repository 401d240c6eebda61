"""Online RL's step (GRPO, RLOO; TRL 1.16): its shape as plain numbers (`OnlineStep`), built by both backends from the
trainer's knob view and the training state's bytes as each counts them (`build_step`), and the phases it runs
(`PhaseKind`: generate, score, train). What each phase holds, vLLM's refusals and the time are online_costs.py's. Shared
by the estimate (advisor/estimator/online_step.py) and the simulator's glue (advisor/simulator/online_simulate.py, which
measures the phases' allocator peaks itself). Part of the physics package: it imports the package's own modules
(vllm.py, shapes.py), the value types and advisor.errors, nothing above them.

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
  adapters first: `_iter_named_params`); colocated vLLM's pool (advisor/physics/vllm.py) is outside PyTorch's
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
passes (the backend's step-time model for those: advisor/physics/timing/). Every constant is in
profiles/measurements/online_rl_constants.json with its source.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from .. import profiles
from ..errors import ConfigError
from .distillation import Teacher
from .shapes import DTYPE_BYTES
from .vllm import DTYPE_BYTES as _VLLM_BYTES
from .vllm import TRL_SLEEP_LEVEL, KVLayout, Mode, Sleep, cudagraph_graphs, derived_max_model_len, kv_layout, vllm_dtype

if TYPE_CHECKING:
    from ..space import Candidate
    from ..workload import GPUSpec


class PhaseKind(str, Enum):
    """What a phase of an online step does (a str-Enum: its members and their values key the same mappings)."""

    GENERATE = "generate"  # sample completions (TRL's generate, or vLLM)
    SCORE = "score"  # reward model / reward functions and reference log-probs on the completions, no gradient
    TRAIN = "train"  # forward, backward and optimizer step of the trained model


GENERATE, SCORE, TRAIN = PhaseKind.GENERATE, PhaseKind.SCORE, PhaseKind.TRAIN
PHASES = (GENERATE, SCORE, TRAIN)

def _constants_path():
    return profiles.PROFILES_DIR / "measurements" / "online_rl_constants.json"


@lru_cache(maxsize=1)
def constants() -> dict[str, Any]:
    """profiles/measurements/online_rl_constants.json: each constant with its source."""
    return json.loads(_constants_path().read_text())


def _c(name: str) -> float:
    return float(constants()[name]["value"])


def _constants_block(name: str) -> dict[str, float]:
    return {k: float(v) for k, v in constants()[name].items() if k != "source"}


class Loss(str, Enum):
    """What the training pass computes on the completions."""

    LOGPROB = "logprob"  # GRPO / RLOO: TRL's fused log-prob head (trl/kernels/chunked_logprob.py)
    DIVERGENCE = "divergence"  # distillation: the teacher's forward and the chunked divergence (distillation.py)


class Reference(str, Enum):
    """The reference of the KL term (`beta != 0`)."""

    NONE = "none"  # beta == 0: no reference forward
    SEPARATE = "separate"  # a second copy of the model (full fine-tuning)
    ADAPTERS_DISABLED = "adapters_disabled"  # PEFT: the policy with its adapters disabled


@dataclass(frozen=True)
class VllmSide:
    """What vLLM loads and reserves, as plain numbers (advisor/physics/vllm.py derives them from the config)."""

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


# ---- the step from the trainer's knob view and the backend's training-state bytes --------------------------------
@dataclass(frozen=True)
class TrainingState:
    """What a backend counts of one rank's training state (bytes) and the step's data: the estimate from the SFT
    estimate's parts, the simulator from its fake run's models."""

    weights_bytes: int  # the policy as resident: weights, adapters, buffers
    gradient_bytes: int
    optimizer_bytes: int
    trainable: int  # trained parameters
    prompt_length: int  # the longest prompt of a generation batch
    reference_bytes: int = 0  # a separate reference on this rank
    model_inputs_bytes: int = 0  # the models given beside the policy (a reward model): resident
    # the model the loss distills from (a model input: distillation's teacher), its bytes not in model_inputs_bytes
    teacher: Teacher | None = None
    optimizer_temporary_bytes: int = 0
    train_activation_bytes: int = 0  # the training micro-batch's saved activations (not the LM head)
    train_recompute_bytes: int = 0  # one checkpointed layer's recompute
    world_size: int = 1
    zero3: bool = False


def build_step(arch: Any, model_config: Mapping[str, Any], candidate: Candidate, knobs: Any, state: TrainingState,
               target: GPUSpec, *, context_bytes: int = 0) -> OnlineStep:
    """The step's `OnlineStep` from the architecture (shapes.py `Architecture`), the candidate's shared knobs, the
    online trainer's knob view (advisor/trainers/online_knobs.py `OnlineKnobs`: TRL 1.16's names, the trainer's
    defaults resolved) and the training state's bytes as the backend counts them. With vLLM, its side (`vllm_side`)
    from the model's config. The element sizes follow autocast: the compute dtype is 16-bit under mixed precision
    or 16-bit weights, the DynamicCache's keys float32 under autocast over float32 weights. The KL coefficient is
    the view's `kl_beta`; a view whose loss is a divergence against a teacher (distillation) gives its beta as
    `divergence_beta` and the state its `teacher`."""
    c, k = candidate, knobs
    b, ga, world = c.per_device_train_batch_size, c.gradient_accumulation_steps, max(1, state.world_size)
    spg = k.steps_per_generation
    if spg is None:  # GRPOConfig.__post_init__: generation_batch_size // (B x processes), else GA
        spg = k.generation_batch_size // (b * world) if k.generation_batch_size else ga
    weight_element = DTYPE_BYTES[c.weights_dtype]
    float32_weights, mixed = weight_element == 4, c.precision.value != "fp32"
    compute = 2 if (mixed or not float32_weights) else 4
    beta = float(k.kl_beta)
    divergence = k.divergence_beta
    if (divergence is None) != (state.teacher is None):
        raise ConfigError([f"divergence_beta={divergence!r} with teacher={state.teacher!r}: a divergence loss needs "
                           "the teacher the backend counted, and a teacher a divergence loss"], context="online step")
    step = OnlineStep(
        parameters=arch.total, trainable=state.trainable, layers=arch.layers, hidden=arch.hidden,
        intermediate=arch.intermediate, kv_heads=max(1, arch.kv_dim // max(1, arch.head_dim)),
        head_dim=arch.head_dim, vocab=arch.vocab, weights_bytes=state.weights_bytes,
        gradient_bytes=state.gradient_bytes, optimizer_bytes=state.optimizer_bytes, kv_dtype_bytes=compute,
        key_dtype_bytes=4 if (mixed and float32_weights) else compute, compute_bytes=compute,
        head_weight_bytes=weight_element, prompt_length=state.prompt_length,
        max_completion_length=int(k.max_completion_length), per_device_train_batch_size=b,
        steps_per_generation=int(spg), num_generations=int(k.num_generations),
        num_iterations=int(k.num_iterations), gradient_accumulation_steps=ga, beta=beta,
        reference=Reference.NONE if beta == 0 else (Reference.ADAPTERS_DISABLED if c.use_lora else
                                                    Reference.SEPARATE),
        reference_bytes=state.reference_bytes, reward_model_bytes=state.model_inputs_bytes,
        vllm_gpu_memory_utilization=float(k.vllm_gpu_memory_utilization),
        sleep=TRL_SLEEP_LEVEL if (k.use_vllm and k.vllm_enable_sleep_mode) else Sleep.OFF,
        vllm_importance_sampling_correction=bool(k.vllm_importance_sampling_correction),
        old_logps_always=bool(k.old_logps_always), world_size=world, zero3=state.zero3,
        ds3_gather_for_generation=bool(k.ds3_gather_for_generation), full_weights_bytes=arch.total * compute,
        cast_lm_head_to_fp32=bool(k.cast_lm_head_to_fp32), lora=c.use_lora,
        gradient_checkpointing=c.activation_checkpointing,
        optimizer_temporary_bytes=state.optimizer_temporary_bytes,
        train_activation_bytes=state.train_activation_bytes, train_recompute_bytes=state.train_recompute_bytes,
        card_bytes=target.memory_bytes, cuda=target.is_cuda,
        loss=Loss.LOGPROB if divergence is None else Loss.DIVERGENCE, teacher=state.teacher,
        divergence_beta=1.0 if divergence is None else float(divergence),
    )
    if k.use_vllm:
        side = vllm_side(model_config, parameters=arch.total, generation_batch=step.generation_batch,
                         vllm_max_model_length=c.base.get("vllm_max_model_length"), context_bytes=context_bytes,
                         supports_bf16=target.supports_bf16)
        step = replace(step, engine=Mode(k.vllm_mode.value), vllm=side)
    return step


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
