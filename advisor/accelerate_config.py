"""The accelerate config (`accelerate launch --config_file`) of a multi-GPU run, beside the TRL config, and the launch
command. The keys are those `accelerate config` writes (accelerate/commands/config/cluster.py) and TRL's shipped
configs use (trl/accelerate_configs/fsdp2.yaml, zero2.yaml, zero3.yaml); every memory-relevant one is set
explicitly, so the run is the one that was simulated (advisor/simulator/distributed.py)."""

from __future__ import annotations

import os
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .parallelism import Layout, Parallelism, Strategy
from .workload import DEFAULT_TRAINER, check_world

__all__ = ["LaunchConfig", "LaunchRead", "accelerate_config", "read_accelerate_config"]


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
    from accelerate.commands.config.config_args import load_config_from_file  # lazy: loads accelerate

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "accelerate.yaml")
        with open(path, "w") as f:
            f.write(text)
        try:
            load_config_from_file(path)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"the emitted accelerate config does not load: {e}", context="accelerate_config") from e


# the keys of an accelerate config that change what a rank holds or how many train, compared with what the TRL
# file's candidate launches as (the launcher's plumbing, e.g. machine_rank, main_process_port, rdzv_backend, is not)
_MEMORY_KEYS = ("distributed_type", "mixed_precision", "num_processes", "num_machines", "use_cpu")
# keys accelerate_config writes inside fsdp_config / deepspeed_config that change nothing a rank holds in a step
_NEUTRAL = frozenset({"fsdp_state_dict_type", "deepspeed_multinode_launcher", "zero3_save_16bit_model"})


@dataclass(frozen=True)
class LaunchRead:
    """An accelerate config read back (`read_accelerate_config`): the layout of the ranks, how many processes it
    launches over how many machines, and the file's dict (`matches` checks it against a candidate)."""

    layout: Layout
    num_processes: int
    num_machines: int
    config: dict[str, Any]
    source: str

    def matches(self, candidate: Any, command: str = DEFAULT_TRAINER) -> None:
        """ConfigError naming each memory-relevant key whose value is not what `candidate` (its TRL file) launches
        as with this layout and these processes: the mixed precision, DeepSpeed's gradient accumulation, an FSDP /
        DeepSpeed option the advisor does not write (not simulated)."""
        want = accelerate_config(candidate.replace(parallelism=self.layout), self.layout.parallelism,
                                 self.num_processes, self.num_machines, command=command).config
        got, problems = self.config, []
        for key in _MEMORY_KEYS:
            if key in got and got[key] != want.get(key):
                problems.append(f"{key}: {got[key]!r}: the TRL file launches as {want.get(key)!r}; write "
                                f"{key}: {want.get(key)!r}")
        for section in ("fsdp_config", "deepspeed_config"):
            mine, theirs = want.get(section) or {}, got.get(section) or {}
            for key in sorted(set(mine) | set(theirs)):
                if key in _NEUTRAL or theirs.get(key) == mine.get(key):
                    continue
                if key not in mine:
                    problems.append(f"{section}.{key}: {theirs[key]!r}: changes memory and is not simulated; remove it")
                elif key in theirs:
                    problems.append(f"{section}.{key}: {theirs[key]!r}: the TRL file launches as {mine[key]!r}; "
                                    f"write {key}: {mine[key]!r}")
        if problems:
            raise ConfigError(problems, context=self.source)


def read_accelerate_config(path: Any) -> LaunchRead:
    """The accelerate config `accelerate_config` writes (`advisor suggest --accelerate-output FILE`), read back: its
    layout (distributed_type with fsdp_config / deepspeed_config), num_processes and num_machines. ConfigError
    naming the file and the key for what the advisor does not simulate (FSDP1, ZeRO-1, another distributed type)."""
    source = f"--accelerate-config {path}"
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot be read ({exc.strerror or exc}); give the file `advisor suggest "
                          "--accelerate-output FILE` wrote", context=source) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not YAML ({exc})", context=source) from None
    if isinstance(data, dict):
        from .emit import answer_part  # lazy: loads numpy

        data = answer_part(data, "accelerate_config")  # `advisor suggest --json`'s answer: its accelerate config
        if data is None:
            raise ConfigError("an answer of `advisor suggest --json` for one GPU: it has no accelerate config (it "
                              "launches without one); drop --accelerate-config", context=source)
    if not isinstance(data, dict):
        raise ConfigError("not a mapping of accelerate's keys (what `accelerate config` writes)", context=source)
    problems: list[str] = []
    processes, machines = (data.get(k, 1) for k in ("num_processes", "num_machines"))
    for key, value in (("num_processes", processes), ("num_machines", machines)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{key}: {value!r}: a whole number >= 1")
    kind = data.get("distributed_type", "NO")
    par = None
    if kind in ("NO", "MULTI_GPU"):
        par = Parallelism(Strategy.DDP)
    elif kind == "FSDP":
        fsdp = data.get("fsdp_config") or {}
        if str(fsdp.get("fsdp_version", 1)) != "2":
            problems.append(f"fsdp_config.fsdp_version: {fsdp.get('fsdp_version', 1)!r}: FSDP1 is not simulated; "
                            "write fsdp_version: 2 (FSDP2)")
        else:
            offload = bool(fsdp.get("fsdp_offload_params", False))
            par = Parallelism(Strategy.FSDP2, reshard_after_forward=bool(fsdp.get("fsdp_reshard_after_forward",
                                                                                   True)),
                              offload_params=offload, offload_optimizer=offload)
    elif kind == "DEEPSPEED":
        ds = data.get("deepspeed_config") or {}
        stage = ds.get("zero_stage")
        if stage not in (2, 3):
            problems.append(f"deepspeed_config.zero_stage: {stage!r}: the advisor simulates ZeRO-2 and ZeRO-3; "
                            "write zero_stage: 2 or 3")
        else:
            par = Parallelism(Strategy.ZERO2 if stage == 2 else Strategy.ZERO3,
                              offload_params=ds.get("offload_param_device", "none") == "cpu",
                              offload_optimizer=ds.get("offload_optimizer_device", "none") == "cpu")
    else:
        problems.append(f"distributed_type: {kind!r}: not simulated; the advisor writes NO, MULTI_GPU (DDP), FSDP "
                        "(FSDP2) or DEEPSPEED (ZeRO-2/3)")
    layout = next((lay for lay in Layout if lay.parallelism == par), None) if par is not None else None
    if par is not None and layout is None:
        problems.extend(par.problems() or [f"{kind} with these options is not a layout the advisor simulates"])
    if problems:
        raise ConfigError(problems, context=source)
    return LaunchRead(layout=layout, num_processes=processes, num_machines=machines, config=data, source=source)
