"""`advisor baseline`: record the peak memory of a configuration, to be checked later by `advisor check`."""

from __future__ import annotations

import argparse

from ..backends import backend_names
from ..errors import UsageError
from ..inputs import WorkloadRef
from ..regress import DEFAULT_BACKEND, record_baseline
from ..render import baseline_text
from ._common import (
    add_config_arg,
    add_workload_args,
    candidate_from_args,
    check_writable,
    emit_json,
    workload_from_args,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "baseline",
        help="record the peak memory of a RUN.yaml as a baseline file for `advisor check`",
        description="Measure a configuration once and write a baseline (peaks, breakdown by category, backend, "
                    "workload fingerprint, library versions). Commit the file; `advisor check` compares against it.",
    )
    add_workload_args(p, model_required=False)
    add_config_arg(p, required=True)
    p.add_argument("--backend", default=DEFAULT_BACKEND, metavar="{" + ",".join(backend_names()) + "}",
                   help="how to measure, a backend of `advisor suggest` (default: simulate, deterministic on a "
                   "CPU-only runner)")
    p.add_argument("--out", required=True, metavar="FILE.json", help="where to write the baseline")
    p.add_argument("--json", action="store_true", help="print the baseline as one JSON object")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    check_writable(ns.out, "--out")
    workload = workload_from_args(ns)
    candidate = candidate_from_args(ns, workload)
    ref = WorkloadRef.of(workload, model=ns.model, gpu=ns.gpu, dataset=ns.dataset, tokenizer=ns.tokenizer,
                         sample=ns.sample)
    baseline = record_baseline(workload, candidate, backend=ns.backend, config_path=ns.config, ref=ref)
    try:
        path = baseline.save(ns.out)
    except OSError as exc:  # after the measurement: say so, leave no half-written file (Baseline.save is atomic)
        raise UsageError(f"--out {ns.out}: cannot be written ({exc.strerror or exc}); nothing was written there; "
                         "choose a path on a writable file system with free space") from None
    if ns.json:
        print(emit_json({"baseline": str(path), **baseline.to_dict()}))
        return 0
    print(baseline_text(baseline, path, workload.gpu.name))
    return 0
