"""`advisor suggest`: the fastest configuration that fits, as a table, YAML, JSON or Python."""

from __future__ import annotations

import argparse
import glob
import importlib.util
import shlex
import sys
from pathlib import Path
from typing import Any

from ..backends import backend_names
from ..emit import load_run_config
from ..errors import BackendError, NoFitError, UsageError
from ..events import StorageNote
from ..report import plot, render_report, render_summary
from ..search import check_backend, check_jobs, prestarted, suggest
from ..trainers import DEFAULT as DEFAULT_TRAINER
from ..workload import Goals
from ._common import (
    add_workload_args,
    check_writable,
    emit_json,
    parse_fraction,
    parse_size,
    workload_from_args,
    write_output,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("suggest", help="search the fastest configuration that fits the target's memory",
                              description="Search the memory knobs for the fastest configuration that fits.")
    add_workload_args(p, model_required=False)
    p.add_argument("--config", default=None, metavar="RUN.yaml",
                   help="take model_name_or_path / dataset_name from a trl sft (trl dpo, trl reward) --config file")
    p.add_argument("--backend", default=None, metavar="{" + ",".join(backend_names()) + "}",
                   help="how candidates are measured (default: cuda when a GPU is present, else simulate)")
    add_goal_args(p)
    p.add_argument("--trials", type=int, default=None, help="distinct candidates to measure at most")
    p.add_argument("--time-budget", type=float, default=None, metavar="S", help="stop searching after S seconds")
    p.add_argument("--fix", action="append", default=[], metavar="FIELD=VALUE",
                   help="pin a knob by its SFTConfig / ModelConfig name, e.g. optim=adamw_torch (repeatable)")
    p.add_argument("--storage", default=None, help="Optuna RDB URL or journal file to share the study")
    p.add_argument("--study", default=None, help="study name (with --storage; workers join it by this name)")
    add_jobs_flag(p)
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the study cache")
    p.add_argument("--exhaustive", action="store_true", help="evaluate every valid candidate (benchmarks)")
    p.add_argument("--format", choices=("table", "yaml", "json", "python"), default="table")
    p.add_argument("--json", action="store_true", help="same as --format json")
    p.add_argument("--report", action="store_true", help="with --format table: list every trial")
    p.add_argument("--output", "-o", default=None, metavar="FILE", help="write the configuration to FILE")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="device peak against throughput")
    p.add_argument("--accelerate-output", default=None, metavar="FILE",
                   help="write the accelerate config (accelerate launch --config_file FILE) of the pick; with "
                        "--num-gpus N > 1 the table shows the launch command")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="list on stderr every message the libraries printed while measuring (default: the report "
                        "names each distinct one once)")
    p.set_defaults(func=run)


def add_jobs_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                   help="simulate N candidates at once in worker processes (default: one per usable core; 1 "
                        "measures in this process; the estimate and the probes always run one at a time)")


def _likely_default_backend() -> str:
    """The default backend's likely name without importing torch (seconds the head start is for): simulate when
    no NVIDIA device node exists. Only the head start hangs on it; `suggest` decides the backend itself."""
    return "cuda" if glob.glob("/dev/nvidia[0-9]*") else "simulate"


def jobs_kwargs(ns: argparse.Namespace) -> dict[str, int]:
    """--jobs checked before any work (ConfigError naming --jobs, exit 2); {} when not given (the default)."""
    if ns.jobs is None:
        return {}

    return {"jobs": check_jobs(ns.jobs)}


# ---- the goal flags: one per `Goals` field, as it declares them ----------------------------------------------
def add_goal_args(p: argparse.ArgumentParser) -> None:
    for g in Goals.declared():
        dest = g.flag.removeprefix("--").replace("-", "_")
        if g.kind == "switch":
            p.add_argument(g.flag, dest=dest, action="store_true", help=g.help)
        elif g.kind == "choice":
            p.add_argument(g.flag, dest=dest, choices=g.choices, default=g.default.value, help=g.help)
        else:
            shown = {"size": "SIZE", "int": "N"}.get(g.kind)
            p.add_argument(g.flag, dest=dest, default=None, metavar=shown, help=g.help + (
                f" (default {g.default})" if g.default is not None else ""))


