"""From a Candidate to what TRL takes, for any trainer: its config kwargs, LoraConfig, model_init_kwargs, the
`trl <command>` YAML and a Python snippet; `load_run_config` reads such a YAML back.

Every memory-relevant config field is set explicitly, from the knobs the trainer's TRL config class has: TRL's
defaults change between versions (activation checkpointing is on by default in TRL's configs, bf16 too). The writer
is one for every trainer; a trainer adds only the keys no knob owns (advisor/trainers/protocol.py).

A run config as the user wrote it is a Candidate (the knobs) over a `RunBase` (every other key the user set).
`KEY_USES` classifies each key of the shared vocabulary (SFTConfig's, ModelConfig's, the script arguments'): a
knob; simulated (passed as written to the config / LoraConfig of every measured run); neutral (no effect on memory:
kept in what is emitted, not given to measured runs, where hub, reporting and output options would act); or refused
unless at a harmless value (it changes memory in a way that is not simulated: a ConfigError names the key and the
fix). A trainer's own keys (its config's fields outside that vocabulary) are its reader's.

The parts live in the run-config layer `advisor/runconfig/` (imported through its `__init__` only), below the
trainers: `keys.py` (KEY_USES), `config.py` (Candidate -> config kwargs, LoraConfig, BitsAndBytesConfig, env),
`writer.py` (the YAML, the Python snippet) and `reader.py` (a run config read back into a Candidate). This module,
above the trainer registry, is their public face, with the trainer named by its registry name or given as a Trainer
(default: advisor.trainers.DEFAULT).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .runconfig import (
    ALLOC_CONF,  # noqa: F401  (public, outside __all__)
    ALLOC_ENV,  # noqa: F401  (the allocator variables the files set)
    KEY_USES,
    KeyUse,
    RunConfig,
    answer_part,
    candidate_from_run_dict,
    env_vars,
    model_init_kwargs,
    peft_config,
    quantization_config,
    trl_fields,
    write_yaml,
)
from .runconfig import load_run_config as read_run_config
from .trainers import DEFAULT, get_trainer

if TYPE_CHECKING:
    from .space import Candidate
    from .trainers import Trainer
    from .workload import Workload

__all__ = [  # noqa: RUF022
    "KEY_USES", "KeyUse", "RunConfig", "answer_part", "candidate_from_run_dict", "env_vars", "load_run_config",
    "model_init_kwargs", "peft_config", "quantization_config", "config_kwargs", "build_config",
    "run_config_dict", "to_yaml", "to_python", "trl_fields", "write_yaml",
]


def config_kwargs(candidate: Candidate, workload: Workload | None = None, *, trainer: str | Trainer = DEFAULT,
                  measured: bool = False) -> dict[str, Any]:
    """`trainer`'s config kwargs (`Trainer.config_kwargs`)."""
    return get_trainer(trainer).config_kwargs(candidate, workload, measured=measured)


def build_config(candidate: Candidate, workload: Workload | None = None, *, trainer: str | Trainer = DEFAULT,
                 measured: bool = False, **overrides: Any) -> Any:
    """`trainer`'s TRL config built through its constructor (`Trainer.build_config`). `measured=True` for the
    simulator's and the probe's runs: the base's neutral keys (hub, reporting, output paths) stay out. On a machine
    without a GPU a bf16 config needs `use_cpu=True` among the overrides."""
    return get_trainer(trainer).build_config(candidate, workload, measured=measured, **overrides)


def run_config_dict(candidate: Candidate, *, trainer: str | Trainer = DEFAULT, model_name_or_path: str | None,
                    dataset_name: str | None = None, workload: Workload | None = None) -> dict[str, Any]:
    """The keys of `trainer`'s `trl <command> --config` file."""
    return get_trainer(trainer).run_config_dict(candidate, model_name_or_path=model_name_or_path,
                                                dataset_name=dataset_name, workload=workload)


def to_yaml(candidate: Candidate, *, trainer: str | Trainer = DEFAULT, model_name_or_path: str | None,
            dataset_name: str | None = None, workload: Workload | None = None, header: str | None = None) -> str:
    """`trainer`'s `trl <command> --config` file; `header` becomes leading `#` comment lines."""
    return get_trainer(trainer).to_yaml(candidate, model_name_or_path=model_name_or_path, dataset_name=dataset_name,
                                        workload=workload, header=header)


def to_python(candidate: Candidate, *, trainer: str | Trainer = DEFAULT, model_name_or_path: str,
              dataset_name: str | None = None, workload: Workload | None = None) -> str:
    """A snippet that trains with this configuration with `trainer`'s TRL classes."""
    return get_trainer(trainer).to_python(candidate, model_name_or_path=model_name_or_path,
                                          dataset_name=dataset_name, workload=workload)


def load_run_config(path: str | Path, trainer: str | Trainer = DEFAULT) -> RunConfig:
    """Read a RUN.yaml (what `advisor suggest --format yaml` writes and `trl <command> --config` accepts) as
    `trainer` reads it: another trainer's keys, e.g. `packing` in a DPO config, are refused by name."""
    return read_run_config(path, get_trainer(trainer))
