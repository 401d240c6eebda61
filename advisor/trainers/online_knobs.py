"""Online RL's knobs and TRL's rules on them: the knobs under GRPOConfig / RLOOConfig's field names (TRL 1.16),
declared once; `OnlineKnobs`, their typed view of a candidate (each trainer's view, grpo.py / rloo.py, adds its TRL
defaults where the two configs differ: `num_generations` GRPO 8, RLOO 2; `beta` GRPO 0.0, RLOO 0.05; the knobs
declare None: "the trainer's default"); and `problems` / `world_problems`, GRPOConfig / RLOOConfig's rules exactly as
strict. `--fix`, the default space, the memory order, the report's labels and the emitted keys all come from these
declarations; the trainer registers the view (online_trainer.py)."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

from ..knobs import FixResult, Home, Kind, Knob, KnobView, Memory, knob_view

if TYPE_CHECKING:
    from ..space import Candidate
    from ..workload import GPUSpec


class VllmMode(str, Enum):
    """Where vLLM generates (GRPOConfig / RLOOConfig `vllm_mode`)."""

    COLOCATE = "colocate"  # in the training processes, a share of each training GPU
    SERVER = "server"  # `trl vllm-serve` on GPUs of its own




def _value(c: Candidate, name: str) -> Any:
    """A knob's value on `c`, its declared default where the base does not carry it (each default in one place)."""
    return c.base.get(name, _DEFAULTS[name])


def _refuse_liger_loss(key: str, text: str) -> FixResult:
    return FixResult(problem=LIGER_LOSS_GONE.format(where=f"--fix {key}={text}"))


LIGER_LOSS_GONE = (
    "{where}: `use_liger_loss` was removed from TRL (GRPOConfig 1.16 has no such field). It was replaced by "
    "`use_liger_kernel`, itself deprecated in TRL 1.16: GRPOTrainer / RLOOTrainer compute the loss with their own "
    "chunked log-prob head over the completion tokens (no [B, T, V] logits, what Liger's fused loss saved) and "
    "apply only Liger's layer kernels; for fused kernels use the Hub kernels, `model_init_kwargs: {{use_kernels: "
    "true}}`. Remove use_liger_loss"
)


def _vllm_on(c: Candidate) -> bool:
    return bool(_value(c, "use_vllm"))


def _colocated(c: Candidate) -> bool:
    """vLLM in the training processes: what sleep mode and the utilization act on (server mode takes neither from the
    training config: `trl vllm-serve` has its own --gpu-memory-utilization)."""
    return _vllm_on(c) and VllmMode(_value(c, "vllm_mode")) is VllmMode.COLOCATE


def _served(c: Candidate) -> bool:
    return _vllm_on(c) and VllmMode(_value(c, "vllm_mode")) is VllmMode.SERVER


def _zero3(c: Candidate) -> bool:
    """DeepSpeed ZeRO-3 shards the policy: the only layout TRL reads ds3_gather_for_generation under
    (trl/models/utils.py unwrap_model_for_generation: gather_deepspeed3_params)."""
    layout = c.parallelism
    return getattr(getattr(getattr(layout, "parallelism", None), "strategy", None), "value", None) == "zero3"


def _vllm_summary(c: Candidate) -> str:
    if not _vllm_on(c):
        return "model.generate"
    if _served(c):
        return f"vLLM server on {_value(c, 'vllm_server_gpus')} GPU(s)"
    sleep = " + sleep" if _value(c, "vllm_enable_sleep_mode") else ""
    return f"vLLM colocate {_value(c, 'vllm_gpu_memory_utilization'):g}{sleep}"


def _vllm_short(c: Candidate) -> str | None:
    if not _vllm_on(c):
        return None
    if _served(c):
        return f"vllm-srv{_value(c, 'vllm_server_gpus')}"
    sleep = "+sleep" if _value(c, "vllm_enable_sleep_mode") else ""
    return f"vllm{_value(c, 'vllm_gpu_memory_utilization'):g}{sleep}"


