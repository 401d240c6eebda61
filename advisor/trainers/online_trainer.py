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

The trainer's parts live by role: its knobs and TRL's rules in online_knobs.py, its search space in
online_space.py, its files in online_files.py; the backends build the step from its knob view
(advisor/physics/online_step.py). `num_generations` and `max_completion_length` are the user's (quality): never
searched, never lowered. grpo.py / rloo.py declare what differs (TRL's classes, their views' defaults).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, UsageError
from . import online_files, online_space
from .base import TrlTrainer, every_row
from .online_knobs import OnlineKnobs, problems, world_problems
from .prompts import (
    DEFAULT_COMPLETION,
    PROMPT_COLUMN,
    PromptDataset,
    check_prompt_rows,
    load_prompts,
    placeholder_text,
    prompt_length_report,
)
from .protocol import GpuSplit, ModelInput, StepShape

if TYPE_CHECKING:
    import datasets
    import torch

    from ..lengths import LengthRequest
    from ..space import Candidate
    from ..workload import GPUSpec, ModelSpec, Workload

REWARD_MODEL = ModelInput(
    role="reward_model", flag="--reward-model", yaml_key=online_files.REWARD_MODEL_KEY,
    help="a reward model (hub id or local directory) resident beside the policy, counted in the memory (reward "
         "functions run on the host and are not); written as reward_model_name_or_path",
)


