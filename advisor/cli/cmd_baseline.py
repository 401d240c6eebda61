"""`advisor baseline`: record the peak memory of a configuration, to be checked later by `advisor check`."""

from __future__ import annotations

import argparse

from ..regress import Backend, WorkloadRef, format_bytes, record_baseline
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
    p.add_argument("--backend", default=Backend.SIMULATE.value, choices=[b.value for b in Backend],
                   help="how to measure (default: simulate, deterministic on a CPU-only runner)")
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
    path = baseline.save(ns.out)
    if ns.json:
        print(emit_json({"baseline": str(path), **baseline.to_dict()}))
        return 0
    print(f"wrote {path}: {baseline.backend.value} backend, {ref.model} on {workload.gpu.name}")
    print(f"  peak_bytes     {format_bytes(baseline.peak_bytes):>12}  ({baseline.peak_bytes} B)")
    print(f"  reserved_bytes {format_bytes(baseline.reserved_bytes):>12}")
    print(f"  device_bytes   {format_bytes(baseline.device_bytes):>12}")
    for name, n in baseline.breakdown.items():
        print(f"    {name:<18} {format_bytes(n):>12}")
    print("  versions: " + ", ".join(f"{k} {v}" for k, v in baseline.versions.items()))
    return 0
