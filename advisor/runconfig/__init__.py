"""The run config, below the trainers (which write and read through it) and above the value types: what each key of
a `trl <command>` config is, a Candidate as a trainer's TRL config objects, the YAML and snippet writers, the reader.
Every function takes the trainer it writes or reads for (advisor.trainers.Trainer); `advisor/emit.py`, above the
trainer registry, names the trainer for callers. Import from here, never from the modules inside."""

from .config import (
    ALLOC_CONF,
    ALLOC_ENV,
    config_kwargs,
    env_vars,
    model_init_kwargs,
    peft_config,
    quantization_config,
)
from .keys import KEY_USES, KeyUse, config_keys, trl_fields
from .reader import RunConfig, answer_part, candidate_from_run_dict, load_run_config
from .target import add_workload_keys, dataset_entry, dataset_of, load_line, target_keys, workload_keys
from .writer import model_input_keys, run_config_dict, write_python, write_yaml

__all__ = [  # noqa: RUF022
    "KEY_USES", "KeyUse", "trl_fields", "config_keys",
    "ALLOC_CONF", "ALLOC_ENV", "config_kwargs", "model_init_kwargs", "quantization_config", "peft_config",
    "env_vars",
    "run_config_dict", "write_yaml", "write_python", "model_input_keys", "add_workload_keys", "workload_keys",
    "target_keys", "load_line", "dataset_of", "dataset_entry",
    "RunConfig", "answer_part", "candidate_from_run_dict", "load_run_config",
]
