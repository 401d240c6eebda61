"""`advisor worker`: one process per GPU or machine measures queued candidates of a shared study."""

from __future__ import annotations

import argparse
import sys

from ._common import emit_json
from .cmd_suggest import add_jobs_flag, jobs_kwargs


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("worker", help="measure queued candidates of a shared study (one per GPU)",
                              description="Join a study made by `advisor suggest --storage URL --study NAME`.")
    p.add_argument("--storage", required=True, help="the study's Optuna RDB URL or journal file")
    p.add_argument("--study", required=True, help="the --study name given to `advisor suggest` (with --method "
                   "auto the worker follows NAME-full, NAME-lora, NAME-qlora)")
    p.add_argument("--backend", default=None, help="the study's backend (default); any other is refused")
    p.add_argument("--idle", type=float, default=30.0, metavar="S", help="exit after S seconds with an empty queue")
    add_jobs_flag(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from ..search import run_worker  # lazy: keeps start-up light (every command registers; loads numpy)

    n = run_worker(ns.storage, ns.study, backend=ns.backend, idle_s=ns.idle, **jobs_kwargs(ns))
    if ns.json:
        print(emit_json({"study": ns.study, "measured": n}))
    else:
        print(f"advisor worker: measured {n} candidate(s) of {ns.study}", file=sys.stderr)
    return 0
