"""From a Candidate to what TRL takes: SFTConfig kwargs, LoraConfig, model_init_kwargs, a `trl sft` YAML.

Every memory-relevant SFTConfig field is set explicitly: TRL's defaults change between versions (activation
checkpointing is on by default in TRL's configs, bf16 too). `load_run_config` reads such a YAML back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .errors import ConfigError, UsageError
from .space import Candidate, Optimizer, Precision, Quantization

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig
    from trl import SFTConfig

    from .workload import ModelSpec, Workload

ALLOC_CONF = "expandable_segments:True"


def sft_config_kwargs(candidate: Candidate, workload: Workload | None = None) -> dict[str, Any]:
    """The SFTConfig fields that decide memory and speed, each set explicitly."""
    c = candidate
    completion_only = workload.dataset.completion_only_loss if workload is not None else None
    return {
        "max_length": c.max_length,
        "truncation_mode": "keep_start",
        "packing": c.packing,
        "packing_strategy": c.packing_strategy.value,
        "padding_free": c.padding_free,
        "pad_to_multiple_of": c.pad_to_multiple_of,
        "per_device_train_batch_size": c.per_device_train_batch_size,
        "gradient_accumulation_steps": c.gradient_accumulation_steps,
        "activation_checkpointing": c.activation_checkpointing,
        "activation_checkpointing_kwargs": c.checkpointing_kwargs,
        "activation_offloading": c.activation_offloading,
        "optim": c.optim.value,
        "bf16": c.precision is Precision.BF16,
        "fp16": c.precision is Precision.FP16,
        "train_sampling_strategy": "group_by_length" if c.group_by_length else "random",
        "use_liger_kernel": False,
        "completion_only_loss": completion_only,
        "model_init_kwargs": model_init_kwargs(c),
    }


def model_init_kwargs(candidate: Candidate) -> dict[str, Any]:
    """What `from_pretrained` gets through SFTConfig.model_init_kwargs (as trl/scripts/sft.py builds it).

    Quantization is passed separately, as the trainer's `quantization_config=` argument (see
    `quantization_config`), exactly like trl/scripts/sft.py does.
    """
    return {"dtype": candidate.weights_dtype.value, "attn_implementation": candidate.attn_implementation.value}


def quantization_config(candidate: Candidate) -> BitsAndBytesConfig | None:
    """The BitsAndBytesConfig of trl.get_quantization_config for this candidate, or None."""
    if candidate.quantization is Quantization.NONE:
        return None
    from transformers import BitsAndBytesConfig

    if candidate.quantization is Quantization.NF4:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_compute_dtype=_compute_dtype(candidate),
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=False,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def _compute_dtype(candidate: Candidate) -> str:
    """trl.get_quantization_config computes in the weights' dtype (ModelConfig.dtype); so do we."""
    return candidate.weights_dtype.value


def peft_config(candidate: Candidate, model: ModelSpec | None = None) -> LoraConfig | None:
    if not candidate.use_lora:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=candidate.lora_r,
        lora_alpha=candidate.lora_alpha,
        lora_dropout=0.0,
        target_modules=list(candidate.lora_target_modules),
        task_type="CAUSAL_LM",
    )


def env_vars(candidate: Candidate) -> dict[str, str]:
    """Allocator settings; both names, since PyTorch 2.10 reads PYTORCH_ALLOC_CONF and vLLM the CUDA one."""
    if not candidate.expandable_segments:
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": ALLOC_CONF, "PYTORCH_ALLOC_CONF": ALLOC_CONF}


def build_sft_config(candidate: Candidate, workload: Workload | None = None, **overrides: Any) -> SFTConfig:
    """A trl.SFTConfig built through its constructor (so activation/gradient checkpointing names stay synced).

    On a machine without a GPU a bf16 config needs `use_cpu=True` among the overrides.
    """
    from trl import SFTConfig

    kwargs = sft_config_kwargs(candidate, workload)
    kwargs.setdefault("output_dir", overrides.pop("output_dir", "advisor-sft"))
    kwargs.update(overrides)
    return SFTConfig(**kwargs)


# ---- YAML for `trl sft --config` -------------------------------------------------------------------------

