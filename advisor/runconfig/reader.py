"""Reading a run config back: a `trl sft --config` YAML (or another trainer's) into a Candidate over a base of the
user's other keys (`candidate_from_run_dict`, `load_run_config`); a key that changes memory and is not
simulated, a misspelt key or a value the advisor cannot measure is a ConfigError naming it and the fix."""

from __future__ import annotations

import argparse
import difflib
import enum
import functools
import importlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ..errors import ConfigError, UsageError
from ..knobs import KNOBS, TRL_DEFAULT, Home, Kind, Knob, knobs_in, yaml_keys
from ..space import CHECKPOINT_EXTRA, UNSUPPORTED_OPTIMIZERS, Candidate, Optimizer, Precision, Quantization
from .config import ALLOC_ENV
from .keys import (
    CHECKPOINT_KWARGS,
    EMITTED_DEFAULTS,
    KEY_USES,
    NEUTRAL_INIT_KWARGS,
    REFUSED,
    SHARED_SCRIPT,
    KeyUse,
    trl_default,
    trl_fields,
)
from .target import carried_by_run_config, dataset_of
from .writer import ONE_TARGET

if TYPE_CHECKING:
    from ..trainers import Trainer


@dataclass(frozen=True)
class RunConfig:
    """A `trl sft --config` file read back: the candidate (knobs over the user's base) and what it says about
    model and data."""

    candidate: Candidate
    model_name_or_path: str | None = None
    dataset_name: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    path: Path | None = None
    datasets: list[dict[str, Any]] | None = None  # a `datasets:` entry of local data (what the writer emits)
    use_cpu: bool | None = None  # the target's (the writer's `use_cpu`), not the candidate's
    # the models the trainer takes beside the policy (its ModelInputs: online RL's reward_model_name_or_path), by
    # parameter: resident beside the policy, part of the workload (their flags) as the model and the data are
    models: dict[str, str] = field(default_factory=dict)

    @property
    def dataset(self) -> str | None:
        """What `--dataset` takes for the file's data: its dataset_name, or the local file / directory of its
        `datasets:` entry."""
        return self.dataset_name or (dataset_of(self.datasets) if self.datasets else None)


def candidate_from_run_dict(data: dict[str, Any], *, source: str = "config") -> Candidate:
    """Map the shared keys (SFTConfig's, the vocabulary every trainer's reader starts from, and ModelConfig's) to a
    Candidate over a base of the other keys; unset knobs take TRL 1.16's defaults. A key that changes memory and is
    not simulated is a ConfigError naming it. Its values are typed as the shared vocabulary's parser types them
    (`typed_run_dict`)."""
    d = typed_run_dict(data, source=source)
    problems: list[str] = []
    base: dict[str, Any] = {}
    fields_ = trl_fields()
    for key, value in d.items():
        use = KEY_USES.get(key)
        if key == "env" or use is KeyUse.KNOB:
            continue
        if use is None:
            if key not in fields_:
                problems.append(f"unknown key {key!r}: not a key trl sft --config accepts")
            elif value != trl_default(key):
                problems.append(f"{key}={value!r}: this TRL key is not known to the advisor, so its effect on "
                                "memory is not simulated; remove it to measure")
            continue
        if use is KeyUse.REFUSED:
            harmless, fix = REFUSED[key]
            if not harmless(value):
                problems.append(f"{key}={value!r}: changes memory and is not simulated: {fix}")
            continue
        if key in EMITTED_DEFAULTS and value == EMITTED_DEFAULTS[key]:
            continue
        if carried_by_run_config(key, value):
            continue  # the target's and the data's keys: RunConfig's (target.py), not the base's
        base[key] = value

    ck_kwargs = _read_mapping(d.get("activation_checkpointing_kwargs", d.get("gradient_checkpointing_kwargs")),
                              "activation_checkpointing_kwargs", problems)
    extra_ck = _checkpoint_extras(ck_kwargs, problems)
    if extra_ck:
        base[CHECKPOINT_EXTRA] = extra_ck
    if d.get("load_in_4bit") and d.get("load_in_8bit"):
        problems.append("load_in_4bit and load_in_8bit both true: choose one")
    mik = _read_mapping(d.get("model_init_kwargs"), "model_init_kwargs", problems)
    extra_init = _init_extras(mik, problems)
    if extra_init:
        base["model_init_kwargs"] = extra_init
    sampling = d.get("train_sampling_strategy")
    if sampling not in (None, "random", "group_by_length"):
        base["train_sampling_strategy"] = sampling
    env = dict(d.get("env") or {})
    alloc = {name: str(env.pop(name)) for name in ALLOC_ENV if name in env}
    for name, value in alloc.items():
        options = [o.strip() for o in value.split(",") if o.strip()]
        other = [o for o in options if o.replace(" ", "") not in ("expandable_segments:True",
                                                                   "expandable_segments:False")]
        if other:
            problems.append(f"env {name}={value!r}: allocator options {other} are not simulated; keep only "
                            "expandable_segments")
    if env:
        base["env"] = {str(k): str(v) for k, v in env.items()}
    source_of = {Home.CHECKPOINT_KWARGS: ck_kwargs, Home.MODEL_INIT_KWARGS: mik}
    fields: dict[str, Any] = {"base": base}
    for k in KNOBS:
        if k.home is Home.LORA_CONFIG and not d.get("use_peft"):
            continue  # inactive: the Candidate's default
        fields[k.name] = _read_knob(k, d, source_of.get(k.home), alloc, problems)
    if problems:
        raise ConfigError(problems, context=source)
    try:
        return Candidate(**fields)
    except ConfigError as exc:
        raise ConfigError(exc.problems, context=source) from None


