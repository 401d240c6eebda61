"""Online RL's knobs (GRPOConfig / RLOOConfig field names, TRL 1.16), declared once in the knob registry, and
`OnlineKnobs`, their typed view of a candidate with each trainer's TRL default resolved (`num_generations`: GRPO 8,
RLOO 2; `beta`: GRPO 0.0, RLOO 0.05; the knobs declare None: "the trainer's default"). `--fix`, the default space,
the memory order, the report's labels and the emitted keys all come from these declarations; the trainer that
reads them is advisor/trainers/online_rl.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..knobs import FixResult, Home, Kind, Knob, Memory, register_knobs

if TYPE_CHECKING:
    from ..space import Candidate


class VllmMode(str, Enum):
    """Where vLLM generates (GRPOConfig / RLOOConfig `vllm_mode`)."""

    COLOCATE = "colocate"  # in the training processes, a share of each training GPU
    SERVER = "server"  # `trl vllm-serve` on GPUs of its own


ONLINE = frozenset({"grpo", "rloo"})
# the trainers whose step generates on-policy with the same engine knobs (DistillationConfig has these fields under
# the same names: advisor/trainers/distillation.py)
GENERATING = ONLINE | {"distillation"}
_GRPO = frozenset({"grpo"})

# TRL 1.16's defaults where GRPOConfig and RLOOConfig differ (tests/test_grpo_trainer.py reads them back from the
# installed configs); the knobs below declare None for these: "the trainer's own default"
TRL_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"num_generations": 8, "beta": 0.0},
    "rloo": {"num_generations": 2, "beta": 0.05},
    "distillation": {"beta": 1.0},
}

# The reward function the emitted file names when the user gave none: `trl grpo` / `trl rloo` build the trainer from
# `reward_funcs` and `reward_model_name_or_path` (trl/scripts/grpo.py); TRL's get_soft_overlong_punishment reads only
# the completions' token ids, so it runs on plain and conversational prompts alike (think_format_reward needs
# conversational completions). A placeholder the notes name; a reward function runs on the host: no device memory.
DEFAULT_REWARD_FUNCS = ("get_soft_overlong_punishment",)
# trl grpo's reward_funcs registry (trl/scripts/grpo.py `reward_funcs_registry`): the name -> the object it passes
REWARD_REGISTRY = {
    "accuracy_reward": "accuracy_reward",
    "reasoning_accuracy_reward": "reasoning_accuracy_reward",
    "think_format_reward": "think_format_reward",
    "get_soft_overlong_punishment": "get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)",
}
# GRPOScriptArguments / RLOOScriptArguments' own keys (trl/scripts/grpo.py): ride in the candidate's base
SCRIPT_KEYS = ("reward_model_name_or_path", "reward_funcs")


def _carried(name: str, default: Any = None) -> Callable[[Candidate], Any]:
    return lambda c: c.base.get(name, default)


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
    return bool(c.base.get("use_vllm", False))


def _colocated(c: Candidate) -> bool:
    """vLLM in the training processes: what sleep mode and the utilization act on (server mode takes neither from the
    training config: `trl vllm-serve` has its own --gpu-memory-utilization)."""
    return _vllm_on(c) and c.base.get("vllm_mode", VllmMode.COLOCATE.value) == VllmMode.COLOCATE.value


def _served(c: Candidate) -> bool:
    return _vllm_on(c) and c.base.get("vllm_mode", VllmMode.COLOCATE.value) == VllmMode.SERVER.value


def _zero3(c: Candidate) -> bool:
    """DeepSpeed ZeRO-3 shards the policy: the only layout TRL reads ds3_gather_for_generation under
    (trl/models/utils.py unwrap_model_for_generation: gather_deepspeed3_params)."""
    layout = c.parallelism
    return getattr(getattr(getattr(layout, "parallelism", None), "strategy", None), "value", None) == "zero3"


def _vllm_summary(c: Candidate) -> str:
    if not c.base.get("use_vllm", False):
        return "model.generate"
    mode = c.base.get("vllm_mode", "colocate")
    if mode == VllmMode.SERVER.value:
        return f"vLLM server on {c.base.get('vllm_server_gpus', 0)} GPU(s)"
    sleep = " + sleep" if c.base.get("vllm_enable_sleep_mode", False) else ""
    return f"vLLM colocate {c.base.get('vllm_gpu_memory_utilization', 0.3):g}{sleep}"


def _vllm_short(c: Candidate) -> str | None:
    if not c.base.get("use_vllm", False):
        return None
    if c.base.get("vllm_mode", "colocate") == VllmMode.SERVER.value:
        return f"vllm-srv{c.base.get('vllm_server_gpus', 0)}"
    return f"vllm{c.base.get('vllm_gpu_memory_utilization', 0.3):g}" + (
        "+sleep" if c.base.get("vllm_enable_sleep_mode", False) else "")


# GRPOConfig / RLOOConfig's memory knobs (TRL 1.16 field names), in the knob registry (advisor/knobs.py): `--fix`,
# the default space, the memory order, the report's labels and the emitted keys all come from these declarations.
KNOBS = register_knobs(
    Knob("num_generations", Kind.OPTIONAL_INT, None, Home.TRAINER_CONFIG, "num_generations",
         "completions sampled per prompt (a group; the advantages are computed within it). None: the trainer's TRL "
         "default (GRPOConfig 8, RLOOConfig 2)", minimum=1, trainers=ONLINE, carried=True,
         label="num_generations", summary=lambda c: None,
         quality="fewer completions per prompt: noisier group advantages (the user's; never searched)"),
    Knob("max_completion_length", Kind.INT, 512, Home.TRAINER_CONFIG, "max_completion_length",
         "tokens generated per completion at most; the bound the memory is measured at (every completion at this "
         "length)", minimum=1, trainers=GENERATING, carried=True, memory=Memory.GROWS, label="max_completion_length",
         summary=lambda c: str(c.base.get("max_completion_length", 512)),
         short=lambda c: f"C={c.base.get('max_completion_length')}" if "max_completion_length" in c.base.as_dict()
         else None,
         quality="completions cut at max_completion_length (the user's; never searched, never lowered)",
         # use_liger_loss (removed from TRL) is refused by name with what replaced it
         extra_fix={"use_liger_loss": _refuse_liger_loss}),
    Knob("steps_per_generation", Kind.OPTIONAL_INT, None, Home.TRAINER_CONFIG, "steps_per_generation",
         "micro-batches generated in one call (None: gradient_accumulation_steps): the generation batch is "
         "per_device_train_batch_size x steps_per_generation completions per rank. 1 generates each micro-batch "
         "on its own (a smaller KV cache, more generate calls; the same optimizer steps, still on-policy)",
         minimum=1, trainers=ONLINE, carried=True, memory=Memory.UNORDERED, search=(None, 1),
         label="steps_per_generation", summary=lambda c: str(c.base.get("steps_per_generation")),
         short=lambda c: None if c.base.get("steps_per_generation") is None else
         f"spg={c.base.get('steps_per_generation')}"),
    Knob("generation_batch_size", Kind.OPTIONAL_INT, None, Home.TRAINER_CONFIG, "generation_batch_size",
         "completions per generation over every rank (derived from steps_per_generation; never both set)",
         minimum=1, trainers=ONLINE, carried=True, memory=Memory.GROWS),
    Knob("num_iterations", Kind.INT, 1, Home.TRAINER_CONFIG, "num_iterations",
         "optimizer passes over each generation batch (mu); > 1 adds the old policy's no-grad forward",
         minimum=1, trainers=ONLINE, carried=True,
         quality="each generation trained on num_iterations times (off-policy after the first)"),
    Knob("beta", Kind.FLOAT, None, Home.TRAINER_CONFIG, "beta",
         "GRPO / RLOO: the KL coefficient; != 0 keeps a reference (a separate copy, or the adapters disabled under "
         "LoRA). Distillation: the generalized JSD's interpolation in [0, 1] (0 forward KL, 0.5 JSD, 1 reverse KL; no "
         "reference). None: the trainer's TRL default (GRPOConfig 0.0, RLOOConfig 0.05, DistillationConfig 1.0)",
         bounds=(0.0, 1000.0), trainers=GENERATING,
         carried=True, label="beta", summary=lambda c: None),
    Knob("use_vllm", Kind.BOOL, False, Home.TRAINER_CONFIG, "use_vllm",
         "generate with vLLM instead of model.generate (needs a CUDA target and `pip install vllm`)",
         trainers=GENERATING, carried=True, requires="vllm", label="generation", summary=_vllm_summary,
         short=_vllm_short),
    # The generation engine is ONE searched dimension of use_vllm, vllm_mode, vllm_enable_sleep_mode,
    # vllm_server_gpus (and expandable_segments, ds3_gather_for_generation where they go with it): its values are
    # OnlineRLTrainer.search_values (CUDA only for vLLM, server mode only with --num-gpus > 1) and its choices
    # OnlineRLTrainer.joint_dimensions (generate, vLLM colocate, vLLM colocate + sleep with expandable_segments off,
    # vLLM server on k GPUs), so no trial goes to a combination TRL or vLLM refuses.
    Knob("vllm_mode", Kind.ENUM, VllmMode.COLOCATE, Home.TRAINER_CONFIG, "vllm_mode",
         "colocate: vLLM in the training processes; server: `trl vllm-serve` on vllm_server_gpus of --num-gpus",
         enum=VllmMode, active=_vllm_on, trainers=GENERATING, carried=True, memory=Memory.UNORDERED),
    Knob("vllm_gpu_memory_utilization", Kind.FLOAT, 0.3, Home.TRAINER_CONFIG, "vllm_gpu_memory_utilization",
         "the share of each card colocated vLLM claims (weights, activations and its KV pool) outside PyTorch's "
         "allocator. Not a search dimension: derived per candidate (OnlineRLTrainer.derive) as the smallest pool, "
         "rounded up to 0.01, that holds the generation batch at full length (prompt + max_completion_length) by "
         "vLLM's accounting (advisor/_physics/vllm.py min_utilization), never below one max_model_len sequence "
         "(what vLLM needs to start); a --fix of it is kept as given", bounds=(0.0, 1.0), active=_colocated,
         trainers=GENERATING, carried=True, memory=Memory.GROWS),
    Knob("vllm_enable_sleep_mode", Kind.BOOL, False, Home.TRAINER_CONFIG, "vllm_enable_sleep_mode",
         "colocated vLLM sleeps (level 2) while the policy trains, giving its weights and KV pool back; vLLM's "
         "CuMemAllocator refuses expandable segments in PYTORCH_CUDA_ALLOC_CONF (the search turns them off with "
         "it: one choice of the engine dimension)", active=_colocated, trainers=GENERATING, carried=True,
         memory=Memory.SAVES_WHEN_ON),
    Knob("vllm_server_gpus", Kind.INT, 0, Home.ACCELERATE, "vllm_server_gpus",
         "server mode: the GPUs of --num-gpus that run `trl vllm-serve` (CUDA_VISIBLE_DEVICES split; "
         "--tensor-parallel-size); the others train", minimum=0, active=_served, trainers=GENERATING, carried=True),
    Knob("ds3_gather_for_generation", Kind.BOOL, True, Home.TRAINER_CONFIG, "ds3_gather_for_generation",
         "ZeRO-3 gathers the whole policy to generate (False: generates layer by layer, slower, less memory; vLLM "
         "needs True). Read by TRL only under ZeRO-3 (active there; searched, with model.generate, only where the "
         "space offers a ZeRO-3 layout)", active=_zero3, trainers=GENERATING, carried=True, memory=Memory.UNORDERED),
    Knob("cast_lm_head_to_fp32", Kind.BOOL, False, Home.TRAINER_CONFIG, "cast_lm_head_to_fp32",
         "the LM head (and its log-probs) in float32", trainers=_GRPO, carried=True,
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
         trainers=_GRPO, carried=True),
)
KNOB_KEYS = frozenset(k.key for k in KNOBS)


class EngineView:
    """What a knob view of a generating trainer answers from its engine knobs and its generation batch (`steps`,
    `generation_batch_size`: the view's)."""

    def generation_batch(self, candidate: Candidate, world_size: int = 1) -> int:
        """Completions per generation over every rank (TRL's generation_batch_size)."""
        if self.generation_batch_size is not None:
            return self.generation_batch_size
        return candidate.per_device_train_batch_size * world_size * self.steps(candidate)

    @property
    def colocated(self) -> bool:
        return self.use_vllm and VllmMode(self.vllm_mode) is VllmMode.COLOCATE

    @property
    def served(self) -> bool:
        return self.use_vllm and VllmMode(self.vllm_mode) is VllmMode.SERVER


class _OnlineKnobsMethods(EngineView):
    """The online trainers' knobs of a candidate, each trainer's TRL default resolved."""

    trainer: str

    @classmethod
    def of(cls, candidate: Candidate, trainer: str) -> Any:
        b = candidate.base
        own = TRL_DEFAULTS[trainer]
        values = {}
        for f in dataclasses.fields(cls):
            if f.name == "trainer":
                continue
            v = b.get(f.name, f.default)
            values[f.name] = own[f.name] if v is None and f.name in own else v
        return cls(trainer=trainer, **values)

    def apply(self, candidate: Candidate) -> Candidate:
        """The candidate with these knobs in its base (each at its default left out, so a plain candidate stays
        plain; num_generations / beta at the trainer's default too)."""
        base = candidate.base.as_dict()
        own = TRL_DEFAULTS[self.trainer]
        for f in dataclasses.fields(self):
            if f.name == "trainer":
                continue
            value = getattr(self, f.name)
            if value == f.default or (f.name in own and value == own[f.name]):
                base.pop(f.name, None)
            else:
                base[f.name] = value.value if isinstance(value, Enum) else value
        return candidate.replace(base=base)

    def steps(self, candidate: Candidate) -> int:
        """steps_per_generation as TRL resolves it (GRPOConfig.__post_init__), on one rank."""
        if self.steps_per_generation is not None:
            return self.steps_per_generation
        if self.generation_batch_size is not None:
            return max(1, self.generation_batch_size // candidate.per_device_train_batch_size)
        return candidate.gradient_accumulation_steps

    def separate_reference(self, candidate: Candidate) -> bool:
        """GRPOTrainer.__init__: beta 0 keeps no reference; PEFT disables the adapters; else a second copy."""
        return self.beta != 0.0 and not candidate.use_lora

    def old_policy_forward(self, candidate: Candidate) -> bool:
        """GRPOTrainer._generate_and_score_completions: the old policy's no-grad forward runs when generation is
        misaligned with the optimizer step, or vLLM's importance-sampling correction is on; RLOOTrainer's always
        (`old_logps_always`)."""
        from .base import get_trainer

        if getattr(get_trainer(self.trainer), "old_logps_always", False):
            return True  # RLOOTrainer._generate_and_score_completions: always, for its clipped ratio
        every = self.steps(candidate) * self.num_iterations
        correction = self.use_vllm and self.vllm_importance_sampling_correction
        return candidate.gradient_accumulation_steps % every != 0 or correction


def check_view(view: Any, knobs: tuple[Knob, ...], context: str) -> None:
    """A knob view's values checked against their declarations (one ConfigError naming every bad one), then its
    enum knobs stored as their enums."""
    problems = []
    for k in knobs:
        v = getattr(view, k.name)
        if k.kind is Kind.BOOL:
            if not isinstance(v, bool):
                problems.append(f"{k.name}={v!r}: must be true or false")
        elif v is not None:
            problems.extend(p for p in [k.coerce(v)[1]] if p)
    if problems:
        raise ConfigError(problems, context=context)
    for k in knobs:
        v = getattr(view, k.name)
        if k.enum is not None and v is not None:
            object.__setattr__(view, k.name, k.enum(v))


def _check(self: Any) -> None:
    check_view(self, KNOBS, self.trainer)


OnlineKnobs = dataclasses.make_dataclass(
    "OnlineKnobs",
    [("trainer", str)] + [(k.name, Any, dataclasses.field(default=k.default)) for k in KNOBS],
    bases=(_OnlineKnobsMethods,), frozen=True, namespace={"__post_init__": _check, "__module__": __name__})
OnlineKnobs.__doc__ = _OnlineKnobsMethods.__doc__
