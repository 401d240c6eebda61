"""The files a Candidate is written as, for any trainer: the keys `trl <command> --config` accepts
(`run_config_dict`), that YAML (`write_yaml`) and a Python snippet that trains with it (`write_python`), the one
writer every trainer's emission goes through (advisor/trainers/base.py `TrlTrainer.to_yaml` / `to_python`). What a
trainer adds is what it declares (`script_kwargs`, `model_extras`, `env`, `snippet_arguments`)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import yaml

from ..knobs import KNOBS, Home, Knob
from ..space import Candidate, Quantization
from .config import compute_dtype, peft_targets, quantization_config
from .keys import base_keys
from .target import add_workload_keys, load_line, target_keys

if TYPE_CHECKING:
    from ..trainers import Trainer
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


def run_config_dict(trainer: Trainer, candidate: Candidate, *, model_name_or_path: str | None,
                    dataset_name: str | None = None, workload: Workload | None = None) -> dict[str, Any]:
    """The keys `trl <trainer.command> --config FILE` accepts: ScriptArguments (with the trainer's own script
    arguments), the trainer's config kwargs as emitted, ModelConfig (with the trainer's own keys there) and an
    `env:` block. The base's keys come after the knobs', as the user wrote them. With `workload`, the target's
    device keys and the measured data too (target.add_workload_keys), so the file runs as written on its target."""
    c = candidate
    kw = trainer.emit_kwargs(c, workload)
    init = kw.pop("model_init_kwargs")  # trl <command> builds it from ModelConfig's dtype / attn_implementation
    out: dict[str, Any] = {}
    if model_name_or_path is not None:
        out["model_name_or_path"] = model_name_or_path
    if dataset_name is not None:
        out["dataset_name"] = dataset_name
    out.update(model_input_keys(trainer, c, workload))
    out.update(trainer.script_kwargs(c, workload))
    out.update({k: v for k, v in base_keys(c, "script", measured=False).items() if k not in trainer.config_fields()})
    out["output_dir"] = c.base.get("output_dir", f"advisor-{trainer.name}")
    out.update(kw)
    # model_init_kwargs goes into the YAML whole but for what ModelConfig's dtype / attn_implementation carry
    # (trl <command> updates those with it): the model_init_kwargs knobs and the user's other loading keys
    extra_init = {k: v for k, v in init.items() if k not in ("dtype", "attn_implementation")}
    if extra_init:
        out["model_init_kwargs"] = extra_init
    for k in KNOBS:
        if k.home in (Home.MODEL_CONFIG, Home.LORA_CONFIG) and k.is_active(c):
            out.update(_write_model(k, c))
    out.update(base_keys(c, "model", measured=False))
    out.update(trainer.model_extras(c))
    env = trainer.env(c)
    if env:
        out["env"] = env
    return add_workload_keys(out, workload)


def model_input_keys(trainer: Trainer, candidate: Candidate, workload: Workload | None) -> dict[str, str]:
    """The models the trainer takes beside the policy, each under its declared YAML key (ModelInput.yaml_key): the
    workload's (`--reward-model`), else what the candidate's base carries (a config read back)."""
    out = {}
    for inp in trainer.model_inputs:
        given = workload.model_of(inp.role) if workload is not None else None
        name = given.name if given is not None else candidate.base.get(inp.yaml_key)
        if name:
            out[inp.yaml_key] = name
    return out


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


def write_python(trainer: Trainer, candidate: Candidate, *, model_name_or_path: str, dataset_name: str | None,
                 workload: Workload | None = None) -> str:
    """Every trainer's snippet: the env vars first, `<Config>(**kwargs)` (the same kwargs the trainer's config object
    and YAML carry), the trainer's LoraConfig when LoRA, the BitsAndBytesConfig when quantized (as `trl <command>`
    passes `get_quantization_config(model_args)` to the trainer), and `<Trainer>(...)` with the trainer's own
    arguments (`snippet_arguments`: `reward_funcs=[...]` for GRPO / RLOO) and their imports. With `workload`: the
    target's device keys and the data the search measured (target.py), as the YAML carries them."""
    c = candidate
    config_name, trainer_name = trainer.config_name, trainer.trainer_name
    peft = trainer.peft_config(c)
    trainer_args, imports = trainer.snippet_arguments(c, workload)
    kw = dict(trainer.emit_kwargs(c, workload))
    if workload is not None:
        kw.update(target_keys(workload.gpu))
    output_dir = kw.pop("output_dir", f"advisor-{trainer.name}")
    lines = ["import os", ""]
    for k, v in trainer.env(c).items():
        lines.append(f"os.environ.setdefault({k!r}, {v!r})  # before torch initialises CUDA")
    lines += ["", "from datasets import load_dataset", f"from trl import {config_name}, {trainer_name}"]
    if peft is not None:
        lines.append("from peft import LoraConfig")
    if c.quantization is not Quantization.NONE:
        lines.append("from transformers import BitsAndBytesConfig")
    lines += list(imports)
    load = load_line(workload, dataset_name, trainer.data_hint)
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