@functools.cache
def _trl_parser(trainer: Trainer | None) -> Any:
    """The TrlParser `trl <command>` builds (trl/scripts/<command>.py), only to read values as it reads them; without
    a trainer, the parser of the shared vocabulary's script (keys.SHARED_SCRIPT)."""
    if trainer is None:
        return importlib.import_module(SHARED_SCRIPT).make_parser()
    return trainer.make_parser()


def _converts(action: argparse.Action) -> bool:
    """An action whose type turns a YAML string into another value: TRL's booleans (string_to_bool), integers and
    floats (with TRL's 'none'/'null' for `T | None`), a choice's Enum. A str, dict or dataclass type is left as
    written: the reader checks those itself."""
    kind = action.type
    if kind in (int, float):
        return True
    return callable(kind) and not isinstance(kind, type)


def typed_run_dict(data: dict[str, Any], *, trainer: Trainer | None = None, source: str = "config"
                   ) -> dict[str, Any]:
    """The config's values as `trl <trainer> --config` reads them: TrlParser.set_defaults_with_config makes every
    YAML value an argparse default, and argparse converts a default that is a string with the field's type at the
    end of parse_args (so `packing: "false"` trains without packing, `per_device_train_batch_size: "4"` is 4 and
    `gradient_checkpointing: sometimes` is refused); a value of another type is taken as it is. A string TRL
    refuses is a ConfigError naming the key, the value and the fix."""
    parser = _trl_parser(trainer)
    actions: dict[str, argparse.Action] = {}
    for a in parser._actions:  # the field's own action, not its `--no_<field>` complement (store_false, no type)
        if a.type is not None or a.dest not in actions:
            actions[a.dest] = a
    out: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in data.items():
        action = actions.get(key)
        if action is None or not isinstance(value, str) or not _converts(action):
            out[key] = value
            continue
        try:
            typed = parser._get_value(action, value)
        except argparse.ArgumentError as exc:
            name = getattr(action.type, "__name__", "")
            fix = ("write true or false" if name == "string_to_bool" else
                   "write a whole number, e.g. 4" if name == "int" else
                   "write a number, e.g. 0.5" if name == "float" else "write a value trl accepts")
            command = trainer.command if trainer is not None else SHARED_SCRIPT.rpartition(".")[2]
            problems.append(f"{key}={value!r}: trl {command} --config refuses it ({exc.message}); {fix}")
            continue
        out[key] = typed.value if isinstance(typed, enum.Enum) else typed
    if problems:
        raise ConfigError(problems, context=source)
    return out


