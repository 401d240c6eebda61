"""The accelerate config (`accelerate launch --config_file`) of a multi-GPU run, beside the TRL config, and the launch
command. The keys are those `accelerate config` writes (accelerate/commands/config/cluster.py) and TRL's shipped
configs use (trl/accelerate_configs/fsdp2.yaml, zero2.yaml, zero3.yaml); every memory-relevant one is set
explicitly, so the run is the one that was simulated (advisor/_sim/distributed.py)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

import yaml

from .errors import ConfigError
from .parallelism import Parallelism, Strategy
from .workload import DEFAULT_TRAINER, check_world

__all__ = ["LaunchConfig", "accelerate_config"]


@dataclass(frozen=True)
class LaunchConfig:
    """An accelerate config as a dict and as YAML, and the commands that launch a TRL trainer (`trl <command>`) with
    it."""

    config: dict[str, Any]
    yaml: str
    command: str  # accelerate launch --config_file ... -m trl.scripts.<command> --config ...
    trl_command: str  # the same through TRL's CLI: trl <command> --config ... --accelerate_config ...
    chosen: str  # what was chosen, in words: "FSDP2, reshard after forward", "DeepSpeed ZeRO-3, optimizer offload"
    server: str | None = None  # online RL's server mode: the `trl vllm-serve` command on GPUs of its own, run first


def accelerate_config(candidate: Any, parallelism: Parallelism, num_gpus: int, num_machines: int = 1, *,
                      config_file: str = "accelerate.yaml", trl_config_file: str = "trl.yaml",
                      command: str = DEFAULT_TRAINER) -> LaunchConfig:
    """The accelerate config that launches `candidate` with `parallelism` on `num_gpus` GPUs over `num_machines`;
    the commands run `trl <command>` (the trainer's: `Trainer.command`; the default trainer's unless given), whose
    script is `trl.scripts.<command>`."""

    check_world(num_gpus, num_machines)
    parallelism.check(num_gpus)
    precision = candidate.precision.value
    mixed = precision if precision in ("bf16", "fp16") else "no"
    base: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": mixed,
        "num_machines": num_machines,
        "num_processes": num_gpus,  # accelerate counts processes over all machines
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    s = parallelism.strategy
    if num_gpus == 1:
        base.update(distributed_type="NO")
        chosen = "one GPU"
    elif s is Strategy.DDP:
        base.update(distributed_type="MULTI_GPU")
        chosen = "DDP"
    elif s is Strategy.FSDP2:
        base.update(distributed_type="FSDP", fsdp_config={
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": parallelism.reshard_after_forward,
            "fsdp_offload_params": parallelism.offload_params,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # each decoder layer (model._no_split_modules)
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            # shards on the meta device: no full copy of the model on any GPU while loading
            "fsdp_cpu_ram_efficient_loading": True,
            # checkpointing is TRL's (activation_checkpointing in the TRL config), not accelerate's
            "fsdp_activation_checkpointing": False,
        })
        chosen = "FSDP2, " + ("reshard after forward" if parallelism.reshard_after_forward else
                              "no reshard after forward") + (", CPU offload" if parallelism.offload_params else "")
    else:
        stage = 2 if s is Strategy.ZERO2 else 3
        ds: dict[str, Any] = {
            "zero_stage": stage,
            "offload_optimizer_device": "cpu" if parallelism.offload_optimizer else "none",
            "offload_param_device": "cpu" if parallelism.offload_params else "none",
            "gradient_accumulation_steps": candidate.gradient_accumulation_steps,
            "deepspeed_multinode_launcher": "standard",
        }
        if stage == 3:
            ds.update(zero3_init_flag=True, zero3_save_16bit_model=True)
        base.update(distributed_type="DEEPSPEED", deepspeed_config=ds)
        chosen = f"DeepSpeed ZeRO-{stage}" + (", optimizer offload" if parallelism.offload_optimizer else "") + (
            ", parameter offload" if parallelism.offload_params else "")
    text = yaml.safe_dump(base, sort_keys=True)
    launch = ["accelerate", "launch", "--config_file", config_file]
    if num_machines > 1:
        launch += ["--machine_rank", "$MACHINE_RANK", "--main_process_ip", "$MAIN_PROCESS_IP",
                   "--main_process_port", "29500"]
    cmd = " ".join(shlex.quote(a) if not a.startswith("$") else a for a in
                   launch + ["-m", f"trl.scripts.{command}", "--config", trl_config_file])
    trl_cmd = " ".join(shlex.quote(a) for a in ["trl", command, "--config", trl_config_file, "--accelerate_config",
                                                 config_file])
    if num_machines > 1:
        trl_cmd += " --machine_rank $MACHINE_RANK --main_process_ip $MAIN_PROCESS_IP --main_process_port 29500"
    return LaunchConfig(config=base, yaml=text, command=cmd, trl_command=trl_cmd, chosen=chosen)


def check_loads(text: str) -> None:
    """ConfigError unless accelerate's own loader (`accelerate launch --config_file`) accepts `text`."""
    import os
    import tempfile

    from accelerate.commands.config.config_args import load_config_from_file

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "accelerate.yaml")
        with open(path, "w") as f:
            f.write(text)
        try:
            load_config_from_file(path)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"the emitted accelerate config does not load: {e}", context="accelerate_config") from e