class OnlineRLTrainer(TrlTrainer):
    """What GRPO and RLOO share; a subclass declares its TRL classes, command and knob view."""

    example_dataset = "trl-lib/DeepMath-103K"
    data_hint = "your prompts (a 'prompt' column: text or a list of messages)"
    config_label: str
    knob_view = OnlineKnobs
    model_inputs = (REWARD_MODEL,)  # a reward model given as a model scores the completions
    batch_unit = "completions"  # what per_device_train_batch_size counts (a dataset row is a prompt)
    # pad_to_multiple_of (GRPOConfig pads each batch of completions with it) and use_kernels are not modelled by
    # the online step: not offered
    not_offered = frozenset({"pad_to_multiple_of", "use_kernels"})

    # ---- rules ------------------------------------------------------------------------------------------------
    def problems(self, candidate: Candidate, gpu: GPUSpec | None = None, model: ModelSpec | None = None
                 ) -> list[str]:
        """The shared rules (SFT's packing / padding-free rules left out: these configs have neither), then TRL's
        GRPOConfig / RLOOConfig rules, exactly as strict (one rank: the generation batch of this GPU), and vLLM's."""
        c = candidate
        out = self.candidate_problems(c, gpu, model)
        try:
            k = self.knobs(c)
        except ConfigError as exc:
            return [*out, *exc.problems]
        return [*out, *problems(self.config_name, self.name, c, k, gpu)]

    def candidate_problems(self, candidate: Candidate, gpu: GPUSpec | None = None, model: ModelSpec | None = None
                           ) -> list[str]:
        """The candidate's own rules but SFT's packing / padding-free ones (these configs have neither), and those
        two keys refused by name."""
        c = candidate
        out = c.replace(packing=False, padding_free=False).problems(gpu, model)
        for key in ("packing", "padding_free"):
            if getattr(c, key):
                out.append(f"{key}=True: an SFT-only key ({self.config_name} has no {key!r}; {self.trainer_name} "
                           "pads each batch of completions); remove it")
        return out

    def check_world(self, candidate: Candidate, num_gpus: int) -> list[str]:
        return world_problems(self.knobs(candidate), num_gpus)

    def canonical(self, candidate: Candidate) -> Candidate:
        return online_space.canonical(candidate)

    # ---- the search space (online_space.py) -------------------------------------------------------------------
    def search_values(self, workload: Workload, values: Mapping[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
        return online_space.search_values(workload, values)

    def joint_dimensions(self, values: Mapping[str, tuple[Any, ...]]) -> dict[str, tuple[tuple[str, dict], ...]]:
        return online_space.joint_dimensions(values)

    def derive(self, workload: Workload, candidate: Candidate, values: Mapping[str, tuple[Any, ...]]
               ) -> Candidate | str:
        return online_space.derive(workload, candidate, self.knobs(candidate), values)

    def derivation_notes(self, workload: Workload, candidate: Candidate, values: Mapping[str, tuple[Any, ...]]
                         ) -> list[str]:
        return online_space.derivation_notes(workload, candidate, self.knobs(candidate), values)

    def training_gpus(self, candidate: Candidate, num_gpus: int) -> int:
        return online_space.training_gpus(self.knobs(candidate), num_gpus)

    def completions_per_row(self, candidate: Candidate) -> int:
        """Micro-batch rows (completions) per dataset row (prompt): what a probe's plan of prompts divides by."""
        return int(self.knobs(candidate).num_generations)

    # ---- the files (online_files.py) --------------------------------------------------------------------------
    def config_extras(self, candidate: Candidate, workload: Workload | None, *, measured: bool) -> dict[str, Any]:
        return online_files.config_extras(candidate, self.knobs(candidate), measured=measured)

    def script_kwargs(self, candidate: Candidate, workload: Workload | None = None) -> dict[str, Any]:
        return online_files.script_kwargs(self, candidate, workload)

    def script_keys(self) -> frozenset[str]:
        return frozenset(online_files.SCRIPT_KEYS)

    def env(self, candidate: Candidate) -> dict[str, str]:
        return {**super().env(candidate), **online_files.allocator_env(candidate)}

    def snippet_arguments(self, candidate: Candidate, workload: Workload | None
                          ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return online_files.snippet_arguments(self, candidate, workload)

    def gpu_split(self, candidate: Candidate, model_name_or_path: str, num_gpus: int) -> GpuSplit | None:
        return online_files.gpu_split(candidate, self.knobs(candidate), model_name_or_path, num_gpus)

    def world_from_launch(self, candidate: Candidate, num_gpus: int, processes: int | None = None) -> Candidate:
        return online_files.world_from_launch(candidate, self.knobs(candidate), num_gpus, processes)

    def check_run_keys(self, data: Mapping[str, Any], *, source: str = "config") -> None:
        online_files.check_run_keys(self, data, source=source)

    def candidate_from_run_dict(self, data: Mapping[str, Any], *, source: str = "config") -> Candidate:
        return online_files.candidate_from_run_dict(self, data, source=source)

    def trainer_kwargs(self, workload: Workload, candidate: Candidate, models: Mapping[str, tuple[Any, Any]]
                       ) -> dict[str, Any]:
        """What a measured run passes `<Trainer>(...)` beyond the shared arguments: the reward. The emitted default,
        built as trl grpo builds it (online_files.REWARD_REGISTRY): a host function, no device memory; a reward
        model given (`models`: its module or path and its tokenizer) scores beside it, resident."""
        from trl.rewards import get_soft_overlong_punishment  # lazy: loads trl

        funcs: list[Any] = [get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)]
        out: dict[str, Any] = {"reward_funcs": funcs}
        given = models.get(REWARD_MODEL.role)
        if given is not None:
            out["reward_funcs"] = [*funcs, given[0]]
            out["reward_processing_classes"] = [None] * len(funcs) + [given[1]]
        return out

    # ---- data ----------------------------------------------------------------------------------------------------
    def load_dataset(self, spec: str | None, model: ModelSpec, tokenizer: str | None = None, *,
                     sample: int | None = None, seed: int = 0, progress: bool = False) -> Any:
        return load_prompts(spec, model, tokenizer, trainer=self.name, sample=sample, seed=seed)

    def check_dataset(self, workload: Workload) -> None:
        data = workload.dataset
        if not isinstance(data, PromptDataset):
            check_prompt_rows(list(data.rows[:1]), data.name, self.name)

    def dataset_from_rows(self, name: str, source: str, rows: tuple[dict, ...], *, dataset_name: str | None = None,
                          completion_only_loss: bool | None = None) -> Any:
        return PromptDataset(name=name, source=source, rows=tuple(tuple(int(t) for t in r) for r in rows),
                             dataset_name=dataset_name)

    def kept_rows(self, workload: Workload, candidate: Candidate) -> Any:
        return every_row(workload)

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
        import datasets  # lazy: loads datasets

        picked = workload.dataset.rows if rows is None else rows
        return datasets.Dataset.from_dict({PROMPT_COLUMN: [placeholder_text(r) for r in picked]})

    def worst_batch(self, trainer: Any, batch_size: int) -> dict[str, torch.Tensor]:
        raise ConfigError([f"trainer={self.name!r}: an online step is not one collated batch; the simulator runs "
                           f"{self.trainer_name}.train() (generate, score, train) on the prompts of worst_rows"],
                          context=self.name)

    def labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The completion tokens (TRL's completion_mask), -100 elsewhere."""
        return batch["completion_ids"].masked_fill(batch["completion_mask"] == 0, -100)

    # ---- the step ------------------------------------------------------------------------------------------------
    def step_shape(self, candidate: Candidate) -> StepShape:
        """Generation inside the step: the backends build it from the knob view (advisor/physics/online_step.py)."""
        return StepShape(generates=True)

    def shadows_integers(self) -> bool:
        return True  # the completion mask comes from the first EOS of each completion: data-dependent

    def extra_models(self, trainer: Any) -> list:
        import torch  # lazy: loads torch

        out = [trainer.ref_model] if getattr(trainer, "ref_model", None) is not None else []
        out += [f for f in getattr(trainer, "reward_funcs", []) if isinstance(f, torch.nn.Module)]
        return out

    # ---- what the report and the notes say -----------------------------------------------------------------------
    def length_report(self, data: Any, request: LengthRequest) -> Any:
        """The prompts' lengths and prompt + max_completion_length (--max-completion-length, else TRL's 512): the
        online trainers truncate neither, and their configs have no max_length (--max-length refused by name)."""
        if request.max_lengths:
            # reading N as the completion length would be a silent guess
            n = request.max_lengths[0]
            raise UsageError(f"--max-length {' '.join(map(str, request.max_lengths))} with --trainer "
                             f"{request.trainer}: {self.config_name} has no max_length (TRL 1.16 truncates no prompt; "
                             f"completions end at max_completion_length); use --max-completion-length {n} (suggest: "
                             f"--fix max_completion_length={n})")
        return prompt_length_report(data, request.max_completion_length or DEFAULT_COMPLETION)

    def report_rows(self, candidate: Candidate) -> list[list[str]]:
        k = self.knobs(candidate)
        ref = ("none" if k.beta == 0.0 else "adapters disabled" if candidate.use_lora else "separate copy")
        return [*super().report_rows(candidate),
                ["completions", f"{k.num_generations} per prompt x {k.max_completion_length} tokens; generation "
                                f"batch {k.generation_batch(candidate)} per GPU"],
                ["reference", f"{ref} (beta {k.beta:g})"]]

    def notes(self, candidate: Candidate, workload: Workload | None = None) -> list[str]:
        k = self.knobs(candidate)
        out = [f"{self.name}: {self.trainer_name}'s step as generate / score / train; every completion at "
               f"max_completion_length={k.max_completion_length} (the bound: real completions that stop earlier "
               "need less)"]
        scored = "reward_funcs" in candidate.base.as_dict() or online_files.reward_model(self, candidate, workload)
        if not scored:
            out.append(f"reward: no reward function or model given; the emitted file names TRL's "
                       f"{online_files.DEFAULT_REWARD_FUNCS[0]} (a host function: no device memory); set reward_funcs "
                       f"(or {REWARD_MODEL.flag}) to yours")
        if k.old_policy_forward(candidate):
            out.append("the old policy's log-probs: an extra no-grad forward on the completions each generation")
        if k.colocated and k.vllm_enable_sleep_mode:
            out.append("vllm_enable_sleep_mode: PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF are written with "
                       "expandable_segments:False (vLLM's CuMemAllocator refuses expandable segments)")
        return out
