"""Emission's parts, private to `advisor/emit.py` (their public face): what each run-config key is, Candidate ->
TRL's config objects, the YAML and snippet writers, the reader. Import from here, never from the modules inside."""

from .config import (
    ALLOC_CONF,
    ALLOC_ENV,
    build_sft_config,
    emitted_sft_kwargs,
    env_vars,
    model_init_kwargs,
    peft_config,
    quantization_config,
    sft_config_kwargs,
)
from .keys import KEY_USES, KeyUse, trl_fields
from .reader import RunConfig, answer_part, candidate_from_run_dict, load_run_config
from .target import add_workload_keys, dataset_entry, dataset_of, load_line, target_keys, workload_keys
from .writer import run_config_dict, to_python, to_yaml, write_python, write_yaml

__all__ = [  # noqa: RUF022
    "KEY_USES", "KeyUse", "trl_fields",
    "ALLOC_CONF", "ALLOC_ENV", "sft_config_kwargs", "emitted_sft_kwargs", "model_init_kwargs",
    "quantization_config", "peft_config", "env_vars",
    "build_sft_config",
    "run_config_dict", "to_yaml", "to_python", "write_yaml", "write_python", "add_workload_keys", "workload_keys",
    "target_keys", "load_line", "dataset_of", "dataset_entry",
    "RunConfig", "answer_part", "candidate_from_run_dict", "load_run_config",
]
