"""From a Candidate to what TRL takes: SFTConfig kwargs, LoraConfig, model_init_kwargs, a `trl sft` YAML.

Every memory-relevant SFTConfig field is set explicitly: TRL's defaults change between versions (activation
checkpointing is on by default in TRL's configs, bf16 too). `load_run_config` reads such a YAML back.

A run config as the user wrote it is a Candidate (the knobs) over a `RunBase` (every other key the user set).
`KEY_USES` classifies each key `trl sft --config` accepts: a knob; simulated (passed as written to the SFTConfig /
LoraConfig of every measured run); neutral (no effect on memory: kept in what is emitted, not given to measured
runs, where hub, reporting and output options would act); or refused unless at a harmless value (it changes
memory in a way that is not simulated: a ConfigError names the key and the fix).

The parts live in the private `advisor/_emit/` (imported through its `__init__` only): `keys.py` (KEY_USES),
`config.py` (Candidate -> SFTConfig kwargs, LoraConfig, BitsAndBytesConfig, env), `writer.py` (the `trl sft` YAML,
the Python snippet) and `reader.py` (a run config read back into a Candidate). This module is their public face.
"""

from __future__ import annotations

from ._emit import (
    ALLOC_CONF,  # noqa: F401  (public, outside __all__ as before)
    ALLOC_ENV,  # noqa: F401  (the allocator variables the files set)
    KEY_USES,
    KeyUse,
    RunConfig,
    answer_part,
    build_sft_config,
    candidate_from_run_dict,
    emitted_sft_kwargs,
    env_vars,
    load_run_config,
    model_init_kwargs,
    peft_config,
    quantization_config,
    run_config_dict,
    sft_config_kwargs,
    to_python,
    to_yaml,
    trl_fields,
    write_python,
    write_yaml,
)

__all__ = [  # noqa: RUF022
    "KEY_USES", "KeyUse", "RunConfig", "answer_part", "build_sft_config", "candidate_from_run_dict", "env_vars",
    "load_run_config",
    "model_init_kwargs", "peft_config", "quantization_config", "run_config_dict", "sft_config_kwargs",
    "emitted_sft_kwargs", "to_python",
    "to_yaml", "trl_fields", "write_python", "write_yaml",
]
