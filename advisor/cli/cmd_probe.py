"""`advisor probe`: measure one configuration with real training steps in an isolated child process."""

from __future__ import annotations

import argparse

from ..backends import PROBE_BACKENDS
from ..probing import probe
from ..render import probe_text
from ..trainers import training_workload
from ._common import (
    add_config_arg,
    add_workload_args,
    candidate_from_args,
    emit_json,
    parse_size,
    with_workload_notes,
    workload_from_args,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "probe",
        help="measure a configuration with real training steps (peak memory, tokens/s)",
        description="Run warm-up + measured SFTTrainer steps of --config on the longest rows first, in a child "
        "process; an out-of-memory, a crash or a hang is reported as a status, never a crash of this command.",
    )
    add_workload_args(p)
    add_config_arg(p)
    p.add_argument("--backend", choices=PROBE_BACKENDS, default=None,
                   help="where to run the steps (default: cuda when the target is a GPU, else cpu)")
    p.add_argument("--steps", type=int, default=3, help="measured optimizer steps (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps, not timed (default 1)")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="hard cap on the memory the run may use (e.g. 40GB); over it the probe reports oom")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds without progress after which the probe is killed (default 300)")
    p.add_argument("--weights", default=None, metavar="DIR",
                   help="load these real weights instead of random ones (same memory and speed either way)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    budget = parse_size(ns.memory_budget) if ns.memory_budget is not None else None

    shown = workload_from_args(ns)
    candidate = candidate_from_args(ns, shown)
    workload = training_workload(shown, candidate)  # the ranks that train (vLLM server mode's GPUs left out)
    backend = ns.backend or ("cuda" if workload.gpu.is_cuda else "cpu")
    m = probe(workload, candidate, backend, steps=ns.steps, warmup=ns.warmup, timeout_s=ns.timeout,
              memory_budget_bytes=budget, weights=ns.weights)
    m = with_workload_notes(m, shown)
    if ns.json:
        print(emit_json(m.to_dict()))
    else:
        print(probe_text(m))
    return 0 if m.ok else 1