# GRPOConfig / RLOOConfig's memory knobs (TRL 1.16 field names), registered in the knob registry (advisor/knobs.py)
# with the trainers: `--fix`, the default space, the memory order, the report's labels and the emitted keys all come
# from these declarations. A trainer takes those its config class has (cast_lm_head_to_fp32 and
# vllm_importance_sampling_correction are GRPOConfig's only).
KNOBS = (
    Knob("num_generations", Kind.OPTIONAL_INT, None, Home.TRAINER_CONFIG, "num_generations",
         "completions sampled per prompt (a group; the advantages are computed within it). None: the trainer's TRL "
         "default (GRPOConfig 8, RLOOConfig 2)", minimum=1, carried=True,
         label="num_generations", summary=lambda c: None,
         quality="fewer completions per prompt: noisier group advantages (the user's; never searched)"),
    Knob("max_completion_length", Kind.INT, 512, Home.TRAINER_CONFIG, "max_completion_length",
         "tokens generated per completion at most; the bound the memory is measured at (every completion at this "
         "length)", minimum=1, carried=True, memory=Memory.GROWS, label="max_completion_length",
         summary=lambda c: str(_value(c, "max_completion_length")),
         short=lambda c: f"C={c.base.get('max_completion_length')}" if "max_completion_length" in c.base.as_dict()
         else None,
         quality="completions cut at max_completion_length (the user's; never searched, never lowered)",
         # use_liger_loss (removed from TRL) is refused by name with what replaced it
         extra_fix={"use_liger_loss": _refuse_liger_loss}),
    Knob("steps_per_generation", Kind.OPTIONAL_INT, None, Home.TRAINER_CONFIG, "steps_per_generation",
         "micro-batches generated in one call (None: gradient_accumulation_steps): the generation batch is "
         "per_device_train_batch_size x steps_per_generation completions per rank. 1 generates each micro-batch "
         "on its own (a smaller KV cache, more generate calls; the same optimizer steps, still on-policy)",
         minimum=1, carried=True, memory=Memory.UNORDERED, search=(None, 1), emit_none=False,
         label="steps_per_generation", summary=lambda c: str(c.base.get("steps_per_generation")),
         short=lambda c: None if c.base.get("steps_per_generation") is None else
         f"spg={c.base.get('steps_per_generation')}"),
    Knob("generation_batch_size", Kind.OPTIONAL_INT, None, Home.TRAINER_CONFIG, "generation_batch_size",
         "completions per generation over every rank (derived from steps_per_generation; never both set)",
         minimum=1, carried=True, memory=Memory.GROWS, emit_none=False),
    Knob("num_iterations", Kind.INT, 1, Home.TRAINER_CONFIG, "num_iterations",
         "optimizer passes over each generation batch (mu); > 1 adds the old policy's no-grad forward",
         minimum=1, carried=True,
         quality="each generation trained on num_iterations times (off-policy after the first)"),
    Knob("beta", Kind.FLOAT, None, Home.TRAINER_CONFIG, "beta",
         "the KL coefficient; != 0 keeps a reference (a separate copy, or the adapters disabled under LoRA). None: "
         "the trainer's TRL default (GRPOConfig 0.0, RLOOConfig 0.05)", bounds=(0.0, 1000.0),
         carried=True, label="beta", summary=lambda c: None),
    Knob("use_vllm", Kind.BOOL, False, Home.TRAINER_CONFIG, "use_vllm",
         "generate with vLLM instead of model.generate (needs a CUDA target and `pip install vllm`)",
         carried=True, requires="vllm", label="generation", summary=_vllm_summary,
         short=_vllm_short),
    # The generation engine is ONE searched dimension of use_vllm, vllm_mode, vllm_enable_sleep_mode,
    # vllm_server_gpus (and expandable_segments, ds3_gather_for_generation where they go with it): its values are
    # online_space.search_values (CUDA only for vLLM, server mode only with --num-gpus > 1) and its choices
    # online_space.joint_dimensions (generate, vLLM colocate, vLLM colocate + sleep with expandable_segments off,
    # vLLM server on k GPUs), so no trial goes to a combination TRL or vLLM refuses.
    Knob("vllm_mode", Kind.ENUM, VllmMode.COLOCATE, Home.TRAINER_CONFIG, "vllm_mode",
         "colocate: vLLM in the training processes; server: `trl vllm-serve` on vllm_server_gpus of --num-gpus",
         enum=VllmMode, active=_vllm_on, carried=True, memory=Memory.UNORDERED),
    Knob("vllm_gpu_memory_utilization", Kind.FLOAT, 0.3, Home.TRAINER_CONFIG, "vllm_gpu_memory_utilization",
         "the share of each card colocated vLLM claims (weights, activations and its KV pool) outside PyTorch's "
         "allocator. Not a search dimension: derived per candidate (online_space.derive) as the smallest pool, "
         "rounded up to 0.01, that holds the generation batch at full length (prompt + max_completion_length) by "
         "vLLM's accounting (advisor/physics/vllm.py min_utilization), never below one max_model_len sequence "
         "(what vLLM needs to start); a --fix of it is kept as given", bounds=(0.0, 1.0), active=_colocated,
         carried=True, memory=Memory.GROWS),
    Knob("vllm_enable_sleep_mode", Kind.BOOL, False, Home.TRAINER_CONFIG, "vllm_enable_sleep_mode",
         "colocated vLLM sleeps (level 2) while the policy trains, giving its weights and KV pool back; vLLM's "
         "CuMemAllocator refuses expandable segments in PYTORCH_CUDA_ALLOC_CONF (the search turns them off with "
         "it: one choice of the engine dimension)", active=_colocated, carried=True,
         memory=Memory.SAVES_WHEN_ON),
    Knob("vllm_server_gpus", Kind.INT, 0, Home.ACCELERATE, "vllm_server_gpus",
         "server mode: the GPUs of --num-gpus that run `trl vllm-serve` (CUDA_VISIBLE_DEVICES split; "
         "--tensor-parallel-size); the others train", minimum=0, active=_served, carried=True),
    Knob("ds3_gather_for_generation", Kind.BOOL, True, Home.TRAINER_CONFIG, "ds3_gather_for_generation",
         "ZeRO-3 gathers the whole policy to generate (False: generates layer by layer, slower, less memory; vLLM "
         "needs True). Read by TRL only under ZeRO-3 (active there; searched, with model.generate, only where the "
         "space offers a ZeRO-3 layout)", active=_zero3, carried=True, memory=Memory.UNORDERED),
    Knob("cast_lm_head_to_fp32", Kind.BOOL, False, Home.TRAINER_CONFIG, "cast_lm_head_to_fp32",
         "the LM head (and its log-probs) in float32", carried=True,
         # never searched (search=None): GRPOConfig 1.16's help says it casts "the language modeling head of the
         # policy and reference models to float32. As recommended by the ScaleRL recipe" (arXiv 2510.13786): the
         # log-probs, hence the importance ratios and the loss, change numerically; a quality decision, the user's
         # (--fix cast_lm_head_to_fp32=true). TRL supports it only with untied embeddings (tie_word_embeddings
         # False) and not with a LoRA adapter on lm_head (GRPOTrainer.__init__ raises)
         quality="the LM head's log-probs in float32 change the numerics of the ratios and the loss (ScaleRL's "
                 "recommendation; the user's, never searched)"),
    Knob("vllm_importance_sampling_correction", Kind.BOOL, True, Home.TRAINER_CONFIG,
         "vllm_importance_sampling_correction",
         "with vLLM: the old policy's no-grad forward on the completions, to correct vLLM's sampling mismatch",
         carried=True),
)
_DEFAULTS = {k.name: k.default for k in KNOBS}