# ModelConfig fields (trl sft) that carry the candidate's model-side knobs.
_MODEL_KEYS = ("dtype", "attn_implementation", "use_peft", "lora_r", "lora_alpha", "lora_dropout",
               "lora_target_modules", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type")


def run_config_dict(
    candidate: Candidate, *, model_name_or_path: str | None, dataset_name: str | None = None,
    completion_only_loss: bool | None = None, output_dir: str = "advisor-sft",
) -> dict[str, Any]:
    """The keys `trl sft --config FILE` accepts: ScriptArguments, SFTConfig, ModelConfig and an `env:` block."""
    c = candidate
    kw = sft_config_kwargs(c)
    kw.pop("model_init_kwargs")  # trl sft builds it from ModelConfig's dtype / attn_implementation
    kw["completion_only_loss"] = completion_only_loss
    out: dict[str, Any] = {}
    if model_name_or_path is not None:
        out["model_name_or_path"] = model_name_or_path
    if dataset_name is not None:
        out["dataset_name"] = dataset_name
    out["output_dir"] = output_dir
    out.update(kw)
    out["dtype"] = c.weights_dtype.value
    out["attn_implementation"] = c.attn_implementation.value
    out["use_peft"] = c.use_lora
    if c.use_lora:
        out.update(
            lora_r=c.lora_r, lora_alpha=c.lora_alpha, lora_dropout=0.0,
            lora_target_modules=list(c.lora_target_modules),
        )
    out["load_in_4bit"] = c.quantization is Quantization.NF4
    out["load_in_8bit"] = c.quantization is Quantization.INT8
    if c.quantization is Quantization.NF4:
        out["bnb_4bit_quant_type"] = "nf4"
    env = env_vars(c)
    if env:
        out["env"] = env
    return out


def to_yaml(candidate: Candidate, *, header: str | None = None, **kwargs: Any) -> str:
    """The `trl sft --config` file; `header` becomes leading `#` comment lines, and without a dataset_name a
    commented placeholder says where `trl sft` takes it from."""
    body = yaml.safe_dump(run_config_dict(candidate, **kwargs), sort_keys=False)
    if kwargs.get("dataset_name") is None:
        placeholder = ("# dataset_name: trl-lib/Capybara   # your dataset: a hub id or a local dataset directory "
                       "(or pass --dataset_name to trl sft)\n")
        lines = body.splitlines(keepends=True)
        at = 1 if lines and lines[0].startswith("model_name_or_path:") else 0
        body = "".join(lines[:at]) + placeholder + "".join(lines[at:])
    if header:
        body = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines()) + body
    return body


@dataclass(frozen=True)
class RunConfig:
    """A `trl sft --config` file read back: the candidate and what it says about model and data."""

    candidate: Candidate
    model_name_or_path: str | None = None
    dataset_name: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    path: Path | None = None


def candidate_from_run_dict(data: dict[str, Any], *, source: str = "config") -> Candidate:
    """Map SFTConfig / ModelConfig keys to a Candidate; unset knobs take TRL 1.16's defaults."""
    d = dict(data)
    problems: list[str] = []
    defaults = Candidate.trl_defaults()
    ck = d.get("activation_checkpointing", d.get("gradient_checkpointing", defaults.activation_checkpointing))
    ck_kwargs = d.get("activation_checkpointing_kwargs", d.get("gradient_checkpointing_kwargs")) or {}
    if isinstance(ck_kwargs, str):
        import json

        try:
            ck_kwargs = json.loads(ck_kwargs)
        except ValueError:
            problems.append(f"activation_checkpointing_kwargs={ck_kwargs!r}: not a JSON object")
            ck_kwargs = {}
    bf16, fp16 = d.get("bf16"), bool(d.get("fp16", False))
    precision = Precision.FP16 if fp16 else Precision.BF16 if bf16 in (None, True) else Precision.FP32
    quant = Quantization.NF4 if d.get("load_in_4bit") else Quantization.INT8 if d.get("load_in_8bit") else \
        Quantization.NONE
    if d.get("load_in_4bit") and d.get("load_in_8bit"):
        problems.append("load_in_4bit and load_in_8bit both true: choose one")
    mik = d.get("model_init_kwargs") or {}
    dtype = d.get("dtype") or mik.get("dtype") or "float32"
    if dtype == "auto":
        problems.append("dtype=auto: the advisor needs an explicit dtype (float32, bfloat16 or float16)")
        dtype = "float32"
    attn = d.get("attn_implementation") or mik.get("attn_implementation") or "sdpa"
    fields: dict[str, Any] = {
        "max_length": d.get("max_length", defaults.max_length),
        "packing": bool(d.get("packing", False)),
        "packing_strategy": d.get("packing_strategy", "bfd"),
        "padding_free": bool(d.get("padding_free", False)),
        "pad_to_multiple_of": None if d.get("pad_to_multiple_of") in (None, "auto") else d.get("pad_to_multiple_of"),
        "per_device_train_batch_size": d.get("per_device_train_batch_size", defaults.per_device_train_batch_size),
        "gradient_accumulation_steps": d.get("gradient_accumulation_steps", 1),
        "activation_checkpointing": bool(ck),
        "checkpoint_selective": bool(ck_kwargs.get("selective", False)),
        "checkpoint_every_n_layers": int(ck_kwargs.get("every_n_layers", 1)),
        "activation_offloading": bool(d.get("activation_offloading", False)),
        "optim": d.get("optim", Optimizer.ADAMW_TORCH_FUSED.value),
        "precision": precision,
        "weights_dtype": dtype,
        "group_by_length": d.get("train_sampling_strategy") == "group_by_length" or bool(d.get("group_by_length")),
        "attn_implementation": attn,
        "use_lora": bool(d.get("use_peft", False)),
        "quantization": quant,
        "expandable_segments": "expandable_segments:True" in str((d.get("env") or {}).get(
            "PYTORCH_CUDA_ALLOC_CONF", (d.get("env") or {}).get("PYTORCH_ALLOC_CONF", ""))),
    }
    if d.get("use_peft"):
        fields["lora_r"] = d.get("lora_r", 16)
        fields["lora_alpha"] = d.get("lora_alpha", 32)
        targets = d.get("lora_target_modules")
        if targets:
            fields["lora_target_modules"] = tuple([targets] if isinstance(targets, str) else targets)
    if problems:
        raise ConfigError(problems, context=source)
    try:
        return Candidate(**fields)
    except ConfigError as exc:
        raise ConfigError(exc.problems, context=source) from None


