"""Online RL's files: what GRPOConfig / RLOOConfig and `trl grpo|rloo`'s script take beyond the knobs (the config
keys no knob owns, the reward functions or model, both allocator variables), the `<Trainer>(reward_funcs=...)` of
the snippet, the split of --num-gpus in server mode, and a `trl grpo|rloo` file read back. The one writer
(advisor/runconfig) writes the rest from the knobs; the online trainer (online_trainer.py) declares these."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..runconfig import ALLOC_ENV, model_input_keys
from ..space import with_knobs
from .base import own_keys, sft_only_keys
from .online_knobs import LIGER_LOSS_GONE, world_problems
from .protocol import GpuSplit

if TYPE_CHECKING:
    from ..space import Candidate
    from ..workload import Workload
    from .base import TrlTrainer

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
REWARD_MODEL_KEY = "reward_model_name_or_path"
# GRPOScriptArguments / RLOOScriptArguments' own keys (trl/scripts/grpo.py): ride in the candidate's base
SCRIPT_KEYS = (REWARD_MODEL_KEY, "reward_funcs")


def config_extras(c: Candidate, k: Any, *, measured: bool) -> dict[str, Any]:
    """The GRPOConfig / RLOOConfig keys no knob owns: vLLM's tensor parallelism (1: one GPU generates for its
    rank), auto_find_batch_size off (TRL refuses it); for a measured run (the probe, the simulator) every completion
    generated at max_completion_length (the bound the memory is counted at) and the prompts in the order given
    (the longest first)."""
    out: dict[str, Any] = {"vllm_tensor_parallel_size": c.base.get("vllm_tensor_parallel_size", 1),
                           "auto_find_batch_size": False}
    if measured:
        out["generation_kwargs"] = {**(c.base.get("generation_kwargs") or {}),
                                    "min_new_tokens": k.max_completion_length}
        out["shuffle_dataset"] = False
    return out


def reward_model(trainer: TrlTrainer, c: Candidate, workload: Workload | None) -> str | None:
    """The reward model given as a model (the writer's ModelInput keys: the workload's --reward-model, else the
    config's reward_model_name_or_path), or None."""

    return model_input_keys(trainer, c, workload).get(REWARD_MODEL_KEY)


def script_kwargs(trainer: TrlTrainer, c: Candidate, workload: Workload | None) -> dict[str, Any]:
    """GRPOScriptArguments / RLOOScriptArguments' own key beyond the reward model (written by the one writer from
    its declaration): the reward functions (host strings, not counted; TRL's get_soft_overlong_punishment when
    neither a function nor a model is given)."""
    funcs = c.base.get("reward_funcs")
    if funcs is None and not reward_model(trainer, c, workload):
        funcs = list(DEFAULT_REWARD_FUNCS)
    return {} if funcs is None else {"reward_funcs": list(funcs)}


def allocator_env(c: Candidate) -> dict[str, str]:
    """Both allocator variables, explicitly: PyTorch 2.10+ reads PYTORCH_ALLOC_CONF, vLLM's CuMemAllocator (sleep
    mode) only PYTORCH_CUDA_ALLOC_CONF, and refuses expandable_segments:True there (under sleep mode the rule asks
    for expandable_segments off; written as the knob says)."""

    on = bool(c.expandable_segments)
    return {name: f"expandable_segments:{on}" for name in ALLOC_ENV}


def snippet_arguments(trainer: TrlTrainer, c: Candidate, workload: Workload | None
                      ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`reward_funcs=[...]` of the snippet's `<Trainer>(...)` (the reward model by name, each function as `trl grpo`
    builds it from its registry, or imported from its dotted path) and the imports they need."""
    script = script_kwargs(trainer, c, workload)
    rm = reward_model(trainer, c, workload)
    rewards = [repr(rm)] if rm else []
    imports = []
    for name in script.get("reward_funcs", ()):
        if name in REWARD_REGISTRY:  # as trl grpo builds it
            imports.append(f"from trl.rewards import {name}")
            rewards.append(REWARD_REGISTRY[name])
        else:  # a dotted import path
            module, func = name.rsplit(".", 1)
            imports.append(f"from {module} import {func}")
            rewards.append(func)
    return (f"reward_funcs=[{', '.join(rewards)}]",), tuple(imports)


def gpu_split(c: Candidate, k: Any, model_name_or_path: str, num_gpus: int) -> GpuSplit | None:
    """Server mode: the last `vllm_server_gpus` of --num-gpus run `trl vllm-serve` (tensor-parallel over them),
    the first ones train (accelerate's num_processes); None otherwise (every GPU trains)."""
    if not k.served:
        return None
    problems = world_problems(k, num_gpus)
    if problems:
        raise ConfigError(problems, context="num_gpus")
    n = k.vllm_server_gpus
    train = ",".join(str(i) for i in range(num_gpus - n))
    serve = ",".join(str(i) for i in range(num_gpus - n, num_gpus))
    cmd = shlex.join(["trl", "vllm-serve", "--model", model_name_or_path, "--tensor-parallel-size", str(n)])
    return GpuSplit(train_gpus=num_gpus - n, train_env=f"CUDA_VISIBLE_DEVICES={train}",
                    server_command=f"CUDA_VISIBLE_DEVICES={serve} {cmd}",
                    chosen=f"vLLM server on GPU(s) {serve}, training on {train}")


def world_from_launch(c: Candidate, k: Any, num_gpus: int, processes: int | None = None) -> Candidate:
    """A server-mode run read back from its files on `num_gpus` GPUs: the server's GPUs are those the accelerate
    config does not launch (`processes`, its num_processes: the training ranks, when that file is given), else the
    one split two GPUs allow (one serves, one trains). `vllm_server_gpus` lives in the launch, not in the TRL file
    (TRL has no key for it, and `trl grpo --config` refuses a key it does not know). Other candidates as they are."""
    if not k.served:
        return c
    if processes is not None:
        served = num_gpus - processes
        if served < 1:
            raise ConfigError([
                f"vllm_mode='server' on --num-gpus {num_gpus} with num_processes {processes} in the accelerate "
                "config (--accelerate-config): no GPU is left for `trl vllm-serve`; give --num-gpus the "
                "training GPUs plus the server's (the suggestion's --num-gpus), or set vllm_mode: colocate"])
    elif k.vllm_server_gpus >= 1:
        return c  # set where the candidate was built (the search's)
    elif num_gpus == 2:
        served = 1
    elif num_gpus < 2:
        raise ConfigError([
            f"vllm_mode='server' on --num-gpus {num_gpus}: server mode runs `trl vllm-serve` on GPUs of its own "
            "beside those that train; give --num-gpus N (N >= 2: the training GPUs plus the server's; with "
            "N > 2 also --accelerate-config FILE, which says how many train), or set vllm_mode: colocate"])
    else:
        raise ConfigError([
            f"vllm_mode='server' on --num-gpus {num_gpus}: how many of them run `trl vllm-serve` is not in the "
            "TRL file (TRL has no key for it); give --accelerate-config FILE, the accelerate config `advisor "
            "suggest --accelerate-output FILE` wrote beside it (its num_processes train, the other GPUs of "
            "--num-gpus serve)"])
    return with_knobs(c, vllm_server_gpus=served)


def check_run_keys(trainer: TrlTrainer, data: Mapping[str, Any], *, source: str) -> None:
    """An SFT-only key, `use_liger_loss` (removed from TRL) and `auto_find_batch_size: true` (refused by the
    config) are ConfigErrors naming the key and the fix (`trl <command>` would pass some on silently)."""
    problems = [f"{key}={data[key]!r}: an SFT-only key ({trainer.config_name} has no {key!r}); remove it from the "
                f"{trainer.config_label} config" for key in sorted(k for k in data if k in sft_only_keys(trainer))]
    if "use_liger_loss" in data:
        problems.append(LIGER_LOSS_GONE.format(where=f"use_liger_loss={data['use_liger_loss']!r}"))
    if data.get("auto_find_batch_size"):
        problems.append(f"auto_find_batch_size={data['auto_find_batch_size']!r}: {trainer.config_name} raises "
                        f"\"auto_find_batch_size is not supported by {trainer.name.upper()}, because the generation "
                        "batch must contain full prompt groups of num_generations completions\"; set "
                        "auto_find_batch_size: false and lower per_device_train_batch_size instead")
    if problems:
        raise ConfigError(problems, context=source)


def candidate_from_run_dict(trainer: TrlTrainer, data: Mapping[str, Any], *, source: str) -> Candidate:
    """A `trl grpo|rloo` config read back: the shared keys as advisor/runconfig reads them, the online keys (the knobs
    of the trainer's view, the rest as written) in the base; what the trainer emits itself for a plain candidate
    (TRL's defaults, the default reward function, its output_dir, the allocator variables) is not stored."""
    check_run_keys(trainer, data, source=source)
    mine = own_keys(trainer) | set(SCRIPT_KEYS)
    shared = {k: v for k, v in data.items() if k not in mine and k != "env"}
    own = {k: v for k, v in data.items() if k in mine}
    if "env" in data:
        shared["env"] = data["env"]  # both allocator variables: the expandable_segments knob
    for key, emitted in (("auto_find_batch_size", False), ("vllm_tensor_parallel_size", 1),
                         ("pad_to_multiple_of", None)):
        if shared.get(key, own.get(key, emitted)) == emitted:
            shared.pop(key, None)
            own.pop(key, None)
    if own.get("reward_funcs") is not None and tuple(own["reward_funcs"]) == DEFAULT_REWARD_FUNCS \
            and not own.get(REWARD_MODEL_KEY):
        own.pop("reward_funcs")
    if own.get(REWARD_MODEL_KEY) is None:
        own.pop(REWARD_MODEL_KEY, None)
    cand = trainer.read_config(shared, own, source=source)
    try:
        knobs = trainer.knobs(cand)
    except ConfigError as exc:
        raise ConfigError(exc.problems, context=source) from None
    return knobs.apply(cand)