def goals_from_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The Goals field values the goal flags give (a flag left out keeps the field's default)."""
    out: dict[str, Any] = {}
    for g in Goals.declared():
        value = getattr(ns, g.flag.removeprefix("--").replace("-", "_"))
        if value is None or value == "":
            continue
        if g.kind == "size":
            value = parse_size(value, g.flag)
        elif g.kind == "fraction":
            value = parse_fraction(value, g.flag)
        elif g.kind == "int":
            try:
                value = int(value)
            except ValueError:
                raise UsageError(f"{g.flag} {value!r}: not a whole number") from None
        out[g.name] = value
    return out


def parse_fixes(items: list[str]) -> dict[str, str]:
    out, bad, twice = {}, [], []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            bad.append(item)
        elif key.strip() in out and out[key.strip()] != value.strip():  # not the last one silently
            twice.append(f"--fix {key.strip()}={out[key.strip()]} and --fix {key.strip()}={value.strip()} "
                         "contradict each other; keep one")
        else:
            out[key.strip()] = value.strip()
    if bad:
        raise UsageError(f"--fix {', '.join(map(repr, bad))}: write FIELD=VALUE, e.g. --fix optim=adamw_torch")
    if twice:
        raise UsageError("; ".join(twice))
    return out


def run(ns: argparse.Namespace) -> int:
    fmt = "json" if ns.json else ns.format
    goals = Goals(**goals_from_args(ns))
    fixes = parse_fixes(ns.fix)
    if ns.parallelism is not None:  # the same as --fix parallelism=VALUE
        fixes.setdefault("parallelism", ns.parallelism)
    if ns.study and not ns.storage:
        raise UsageError("--study needs --storage (the shared study's URL or journal file)")
    if ns.plot:
        if importlib.util.find_spec("matplotlib") is None:
            raise UsageError("--plot needs matplotlib: pip install 'advisor[plot]'")
    check_writable(ns.output, "--output")
    check_writable(ns.plot, "--plot")
    check_writable(ns.accelerate_output, "--accelerate-output")
    jobs = jobs_kwargs(ns)
    if ns.backend is not None:
        check_backend(ns.backend)  # an unknown name, or cuda without a GPU, exits 2 naming --backend before any work

    bar = _Stderr(bar=sys.stderr.isatty())
    # the simulator's worker server imports torch, transformers and TRL while this process resolves the workload
    with prestarted(ns.backend or _likely_default_backend(), jobs.get("jobs")):
        try:
            workload = workload_from_args(ns, goals=goals)
            s = suggest(workload, backend=ns.backend, trials=ns.trials, time_budget_s=ns.time_budget, fix=fixes,
                        storage=ns.storage, study_name=ns.study, cache=not ns.no_cache, exhaustive=ns.exhaustive,
                        progress=bar, workload_names=_workload_names(ns, workload), **jobs)
        except (NoFitError, BackendError) as exc:
            if fmt != "json":
                raise
            status = "no_fit" if isinstance(exc, NoFitError) else "backend_error"
            print(emit_json({"status": status, "message": str(exc), **exc.details}))
            return exc.exit_code
        finally:
            bar.close()
    _answer(ns, s, fmt)
    return 0


def _answer(ns: argparse.Namespace, s: Any, fmt: str) -> None:
    """The suggestion as asked: printed in `fmt`, and the files --output, --plot, --accelerate-output written."""
    if ns.verbose:
        for msg in s.messages:
            print(f"advisor: while measuring: {msg}", file=sys.stderr)
    text = {"yaml": s.to_yaml, "python": s.to_python, "json": lambda: emit_json(s.to_json_dict())}.get(fmt)
    config_text = text() if text else s.to_yaml()
    if ns.output:
        try:
            write_output(ns.output, config_text if text else s.to_yaml(), "--output")
        except UsageError:
            print(config_text if text else s.to_yaml(), end="")  # the search's answer is not lost with the file
            raise
    if ns.plot:
        plot(s, ns.plot)
    if ns.accelerate_output:
        write_output(ns.accelerate_output, s.accelerate_yaml(ns.accelerate_output, ns.output or "run.yaml"),
                     "--accelerate-output")
    if fmt == "table":
        _print_table(ns, s)
    else:
        print(config_text, end="" if config_text.endswith("\n") else "\n")
        if ns.output:
            print(f"advisor: wrote {ns.output}", file=sys.stderr)
        if ns.accelerate_output:
            print(f"advisor: wrote {ns.accelerate_output}", file=sys.stderr)
        if ns.plot:
            print(f"advisor: wrote the plot to {ns.plot}", file=sys.stderr)


def _print_table(ns: argparse.Namespace, s: Any) -> None:
    """The table answer: the summary (or --report), the files written, the launch on several GPUs, the next step."""
    print(render_report(s) if ns.report else render_summary(s))
    if ns.output:
        print(f"\nwrote {ns.output}")
    if ns.plot:
        print(f"wrote the plot (device peak against tokens/s) to {ns.plot}")
    if ns.accelerate_output:
        print(f"wrote {ns.accelerate_output}")
    if s.workload.num_gpus > 1:
        lc = s.launch(config_file=ns.accelerate_output or "accelerate.yaml",
                      trl_config_file=ns.output or "run.yaml")
        print(f"\n{s.workload.num_gpus} GPUs: {lc.chosen}; launch with\n  {lc.command}")
        if not ns.accelerate_output:
            print("  (write the accelerate config with --accelerate-output accelerate.yaml)")
    print("\n" + next_step(ns, s))


def next_step(ns: argparse.Namespace, s) -> str:
    """How to get the YAML and train with it: what a TRL user does after reading the table."""
    ds = s.workload.dataset
    if ds.dataset_name or "datasets" in s.run_config():
        data = ""  # the YAML names it (a hub id, or the local file as a `datasets:` entry)
    elif ds.synthetic:
        data = f" --dataset_name <your dataset, e.g. {s.trainer.example_dataset}>"
    else:
        data = f" --dataset_name <a hub id or directory for {ds.name}>"
    lines = ["Next:"]
    world = s.workload.num_gpus > 1
    if ns.output and Path(ns.output).suffix in (".yaml", ".yml") and ns.format != "python":
        run = (s.launch_command(ns.accelerate_output or "accelerate.yaml", ns.output) if world else
               f"trl {s.trainer.command} --config {shlex.quote(ns.output)}")
        lines.append(f"  {run}{data}")
    else:
        unstored = ns.no_cache or any(isinstance(e, StorageNote) for e in s.events)  # memory, or read-only
        cache = "" if unstored else "    # the same search: answered from the stored study"
        more = " --accelerate-output accelerate.yaml" if world and not ns.accelerate_output else ""
        lines.append(f"  {shlex.join(['advisor', 'suggest', *_same_search(ns)])} --format yaml -o run.yaml{more}"
                     f"{cache}")
        run = s.launch_command(ns.accelerate_output or "accelerate.yaml", "run.yaml") if world else \
            f"trl {s.trainer.command} --config run.yaml"
        lines.append(f"  {run}{data}")
    if world and not s.measured_on_target:
        lines.append(f"  (the numbers above are {s.measurement.source.value} predictions of one rank of "
                     f"{s.workload.num_gpus} x {s.workload.gpu.name}; a real probe of several GPUs is not supported "
                     "yet)")
    elif not s.measured_on_target:
        wl = s.workload
        probe = shlex.join(["advisor", "probe", "--model", _absolute(ns.model) or s.model_name_or_path,
                            "--config", "run.yaml", "--gpu", wl.gpu.name, *(["--dataset", ns.dataset] if ns.dataset
                                                                           else []),
                            *(["--trainer", wl.trainer] if wl.trainer != DEFAULT_TRAINER else []),
                            "--backend", "cuda" if wl.gpu.is_cuda else "cpu"])
        lines.append(f"  (the numbers above are {s.measurement.source.value} predictions for {wl.gpu.name}; on "
                     f"{'that GPU' if wl.gpu.is_cuda else 'this machine'}, `{probe}` measures real steps)")
    return "\n".join(lines)


_OUTPUT_FLAGS = {"--format": 1, "--json": 0, "--output": 1, "-o": 1, "--report": 0, "--plot": 1,
                 "--accelerate-output": 1}


def _same_search(ns: argparse.Namespace) -> list[str]:
    """The user's own suggest arguments without those that only choose the output."""
    argv = list(getattr(ns, "argv", None) or [])
    if "suggest" in argv:
        argv = argv[argv.index("suggest") + 1:]
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        flag = next((f for f in _OUTPUT_FLAGS if f == name or (len(name) > 3 and f.startswith(name))), None)
        if flag is not None:
            skip = _OUTPUT_FLAGS[flag] if "=" not in arg else 0
            continue
        out.append(arg)
    return out


def _workload_names(ns: argparse.Namespace, workload) -> dict[str, object]:
    """The names the workload was built from, stored in the study so `advisor worker` can rebuild it."""
    model, dataset = ns.model, ns.dataset
    if ns.config and (model is None or dataset is None):
        rc = load_run_config(ns.config, trainer=ns.trainer)
        model, dataset = model or rc.model_name_or_path, dataset or rc.dataset
    # the resolved GPU, so that a worker on another machine measures for the same target; local paths made
    # absolute, so that `advisor report --study` and workers started elsewhere find the same files
    return {"model": _absolute(model), "gpu": ns.gpu or workload.gpu.name, "dataset": _absolute(dataset),
            "tokenizer": _absolute(ns.tokenizer), "sample": ns.sample}


def _absolute(name: str | None) -> str | None:
    return str(Path(name).expanduser().resolve()) if name is not None and Path(name).expanduser().exists() else name


class _Stderr:
    """What suggest puts on stderr besides the assumption lines: the lines the search says the user must see now
    (e.g. the cache cannot be written), and on a terminal one tqdm bar over measured candidates with the best
    tokens/s so far."""

    def __init__(self, bar: bool) -> None:
        self._bar = None
        if bar:
            from tqdm import tqdm  # lazy: loads tqdm

            self._bar = tqdm(total=None, unit="cand", file=sys.stderr, leave=False, dynamic_ncols=True)
        self._n = 0

    def __call__(self, p) -> None:
        if p.note:
            line = f"advisor: {p.note}"
            if self._bar is not None:
                self._bar.write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr)
            return
        if self._bar is None:
            return
        if p.total and self._bar.total != p.total:
            self._bar.total = p.total
        self._bar.update(max(0, p.evaluations - self._n))
        self._n = p.evaluations
        if p.best_tokens_per_second:
            self._bar.set_postfix_str(f"best {p.best_tokens_per_second:,.0f} tok/s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
