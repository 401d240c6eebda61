"""The files a Candidate is written as: the YAML `trl <command> --config` accepts and a Python snippet that trains
with it. `write_yaml` / `write_python` are the one writer every trainer's emission goes through
(advisor/trainers/base.py `TrlTrainer.to_yaml` / `to_python`); `run_config_dict`, `to_yaml` and `to_python` are
SFT's keys and files."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import yaml

from ..knobs import KNOBS, Home, Knob
from ..space import Candidate, Quantization
from .config import (
    compute_dtype,
    emitted_sft_kwargs,
    env_vars,
    peft_config,
    peft_targets,
    quantization_config,
)
from .keys import base_keys
from .target import add_workload_keys, load_line, target_keys

if TYPE_CHECKING:
    from ..workload import Workload

# One target written for `trl sft`: ModelConfig turns a one-element list into a string, which PEFT matches as a
# regular expression against the full module name, so a bare name would match nothing.
ONE_TARGET = re.compile(r"\.\*\\\.([A-Za-z_][A-Za-z0-9_]*)")


def _yaml_targets(candidate: Candidate) -> list[str] | None:
    t = candidate.lora_target_modules
    if t is None:
        return None
    if len(t) == 1 and t[0] != "all-linear":
        return [f".*\\.{t[0]}"]
    return list(t)


def _write_model(k: Knob, c: Candidate) -> dict[str, Any]:
    """One ModelConfig / LoraConfig knob as `trl sft` reads it."""
    if k.name == "attn_implementation":
        return {} if c.attn_implementation is None else {"attn_implementation": c.attn_implementation.value}
    if k.name == "lora_target_modules":
        targets = _yaml_targets(c)
        return {} if targets is None else {"lora_target_modules": targets}
    if k.name == "quantization":
        out = {"load_in_4bit": c.quantization is Quantization.NF4, "load_in_8bit": c.quantization is Quantization.INT8}
        if c.quantization is Quantization.NF4:
            out["bnb_4bit_quant_type"] = "nf4"
        return out
    return {k.key: k.plain(getattr(c, k.name))}


def run_config_dict(
    candidate: Candidate, *, model_name_or_path: str | None, dataset_name: str | None = None,
    completion_only_loss: bool | None = None, output_dir: str = "advisor-sft", workload: Workload | None = None,
) -> dict[str, Any]:
    """The keys `trl sft --config FILE` accepts: ScriptArguments, SFTConfig, ModelConfig and an `env:` block.
    The base's keys come after the knobs', as the user wrote them. With `workload`, the target's device keys and
    the measured data too (target.add_workload_keys), so the file runs as written on its target."""
    c = candidate
    kw = emitted_sft_kwargs(c, completion_only_loss)
    init = kw.pop("model_init_kwargs")  # trl sft builds it from ModelConfig's dtype / attn_implementation
    out: dict[str, Any] = {}
    if model_name_or_path is not None:
        out["model_name_or_path"] = model_name_or_path
    if dataset_name is not None:
        out["dataset_name"] = dataset_name
    out.update(base_keys(c, "script", measured=False))
    out["output_dir"] = c.base.get("output_dir", output_dir)
    out.update(kw)
    # model_init_kwargs goes into the YAML whole but for what ModelConfig's dtype / attn_implementation carry
    # (trl sft updates those with it): the model_init_kwargs knobs and the user's other loading keys
    extra_init = {k: v for k, v in init.items() if k not in ("dtype", "attn_implementation")}
    if extra_init:
        out["model_init_kwargs"] = extra_init
    for k in KNOBS:
        if k.home in (Home.MODEL_CONFIG, Home.LORA_CONFIG) and k.is_active(c):
            out.update(_write_model(k, c))
    out.update(base_keys(c, "model", measured=False))
    env = env_vars(c)
    if env:
        out["env"] = env
    return add_workload_keys(out, workload)


def to_yaml(candidate: Candidate, *, header: str | None = None, **kwargs: Any) -> str:
    """The `trl sft --config` file; `header` becomes leading `#` comment lines, and without a dataset_name a
    commented placeholder says where `trl sft` takes it from."""
    return write_yaml(run_config_dict(candidate, **kwargs), header=header, command="sft",
                      example_dataset="trl-lib/Capybara")


def write_yaml(run_dict: dict[str, Any], *, header: str | None = None, command: str,
               example_dataset: str) -> str:
    """Every trainer's `trl <command> --config` file from its keys (`Trainer.run_config_dict`): `header` becomes
    leading `#` comment lines, and without a dataset_name a commented placeholder (`example_dataset`, a hub id of
    the trainer's kind of data) says where `trl <command>` takes it from."""
    body = yaml.safe_dump(run_dict, sort_keys=False)
    if run_dict.get("dataset_name") is None and not run_dict.get("datasets"):
        placeholder = (f"# dataset_name: {example_dataset}   # your dataset: a hub id or a local dataset directory "
                       f"(or pass --dataset_name to trl {command})\n")
        lines = body.splitlines(keepends=True)
        at = 1 if lines and lines[0].startswith("model_name_or_path:") else 0
        body = "".join(lines[:at]) + placeholder + "".join(lines[at:])
    if header:
        body = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines()) + body
    return body


