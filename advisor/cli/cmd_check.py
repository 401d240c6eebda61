"""`advisor check`: re-measure a baseline's workload and fail (exit 1) when peak memory grew."""

from __future__ import annotations

import argparse
import os

from ..baseline import load_baseline
from ..emit import load_run_config
from ..errors import UsageError
from ..regress import DEFAULT_TOLERANCE, check, parse_tolerance
from ..render import check_markdown, check_text, check_verdict
from ._common import add_config_arg, emit_json, reattribute


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check",
        help="compare the peak memory of a configuration against a baseline (exit 1 on a regression)",
        description="Re-measure the baseline's workload with the baseline's backend (or --config against it) "
                    "and print baseline, now and difference per category. Exit 0 within tolerance, 1 on a "
                    "regression, 2 on bad input. Writes the table as Markdown to $GITHUB_STEP_SUMMARY when set.",
    )
    p.add_argument("--baseline", required=True, metavar="FILE.json", help="a file written by `advisor baseline`")
    add_config_arg(p, required=False, launch=False)
    p.add_argument("--tolerance", default=f"{DEFAULT_TOLERANCE:.0%}",
                   help="allowed growth of the peaks, e.g. 1%% or 0.01 (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    tolerance = parse_tolerance(ns.tolerance)
    baseline = load_baseline(ns.baseline)
    candidate = None
    if ns.config:
        candidate = load_run_config(ns.config, trainer=baseline.workload.trainer).candidate  # the baseline's
    try:
        result = check(baseline, candidate=candidate, tolerance=tolerance)
    except UsageError as exc:  # the workload rebuilt from the baseline's names: check has no --model / --gpu

        raise reattribute(exc, {f"--{k}": f"--baseline {ns.baseline}: workload.{k}"
                                for k in ("model", "gpu", "dataset", "tokenizer", "sample")}) from None
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as fh:
            fh.write(f"`{ns.baseline}`\n\n" + check_markdown(result) + "\n")
    if ns.json:
        print(emit_json({"baseline": ns.baseline, "verdict": check_verdict(result), **result.to_dict()}))
    else:
        print(f"{ns.baseline}: " + check_text(result), end="")
    return 1 if result.regressed else 0