def load_run_config(path: str | Path) -> RunConfig:
    """Read a RUN.yaml (what `advisor suggest --format yaml` writes and `trl sft --config` accepts)."""
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
    _check_keys(data, path)
    env = {str(k): str(v) for k, v in (data.get("env") or {}).items()}
    return RunConfig(
        candidate=candidate_from_run_dict(data, source=f"--config {path}"),
        model_name_or_path=data.get("model_name_or_path"),
        dataset_name=data.get("dataset_name"),
        env=env,
        path=path,
    )


def _check_keys(data: dict[str, Any], path: Path) -> None:
    """`trl sft` passes unknown keys on silently; we don't: a misspelt key is an error here."""
    import dataclasses

    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig

    known = {"env"}
    for cls in (ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig):
        known.update(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(data) - known)
    if unknown:
        import difflib

        problems = []
        for key in unknown:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            problems.append(f"unknown key {key!r}" + (f"; did you mean {near[0]!r}?" if near else ""))
        raise ConfigError(problems, context=f"--config {path}")


def to_python(candidate: Candidate, *, model_name_or_path: str, dataset_name: str | None = None,
              completion_only_loss: bool | None = None) -> str:
    """A snippet that trains with this configuration."""
    kw = sft_config_kwargs(candidate)
    kw["completion_only_loss"] = completion_only_loss
    lines = ["import os", ""]
    for k, v in env_vars(candidate).items():
        lines.append(f"os.environ.setdefault({k!r}, {v!r})  # before torch initialises CUDA")
    lines += ["", "from datasets import load_dataset", "from trl import SFTConfig, SFTTrainer"]
    if candidate.use_lora:
        lines.append("from peft import LoraConfig")
    if candidate.quantization is not Quantization.NONE:
        lines.append("from transformers import BitsAndBytesConfig")
    lines += ["", "config = SFTConfig(", '    output_dir="advisor-sft",']
    lines += [f"    {k}={v!r}," for k, v in kw.items()]
    lines.append(")")
    args = [f"    model={model_name_or_path!r},", "    args=config,", "    train_dataset=dataset,"]
    load = f"load_dataset({dataset_name!r}, split=\"train\")" if dataset_name else \
        'load_dataset("json", data_files="train.jsonl", split="train")  # your data'
    lines.insert(lines.index("config = SFTConfig("), f"dataset = {load}")
    if candidate.use_lora:
        lines.append(
            f"peft_config = LoraConfig(r={candidate.lora_r}, lora_alpha={candidate.lora_alpha}, lora_dropout=0.0, "
            f"target_modules={list(candidate.lora_target_modules)!r}, task_type=\"CAUSAL_LM\")"
        )
        args.append("    peft_config=peft_config,")
    qc = quantization_config(candidate) if candidate.quantization is not Quantization.NONE else None
    if qc is not None:
        if candidate.quantization is Quantization.NF4:
            lines.append(
                "quantization_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\", "
                f"bnb_4bit_compute_dtype={_compute_dtype(candidate)!r})"
            )
        else:
            lines.append("quantization_config = BitsAndBytesConfig(load_in_8bit=True)")
        args.append("    quantization_config=quantization_config,")
    lines += ["trainer = SFTTrainer(", *args, ")", "trainer.train()", ""]
    return "\n".join(lines)


__all__ = [  # noqa: RUF022
    "RunConfig", "build_sft_config", "candidate_from_run_dict", "env_vars", "load_run_config", "model_init_kwargs",
    "peft_config", "quantization_config", "run_config_dict", "sft_config_kwargs", "to_python", "to_yaml",
]
