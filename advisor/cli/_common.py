"""Flags and conversions shared by the sub-commands (DESIGN.md's vocabulary)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from .._files import check_names, write_atomic
from ..accelerate_config import read_accelerate_config
from ..emit import ALLOC_ENV, load_run_config
from ..errors import ConfigError, UsageError
from ..inputs import build_workload
from ..knobs import Home, fix_names, yaml_keys
from ..measurement import Measurement
from ..parallelism import Layout, layout_problems
from ..profiles import decide_offline
from ..space import Candidate
from ..trainers import (
    DEFAULT,
    choices,
    get_trainer,
    launched_candidate,
    model_inputs,
    names,
    trainer_of,
    training_workload,
)
from ..trainers import names as trainer_names
from ..workload import Goals, Workload, parse_fraction, parse_size  # noqa: F401 (the CLI's)


def add_workload_args(parser: argparse.ArgumentParser, *, model_required: bool = True) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--model", required=model_required,
                   help="hub id, local directory or config.json (overrides model_name_or_path of --config)")
    g.add_argument("--gpu", default=None,
                   help="target: a profile in profiles/gpus/ (e.g. H100-80GB, L4) or 'cpu'; default: the local GPU")
    g.add_argument("--dataset", default=None,
                   help="hub id, local .jsonl/.json/.parquet/.csv, or a directory saved with datasets' "
                   "save_to_disk; default: the built-in synthetic chat set")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory or id (default: the model's)")
    g.add_argument("--sample", type=int, default=None, help="estimate lengths from a seeded sample of N rows")
    g.add_argument("--num-gpus", type=int, default=1, metavar="N",
                   help="train on N GPUs of the --gpu kind (accelerate); the memory budget applies to each rank, "
                        "the effective batch counts every rank (default 1)")
    g.add_argument("--num-machines", type=int, default=1, metavar="M",
                   help="the N GPUs are spread over M machines, N/M each (default 1)")

    g.add_argument("--parallelism", default=None, choices=[v.value for v in Layout],
                   help="with --num-gpus N > 1 and --config: how accelerate shards the model (the accelerate config "
                        "`advisor suggest --accelerate-output` writes; default ddp, accelerate's MULTI_GPU). "
                        "suggest searches it: pin it there with --fix parallelism=VALUE")
    data = "; ".join(f"{n}: {get_trainer(n).data_hint}" for n in choices())
    g.add_argument("--trainer", choices=choices(), default=DEFAULT,
                   help=f"the TRL trainer, one of {', '.join(choices())} (default {DEFAULT}); --dataset is that "
                   f"trainer's data ({data}; default: the built-in synthetic set of its kind); --config is then a "
                   "`trl <trainer>` file")
    for m in model_inputs():  # the models a trainer takes beside the policy, as the trainers declare them
        takers = ", ".join(n for n in choices() if m in get_trainer(n).model_inputs)
        g.add_argument(m.flag, dest=m.param, default=None, metavar="ID", help=f"{takers}: {m.help}")


def add_config_arg(parser: argparse.ArgumentParser, *, required: bool = True, launch: bool = True) -> None:
    parser.add_argument("--config", required=required, metavar="RUN.yaml",
                        help="a trl sft --config file (what `advisor suggest --format yaml` writes)")
    if launch:
        parser.add_argument("--accelerate-config", default=None, metavar="FILE",
                            help="with --num-gpus N > 1: the accelerate config the run launches with (what `advisor "
                            "suggest --accelerate-output FILE` writes): its layout (instead of --parallelism) and its "
                            "num_processes, the ranks that train (online RL's vLLM server mode: the other GPUs of "
                            "--num-gpus run `trl vllm-serve`)")


def read_run_config(ns: argparse.Namespace) -> Any:
    """--config read as --trainer's `trl <command>` reads it (a RunConfig). A file another trainer's command reads
    and this one refuses (a GRPO file read as the default sft's: every GRPO key unknown) says which --trainer reads
    it."""
    trainer = getattr(ns, "trainer", DEFAULT)
    try:
        return load_run_config(ns.config, trainer=trainer)
    except ConfigError as exc:
        readers = []
        for other in names():
            if other == trainer:
                continue
            try:
                load_run_config(ns.config, trainer=other)
            except (ConfigError, UsageError):
                continue
            readers.append(other)
        if not readers:
            raise
        commands = " or ".join(f"`trl {r}`" for r in readers)
        which = " or ".join(f"--trainer {r}" for r in readers)
        raise ConfigError([*exc.problems, f"the file reads as a {commands} config, not `trl {trainer}`'s: give "
                           f"{which}"], context=f"--config {ns.config}") from None


def workload_from_args(ns: argparse.Namespace, goals: Goals | None = None) -> Workload:
    model = ns.model
    dataset = getattr(ns, "dataset", None)
    config_path = getattr(ns, "config", None)
    models = {m.param: getattr(ns, m.param, None) for m in model_inputs()}
    flags = {m.param: m.flag for m in model_inputs()}
    trainer = getattr(ns, "trainer", DEFAULT)
    check_names({"--model": model, "--dataset": dataset, "--tokenizer": getattr(ns, "tokenizer", None),
                 "--config": config_path, **{flags[p]: v for p, v in models.items()}})
    from_config: dict[str, str] = {}  # a value the config wrote, not a flag: its error names the key
    if config_path and (model is None or dataset is None or None in models.values()):
        rc = read_run_config(ns)
        from_config = {flag: f"--config {config_path}: {key}" for flag, key, given in (
            ("--model", "model_name_or_path", model), ("--dataset", "dataset_name", dataset)) if given is None}
        model = model or rc.model_name_or_path
        dataset = dataset or rc.dataset
        keys = {m.param: m.yaml_key for m in get_trainer(trainer).model_inputs}
        for param, path in rc.models.items():  # the file's, as `trl <command>` loads them
            if models.get(param) is None:
                models[param] = path
                from_config[flags[param]] = f"--config {config_path}: {keys[param]}"
    if model is None:
        raise UsageError("--model is required (or model_name_or_path in --config)")

    offline = decide_offline(model, dataset, getattr(ns, "tokenizer", None))  # once, before anything waits on it
    if offline:
        print(f"advisor: {offline}", file=sys.stderr)
    try:
        wl = build_workload(model, gpu=ns.gpu, dataset=dataset, tokenizer=getattr(ns, "tokenizer", None),
                            sample=getattr(ns, "sample", None), goals=goals, num_gpus=getattr(ns, "num_gpus", 1),
                            num_machines=getattr(ns, "num_machines", 1), trainer=trainer, **models)
    except UsageError as exc:
        if not from_config:
            raise
        raise reattribute(exc, from_config) from None
    for note in workload_notes(wl):
        print(f"advisor: {note}", file=sys.stderr)
    return wl


def reattribute(exc: UsageError, names: dict[str, str]) -> UsageError:
    """The same error, naming where the value was written (a baseline's key, a --config key) instead of the flag
    the library names (`--model`, `--gpu`, ...) when the user gave no such flag. Same class, same exit code."""
    def reword(text: str) -> str:
        for flag, where in names.items():  # the first mention in full, later ones (a fix) by the key alone
            pattern = re.escape(flag) + r"(?![\w-])"
            text = re.sub(pattern, where, text, count=1)
            text = re.sub(pattern, where.rpartition(": ")[2], text)
        return text

    if isinstance(exc, ConfigError):
        return ConfigError([reword(p) for p in exc.problems])
    try:
        out = type(exc)(reword(str(exc)))
    except TypeError:  # a subclass with another constructor
        out = UsageError(reword(str(exc)))
    return out


def workload_notes(wl: Workload) -> tuple[str, ...]:
    """What the user must know about the inputs: an assumed GPU, synthetic data, bad rows skipped, a sample."""
    return tuple(wl.notes) + tuple(wl.dataset.notes)


def with_workload_notes(m: Measurement, wl: Workload) -> Measurement:
    return dataclasses.replace(m, notes=workload_notes(wl) + tuple(m.notes))


def check_writable(path: str | Path | None, flag: str) -> None:
    """Fail before the work, not after it, when an output file cannot be written."""
    if path is None:
        return
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file name, e.g. {path / 'out'}")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable; choose a writable path")


def write_output(path: str | Path, text: str, flag: str) -> None:
    """An output file written atomically (advisor._files); a failure is a UsageError naming the flag, with
    nothing half-written left behind."""
    try:
        write_atomic(path, text)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot be written ({exc.strerror or exc}); nothing was written there; "
                         "choose a path on a writable file system with free space") from None


def candidate_from_args(ns: argparse.Namespace, workload: Workload | None = None) -> Candidate:
    """The Candidate of --config (and --accelerate-config, --parallelism: the accelerate side of the run, which the
    TRL file does not hold), checked against the target and the model (every problem at once)."""
    cand = read_run_config(ns).candidate
    layout = getattr(ns, "parallelism", None)
    launch = None
    if getattr(ns, "accelerate_config", None):
        launch = read_accelerate_config(ns.accelerate_config)
        if layout is not None and layout != launch.layout.value:
            raise UsageError(f"--parallelism {layout} with --accelerate-config {ns.accelerate_config}, whose layout "
                             f"is {launch.layout.value}: give one of them")
        layout = launch.layout
    if layout is not None:
        cand = cand.replace(parallelism=layout)
    if workload is not None:  # the trainer's rules (SFT: the candidate's own; DPO: no packing, ...)
        kind = trainer_of(workload)
        try:
            # the knobs the TRL file cannot hold, read back from the launch (online RL's vLLM server GPUs), and the
            # world's rules (server mode leaves a GPU to train)
            cand = launched_candidate(kind, cand, workload.num_gpus, launch.num_processes if launch else None)
            problems = kind.problems(cand, workload.gpu, workload.model)
            if problems:
                raise ConfigError(problems)
            cand.check(workload.gpu, workload.model)
        except ConfigError as exc:  # the fixes said as the file's keys: this command has no --fix
            raise ConfigError([in_config_file(p, ns.config) for p in exc.problems],
                              context=f"--config {ns.config}") from None
        train = training_workload(workload, cand)
        if launch is not None:
            launch.matches(cand, kind.command)
            if launch.num_machines != train.num_machines:
                raise UsageError(f"--num-machines {workload.num_machines} with --accelerate-config "
                                 f"{ns.accelerate_config}, whose num_machines is {launch.num_machines}: give "
                                 f"--num-machines {launch.num_machines}")

        world = [p.replace("parallelism=", "--parallelism ") for p in layout_problems(cand.parallelism,
                                                                                    train.num_gpus)]
        if world:
            raise UsageError("; ".join(world).replace("--fix parallelism", "--parallelism"))
    return cand


def in_config_file(problem: str, path: str) -> str:
    """A rule's problem as a command reading `--config FILE` says it: each `--fix NAME=VALUE` (the search's way to
    pin a knob, which such a command has not) becomes what to write in the file: the knob's key in the TRL file,
    both allocator variables of its `env:` block, or the accelerate config."""
    trainer_names()  # every built-in trainer's own knobs registered
    names = fix_names()

    def key(m: re.Match) -> str:
        entry = names.get(m.group(1))
        value = m.group(2)
        if entry is None:
            return f"{m.group(1)}: {value} in --config {path}"
        k = entry[0]
        if k.home is Home.ENV:
            return f"env {' / '.join(ALLOC_ENV)}: {k.name}:{value.capitalize()} in --config {path}"
        if k.home is Home.ACCELERATE:
            return f"{k.name}={value} in the accelerate config (--accelerate-config)"
        return f"{(yaml_keys(k) or (k.key,))[0]}: {value} in --config {path}"

    return re.sub(r"--fix ([\w.]+)=([^\s,;)]+)", key, problem)


def emit_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, default=_json_default)


def _json_default(o: Any) -> Any:
    if isinstance(o, enum.Enum):
        return o.value
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