def to_python(candidate: Candidate, *, model_name_or_path: str, dataset_name: str | None = None,
              completion_only_loss: bool | None = None, workload: Workload | None = None) -> str:
    """A snippet that trains with this configuration (SFTConfig + SFTTrainer; with `workload`: on its target,
    over the measured data)."""
    c = candidate
    return write_python(c, config_name="SFTConfig", trainer_name="SFTTrainer",
                        kwargs=emitted_sft_kwargs(c, completion_only_loss), peft=peft_config(c),
                        model_name_or_path=model_name_or_path, dataset_name=dataset_name,
                        default_output_dir="advisor-sft", data_hint="your data", workload=workload)


def write_python(candidate: Candidate, *, config_name: str, trainer_name: str, kwargs: dict[str, Any], peft: Any,
                 model_name_or_path: str, dataset_name: str | None, default_output_dir: str, data_hint: str,
                 workload: Workload | None = None, trainer_args: tuple[str, ...] = (),
                 imports: tuple[str, ...] = ()) -> str:
    """Every trainer's snippet: the env vars first, `<config_name>(**kwargs)` (the same kwargs the trainer's config
    object and YAML carry), the trainer's LoraConfig (`peft`) when LoRA, the BitsAndBytesConfig when quantized (as
    `trl <command>` passes `get_quantization_config(model_args)` to the trainer), and `<trainer_name>(...)`. With
    `workload`: the target's device keys and the data the search measured (target.py), as the YAML carries them.
    `trainer_args`: the trainer's own arguments (`reward_funcs=[...]` for GRPO / RLOO), with their `imports`."""
    c = candidate
    kw = dict(kwargs)
    if workload is not None:
        kw.update(target_keys(workload.gpu))
    output_dir = kw.pop("output_dir", default_output_dir)
    lines = ["import os", ""]
    for k, v in env_vars(c).items():
        lines.append(f"os.environ.setdefault({k!r}, {v!r})  # before torch initialises CUDA")
    lines += ["", "from datasets import load_dataset", f"from trl import {config_name}, {trainer_name}"]
    if peft is not None:
        lines.append("from peft import LoraConfig")
    if c.quantization is not Quantization.NONE:
        lines.append("from transformers import BitsAndBytesConfig")
    lines += list(imports)
    load = load_line(workload, dataset_name, data_hint)
    lines += ["", f"dataset = {load}", f"config = {config_name}(", f"    output_dir={output_dir!r},"]
    lines += [f"    {k}={v!r}," for k, v in kw.items()]
    lines.append(")")
    args = [f"    model={model_name_or_path!r},", *(f"    {a}," for a in trainer_args), "    args=config,",
            "    train_dataset=dataset,"]
    if peft is not None:
        lc = peft
        extra = "".join(f", {k}={getattr(lc, k)!r}" for k in ("use_rslora", "use_dora", "modules_to_save")
                        if getattr(lc, k) not in (None, False))
        lines.append(
            f"peft_config = LoraConfig(r={lc.r}, lora_alpha={lc.lora_alpha}, lora_dropout={lc.lora_dropout!r}, "
            f"target_modules={peft_targets(c)!r}, bias=\"none\", task_type={lc.task_type!r}{extra})"
        )
        args.append("    peft_config=peft_config,")
    qc = quantization_config(c)
    if qc is not None:
        if c.quantization is Quantization.NF4:
            lines.append(
                f"quantization_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="
                f"{qc.bnb_4bit_quant_type!r}, bnb_4bit_compute_dtype={compute_dtype(c)!r}, "
                f"bnb_4bit_use_double_quant={qc.bnb_4bit_use_double_quant!r})"
            )
        else:
            lines.append("quantization_config = BitsAndBytesConfig(load_in_8bit=True)")
        args.append("    quantization_config=quantization_config,")
    lines += [f"trainer = {trainer_name}(", *args, ")", "trainer.train()", ""]
    return "\n".join(lines)
