"""`advisor report --study NAME`: a stored search's answer and trials again, without measuring anything."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("report", help="show a stored search again without re-running it",
                              description="Rebuild the answer of a stored study (`advisor studies` lists them) "
                              "from its trials and stored confirmation; nothing is measured.")
    p.add_argument("--study", required=True, help="the study's name, as `advisor studies` lists it")
    p.add_argument("--storage", default=None, help="Optuna RDB URL or journal file (default: the study cache)")
    p.add_argument("--format", choices=("table", "yaml", "json", "python"), default="table")
    p.add_argument("--json", action="store_true", help="same as --format json")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="device peak against throughput")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from ..search import stored_suggestion  # lazy: loads numpy
    from ._common import check_writable, emit_json  # lazy: loads numpy

    check_writable(ns.plot, "--plot")
    s = stored_suggestion(ns.study, ns.storage)
    fmt = "json" if ns.json else ns.format
    if ns.plot:
        from ..report import plot  # lazy: keeps start-up light

        plot(s, ns.plot)
    if fmt == "table":
        from ..report import render_report  # lazy: keeps start-up light

        print(render_report(s))
        if ns.plot:
            print(f"\nwrote the plot (device peak against tokens/s) to {ns.plot}")
        return 0
    text = {"yaml": s.to_yaml, "python": s.to_python, "json": lambda: emit_json(s.to_json_dict())}[fmt]()
    print(text, end="" if text.endswith("\n") else "\n")
    if ns.plot:
        print(f"advisor: wrote the plot to {ns.plot}", file=sys.stderr)
    return 0
