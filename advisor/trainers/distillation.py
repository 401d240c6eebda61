"""Distillation: `trl.DistillationTrainer` / `trl.DistillationConfig`, parsed by `trl distillation`.

On-policy knowledge distillation as TRL 1.16 runs it (trl/trainer/distillation_trainer.py `_prepare_inputs`,
`_generate_and_score_completions`, `compute_loss`, `_compute_loss`):
- generate: every `gradient_accumulation_steps` micro-steps the local generation batch, `per_device_train_batch_size x
  gradient_accumulation_steps` prompts with ONE completion each (1.16 has no `num_generations`, no `lmbda` / `seq_kd`
  mixing: every completion is the student's own, sampled at `temperature`), goes through the student's
  `model.generate` in one call, or through vLLM (colocated or served; the same engine knobs under the same names as
  GRPO's: online_knobs.py). The teacher and the student's training state stay resident.
- score: nothing is scored (TRL keeps GRPO's method name): the completions are padded and buffered.
- train, per micro-batch: the student's backbone with grad (not its LM head: `_get_last_hidden_state` calls
  `base_model`), the teacher's backbone under `no_grad`, then the generalized Jensen-Shannon divergence (`beta`: 0
  forward KL, 1 reverse KL, between them the JSD with a second pass) over the whole vocabulary at `temperature` by
  trl/kernels/chunked_divergence.py `ChunkedDivergenceFunction`: both models' hidden states of the completion tokens
  projected through their own LM heads onto float32 tiles of [min(N, 4096), 32768] (N the micro-batch's completion
  tokens; the [N, V] logits are never materialised), the backward projecting them again and accumulating the
  student head's weight gradient in float32 ([V, H]) and the hidden states' ([N, H]).

The teacher is the workload's (`--teacher`, written as `teacher_model_name_or_path`); `trl distillation` loads it with
ModelConfig's dtype and attention implementation under `teacher_model_init_kwargs` (this module's `teacher_dtype`
knob writes the dtype there). It must share the student's vocabulary (DistillationTrainer raises otherwise; the
Workload refuses it first) and may be of another width or depth. The step, the search (the generation engine as one
dimension, colocated vLLM's share derived), the server split and the allocator variables are online_rl.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

from .._candidate import WeightsDtype
from ..errors import ConfigError
from ..knobs import Home, Kind, Knob, Memory, register_knobs
from .base import field_names, register
from .online_knobs import KNOBS as _ONLINE_KNOBS
from .online_knobs import LIGER_LOSS_GONE, TRL_DEFAULTS, EngineView, check_view
from .online_rl import OnlineRLTrainer, allocator_env, engine_rules

if TYPE_CHECKING:
    from ..space import Candidate
    from ..workload import GPUSpec, Workload

_DISTILLATION = frozenset({"distillation"})
TEACHER_KEYS = ("teacher_model_name_or_path", "teacher_model_init_kwargs")


def _teacher_summary(c: Candidate) -> str:
    dtype = c.base.get("teacher_dtype")
    return f"resident, loaded in {getattr(dtype, 'value', dtype)}" if dtype else \
        "resident, loaded in ModelConfig's dtype (as the student)"


# DistillationConfig's memory knobs that online RL has no name for, in the knob registry (advisor/knobs.py)
KNOBS = register_knobs(
    Knob("teacher_dtype", Kind.OPTIONAL_ENUM, None, Home.MODEL_INIT_KWARGS, "teacher_dtype",
         "the dtype the teacher is loaded in: `teacher_model_init_kwargs: {dtype: ...}` (None: `trl distillation` "
         "loads it in ModelConfig's dtype, the student's). The teacher is resident all step (its weights, not "
         "trained: no gradient, no optimizer state) and its forward computes in that dtype (no autocast reaches the "
         "training pass). Searched (None or bfloat16, `Distillation.search_values`) where the teacher's checkpoint "
         "is stored in bfloat16 (its config's torch_dtype: loading it in bfloat16 holds the checkpoint's own "
         "weights) or the goals allow low-precision weights; else pinned by --fix only",
         enum=WeightsDtype, trainers=_DISTILLATION, carried=True, memory=Memory.UNORDERED,
         label="teacher", summary=_teacher_summary,
         short=lambda c: None if c.base.get("teacher_dtype") is None else
         f"teacher={getattr(c.base.get('teacher_dtype'), 'value', c.base.get('teacher_dtype'))}",
         quality="the teacher's forward in 16 bits: its next-token distribution, the student's target, computed in "
                 "16-bit matmuls (and from 16-bit weights where its checkpoint is float32)"),
)
# the online knobs DistillationConfig has under the same names (declared once in online_knobs.py)
_SHARED = tuple(k for k in _ONLINE_KNOBS if k.accepts("distillation"))
_VIEW = (*_SHARED, *KNOBS)


class _DistillationKnobsMethods(EngineView):
    """DistillationConfig's memory knobs of a candidate, TRL 1.16's defaults resolved (`beta` 1.0: reverse KL). What
    the online trainers' shared parts read of GRPO's view is answered as DistillationTrainer runs: one completion per
    prompt, generated every gradient_accumulation_steps micro-steps, no reference, no old-policy forward."""

    num_generations = 1
    steps_per_generation = None  # DistillationConfig has none: the generation batch is the effective batch
    generation_batch_size = None
    num_iterations = 1
    vllm_importance_sampling_correction = False
    cast_lm_head_to_fp32 = False

    @classmethod
    def of(cls, candidate: Candidate) -> Any:
        b = candidate.base
        values = {f.name: b.get(f.name, f.default) for f in dataclasses.fields(cls)}
        if values["beta"] is None:
            values["beta"] = TRL_DEFAULTS["distillation"]["beta"]
        return cls(**values)

    def apply(self, candidate: Candidate) -> Candidate:
        """The candidate with these knobs in its base (each at its default left out, beta at TRL's 1.0 too)."""
        base = candidate.base.as_dict()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default or (f.name == "beta" and value == TRL_DEFAULTS["distillation"]["beta"]):
                base.pop(f.name, None)
            else:
                base[f.name] = value.value if isinstance(value, Enum) else value
        return candidate.replace(base=base)

    def steps(self, candidate: Candidate) -> int:
        """Micro-steps per generation: gradient_accumulation_steps (`_prepare_inputs`: `generate_every`)."""
        return candidate.gradient_accumulation_steps

    def separate_reference(self, candidate: Candidate) -> bool:
        return False  # beta selects the divergence; there is no reference model

    def old_policy_forward(self, candidate: Candidate) -> bool:
        return False


def _check(self: Any) -> None:
    check_view(self, _VIEW, "distillation")


DistillationKnobs = dataclasses.make_dataclass(
    "DistillationKnobs", [(k.name, Any, dataclasses.field(default=k.default)) for k in _VIEW],
    bases=(_DistillationKnobsMethods,), frozen=True, namespace={"__post_init__": _check, "__module__": __name__})
DistillationKnobs.__doc__ = _DistillationKnobsMethods.__doc__


class Distillation(OnlineRLTrainer):
    """On-policy distillation on prompt-only data (prompts.PromptDataset), the teacher resident."""

    name = "distillation"
    command = "distillation"
    config_name, trainer_name, config_label = "DistillationConfig", "DistillationTrainer", "Distillation"
    example_dataset = "trl-lib/ultrafeedback-prompt"
    takes_reward_model = False
    takes_teacher = True  # a Workload's teacher (--teacher) is this trainer's, and it needs one
    # compute_loss runs the backbones through TRL's _ForwardRedirection, which swaps out the forward accelerate
    # wrapped in autocast: the training passes compute in the weights' dtype (generation alone under autocast)
    train_autocast = False

    def knobs(self, candidate: Candidate) -> Any:
        return DistillationKnobs.of(candidate)

    # ---- rules ------------------------------------------------------------------------------------------------
    def _rules(self, c: Candidate, k: Any, gpu: GPUSpec | None) -> list[str]:
        out = []
        if not 0.0 <= k.beta <= 1.0:
            out.append(f"beta={k.beta:g}: DistillationConfig raises \"beta must be in [0.0, 1.0]\" (0 forward KL, 0.5 "
                       "JSD, 1 reverse KL); set beta in [0, 1]")
        if c.base.get("auto_find_batch_size"):
            out.append("auto_find_batch_size=True: the advisor picks per_device_train_batch_size for the memory and "
                       "writes auto_find_batch_size: false (transformers would retry smaller batches after an OOM, "
                       "another run than the one measured); set auto_find_batch_size: false")
        if "use_liger_loss" in c.base.as_dict():
            out.append(LIGER_LOSS_GONE.format(where=f"use_liger_loss={c.base.get('use_liger_loss')!r}"))
        if c.use_lora and c.lora_target_modules and "lm_head" in c.lora_target_modules:
            out.append("LoRA on lm_head: DistillationTrainer raises \"Applying a PEFT adapter to `lm_head` is not "
                       "supported\" (the loss reads lm_head.weight directly); drop lm_head from lora_target_modules")
        init = c.base.get("teacher_model_init_kwargs") or {}
        if isinstance(init, Mapping) and init.get("quantization_config") is not None:
            out.append("teacher_model_init_kwargs.quantization_config: a quantized teacher is not measured by the "
                       "advisor (its bitsandbytes weights and dequantised forward); drop it, or load the teacher in "
                       "16 bits with --fix teacher_dtype=bfloat16")
        out.extend(engine_rules(c, k, gpu))
        return out

    # ---- the search space ---------------------------------------------------------------------------------------
    def search_values(self, workload: Workload, values: Mapping[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
        """The generation engine's values (online_rl.py), and the teacher's dtype: ModelConfig's or bfloat16 where
        the teacher's checkpoint is stored in bfloat16 (loading it so keeps its own weights; float32 only upcasts
        them) or the goals allow low-precision weights; ModelConfig's alone otherwise."""
        out = super().search_values(workload, values)
        teacher = workload.teacher
        stored = str((teacher.config.get("text_config") or teacher.config).get("torch_dtype")
                     or teacher.config.get("dtype") or "") if teacher is not None else ""
        if stored == WeightsDtype.BFLOAT16.value or workload.goals.allow_low_precision_weights:
            out["teacher_dtype"] = (None, WeightsDtype.BFLOAT16)
        return out

    # ---- the step's knobs, as the physics takes them ------------------------------------------------------------
    def step_knobs(self, candidate: Candidate) -> dict[str, Any]:
        """One completion per prompt, generated every gradient_accumulation_steps micro-steps (steps_per_generation
        None: the physics reads GA), no KL reference (`beta` 0 for the physics) and no old-policy forward; the loss
        is the divergence against the teacher (`divergence_beta`: DistillationConfig's beta)."""
        k = self.knobs(candidate)
        return dict(steps_per_generation=None, generation_batch_size=None, num_generations=1, num_iterations=1,
                    beta=0.0, use_vllm=bool(k.use_vllm), vllm_mode=k.vllm_mode.value,
                    vllm_enable_sleep_mode=bool(k.vllm_enable_sleep_mode),
                    vllm_gpu_memory_utilization=float(k.vllm_gpu_memory_utilization),
                    vllm_importance_sampling_correction=False,
                    vllm_max_model_length=candidate.base.get("vllm_max_model_length"),
                    ds3_gather_for_generation=bool(k.ds3_gather_for_generation), cast_lm_head_to_fp32=False,
                    old_logps_always=False, loss="divergence", divergence_beta=float(k.beta))

    def teacher_dtype(self, candidate: Candidate) -> str:
        """The teacher's dtype as `trl distillation` loads it: teacher_model_init_kwargs' dtype over ModelConfig's."""
        chosen = self.knobs(candidate).teacher_dtype
        return (chosen or candidate.weights_dtype).value

    # ---- config ------------------------------------------------------------------------------------------------
    def own_config_kwargs(self, candidate: Candidate, knobs: Any, fields: set[str], workload: Workload | None, *,
                          measured: bool) -> dict[str, Any]:
        """DistillationConfig's memory knobs, the teacher's name (the workload's --teacher, else the config's) and,
        when the teacher's dtype is pinned or the run is measured, `teacher_model_init_kwargs` as `trl distillation`
        builds it (ModelConfig's dtype and attention implementation, under the pinned dtype)."""
        k = knobs
        out: dict[str, Any] = {kn.key: _plain(getattr(k, kn.name)) for kn in _SHARED if kn.key in fields}
        teacher = self.teacher_name(candidate, workload)
        if teacher:
            out["teacher_model_name_or_path"] = teacher
        init = self._teacher_init_kwargs(candidate, resolved=measured)
        if init:
            out["teacher_model_init_kwargs"] = init
        return out

    def _teacher_init_kwargs(self, candidate: Candidate, *, resolved: bool) -> dict[str, Any]:
        """The user's teacher_model_init_kwargs with the knob's dtype; `resolved`: with the dtype and attention
        implementation `trl distillation` adds from ModelConfig (what a measured run and the snippet pass)."""
        init = dict(candidate.base.get("teacher_model_init_kwargs") or {})
        init.pop("dtype", None)
        chosen = self.knobs(candidate).teacher_dtype
        if resolved:
            if candidate.attn_implementation is not None:
                init.setdefault("attn_implementation", candidate.attn_implementation.value)
            init["dtype"] = self.teacher_dtype(candidate)
        elif chosen is not None:
            init["dtype"] = chosen.value
        return init

    def teacher_name(self, candidate: Candidate, workload: Workload | None = None) -> str | None:
        if workload is not None and workload.teacher is not None:
            return workload.teacher.name
        return candidate.base.get("teacher_model_name_or_path")

    def written_keys(self) -> frozenset[str]:
        return frozenset(k.key for k in _VIEW) | frozenset(TEACHER_KEYS)

    def own_keys(self) -> set[str]:
        from trl import SFTConfig

        return field_names(self.config_class()) - field_names(SFTConfig)

    def emit_kwargs(self, candidate: Candidate, workload: Workload | None = None) -> dict[str, Any]:
        """The config kwargs of the snippet and the config object: the YAML's, with the teacher's init kwargs as
        `trl distillation` resolves them from ModelConfig (a DistillationTrainer built in Python would load the
        teacher in float32 without them)."""
        out = self.config_kwargs(candidate, workload)
        out["teacher_model_init_kwargs"] = self._teacher_init_kwargs(candidate, resolved=True)
        return out

    def script_kwargs(self, candidate: Candidate, workload: Workload | None = None) -> dict[str, Any]:
        return {}  # ScriptArguments only: the teacher is DistillationConfig's

    def trainer_kwargs(self, workload: Workload, candidate: Candidate) -> dict[str, Any]:
        return {}  # the teacher is the probe's and the simulator's to add (loaded by path / built on meta)

    def script_keys(self) -> frozenset[str]:
        return frozenset()

    def run_config_dict(self, candidate: Candidate, *, model_name_or_path: str | None,
                        dataset_name: str | None = None, workload: Workload | None = None) -> dict[str, Any]:
        """The keys `trl distillation --config FILE` accepts: ScriptArguments, DistillationConfig (the teacher's name
        and, when pinned, its dtype), ModelConfig, and `env:` with both allocator variables."""
        from .base import run_config_for

        out = run_config_for(self, candidate, model_name_or_path=model_name_or_path, dataset_name=dataset_name,
                             output_dir=f"advisor-{self.name}", workload=workload)
        teacher = self.teacher_name(candidate, workload)
        if teacher:  # the workload's --teacher (run_config_for writes the config's kwargs without the workload)
            head = {k: out.pop(k) for k in ("model_name_or_path", "dataset_name") if k in out}
            out.pop("teacher_model_name_or_path", None)
            out = {**head, "teacher_model_name_or_path": teacher, **out}
        out["env"] = {**(out.get("env") or {}), **allocator_env(candidate, self.knobs(candidate))}
        return out

    def to_python(self, candidate: Candidate, *, model_name_or_path: str, dataset_name: str | None = None,
                  workload: Workload | None = None) -> str:
        """The snippet through the one writer, the teacher passed as `DistillationTrainer(teacher_model=...)` (the
        trainer does not read teacher_model_name_or_path; `trl distillation` passes it so) and both allocator
        variables set before torch starts."""
        from ..emit import write_python

        env = {**(candidate.base.get("env") or {}), **allocator_env(candidate, self.knobs(candidate))}
        shown = candidate.replace(base={**candidate.base.as_dict(), "env": env})
        teacher = self.teacher_name(candidate, workload) or "TEACHER_MODEL_ID"
        return write_python(shown, config_name=self.config_name, trainer_name=self.trainer_name,
                            kwargs=self.emit_kwargs(candidate, workload), peft=self.peft_config(candidate),
                            model_name_or_path=model_name_or_path, dataset_name=dataset_name,
                            default_output_dir=f"advisor-{self.name}", data_hint=self.data_hint, workload=workload,
                            trainer_args=(f"teacher_model={teacher!r}",))

    def check_run_keys(self, data: Mapping[str, Any], *, source: str = "config") -> None:
        """An SFT-only key, online RL's reward keys, `use_liger_loss` and `auto_find_batch_size: true` are
        ConfigErrors naming the key and the fix (`trl distillation` would pass some on silently)."""
        from trl import GRPOConfig, SFTConfig

        problems = []
        mine = field_names(self.config_class())
        sft_only = field_names(SFTConfig) - mine
        rl_only = (field_names(GRPOConfig) - mine - field_names(SFTConfig)) | {"reward_funcs",
                                                                               "reward_model_name_or_path"}
        for key in sorted(k for k in data if k in sft_only):
            problems.append(f"{key}={data[key]!r}: an SFT-only key (DistillationConfig has no {key!r}); remove it "
                            "from the Distillation config")
        for key in sorted(k for k in data if k in rl_only):
            problems.append(f"{key}={data[key]!r}: an online-RL key (GRPO / RLOO; DistillationConfig has no {key!r}: "
                            "the teacher's distribution is the target, one completion per prompt); remove it")
        if "use_liger_loss" in data:
            problems.append(LIGER_LOSS_GONE.format(where=f"use_liger_loss={data['use_liger_loss']!r}"))
        if data.get("auto_find_batch_size"):
            problems.append(f"auto_find_batch_size={data['auto_find_batch_size']!r}: the advisor measures one "
                            "per_device_train_batch_size; set auto_find_batch_size: false and lower "
                            "per_device_train_batch_size instead")
        init = data.get("teacher_model_init_kwargs")
        if init is not None and not isinstance(init, Mapping):
            problems.append(f"teacher_model_init_kwargs={init!r}: a mapping of from_pretrained's keyword arguments "
                            "(e.g. {dtype: bfloat16})")
        if problems:
            raise ConfigError(problems, context=source)

    def own_from_run(self, own: dict[str, Any]) -> dict[str, Any]:
        """DistillationConfig's keys of a file read back: `teacher_model_init_kwargs`' dtype as the teacher_dtype
        knob (the rest of it as written), an empty teacher name not stored."""
        init = dict(own.pop("teacher_model_init_kwargs", None) or {})
        if "dtype" in init:
            own["teacher_dtype"] = init.pop("dtype")
        if init:
            own["teacher_model_init_kwargs"] = init
        if own.get("teacher_model_name_or_path") is None:
            own.pop("teacher_model_name_or_path", None)
        return own

    def canonical(self, candidate: Candidate) -> Candidate:
        """The online knobs without effect reset (online_rl.py), and a teacher_dtype equal to ModelConfig's dtype
        (what `trl distillation` loads the teacher in anyway) back to None, so equivalent candidates compare equal."""
        out = super().canonical(candidate)
        chosen = out.base.get("teacher_dtype")
        if chosen is not None and WeightsDtype(chosen) is out.weights_dtype:
            from ..space import with_knobs

            out = with_knobs(out, teacher_dtype=None)
        return out

    # ---- the fake run and the step as phases ---------------------------------------------------------------------
    def extra_models(self, trainer: Any) -> list:
        teacher = getattr(trainer, "teacher_model", None)
        return [teacher] if teacher is not None else []

    def resident_models(self, candidate: Candidate) -> tuple:
        """The student and the teacher, in every phase (no reference, no reward model)."""
        from .phases import Resident

        return (Resident.POLICY, Resident.TEACHER)

    # ---- what the report and the notes say -----------------------------------------------------------------------
    def report_rows(self, candidate: Candidate) -> list[list[str]]:
        k = self.knobs(candidate)
        from .._physics import divergence_tiles

        n = candidate.per_device_train_batch_size * int(k.max_completion_length)
        rows, tiles = divergence_tiles(n)
        return [*super(OnlineRLTrainer, self).report_rows(candidate),
                ["completions", f"1 per prompt x {k.max_completion_length} tokens; generation batch "
                                f"{k.generation_batch(candidate)} per GPU"],
                ["divergence", f"generalized JSD, beta {k.beta:g} ("
                               + ("forward KL" if k.beta == 0 else "reverse KL" if k.beta == 1 else "two passes")
                               + f") over the whole vocabulary: the logits of the {n:,} completion tokens of a "
                               f"micro-batch in two float32 tiles of {rows:,} x 32,768 ({tiles / 2**30:.2f} GiB), "
                               "never [N, V]"]]

    def notes(self, candidate: Candidate) -> list[str]:
        k = self.knobs(candidate)
        out = [f"{self.name}: {self.trainer_name}'s step as generate / train; one completion per prompt, every "
               f"completion at max_completion_length={k.max_completion_length} (the bound: real completions that "
               "stop earlier need less)",
               f"the teacher resident in {self.teacher_dtype(candidate)} (no gradient, no optimizer state); its "
               "backbone runs under no_grad on every training micro-batch"]
        from ..space import Precision

        if candidate.precision is not Precision.FP32 and candidate.weights_dtype.value == "float32":
            out.append(f"{candidate.precision.value}=True reaches generation only: DistillationTrainer.compute_loss "
                       "runs the backbones and the loss through TRL's _ForwardRedirection, which swaps out the "
                       "forward accelerate wrapped in autocast, so the training pass computes and saves its "
                       "activations in float32 (measured on the real CPU run); 16-bit weights "
                       "(--allow-low-precision-weights) train in 16 bits")
        if k.colocated and k.vllm_enable_sleep_mode:
            out.append("vllm_enable_sleep_mode: PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF are written with "
                       "expandable_segments:False (vLLM's CuMemAllocator refuses expandable segments)")
        return out


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


DISTILLATION_TRAINER = register(Distillation())
