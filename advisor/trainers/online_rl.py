"""Online RL (GRPO, RLOO): what `trl.GRPOTrainer` and `trl.RLOOTrainer` share, on the trainer seam.

A step of TRL 1.16's online trainers is a cycle (trl/trainer/grpo_trainer.py `_prepare_inputs`,
`_generate_and_score_completions`, `compute_loss`; rloo_trainer.py alike):
- generate: every `steps_per_generation x num_iterations` micro-steps, the local generation batch
  (`per_device_train_batch_size x steps_per_generation` completions, `num_generations` per prompt) goes through
  `model.generate` in one call (its KV cache covers all of it at prompt + `max_completion_length`), or through vLLM
  (colocated: `vllm_gpu_memory_utilization` x the card outside PyTorch's allocator, all the time without sleep mode,
  only while generating with it; served: on GPUs of its own). The training state (weights, optimizer state) stays
  resident;
- score: no-grad forwards on the completions: the reference's log-probs when `beta != 0` (a separate copy without
  PEFT, the adapters disabled with it), the old policy's when vLLM's importance-sampling correction is on or
  generation is misaligned with the optimizer step (`gradient_accumulation_steps % (steps_per_generation x
  num_iterations) != 0`), and a reward model given as a model (resident: counted; reward functions are not);
- train: forward and backward of `per_device_train_batch_size` completions (it counts completions), TRL's chunked
  log-prob head on the completion tokens, the optimizer step.

The knobs are declared once in online_knobs.py under TRL's own field names (GRPOConfig / RLOOConfig), carried in
the candidate's base; `OnlineKnobs` is their typed view, with each trainer's TRL 1.16 defaults where the two configs
differ (`num_generations`: GRPO 8, RLOO 2; `beta`: GRPO 0.0, RLOO 0.05; the knobs declare None: "the trainer's
default").
`num_generations` and `max_completion_length` are the user's (quality): never searched, never lowered.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .base import TrlTrainer, base_config_keys
from .base import field_names as _field_names
from .online_knobs import (
    DEFAULT_REWARD_FUNCS,
    KNOB_KEYS,
    KNOBS,
    LIGER_LOSS_GONE,
    REWARD_REGISTRY,
    SCRIPT_KEYS,
    TRL_DEFAULTS,
    OnlineKnobs,
    VllmMode,
)
from .phases import ClosedForm
from .server_split import ServerSplit

if TYPE_CHECKING:
    import datasets
    import torch

    from ..space import Candidate
    from ..workload import GPUSpec, ModelSpec, Workload


def online_only_keys(config_class: type) -> set[str]:
    """The keys of `config_class` (GRPOConfig / RLOOConfig) SFTConfig has not, and the script's own."""
    from trl import SFTConfig

    return (_field_names(config_class) - _field_names(SFTConfig)) | set(SCRIPT_KEYS)