class _OnlineKnobsMethods(KnobView):
    """The online trainers' knobs of a candidate, each trainer's TRL default resolved (its view's `DEFAULTS`)."""

    old_logps_always: ClassVar[bool] = False  # the scoring runs the old policy's forward every generation (RLOO)
    # the loss is a divergence against a teacher at this beta (distillation's view); None: the log-prob loss
    divergence_beta: ClassVar[float | None] = None

    @property
    def kl_beta(self) -> float:
        """The KL coefficient against a reference (GRPOConfig / RLOOConfig `beta`): != 0 keeps one."""
        return float(self.beta)

    def steps(self, candidate: Candidate) -> int:
        """steps_per_generation as TRL resolves it (GRPOConfig.__post_init__), on one rank."""
        if self.steps_per_generation is not None:
            return self.steps_per_generation
        if self.generation_batch_size is not None:
            return max(1, self.generation_batch_size // candidate.per_device_train_batch_size)
        return candidate.gradient_accumulation_steps

    def generation_batch(self, candidate: Candidate, world_size: int = 1) -> int:
        """Completions per generation over every rank (TRL's generation_batch_size)."""
        if self.generation_batch_size is not None:
            return self.generation_batch_size
        return candidate.per_device_train_batch_size * world_size * self.steps(candidate)

    @property
    def colocated(self) -> bool:
        return self.use_vllm and self.vllm_mode is VllmMode.COLOCATE

    @property
    def served(self) -> bool:
        return self.use_vllm and self.vllm_mode is VllmMode.SERVER

    def separate_reference(self, candidate: Candidate) -> bool:
        """GRPOTrainer.__init__: beta 0 keeps no reference; PEFT disables the adapters; else a second copy."""
        return self.kl_beta != 0.0 and not candidate.use_lora

    def old_policy_forward(self, candidate: Candidate) -> bool:
        """GRPOTrainer._generate_and_score_completions: the old policy's no-grad forward runs when generation is
        misaligned with the optimizer step, or vLLM's importance-sampling correction is on; RLOOTrainer's always
        (`old_logps_always`)."""
        if self.old_logps_always:
            return True  # RLOOTrainer._generate_and_score_completions: always, for its clipped ratio
        every = self.steps(candidate) * self.num_iterations
        correction = self.use_vllm and self.vllm_importance_sampling_correction
        return candidate.gradient_accumulation_steps % every != 0 or correction


OnlineKnobs = knob_view("OnlineKnobs", KNOBS, _OnlineKnobsMethods, __name__)


# ---- TRL's rules (GRPOConfig / RLOOConfig.__post_init__, GRPOTrainer.__init__, vLLM), exactly as strict ----------
def problems(config: str, trainer: str, c: Candidate, k: Any, gpu: GPUSpec | None) -> list[str]:
    """Every rule of `config` (GRPOConfig / RLOOConfig) and vLLM that `c` breaks on one rank (the generation batch of
    this GPU), with the fix; `trainer` names the trainer as TRL's messages do, `k` is its view of `c`."""
    out = []
    if c.base.get("auto_find_batch_size"):
        out.append(f"auto_find_batch_size=True: {config} raises \"auto_find_batch_size is not supported by "
                   f"{trainer.upper()}, because the generation batch must contain full prompt groups of "
                   "num_generations completions\"; set auto_find_batch_size: false and let the advisor pick "
                   "per_device_train_batch_size")
    if "use_liger_loss" in c.base.as_dict():
        out.append(LIGER_LOSS_GONE.format(where=f"use_liger_loss={c.base.get('use_liger_loss')!r}"))
    if k.num_generations < 2:
        out.append(f"num_generations={k.num_generations}: {config} raises \"{trainer.upper()} requires at least 2 "
                   "generations per prompt to calculate the advantages\"; set num_generations >= 2")
    out.extend(_batch_problems(config, c, k))
    out.extend(engine_problems(c, k, gpu))
    if k.cast_lm_head_to_fp32 and c.use_lora and c.lora_target_modules and "lm_head" in c.lora_target_modules:
        out.append("cast_lm_head_to_fp32=True with LoRA on lm_head: GRPOTrainer raises \"`cast_lm_head_to_fp32"
                   "=True` is not supported when the lm_head carries a PEFT adapter\"; drop lm_head from "
                   "lora_target_modules or set cast_lm_head_to_fp32: false")
    return out


def _batch_problems(config: str, c: Candidate, k: Any) -> list[str]:
    """The generation batch: one of generation_batch_size / steps_per_generation, whole groups of num_generations."""
    b = c.per_device_train_batch_size
    if k.generation_batch_size is not None and k.steps_per_generation is not None:
        return [f"generation_batch_size={k.generation_batch_size} with steps_per_generation="
                f"{k.steps_per_generation}: {config} raises \"'generation_batch_size' and 'steps_per_generation' "
                "can not be both configured at the same time\"; set one of them"]
    if k.generation_batch_size is not None and k.generation_batch_size % b:
        return [f"generation_batch_size={k.generation_batch_size}: {config} raises \"generation_batch_size "
                f"({k.generation_batch_size}) must be divisible by the global batch size ({b})\"; use a "
                f"multiple of per_device_train_batch_size x GPUs"]
    gen = k.generation_batch(c)
    if gen % k.num_generations == 0:
        return []
    spg = "steps_per_generation" if k.steps_per_generation is not None else (
        "generation_batch_size" if k.generation_batch_size is not None else
        "gradient_accumulation_steps (steps_per_generation unset)")
    return [f"num_generations={k.num_generations}: {config} raises \"generation_batch_size ({gen}) must "
            f"be divisible by num_generations ({k.num_generations})\" (the generation batch is "
            f"per_device_train_batch_size {b} x {spg} {k.steps(c)} x GPUs); make "
            f"per_device_train_batch_size x steps_per_generation a multiple of {k.num_generations}, "
            "or use a num_generations that divides it"]


def engine_problems(c: Candidate, k: Any, gpu: GPUSpec | None) -> list[str]:
    """vLLM's rules: CUDA only, server mode's own GPUs, sleep mode's allocator, ZeRO-3's gathered weights."""
    out = []
    if k.use_vllm and gpu is not None and not gpu.is_cuda:
        out.append(f"use_vllm=True on {gpu.name}: vLLM generates on CUDA GPUs only; set use_vllm: false "
                   "(model.generate) for this target")
    if k.served and k.vllm_server_gpus < 1:
        out.append(f"vllm_mode='server' with vllm_server_gpus={k.vllm_server_gpus}: server mode runs `trl "
                   "vllm-serve` on GPUs of its own and none is set aside; give it K of --num-gpus (--fix "
                   "vllm_server_gpus=K, K < --num-gpus: the others train), or set vllm_mode: colocate")
    if not k.served and k.vllm_server_gpus:
        out.append(f"vllm_server_gpus={k.vllm_server_gpus} without vllm_mode='server' (use_vllm="
                   f"{k.use_vllm}): only server mode sets GPUs aside for vLLM; drop it or set use_vllm: true, "
                   "vllm_mode: server")
    if k.colocated and k.vllm_enable_sleep_mode and c.expandable_segments:
        out.append("vllm_enable_sleep_mode=True with expandable_segments=True: vLLM's CuMemAllocator "
                   "(vllm/device_allocator/cumem.py) asserts \"Expandable segments are not compatible with "
                   "memory pool\" when PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True; set "
                   "expandable_segments: false (--fix expandable_segments=false) or vllm_enable_sleep_mode: false")
    if k.use_vllm and not k.ds3_gather_for_generation:
        out.append("ds3_gather_for_generation=False with use_vllm=True: TRL syncs the whole policy's weights to "
                   "vLLM and needs them gathered; set ds3_gather_for_generation: true or use_vllm: false")
    return out


def world_problems(k: Any, num_gpus: int) -> list[str]:
    """TRL's rules that need the world size: server mode leaves at least one of --num-gpus to train."""
    if k.served and k.vllm_server_gpus >= num_gpus:
        return [f"vllm_mode='server' with vllm_server_gpus={k.vllm_server_gpus} of --num-gpus {num_gpus}: "
                "no GPU is left to train; give vLLM fewer (--fix vllm_server_gpus=K, K < --num-gpus), add "
                "GPUs, or set vllm_mode: colocate"]
    return []
