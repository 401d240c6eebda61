"""Flags and conversions shared by the sub-commands (DESIGN.md's vocabulary)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from ..errors import UsageError
from ..space import Candidate
from ..workload import Goals, Workload, build_workload

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, flag: str = "--memory-budget") -> int:
    """'40GB', '40GiB', '81559MiB', '4e10' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise UsageError(f"{flag} {text!r}: not a size; write e.g. 40GB, 40GiB or 42949672960")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"{flag} {text!r}: must be positive")
    return value


def parse_fraction(text: str, flag: str) -> float:
    """'5%' or '0.05' -> 0.05."""
    s = str(text).strip()
    try:
        return float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: not a fraction; write e.g. 5% or 0.05") from None


def add_workload_args(parser: argparse.ArgumentParser, *, model_required: bool = True) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--model", required=model_required,
                   help="hub id, local directory or config.json (overrides model_name_or_path of --config)")
    g.add_argument("--gpu", default=None,
                   help="target: a profile in profiles/gpus/ (e.g. H100-80GB, L4) or 'cpu'; default: the local GPU")
    g.add_argument("--dataset", default=None,
                   help="hub id or local .jsonl/.json/.parquet/.csv; default: the built-in synthetic chat set")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory or id (default: the model's)")
    g.add_argument("--sample", type=int, default=None, help="estimate lengths from a seeded sample of N rows")


def add_config_arg(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument("--config", required=required, metavar="RUN.yaml",
                        help="a trl sft --config file (what `advisor suggest --format yaml` writes)")


def workload_from_args(ns: argparse.Namespace, goals: Goals | None = None) -> Workload:
    model = ns.model
    dataset = getattr(ns, "dataset", None)
    config_path = getattr(ns, "config", None)
    if config_path and (model is None or dataset is None):
        from ..emit import load_run_config

        rc = load_run_config(config_path)
        model = model or rc.model_name_or_path
        dataset = dataset or rc.dataset_name
    if model is None:
        raise UsageError("--model is required (or model_name_or_path in --config)")
    wl = build_workload(model, gpu=ns.gpu, dataset=dataset, tokenizer=getattr(ns, "tokenizer", None),
                        sample=getattr(ns, "sample", None), goals=goals)
    for note in wl.notes:
        print(f"advisor: {note}", file=sys.stderr)
    return wl


def candidate_from_args(ns: argparse.Namespace, workload: Workload | None = None) -> Candidate:
    """The Candidate of --config, checked against the target and the model (every problem at once)."""
    from ..emit import load_run_config

    cand = load_run_config(ns.config).candidate
    if workload is not None:
        cand.check(workload.gpu, workload.model)
    return cand


def emit_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, default=_json_default)


def _json_default(o: Any) -> Any:
    import enum
    from pathlib import Path

    if isinstance(o, enum.Enum):
        return o.value
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