class OnlineRLTrainer(ServerSplit, TrlTrainer):
    """What GRPO and RLOO share; a subclass declares its TRL classes and command."""

    example_dataset = "trl-lib/DeepMath-103K"
    data_hint = "your prompts (a 'prompt' column: text or a list of messages)"
    closed_form = ClosedForm.ONLINE_RL
    config_label: str
    takes_reward_model = True  # a Workload's reward_model (--reward-model) is this trainer's to score with
    train_autocast = True  # its training forwards run under the mixed-precision autocast (bf16 / fp16)
    old_logps_always = False  # its scoring runs the old policy's no-grad forward every generation (RLOO: True)

    @property
    def trl_defaults(self) -> dict[str, Any]:
        """TRL 1.16's defaults of this trainer's config where GRPOConfig and RLOOConfig differ (num_generations,
        beta): what a candidate without the key means. The estimate and the simulator read the knobs through it."""
        return dict(TRL_DEFAULTS[self.name])

    def knobs(self, candidate: Candidate) -> Any:
        """This trainer's online knobs of `candidate`, its TRL defaults resolved (OnlineKnobs)."""
        return OnlineKnobs.of(candidate, self.name)

    # ---- rules ------------------------------------------------------------------------------------------------
    def problems(self, candidate: Candidate, gpu: GPUSpec | None = None, model: ModelSpec | None = None
                 ) -> list[str]:
        """The shared rules (SFT's packing / padding-free rules left out: these configs have neither), then TRL's
        GRPOConfig / RLOOConfig rules, exactly as strict (one rank: the generation batch of this GPU), and vLLM's."""
        c = candidate
        out = c.replace(packing=False, padding_free=False).problems(gpu, model)
        for key in ("packing", "padding_free"):
            if getattr(c, key):
                out.append(f"{key}=True: an SFT-only key ({self.config_name} has no {key!r}; {self.trainer_name} "
                           "pads each batch of completions); remove it")
        try:
            k = self.knobs(c)
        except ConfigError as exc:
            return [*out, *exc.problems]
        out.extend(self._rules(c, k, gpu))
        return out

    def _rules(self, c: Candidate, k: Any, gpu: GPUSpec | None) -> list[str]:
        out = []
        cfg = self.config_name
        if c.base.get("auto_find_batch_size"):
            out.append(f"auto_find_batch_size=True: {cfg} raises \"auto_find_batch_size is not supported by "
                       f"{self.name.upper()}, because the generation batch must contain full prompt groups of "
                       "num_generations completions\"; set auto_find_batch_size: false and let the advisor pick "
                       "per_device_train_batch_size")
        if "use_liger_loss" in c.base.as_dict():
            out.append(LIGER_LOSS_GONE.format(where=f"use_liger_loss={c.base.get('use_liger_loss')!r}"))
        if k.num_generations < 2:
            out.append(f"num_generations={k.num_generations}: {cfg} raises \"{self.name.upper()} requires at least 2 "
                       "generations per prompt to calculate the advantages\"; set num_generations >= 2")
        b = c.per_device_train_batch_size
        if k.generation_batch_size is not None and k.steps_per_generation is not None:
            out.append(f"generation_batch_size={k.generation_batch_size} with steps_per_generation="
                       f"{k.steps_per_generation}: {cfg} raises \"'generation_batch_size' and 'steps_per_generation' "
                       "can not be both configured at the same time\"; set one of them")
        elif k.generation_batch_size is not None and k.generation_batch_size % b:
            out.append(f"generation_batch_size={k.generation_batch_size}: {cfg} raises \"generation_batch_size "
                       f"({k.generation_batch_size}) must be divisible by the global batch size ({b})\"; use a "
                       f"multiple of per_device_train_batch_size x GPUs")
        else:
            gen = k.generation_batch(c)
            if gen % k.num_generations:
                spg = "steps_per_generation" if k.steps_per_generation is not None else (
                    "generation_batch_size" if k.generation_batch_size is not None else
                    "gradient_accumulation_steps (steps_per_generation unset)")
                out.append(f"num_generations={k.num_generations}: {cfg} raises \"generation_batch_size ({gen}) must "
                           f"be divisible by num_generations ({k.num_generations})\" (the generation batch is "
                           f"per_device_train_batch_size {b} x {spg} {k.steps(c)} x GPUs); make "
                           f"per_device_train_batch_size x steps_per_generation a multiple of {k.num_generations}, "
                           "or use a num_generations that divides it")
        out.extend(engine_rules(c, k, gpu))
        if getattr(k, "cast_lm_head_to_fp32", False) and c.use_lora and c.lora_target_modules and \
                "lm_head" in c.lora_target_modules:
            out.append("cast_lm_head_to_fp32=True with LoRA on lm_head: GRPOTrainer raises \"`cast_lm_head_to_fp32"
                       "=True` is not supported when the lm_head carries a PEFT adapter\"; drop lm_head from "
                       "lora_target_modules or set cast_lm_head_to_fp32: false")
        return out

    def step_knobs(self, candidate: Candidate) -> dict[str, Any]:
        """The step's knobs as the physics builds an online step from them (advisor/_physics/online_rl.py
        `build_step`'s keyword arguments, TRL's names, this trainer's defaults resolved): what the estimate and the
        simulator's glue both pass."""
        k = self.knobs(candidate)
        return dict(steps_per_generation=k.steps_per_generation, generation_batch_size=k.generation_batch_size,
                    num_generations=int(k.num_generations), num_iterations=int(k.num_iterations), beta=float(k.beta),
                    use_vllm=bool(k.use_vllm), vllm_mode=k.vllm_mode.value,
                    vllm_enable_sleep_mode=bool(k.vllm_enable_sleep_mode),
                    vllm_gpu_memory_utilization=float(k.vllm_gpu_memory_utilization),
                    vllm_importance_sampling_correction=bool(k.vllm_importance_sampling_correction),
                    vllm_max_model_length=candidate.base.get("vllm_max_model_length"),
                    ds3_gather_for_generation=bool(k.ds3_gather_for_generation),
                    cast_lm_head_to_fp32=bool(k.cast_lm_head_to_fp32), old_logps_always=self.old_logps_always)

    def teacher_dtype(self, candidate: Candidate) -> str | None:
        """The dtype a resident teacher is loaded in (None: this trainer has no teacher)."""
        return None

    # ---- the search space (advisor/_search/space.py default_space, advisor/_search/params.py StudySpace) ---------
    batch_unit = "completions"  # what per_device_train_batch_size counts (a dataset row is a prompt)
    ENGINE = "generation_engine"  # the name of the one searched dimension of the generation engine

    def search_values(self, workload: Workload, values: Mapping[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
        """The default space's values of the engine knobs, from the target: vLLM (colocated with or without sleep
        mode) only on a CUDA target, server mode on k of --num-gpus (k in 1..num_gpus-1: at least one GPU trains)
        only when --num-gpus > 1; expandable_segments off offered beside the space's own value (it goes with sleep
        mode: `joint_dimensions`). `values`: the space so far (the shared knobs' values)."""
        out: dict[str, tuple[Any, ...]] = {}
        n = max(1, int(workload.num_gpus))
        if workload.gpu.is_cuda:
            out["use_vllm"] = (False, True)
            out["vllm_enable_sleep_mode"] = (False, True)
            out["expandable_segments"] = tuple(dict.fromkeys((*values.get("expandable_segments", (True,)), False)))
            if n > 1:
                out["vllm_mode"] = (VllmMode.COLOCATE.value, VllmMode.SERVER.value)
                out["vllm_server_gpus"] = tuple(range(1, n))
        else:
            out["use_vllm"] = (False,)  # vLLM generates on CUDA GPUs only
        return out

    def joint_dimensions(self, values: Mapping[str, tuple[Any, ...]]) -> dict[str, tuple[tuple[str, dict], ...]]:
        """The generation engine as ONE categorical of the study (label -> the knobs it sets), the choices of what
        `values` (the space, --fix pins applied) offers: model.generate (and, where ZeRO-3 is offered, generating
        layer by layer: ds3_gather_for_generation False), vLLM colocate without sleep, vLLM colocate with sleep and
        expandable_segments off (vLLM's CuMemAllocator refuses them: one decision, not a refused combination), vLLM
        server on k GPUs. A knob the user pinned holds: sleep mode with expandable_segments pinned on stays a choice,
        refused by the rule with its fix. Empty when the space offers no choice of engine."""
        from ..knobs import knob

        def offered(name: str, value: Any) -> bool:
            return value in values.get(name, (knob(name).default,))

        es = offered("expandable_segments", True)
        # ds3_gather_for_generation: both ways where a ZeRO-3 layout is offered (TRL reads it only there; the
        # --fix'd parallelism counts), as the user pinned it otherwise
        zero3 = any(str(getattr(layout, "value", layout)).startswith("zero3")
                    for layout in values.get("parallelism", ()))
        gathers = tuple(values.get("ds3_gather_for_generation", (True, False) if zero3 else (True,)))
        opts: list[tuple[str, dict]] = []
        if offered("use_vllm", False):
            for gather in (True, False):
                if gather in gathers:
                    opts.append(("generate" if gather else "generate-layerwise",
                                 {"use_vllm": False, "ds3_gather_for_generation": gather, "expandable_segments": es}))
        if offered("use_vllm", True):
            on = {"use_vllm": True, "ds3_gather_for_generation": True in gathers}  # TRL: vLLM needs it gathered
            colocate, server = VllmMode.COLOCATE.value, VllmMode.SERVER.value
            if offered("vllm_mode", colocate):
                if offered("vllm_enable_sleep_mode", False):
                    opts.append(("vllm-colocate", {**on, "vllm_mode": colocate, "vllm_enable_sleep_mode": False,
                                                   "expandable_segments": es}))
                if offered("vllm_enable_sleep_mode", True):
                    opts.append(("vllm-colocate-sleep", {
                        **on, "vllm_mode": colocate, "vllm_enable_sleep_mode": True,
                        "expandable_segments": not offered("expandable_segments", False)}))
            if offered("vllm_mode", server):
                for k in values.get("vllm_server_gpus", ()):
                    if int(k) >= 1:
                        opts.append((f"vllm-server-{k}", {**on, "vllm_mode": server, "vllm_server_gpus": int(k),
                                                          "expandable_segments": es}))
        return {self.ENGINE: tuple(opts)} if opts else {}

    def canonical(self, candidate: Candidate) -> Candidate:
        """This trainer's own knobs that have no effect (their `active`: sleep mode and the utilization off colocated
        vLLM, vllm_server_gpus off server mode, vllm_mode without vLLM, ds3_gather_for_generation off ZeRO-3) back to
        their defaults, so equivalent candidates compare equal (Candidate.canonical does it for the shared knobs)."""
        from ..space import with_knobs

        reset = {k.name: k.default for k in KNOBS
                 if not k.is_active(candidate) and candidate.base.get(k.name, k.default) != k.default}
        if not reset:
            return candidate
        return with_knobs(candidate, **{n: v.value if isinstance(v, Enum) else v for n, v in reset.items()})

    def vllm_pool_need(self, workload: Workload, candidate: Candidate) -> Any:
        """vLLM's own accounting of the pool colocated vLLM needs for this candidate (advisor/_physics/vllm.py
        `min_utilization`, on `online_vllm_side`'s weights, profile activations, non-torch memory, CUDA graphs and KV
        layout, as the estimate builds them): the generation batch TRL hands it (max_num_seqs =
        per_device_train_batch_size x steps_per_generation, tensor-parallel 1) at full length (the longest prompt +
        max_completion_length, capped at max_model_len), never below one max_model_len sequence (what vLLM needs to
        start)."""
        from .._physics import architecture, online_vllm_side, vllm_min_utilization

        c = candidate
        k = self.knobs(c)
        b = c.per_device_train_batch_size
        world = self.training_gpus(c, max(1, int(workload.num_gpus)))
        spg = k.steps_per_generation or (k.generation_batch_size // (b * world) if k.generation_batch_size
                                         else c.gradient_accumulation_steps)
        gen = b * max(1, int(spg))
        lengths = getattr(workload.dataset, "lengths", None)
        prompt = int(max(lengths)) if lengths is not None and len(lengths) else 0
        gpu = workload.gpu
        side = online_vllm_side(workload.model.config, parameters=architecture(workload.model).total,
                                generation_batch=gen, vllm_max_model_length=c.base.get("vllm_max_model_length"),
                                supports_bf16=gpu.supports_bf16)
        length = min(prompt + int(k.max_completion_length), side.max_model_len)
        need = vllm_min_utilization(gpu.memory_bytes, weights_bytes=side.weights_bytes,
                                    activation_bytes=side.activation_bytes, non_torch_bytes=side.non_torch_bytes,
                                    layout=side.layout, sequences=gen, sequence_length=length,
                                    max_model_len=side.max_model_len, cudagraph_bytes=side.cudagraph_bytes)
        return need, side, gen, prompt, length

    def derive(self, workload: Workload, candidate: Candidate, values: Mapping[str, tuple[Any, ...]]
               ) -> Candidate | str:
        """The knobs the search derives rather than searches: colocated vLLM's `vllm_gpu_memory_utilization`, the
        smallest pool that holds the generation batch at full length (`vllm_pool_need`, rounded up to 0.01), unless
        the space pins it (the user's --fix: kept as given). A pool of the whole card or more is the reason the
        candidate is not admitted."""
        k = self.knobs(candidate)
        if not k.colocated or "vllm_gpu_memory_utilization" in values:
            return candidate
        try:
            need = self.vllm_pool_need(workload, candidate)[0]
        except ConfigError as exc:
            return "; ".join(exc.problems)
        if need.value >= 1.0:
            return (f"colocated vLLM: the pool that holds the generation batch at full length is {need.exact:.1%} of "
                    f"the card ({need.pool_bytes / 2**30:.2f} GiB of {workload.gpu.memory_bytes / 2**30:.2f}): "
                    "nothing is left to train; a smaller micro-batch or steps_per_generation, or vLLM server mode")
        from ..space import with_knobs

        return with_knobs(candidate, vllm_gpu_memory_utilization=need.value)

    def derivation_notes(self, workload: Workload, candidate: Candidate, values: Mapping[str, tuple[Any, ...]]
                         ) -> list[str]:
        """How the pick's derived knobs were derived (the search's notes)."""
        k = self.knobs(candidate)
        if not k.colocated:
            return []
        if "vllm_gpu_memory_utilization" in values:
            return [f"vllm_gpu_memory_utilization={k.vllm_gpu_memory_utilization:g}: yours (--fix), kept as given"]
        try:
            need, side, gen, prompt, length = self.vllm_pool_need(workload, candidate)
        except ConfigError:
            return []
        gib = 2**30
        return [f"vllm_gpu_memory_utilization={need.value:.2f}: derived, not searched: the smallest share of the "
                f"{workload.gpu.memory_bytes / gib:.2f} GiB card, rounded up to 0.01 (exact {need.exact:.4f}), whose "
                f"pool ({need.pool_bytes / gib:.2f} GiB) holds vLLM's weights ({side.weights_bytes / gib:.2f} GiB), "
                f"its profile run's activations ({side.activation_bytes / gib:.2f} GiB), non-torch memory "
                f"({side.non_torch_bytes / gib:.2f} GiB), its CUDA graphs ({side.cudagraph_bytes / gib:.2f} GiB, "
                f"inside the pool since vLLM 0.21) and KV pages ({need.kv_bytes / gib:.2f} GiB) for the "
                f"{need.binding} (the generation batch: {gen} sequences x {length} tokens = the longest prompt "
                f"{prompt} + max_completion_length {k.max_completion_length}; one sequence: max_model_len "
                f"{side.max_model_len}), by vLLM's accounting (advisor/_physics/vllm.py min_utilization); "
                "--fix vllm_gpu_memory_utilization=X keeps yours"]

    # ---- config ------------------------------------------------------------------------------------------------
    def config_kwargs(self, candidate: Candidate, workload: Workload | None = None, *,
                      measured: bool = False) -> dict[str, Any]:
        """Every memory-relevant field of this trainer's config, explicitly (TRL's defaults resolved): its own knobs
        (`own_config_kwargs`) and the training arguments online trainers share, then the base's config keys
        (`measured`: only those that reach a measured run)."""
        from ..emit import model_init_kwargs
        from ..space import Precision

        c = candidate
        k = self.knobs(c)
        fields = _field_names(self.config_class())
        out: dict[str, Any] = {
            "per_device_train_batch_size": c.per_device_train_batch_size,
            "gradient_accumulation_steps": c.gradient_accumulation_steps,
            **self.own_config_kwargs(c, k, fields, workload, measured=measured),
            "vllm_tensor_parallel_size": c.base.get("vllm_tensor_parallel_size", 1),
            "activation_checkpointing": c.activation_checkpointing,
            "activation_checkpointing_kwargs": c.checkpointing_kwargs,
            "optim": c.optim.value,
            "bf16": c.precision is Precision.BF16,
            "fp16": c.precision is Precision.FP16,
            # a TrainingArguments field the online trainers ignore (their RepeatSampler deals the generation batch):
            # written as the knob says, so the file is what was measured
            "train_sampling_strategy": "group_by_length" if c.group_by_length else
            c.base.get("train_sampling_strategy", "random"),
            "auto_find_batch_size": False,
            "use_liger_kernel": False,
            "model_init_kwargs": model_init_kwargs(c, measured=measured),
        }
        if measured:
            # a measured run (the probe, the simulator) generates every completion at max_completion_length (the
            # bound the memory is counted at), and takes the prompts in the order given (the longest first)
            out["generation_kwargs"] = {**(c.base.get("generation_kwargs") or {}),
                                        "min_new_tokens": k.max_completion_length}
            out["shuffle_dataset"] = False
        skip = self.written_keys() | {"vllm_tensor_parallel_size", "auto_find_batch_size",
                                      *(("generation_kwargs", "shuffle_dataset") if measured else ())}
        out.update(base_config_keys(c, fields, measured=measured, own=self.own_keys(), skip=skip))
        return out

    def own_config_kwargs(self, candidate: Candidate, knobs: Any, fields: set[str], workload: Workload | None, *,
                          measured: bool) -> dict[str, Any]:
        """This trainer's own knobs as its config's fields (GRPOConfig / RLOOConfig: declared once in KNOBS)."""
        own = {kn.key: getattr(knobs, kn.name) for kn in KNOBS if kn.key in fields}
        own["vllm_mode"] = knobs.vllm_mode.value
        # the generation batch: the one of steps_per_generation / generation_batch_size that is set (never both:
        # GRPOConfig derives the other); neither when unset, which TRL reads as steps_per_generation =
        # gradient_accumulation_steps (written explicitly above)
        for key in ("steps_per_generation", "generation_batch_size"):
            if own[key] is None:
                own.pop(key)
        return own

    def written_keys(self) -> frozenset[str]:
        """The keys `own_config_kwargs` and the script's own keys write (the base's copies are not written again)."""
        return KNOB_KEYS | frozenset(SCRIPT_KEYS)

    def own_keys(self) -> set[str]:
        """The keys of this trainer's config SFTConfig has not, and its script's own."""
        return online_only_keys(self.config_class())

    def script_kwargs(self, candidate: Candidate, workload: Workload | None = None) -> dict[str, Any]:
        """GRPOScriptArguments / RLOOScriptArguments' keys: the reward model (resident, counted: the workload's
        --reward-model, else the config's) and the reward functions (host strings, not counted; TRL's
        get_soft_overlong_punishment when neither a function nor a model is given)."""
        out: dict[str, Any] = {}
        rm = workload.reward_model.name if workload is not None and workload.reward_model is not None else \
            candidate.base.get("reward_model_name_or_path")
        if rm:
            out["reward_model_name_or_path"] = rm
        funcs = candidate.base.get("reward_funcs")
        if funcs is None and not rm:
            funcs = list(DEFAULT_REWARD_FUNCS)
        if funcs is not None:
            out["reward_funcs"] = list(funcs)
        return out

    def trainer_kwargs(self, workload: Workload, candidate: Candidate) -> dict[str, Any]:
        """What a measured run (the probe's child) passes `<Trainer>(...)` beyond the shared arguments: the reward.
        The emitted default, built as trl grpo builds it (REWARD_REGISTRY): a host function, no device memory. A
        reward model given by --reward-model is the probe's to add (it loads one of its architecture by path)."""
        from trl.rewards import get_soft_overlong_punishment

        return {"reward_funcs": [get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)]}

    def completions_per_row(self, candidate: Candidate) -> int:
        """Micro-batch rows (completions) per dataset row (prompt): what a probe's plan of prompts divides by."""
        return int(self.knobs(candidate).num_generations)

    def script_keys(self) -> frozenset[str]:
        """The keys of `trl <command>`'s script arguments beyond ScriptArguments' (its YAML's reader accepts them)."""
        return frozenset(SCRIPT_KEYS)

    def run_config_dict(self, candidate: Candidate, *, model_name_or_path: str | None,
                        dataset_name: str | None = None, workload: Workload | None = None) -> dict[str, Any]:
        """The keys `trl grpo|rloo --config FILE` accepts: ScriptArguments (with reward_funcs /
        reward_model_name_or_path), the config, ModelConfig, and `env:` with both allocator variables."""
        from .base import run_config_for

        out = run_config_for(self, candidate, model_name_or_path=model_name_or_path, dataset_name=dataset_name,
                             output_dir=f"advisor-{self.name}", workload=workload)
        head = {k: out.pop(k) for k in ("model_name_or_path", "dataset_name") if k in out}
        env = out.pop("env", None)
        out = {**head, **self.script_kwargs(candidate, workload), **out}
        out["env"] = {**(env or {}), **allocator_env(candidate, self.knobs(candidate))}
        return out

    def to_python(self, candidate: Candidate, *, model_name_or_path: str, dataset_name: str | None = None,
                  workload: Workload | None = None) -> str:
        """The snippet through the one writer, with the reward functions / model as `<Trainer>(reward_funcs=...)`
        and both allocator variables set before torch starts."""
        from ..emit import write_python

        env = {**(candidate.base.get("env") or {}), **allocator_env(candidate, self.knobs(candidate))}
        shown = candidate.replace(base={**candidate.base.as_dict(), "env": env})
        script = self.script_kwargs(candidate, workload)
        rewards = ([repr(script["reward_model_name_or_path"])] if "reward_model_name_or_path" in script else [])
        imports = []
        for name in script.get("reward_funcs", ()):
            if name in REWARD_REGISTRY:  # as trl grpo builds it
                imports.append(f"from trl.rewards import {name}")
                rewards.append(REWARD_REGISTRY[name])
            else:  # a dotted import path
                module, func = name.rsplit(".", 1)
                imports.append(f"from {module} import {func}")
                rewards.append(func)
        return write_python(shown, config_name=self.config_name, trainer_name=self.trainer_name,
                            kwargs=self.emit_kwargs(candidate, workload), peft=self.peft_config(candidate),
                            model_name_or_path=model_name_or_path, dataset_name=dataset_name,
                            default_output_dir=f"advisor-{self.name}", data_hint=self.data_hint, workload=workload,
                            trainer_args=(f"reward_funcs=[{', '.join(rewards)}]",), imports=tuple(imports))

    def check_run_keys(self, data: Mapping[str, Any], *, source: str = "config") -> None:
        """An SFT-only key, `use_liger_loss` (removed from TRL) and `auto_find_batch_size: true` (refused by the
        config) are ConfigErrors naming the key and the fix (`trl <command>` would pass some on silently)."""
        from trl import SFTConfig

        problems = []
        sft_only = _field_names(SFTConfig) - _field_names(self.config_class())
        for key in sorted(k for k in data if k in sft_only):
            problems.append(f"{key}={data[key]!r}: an SFT-only key ({self.config_name} has no {key!r}); remove it "
                            f"from the {self.config_label} config")
        if "use_liger_loss" in data:
            problems.append(LIGER_LOSS_GONE.format(where=f"use_liger_loss={data['use_liger_loss']!r}"))
        if data.get("auto_find_batch_size"):
            problems.append(f"auto_find_batch_size={data['auto_find_batch_size']!r}: {self.config_name} raises "
                            f"\"auto_find_batch_size is not supported by {self.name.upper()}, because the generation "
                            "batch must contain full prompt groups of num_generations completions\"; set "
                            "auto_find_batch_size: false and lower per_device_train_batch_size instead")
        if problems:
            raise ConfigError(problems, context=source)

    def candidate_from_run_dict(self, data: Mapping[str, Any], *, source: str = "config") -> Candidate:
        """A `trl <command>` config read back: the shared keys as advisor.emit reads them, this trainer's own keys
        (its knobs, the rest as written) in the base; what this trainer emits itself for a plain candidate (TRL's
        defaults, its output_dir, the allocator variables, `own_from_run`'s) is not stored."""
        from ..emit import candidate_from_run_dict

        self.check_run_keys(data, source=source)
        own_keys = self.own_keys()
        shared = {k: v for k, v in data.items() if k not in own_keys and k != "env"}
        own = {k: v for k, v in data.items() if k in own_keys}
        if "env" in data:
            shared["env"] = data["env"]  # both allocator variables: the expandable_segments knob
        for key, emitted in (("auto_find_batch_size", False), ("vllm_tensor_parallel_size", 1),
                             ("pad_to_multiple_of", None)):
            if shared.get(key, own.get(key, emitted)) == emitted:
                shared.pop(key, None)
                own.pop(key, None)
        own = self.own_from_run(own)
        cand = candidate_from_run_dict(shared, source=source)
        base = cand.base.as_dict()
        if base.get("output_dir") == f"advisor-{self.name}":
            base.pop("output_dir")
        cand = cand.replace(base={**base, **own})
        try:
            knobs = self.knobs(cand)
        except ConfigError as exc:
            raise ConfigError(exc.problems, context=source) from None
        return knobs.apply(cand)

    def own_from_run(self, own: dict[str, Any]) -> dict[str, Any]:
        """This trainer's own keys of a file read back, as the base stores them: the default reward function (what
        the file names when the user gave none) and an empty reward model are not stored."""
        if own.get("reward_funcs") is not None and tuple(own["reward_funcs"]) == DEFAULT_REWARD_FUNCS \
                and not own.get("reward_model_name_or_path"):
            own.pop("reward_funcs")
        if own.get("reward_model_name_or_path") is None:
            own.pop("reward_model_name_or_path", None)
        return own

    # ---- data ----------------------------------------------------------------------------------------------------
    def load_dataset(self, spec: str | None, model: ModelSpec, tokenizer: str | None = None, *,
                     sample: int | None = None, seed: int = 0, progress: bool = False) -> Any:
        from .prompts import load_prompts

        return load_prompts(spec, model, tokenizer, trainer=self.name, sample=sample, seed=seed)

    def check_dataset(self, workload: Workload) -> None:
        from .prompts import PromptDataset, check_prompt_rows

        data = workload.dataset
        if not isinstance(data, PromptDataset):
            check_prompt_rows(list(data.rows[:1]), data.name, self.name)

    def dataset_from_rows(self, name: str, source: str, rows: tuple[dict, ...], *, dataset_name: str | None = None,
                          completion_only_loss: bool | None = None) -> Any:
        from .prompts import PromptDataset

        return PromptDataset(name=name, source=source, rows=tuple(tuple(int(t) for t in r) for r in rows),
                             dataset_name=dataset_name)

    def worst_rows(self, workload: Workload, candidate: Candidate) -> list:
        """The prompts of the generation batch that needs the most memory: the longest prompts, one per group of
        num_generations completions of this rank's generation batch (per_device_train_batch_size x
        steps_per_generation completions), each completion at max_completion_length (the bound)."""
        k = self.knobs(candidate)
        n = max(1, -(-k.generation_batch(candidate) // k.num_generations))
        data = workload.dataset
        return [data.rows[int(i)] for i in data.longest(n)]

    def train_dataset(self, workload: Workload, rows: list | None = None) -> datasets.Dataset:
        """The `prompt` column the trainer reads: advisor.modeling's placeholder text of each prompt's token ids."""
        import datasets

        from .prompts import PROMPT_COLUMN, placeholder_text

        picked = workload.dataset.rows if rows is None else rows
        return datasets.Dataset.from_dict({PROMPT_COLUMN: [placeholder_text(r) for r in picked]})

    def worst_batch(self, trainer: Any, batch_size: int) -> dict[str, torch.Tensor]:
        raise ConfigError([f"trainer={self.name!r}: an online step is not one collated batch; the simulator runs "
                           f"{self.trainer_name}.train() (generate, score, train) on the prompts of worst_rows"],
                          context=self.name)

    def labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The completion tokens (TRL's completion_mask), -100 elsewhere."""
        return batch["completion_ids"].masked_fill(batch["completion_mask"] == 0, -100)

    def shadows_integers(self) -> bool:
        return True  # the completion mask comes from the first EOS of each completion: data-dependent

    def extra_models(self, trainer: Any) -> list:
        out = [trainer.ref_model] if getattr(trainer, "ref_model", None) is not None else []
        import torch

        out += [f for f in getattr(trainer, "reward_funcs", []) if isinstance(f, torch.nn.Module)]
        return out

    # ---- the step as phases --------------------------------------------------------------------------------------
    def phases(self, candidate: Candidate) -> tuple:
        """generate (the policy and its optimizer state resident, the KV cache; colocated vLLM's share of the card,
        only while generating under sleep mode), score (the no-grad forwards: reference, old policy, reward model),
        train (forward, backward and optimizer step). What stays resident across the step is in every phase."""
        from .phases import Phase, PhaseKind, Resident

        k = self.knobs(candidate)
        pool = k.vllm_gpu_memory_utilization if k.colocated else 0.0
        held = 0.0 if k.vllm_enable_sleep_mode else pool  # asleep while scoring and training (level 2)
        resident = self.resident_models(candidate)
        return (
            Phase(PhaseKind.GENERATE, (*resident, Resident.OPTIMIZER_STATE), kv_cache=not k.use_vllm,
                  outside_allocator_fraction=pool),
            Phase(PhaseKind.SCORE, (*resident, Resident.OPTIMIZER_STATE), outside_allocator_fraction=held),
            Phase(PhaseKind.TRAIN, (*resident, Resident.GRADIENTS, Resident.OPTIMIZER_STATE), activations=True,
                  outside_allocator_fraction=held),
        )

    def resident_models(self, candidate: Candidate) -> tuple:
        """The models resident in every phase: the policy, a separate reference, a reward model given as a model."""
        from .phases import Resident

        resident = [Resident.POLICY]
        if self.knobs(candidate).separate_reference(candidate):
            resident.append(Resident.REFERENCE)
        if candidate.base.get("reward_model_name_or_path"):
            resident.append(Resident.REWARD_MODEL)
        return tuple(resident)

    # ---- what the report and the notes say -----------------------------------------------------------------------
    def report_rows(self, candidate: Candidate) -> list[list[str]]:
        k = self.knobs(candidate)
        ref = ("none" if k.beta == 0.0 else "adapters disabled" if candidate.use_lora else "separate copy")
        return [*super().report_rows(candidate),
                ["completions", f"{k.num_generations} per prompt x {k.max_completion_length} tokens; generation "
                                f"batch {k.generation_batch(candidate)} per GPU"],
                ["reference", f"{ref} (beta {k.beta:g})"]]

    def notes(self, candidate: Candidate) -> list[str]:
        k = self.knobs(candidate)
        out = [f"{self.name}: {self.trainer_name}'s step as generate / score / train; every completion at "
               f"max_completion_length={k.max_completion_length} (the bound: real completions that stop earlier "
               "need less)"]
        if "reward_funcs" not in candidate.base.as_dict() and not candidate.base.get("reward_model_name_or_path"):
            out.append(f"reward: no reward function or model given; the emitted file names TRL's "
                       f"{DEFAULT_REWARD_FUNCS[0]} (a host function: no device memory); set reward_funcs (or "
                       "--reward-model) to yours")
        if k.old_policy_forward(candidate):
            out.append("the old policy's log-probs: an extra no-grad forward on the completions each generation")
        if k.colocated and k.vllm_enable_sleep_mode:
            out.append("vllm_enable_sleep_mode: PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF are written with "
                       "expandable_segments:False (vLLM's CuMemAllocator refuses expandable segments)")
        return out


def engine_rules(c: Candidate, k: Any, gpu: GPUSpec | None) -> list[str]:
    """The generation engine's rules every generating trainer shares (TRL's and vLLM's), with the fix: vLLM on CUDA
    only, server mode with GPUs of its own and only there, sleep mode without expandable segments, vLLM's gathered
    weights under ZeRO-3."""
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


def allocator_env(candidate: Candidate, knobs: Any) -> dict[str, str]:
    """Both allocator variables, explicitly: PyTorch 2.10+ reads PYTORCH_ALLOC_CONF, vLLM's CuMemAllocator (sleep
    mode) only PYTORCH_CUDA_ALLOC_CONF, and refuses expandable_segments:True there."""
    from .._emit import ALLOC_ENV

    del knobs  # under sleep mode the rule (problems) asks for expandable_segments off; written as the knob says
    on = bool(candidate.expandable_segments)
    return {name: f"expandable_segments:{on}" for name in ALLOC_ENV}
