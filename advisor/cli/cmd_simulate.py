"""`advisor simulate`: the peak memory of a RUN.yaml's training step on a target, predicted on fake tensors."""

from __future__ import annotations

import argparse

from ..render import simulate_text
from ..simulator import simulate, simulate_per_rank
from ..trainers import training_workload
from ._common import (
    add_config_arg,
    add_workload_args,
    candidate_from_args,
    emit_json,
    with_workload_notes,
    workload_from_args,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("simulate", help="predict peak memory and step time on fake tensors (no GPU needed)")
    add_workload_args(p)
    add_config_arg(p)
    p.add_argument("--full-depth", action="store_true", help="simulate every layer instead of extrapolating")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    shown = workload_from_args(ns)
    candidate = candidate_from_args(ns, shown)
    workload = training_workload(shown, candidate)  # the ranks that train (vLLM server mode's GPUs left out)
    layers = None if ns.full_depth else (2, 3)
    if workload.num_gpus > 1:  # one rank of N, sharded as --parallelism says

        m = simulate_per_rank(workload, candidate, parallelism=candidate.parallelism.parallelism, layers=layers)
    else:
        m = simulate(workload, candidate, layers=layers)
    m = with_workload_notes(m, shown)
    if ns.json:
        print(emit_json(m.to_dict()))
    else:
        print(simulate_text(m, shown.budget_bytes))
    return 0 if m.ok else 1
