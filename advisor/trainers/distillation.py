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
  trl/kernels/chunked_divergence.py `ChunkedDivergenceFunction` (advisor/physics/distillation.py counts it: float32
  tiles of [min(N, 4096), 32768], never the [N, V] logits; the head's float32 weight gradient).

The teacher is a model input (`TEACHER`: `--teacher`, `suggest(teacher=)`, written as `teacher_model_name_or_path`,
required, with the student's vocabulary: DistillationTrainer raises otherwise and the registry refuses it first). It
may be of another width or depth. `trl distillation` loads it with ModelConfig's dtype and attention implementation
under `teacher_model_init_kwargs`; this module's `teacher_dtype` knob writes the dtype there (`input_dtype`). The
step's shape declares the divergence against it (`StepShape.distills_from`) and training passes outside autocast
(`train_autocast` False: `compute_loss` runs through TRL's `_ForwardRedirection`, which swaps out the forward
accelerate wrapped in autocast). The search (the generation engine as one dimension, colocated vLLM's share
derived), the server split and the allocator variables are online RL's (online_space.py, online_files.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..knobs import Home, Kind, Knob, Memory, knob_view
from ..physics import divergence_tiles
from ..runconfig import model_input_keys
from ..space import Precision, with_knobs
from ..values import WeightsDtype
from . import online_files
from .base import field_names, own_keys, register, sft_only_keys
from .online_knobs import KNOBS as _ONLINE_KNOBS
from .online_knobs import LIGER_LOSS_GONE, _OnlineKnobsMethods, engine_problems
from .online_trainer import OnlineRLTrainer
from .protocol import Head, ModelInput, StepShape

if TYPE_CHECKING:
    from ..space import Candidate
    from ..workload import GPUSpec, ModelSpec, Workload

TEACHER_INIT_KEY = "teacher_model_init_kwargs"
TEACHER = ModelInput(
    role="teacher", flag="--teacher", yaml_key="teacher_model_name_or_path", head=Head.LM, required=True,
    same_vocabulary=True, init_kwargs_key=TEACHER_INIT_KEY,
    help="distillation: the teacher (hub id, local directory or config.json) resident beside the student, with the "
         "student's vocabulary; counted in the memory; written as teacher_model_name_or_path",
)


def _teacher_summary(c: Candidate) -> str:
    dtype = c.base.get("teacher_dtype")
    return f"resident, loaded in {getattr(dtype, 'value', dtype)}" if dtype else \
        "resident, loaded in ModelConfig's dtype (as the student)"


# DistillationConfig's memory knob that online RL has no name for
KNOBS = (
    Knob("teacher_dtype", Kind.OPTIONAL_ENUM, None, Home.MODEL_INIT_KWARGS, "teacher_dtype",
         "the dtype the teacher is loaded in: `teacher_model_init_kwargs: {dtype: ...}` (None: `trl distillation` "
         "loads it in ModelConfig's dtype, the student's). The teacher is resident all step (its weights, not "
         "trained: no gradient, no optimizer state) and its forward computes in that dtype (no autocast reaches the "
         "training pass). Searched (None or bfloat16, `Distillation.search_values`) where the teacher's checkpoint "
         "is stored in bfloat16 (its config's torch_dtype: loading it in bfloat16 holds the checkpoint's own "
         "weights) or the goals allow low-precision weights; else pinned by --fix only",
         enum=WeightsDtype, carried=True, memory=Memory.UNORDERED, label="teacher", summary=_teacher_summary,
         short=lambda c: None if c.base.get("teacher_dtype") is None else
         f"teacher={getattr(c.base.get('teacher_dtype'), 'value', c.base.get('teacher_dtype'))}",
         quality="the teacher's forward in 16 bits: its next-token distribution, the student's target, computed in "
                 "16-bit matmuls (and from 16-bit weights where its checkpoint is float32)"),
)
# the online knobs DistillationConfig has under the same names (declared once in online_knobs.py), and the server
# split of the launch (vllm_server_gpus: accelerate's, as for GRPO)
_SHARED_NAMES = ("max_completion_length", "beta", "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization",
                 "vllm_enable_sleep_mode", "vllm_server_gpus", "ds3_gather_for_generation")
_SHARED = tuple(k for k in _ONLINE_KNOBS if k.name in _SHARED_NAMES)


class _DistillationKnobsMethods(_OnlineKnobsMethods):
    """DistillationConfig's memory knobs of a candidate, TRL 1.16's defaults resolved (`beta` 1.0: reverse KL). What
    the online step reads of GRPO's view is answered as DistillationTrainer runs: one completion per prompt,
    generated every gradient_accumulation_steps micro-steps, no KL reference (`kl_beta` 0), no old-policy forward;
    the loss is the divergence at `beta` (`divergence_beta`)."""

    DEFAULTS = {"beta": 1.0}
    CONTEXT = "distillation"
    num_generations = 1
    steps_per_generation = None  # DistillationConfig has none: the generation batch is the effective batch
    generation_batch_size = None
    num_iterations = 1
    vllm_importance_sampling_correction = False
    cast_lm_head_to_fp32 = False

    @property
    def kl_beta(self) -> float:
        return 0.0  # beta selects the divergence; there is no reference model

    @property
    def divergence_beta(self) -> float:  # type: ignore[override]
        return float(self.beta)


DistillationKnobs = knob_view("DistillationKnobs", (*_SHARED, *KNOBS), _DistillationKnobsMethods, __name__)


class Distillation(OnlineRLTrainer):
    """On-policy distillation on prompt-only data (prompts.PromptDataset), the teacher resident."""

    name = "distillation"
    command = "distillation"
    config_name, trainer_name, config_label = "DistillationConfig", "DistillationTrainer", "Distillation"
    example_dataset = "trl-lib/ultrafeedback-prompt"
    knob_view = DistillationKnobs
    model_inputs = (TEACHER,)
    # the front door's search without --trials: a fake step of the student and a resident teacher with
    # transformers' generate costs ~11 s of CPU a candidate (the 24-layer student's decode and the 28-layer
    # teacher's forward on fake tensors), so 40 trials took 6 min 50 s on 2 cores; 4 pick what 40 pick on
    # Qwen2.5-0.5B from Qwen2.5-1.5B on an H100 (README 'Distillation memory'). --trials N asks for more.
    default_trials = 4

    # ---- rules ------------------------------------------------------------------------------------------------
    def problems(self, candidate: Candidate, gpu: GPUSpec | None = None, model: ModelSpec | None = None
                 ) -> list[str]:
        c = candidate
        out = self.candidate_problems(c, gpu, model)
        try:
            k = self.knobs(c)
        except ConfigError as exc:
            return [*out, *exc.problems]
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
        init = c.base.get(TEACHER_INIT_KEY) or {}
        if isinstance(init, Mapping) and init.get("quantization_config") is not None:
            out.append("teacher_model_init_kwargs.quantization_config: a quantized teacher is not measured by the "
                       "advisor (its bitsandbytes weights and dequantised forward); drop it, or load the teacher in "
                       "16 bits with --fix teacher_dtype=bfloat16")
        return [*out, *engine_problems(c, k, gpu)]

    def canonical(self, candidate: Candidate) -> Candidate:
        """The online knobs without effect reset (online_space.py), and a teacher_dtype equal to ModelConfig's dtype
        (what `trl distillation` loads the teacher in anyway) back to None, so equivalent candidates compare equal."""
        out = super().canonical(candidate)
        chosen = out.base.get("teacher_dtype")
        if chosen is not None and WeightsDtype(chosen) is out.weights_dtype:
            out = with_knobs(out, teacher_dtype=None)
        return out

    # ---- the search space ---------------------------------------------------------------------------------------
    def search_values(self, workload: Workload, values: Mapping[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
        """The generation engine's values (online_space.py), and the teacher's dtype: ModelConfig's or bfloat16 where
        the teacher's checkpoint is stored in bfloat16 (loading it so keeps its own weights; float32 only upcasts
        them) or the goals allow low-precision weights; ModelConfig's alone otherwise."""
        out = super().search_values(workload, values)
        teacher = workload.model_of(TEACHER.role)
        stored = str((teacher.config.get("text_config") or teacher.config).get("torch_dtype")
                     or teacher.config.get("dtype") or "") if teacher is not None else ""
        if stored == WeightsDtype.BFLOAT16.value or workload.goals.allow_low_precision_weights:
            out["teacher_dtype"] = (None, WeightsDtype.BFLOAT16)
        return out

    def completions_per_row(self, candidate: Candidate) -> int:
        return 1

    # ---- the models beside the student ---------------------------------------------------------------------------
    def input_dtype(self, candidate: Candidate, role: str) -> WeightsDtype:
        """The teacher as `trl distillation` loads it: teacher_model_init_kwargs' dtype over ModelConfig's."""
        chosen = self.knobs(candidate).teacher_dtype if role == TEACHER.role else None
        return chosen or candidate.weights_dtype

    def trainer_kwargs(self, workload: Workload, candidate: Candidate, models: Mapping[str, tuple[Any, Any]]
                       ) -> dict[str, Any]:
        """`DistillationTrainer(teacher_model=...)`: the teacher given (the probe's path, loaded with
        teacher_model_init_kwargs as `trl distillation` loads it; the simulator's model built on meta)."""
        given = models.get(TEACHER.role)
        return {} if given is None else {"teacher_model": given[0]}

    # ---- the files ------------------------------------------------------------------------------------------------
    def config_extras(self, candidate: Candidate, workload: Workload | None, *, measured: bool) -> dict[str, Any]:
        """vLLM's tensor parallelism, auto_find_batch_size off and (measured) every completion at its bound, as
        online RL writes them; `teacher_model_init_kwargs` when the teacher's dtype is pinned, or resolved as
        `trl distillation` builds it from ModelConfig for a measured run."""
        out = online_files.config_extras(candidate, self.knobs(candidate), measured=measured)
        init = self._teacher_init_kwargs(candidate, resolved=measured)
        if init:
            out[TEACHER_INIT_KEY] = init
        return out

    def _teacher_init_kwargs(self, candidate: Candidate, *, resolved: bool) -> dict[str, Any]:
        """The user's teacher_model_init_kwargs with the knob's dtype; `resolved`: with the dtype and attention
        implementation `trl distillation` adds from ModelConfig (what a measured run and the snippet pass)."""
        init = dict(candidate.base.get(TEACHER_INIT_KEY) or {})
        init.pop("dtype", None)
        chosen = self.knobs(candidate).teacher_dtype
        if resolved:
            if candidate.attn_implementation is not None:
                init.setdefault("attn_implementation", candidate.attn_implementation.value)
            init["dtype"] = self.input_dtype(candidate, TEACHER.role).value
        elif chosen is not None:
            init["dtype"] = chosen.value
        return init

    def emit_kwargs(self, candidate: Candidate, workload: Workload | None = None) -> dict[str, Any]:
        """The config kwargs with the teacher's init kwargs as `trl distillation` resolves them from ModelConfig (a
        DistillationTrainer built in Python would load the teacher in float32 without them; the YAML says what the
        command does anyway)."""
        out = self.config_kwargs(candidate, workload)
        out.update(model_input_keys(self, candidate, workload))  # teacher_model_name_or_path: a config field
        out[TEACHER_INIT_KEY] = self._teacher_init_kwargs(candidate, resolved=True)
        return out

    def script_kwargs(self, candidate: Candidate, workload: Workload | None = None) -> dict[str, Any]:
        return {}  # ScriptArguments only: the teacher is DistillationConfig's

    def script_keys(self) -> frozenset[str]:
        return frozenset()

    def snippet_arguments(self, candidate: Candidate, workload: Workload | None
                          ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """`DistillationTrainer(teacher_model=...)`: the trainer does not read teacher_model_name_or_path (`trl
        distillation` passes it so)."""
        teacher = model_input_keys(self, candidate, workload).get(TEACHER.yaml_key) or "TEACHER_MODEL_ID"
        return (f"teacher_model={teacher!r}",), ()

    def check_run_keys(self, data: Mapping[str, Any], *, source: str = "config") -> None:
        """An SFT-only key, online RL's reward keys, `use_liger_loss` and `auto_find_batch_size: true` are
        ConfigErrors naming the key and the fix (`trl distillation` would pass some on silently)."""
        from trl import GRPOConfig  # lazy: loads trl


        problems = [f"{key}={data[key]!r}: an SFT-only key (DistillationConfig has no {key!r}); remove it from the "
                    "Distillation config" for key in sorted(k for k in data if k in sft_only_keys(self))]
        rl_only = (field_names(GRPOConfig) - self.config_fields() - sft_only_keys(self)) | {
            "reward_funcs", "reward_model_name_or_path"}
        problems += [f"{key}={data[key]!r}: an online-RL key (GRPO / RLOO; DistillationConfig has no {key!r}: the "
                     "teacher's distribution is the target, one completion per prompt); remove it"
                     for key in sorted(k for k in data if k in rl_only)]
        if "use_liger_loss" in data:
            problems.append(LIGER_LOSS_GONE.format(where=f"use_liger_loss={data['use_liger_loss']!r}"))
        if data.get("auto_find_batch_size"):
            problems.append(f"auto_find_batch_size={data['auto_find_batch_size']!r}: the advisor measures one "
                            "per_device_train_batch_size; set auto_find_batch_size: false and lower "
                            "per_device_train_batch_size instead")
        init = data.get(TEACHER_INIT_KEY)
        if init is not None and not isinstance(init, Mapping):
            problems.append(f"{TEACHER_INIT_KEY}={init!r}: a mapping of from_pretrained's keyword arguments (e.g. "
                            "{dtype: bfloat16})")
        if problems:
            raise ConfigError(problems, context=source)

    def candidate_from_run_dict(self, data: Mapping[str, Any], *, source: str = "config") -> Candidate:
        """A `trl distillation` config read back: the shared keys as advisor/runconfig reads them, DistillationConfig's
        in the base, `teacher_model_init_kwargs`' dtype as the teacher_dtype knob (the rest of it as written); what
        the writer emits for a plain candidate (TRL's defaults, its output_dir, the allocator variables) not
        stored."""
        self.check_run_keys(data, source=source)
        mine = own_keys(self)
        shared = {k: v for k, v in data.items() if k not in mine and k != "env"}
        own = {k: v for k, v in data.items() if k in mine}
        if "env" in data:
            shared["env"] = data["env"]  # both allocator variables: the expandable_segments knob
        for key, emitted in (("auto_find_batch_size", False), ("vllm_tensor_parallel_size", 1)):
            if shared.get(key, own.get(key, emitted)) == emitted:
                shared.pop(key, None)
                own.pop(key, None)
        init = dict(own.pop(TEACHER_INIT_KEY, None) or {})
        dtype = init.pop("dtype", None)
        if own.get(TEACHER.yaml_key) is None:
            own.pop(TEACHER.yaml_key, None)
        cand = self.read_config(shared, own, source=source)
        # what `trl distillation` adds from ModelConfig anyway (the writer spells it out) is no pin of the teacher's
        if cand.attn_implementation is not None and init.get("attn_implementation") == cand.attn_implementation.value:
            init.pop("attn_implementation")
        base = cand.base.as_dict()
        if init:
            base[TEACHER_INIT_KEY] = init
        if dtype not in (None, "auto", cand.weights_dtype.value):
            base["teacher_dtype"] = dtype
        try:
            return self.knobs(cand.replace(base=base)).apply(cand.replace(base=base))
        except ConfigError as exc:
            raise ConfigError(exc.problems, context=source) from None

    # ---- the step ------------------------------------------------------------------------------------------------
    def step_shape(self, candidate: Candidate) -> StepShape:
        """Generation inside the step; the loss a divergence against the teacher, the training passes outside
        autocast (TRL's _ForwardRedirection swaps out accelerate's autocast forward: float32 activations under
        bf16=True over float32 weights, checked on the real CPU run)."""
        return StepShape(generates=True, distills_from=TEACHER.role, train_autocast=False)

    def extra_models(self, trainer: Any) -> list:
        teacher = getattr(trainer, "teacher_model", None)
        return [teacher] if teacher is not None else []

    # ---- what the report and the notes say -----------------------------------------------------------------------
    def report_rows(self, candidate: Candidate) -> list[list[str]]:
        k = self.knobs(candidate)
        n = candidate.per_device_train_batch_size * int(k.max_completion_length)
        rows, tiles = divergence_tiles(n)
        kind = "forward KL" if k.beta == 0 else "reverse KL" if k.beta == 1 else "two passes"
        return [*super(OnlineRLTrainer, self).report_rows(candidate),
                ["completions", f"1 per prompt x {k.max_completion_length} tokens; generation batch "
                                f"{k.generation_batch(candidate)} per GPU"],
                ["divergence", f"generalized JSD, beta {k.beta:g} ({kind}) over the whole vocabulary: the logits of "
                               f"the {n:,} completion tokens of a micro-batch in two float32 tiles of {rows:,} x "
                               f"32,768 ({tiles / 2**30:.2f} GiB), never [N, V]"]]

    def notes(self, candidate: Candidate, workload: Workload | None = None) -> list[str]:
        k = self.knobs(candidate)
        out = [f"{self.name}: {self.trainer_name}'s step as generate / train; one completion per prompt, every "
               f"completion at max_completion_length={k.max_completion_length} (the bound: real completions that "
               "stop earlier need less)",
               f"the teacher resident in {self.input_dtype(candidate, TEACHER.role).value} (no gradient, no "
               "optimizer state); its backbone runs under no_grad on every training micro-batch"]
        if candidate.precision is not Precision.FP32 and candidate.weights_dtype is WeightsDtype.FLOAT32:
            out.append(f"{candidate.precision.value}=True reaches generation only: DistillationTrainer.compute_loss "
                       "runs the backbones and the loss through TRL's _ForwardRedirection, which swaps out the "
                       "forward accelerate wrapped in autocast, so the training pass computes and saves its "
                       "activations in float32 (measured on the real CPU run); 16-bit weights "
                       "(--allow-low-precision-weights) train in 16 bits")
        if k.colocated and k.vllm_enable_sleep_mode:
            out.append("vllm_enable_sleep_mode: PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF are written with "
                       "expandable_segments:False (vLLM's CuMemAllocator refuses expandable segments)")
        return out


DISTILLATION_TRAINER = register(Distillation())
