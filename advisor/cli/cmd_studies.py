"""`advisor studies`: the searches stored in the study cache (or --storage), for `advisor report --study`."""

from __future__ import annotations

import argparse
import dataclasses


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("studies", help="list the stored searches (see one again with advisor report)",
                              description="The advisor studies in the study cache, or in --storage.")
    p.add_argument("--storage", default=None, help="Optuna RDB URL or journal file (default: the study cache)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from ..search import stored_studies  # lazy: loads numpy
    from ._common import emit_json  # lazy: loads numpy

    studies = stored_studies(ns.storage)
    if ns.json:
        print(emit_json({"studies": [dataclasses.asdict(s) for s in studies]}))
        return 0
    where = ns.storage or "the study cache"
    if not studies:
        print(f"no stored search in {where}; `advisor suggest` stores one")
        return 0
    from tabulate import tabulate  # lazy: loads tabulate

    rows = [[s.name, s.model or "-", s.gpu or "-", s.dataset or "synthetic", s.backend, s.method, s.trials,
             "yes" if s.answered else "no", s.started or "-"] for s in studies]
    print(tabulate(rows, headers=["study", "model", "gpu", "dataset", "backend", "method", "measured", "answered",
                                  "started"], tablefmt="simple"))
    flag = f" --storage {ns.storage}" if ns.storage else ""
    print(f"\nshow one again (nothing is measured): advisor report --study NAME{flag}")
    return 0