def _checkpoint_extras(ck_kwargs: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """activation_checkpointing_kwargs beyond the knobs' (selective, every_n_layers, offload): the options torch's
    checkpoint takes as written; any other is a problem named."""
    ck_keys = {k.key for k in knobs_in(Home.CHECKPOINT_KWARGS)}
    extra_ck = {}
    for k, v in ck_kwargs.items():
        if k in ck_keys:
            continue  # a knob's (selective, every_n_layers, offload)
        if k == "use_reentrant" and v is False:
            continue  # what TRL sets when it is not given, and what the emitter writes
        if k in CHECKPOINT_KWARGS:
            extra_ck[k] = v
        else:
            problems.append(f"activation_checkpointing_kwargs {k}={v!r}: not an option the advisor simulates "
                            f"(known: {', '.join([*sorted(ck_keys), *CHECKPOINT_KWARGS])}); remove it")
    return extra_ck


def _init_extras(mik: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """model_init_kwargs beyond the knobs' (dtype, attention, the MODEL_INIT_KWARGS knobs): the loading options
    that do not change memory, kept; any other is a problem named."""
    init_keys = {"dtype", "torch_dtype", "attn_implementation", *(k.key for k in knobs_in(Home.MODEL_INIT_KWARGS))}
    extra_init = {}
    for k, v in mik.items():
        if k in init_keys:
            continue
        if k in NEUTRAL_INIT_KWARGS:
            extra_init[k] = v
        else:
            problems.append(f"model_init_kwargs {k}={v!r}: changes how the model is loaded and is not simulated; "
                            "remove it (quantization: load_in_4bit / load_in_8bit)")
    return extra_init


def _read_mapping(value: Any, name: str, problems: list[str]) -> dict[str, Any]:
    """A kwargs key of a run config (a mapping, or the JSON text the CLI passes)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            problems.append(f"{name}={value!r}: not a JSON object")
            return {}
    if not isinstance(value, dict):
        problems.append(f"{name}={value!r}: must be a mapping")
        return {}
    return value


def _read_knob(k: Knob, d: dict[str, Any], kwargs: dict[str, Any] | None, alloc: dict[str, str],
               problems: list[str]) -> Any:
    """One knob's value from a run config: its key in its home, else what TRL takes when it is not set."""
    absent = trl_default(k.key) if k.absent is TRL_DEFAULT else k.absent
    if k.name == "precision":
        bf16, fp16 = d.get("bf16"), bool(d.get("fp16", False))
        return Precision.FP16 if fp16 else Precision.BF16 if bf16 in (None, True) else Precision.FP32
    if k.name == "quantization":
        return Quantization.NF4 if d.get("load_in_4bit") else Quantization.INT8 if d.get("load_in_8bit") else \
            Quantization.NONE
    if k.name == "group_by_length":
        return d.get("train_sampling_strategy") == "group_by_length" or bool(d.get("group_by_length"))
    if k.name == "expandable_segments":
        return any("expandable_segments:True" in v.replace(" ", "") for v in alloc.values())
    if k.name == "lora_target_modules":
        return _read_targets(d.get("lora_target_modules"), problems)
    if k.name == "weights_dtype":
        # trl sft: model_init_kwargs update what ModelConfig's dtype gives
        mik = _read_mapping(d.get("model_init_kwargs"), "model_init_kwargs", [])
        dtype = mik.get("dtype") or mik.get("torch_dtype") or d.get("dtype") or trl_default("dtype")
        if dtype == "auto":
            problems.append("dtype=auto: the advisor needs an explicit dtype (float32, bfloat16 or float16)")
            return "float32"
        return dtype
    if k.name == "attn_implementation":
        mik = _read_mapping(d.get("model_init_kwargs"), "model_init_kwargs", [])
        return mik.get("attn_implementation") or d.get("attn_implementation")  # None: what transformers picks
    if kwargs is not None:
        value = kwargs.get(k.key, absent)
    else:
        value = next((d[key] for key in yaml_keys(k) if key in d), absent)
    if k.name == "optim" and value in UNSUPPORTED_OPTIMIZERS:
        known = ", ".join(o.value for o in Optimizer)
        problems.append(f"optim={value!r}: {UNSUPPORTED_OPTIMIZERS[value]}; use one of {known}")
        return Optimizer.ADAMW_TORCH.value
    if k.name == "pad_to_multiple_of" and value == "auto":
        return None
    if k.kind is Kind.BOOL:
        return bool(value)
    if k.name == "checkpoint_every_n_layers":
        return int(value)
    return value


def _read_targets(targets: Any, problems: list[str]) -> tuple[str, ...] | None:
    """lora_target_modules as trl sft reads it: None is PEFT's default for the model type; ModelConfig turns a
    one-element list into a string that PEFT matches as a regular expression against full module names."""
    if targets is None:
        return None
    items = [targets] if isinstance(targets, str) else list(targets)
    if len(items) != 1 or items[0] == "all-linear":
        return tuple(str(t) for t in items)
    one = str(items[0])
    m = ONE_TARGET.fullmatch(one)
    if m:
        return (m.group(1),)
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", one):
        problems.append(
            f"lora_target_modules={targets!r}: trl sft passes one module as a regular expression matched against "
            f"full module names, so {one!r} matches nothing and PEFT raises \"Target modules not found\"; write "
            f"'.*\\.{one}' or list several modules"
        )
    else:
        problems.append(f"lora_target_modules={targets!r}: a regular expression is not simulated; list the module "
                        "names, or write one module as '.*\\.NAME'")
    return None


def load_run_config(path: str | Path, trainer: Trainer) -> RunConfig:
    """Read a RUN.yaml (what `advisor suggest --format yaml` writes and `trl <command> --config` accepts) as
    `trainer` reads it: another trainer's keys, e.g. `packing` in a DPO config, are refused by name."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--config {path}: no such file; write one with `advisor suggest --format yaml --output "
                         f"{path}`")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UsageError(f"--config {path}: not valid YAML ({exc}); fix the file") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: must be a YAML mapping of trl sft keys, got {type(data).__name__}")
    data = answer_part(data, "config")  # `advisor suggest --json`'s answer: its run config
    env = {str(k): str(v) for k, v in (data.get("env") or {}).items()}
    data = typed_run_dict(data, trainer=trainer, source=f"--config {path}")
    trainer.check_run_keys(data, source=f"--config {path}")
    # its config's keys, its script's, its models' beside the policy
    _check_keys(data, path, extra=trainer.config_fields() | trainer.script_keys()
                | {m.yaml_key for m in trainer.model_inputs})
    cand = trainer.candidate_from_run_dict(data, source=f"--config {path}")
    return RunConfig(
        candidate=cand,
        model_name_or_path=data.get("model_name_or_path"),
        dataset_name=data.get("dataset_name"),
        env=env,
        path=path,
        datasets=data["datasets"] if dataset_of(data.get("datasets")) is not None else None,
        use_cpu=data.get("use_cpu"),
        models={m.param: str(data[m.yaml_key]) for m in trainer.model_inputs if data.get(m.yaml_key)},
    )


def answer_part(data: dict[str, Any], key: str) -> Any:
    """`data` itself, or where it is the answer `advisor suggest --json` writes (Suggestion.to_json_dict: the
    measurement beside `config`, the run config, and on several GPUs `accelerate_config`), its part `key`: every
    file suggest writes reads back."""
    if not ({"config", "peak_bytes", "source"} <= data.keys() and isinstance(data.get("config"), dict)):
        return data
    return data.get(key)


def _check_keys(data: dict[str, Any], path: Path, extra: set[str] | frozenset[str] = frozenset()) -> None:
    """`trl sft` passes unknown keys on silently; we don't: a misspelt key is an error here (`extra`: another
    trainer's config fields)."""
    known = {"env", *trl_fields(), *extra}
    unknown = sorted(set(data) - known)
    if unknown:
        problems = []
        for key in unknown:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            problems.append(f"unknown key {key!r}" + (f"; did you mean {near[0]!r}?" if near else ""))
        raise ConfigError(problems, context=f"--config {path}")
