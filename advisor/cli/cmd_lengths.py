"""`advisor lengths`: the token-length distribution of a dataset, as TRL prepares it, and what each max_length costs."""

from __future__ import annotations

import argparse
import sys

from ..errors import UsageError
from ._common import add_workload_args, check_writable, emit_json, parse_fraction


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "lengths",
        help="token lengths of a dataset: percentiles, truncation, padding and packing per max_length",
        description="Tokenize the dataset exactly as SFTTrainer does (max_length=None) and report the length "
                    "percentiles, trained tokens, and for each candidate max_length the trained tokens lost to "
                    "truncation, the padding share per micro-batch size (random order and group_by_length) and "
                    "the fill rate of packed rows (bfd, bfd_split, wrapped) from TRL's own pack_dataset. "
                    "Exit 2 on a malformed file or when no tokenizer is reachable.",
    )
    add_workload_args(p)
    p.add_argument("--max-length", type=int, nargs="+", default=None, metavar="L",
                   help="max_length values to evaluate (default: the advisor's candidates for --max-truncation)")
    p.add_argument("--max-completion-length", type=int, default=None, metavar="C",
                   help="prompt data (--trainer grpo|rloo|distillation): the completion length each prompt is "
                        "counted with (the config's max_completion_length; default: TRL's 512). The online trainers "
                        "have no max_length")
    p.add_argument("--max-truncation", default="1%",
                   help="share of trained tokens that truncation may drop, for the suggested max_length "
                        "(default: %(default)s)")
    p.add_argument("--micro-batch", type=int, nargs="+", default=None, metavar="B",
                   help="micro-batch sizes for the padding share (default: 1 2 4 8 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of --sample and of the bootstrap (default: 0)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="also write a histogram PNG (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from ..profiles import resolve_model
    from ..trainers import get_trainer

    max_truncation = parse_fraction(ns.max_truncation, "--max-truncation")
    check_writable(ns.plot, "--plot")
    bad = [v for v in (ns.max_length or []) if v < 1] + [v for v in (ns.micro_batch or []) if v < 1]
    if ns.max_completion_length is not None and ns.max_completion_length < 1:
        bad.append(ns.max_completion_length)
    if bad:
        raise UsageError(f"--max-length / --micro-batch / --max-completion-length {bad}: must be positive integers, "
                         "e.g. --max-length 1024")
    model = resolve_model(ns.model)
    # the trainer reads its own data; the report is that of its kind of data (rows, pairs)
    data = get_trainer(ns.trainer).load_dataset(ns.dataset, model, ns.tokenizer, sample=ns.sample, seed=ns.seed,
                                                progress=sys.stderr.isatty())
    if data.unit == "prompts" and ns.max_length:
        # GRPOConfig / RLOOConfig have no max_length: reading N as the completion length would be a silent guess
        raise UsageError(f"--max-length {' '.join(map(str, ns.max_length))} with --trainer {ns.trainer}: "
                         f"{get_trainer(ns.trainer).config_name} has no max_length (TRL 1.16 truncates no prompt; "
                         "completions end at max_completion_length); use --max-completion-length "
                         f"{ns.max_length[0]} (suggest: --fix max_completion_length={ns.max_length[0]})")
    if data.unit != "prompts" and ns.max_completion_length is not None:
        raise UsageError(f"--max-completion-length {ns.max_completion_length} with --trainer {ns.trainer}: only the "
                         "online trainers (--trainer grpo|rloo|distillation) generate completions; use --max-length")
    report_of = _REPORTS.get(data.unit)
    if report_of is None:
        raise UsageError(f"--trainer {ns.trainer}: `advisor lengths` has no report for {data.unit} yet; use "
                         "`advisor suggest`, which reads them")
    return report_of(ns, data, max_truncation)


def _rows(ns: argparse.Namespace, data, max_truncation: float) -> int:
    """Chat rows (SFT): percentiles, truncation, padding per micro-batch and packing fill per max_length."""
    from ..lengths import MICRO_BATCHES, length_report, plot_lengths

    report = length_report(data, max_lengths=ns.max_length, micro_batches=tuple(ns.micro_batch or MICRO_BATCHES),
                           max_truncation=max_truncation, seed=ns.seed)
    marker = ns.max_length[0] if ns.max_length else report.suggested_max_length
    plot = plot_lengths(report, ns.plot, max_length=marker) if ns.plot else None
    if ns.json:
        out = report.to_dict()
        out["plot"] = None if plot is None else str(plot)
        print(emit_json(out))
        return 0
    print(_text(report, marker))
    if plot is not None:
        print(f"\nhistogram written to {plot}")
    return 0


def _text(report, marker: int) -> str:
    from tabulate import tabulate

    from ..lengths import histogram_text

    kind = "synthetic data (no --dataset given)" if report.synthetic else "dataset"
    pct = report.percentiles
    lines = [
        f"{report.name}: {kind}, {report.count} rows, {report.total_tokens} tokens, "
        f"{report.trained_tokens} trained tokens",
        f"full prepared length: p50 {pct.p50}  p90 {pct.p90}  p95 {pct.p95}  p99 {pct.p99}  max {pct.max}  "
        f"(mean {report.mean_length:.1f})",
    ]
    if report.sampling is not None:
        s = report.sampling
        ci = "  ".join(f"{k} [{v.low:.0f}, {v.high:.0f}]" for k, v in s.percentiles.items())
        lines.append(f"sampled {s.rows} of {s.population} rows; {s.confidence:.0%} bootstrap intervals: {ci}; "
                     f"mean [{s.mean_length.low:.1f}, {s.mean_length.high:.1f}]")
    lines.append(f"suggested max_length: {report.suggested_max_length} "
                 f"(loses at most {report.max_truncation:.1%} of trained tokens, a multiple of 64)")
    rows = []
    for m in report.max_lengths:
        padding = " ".join(f"{p.micro_batch}:{p.random:.0%}/{p.group_by_length:.0%}" for p in m.padding)
        packing = " ".join(f"{p.strategy.value} {p.fill_rate:.1%}" for p in m.packing)
        rows.append([m.max_length, f"{m.tokens_lost_fraction:.2%}", m.rows_truncated, m.rows_dropped, padding,
                     packing])
    lines.append("")
    lines.append(tabulate(rows, headers=["max_length", "trained lost", "rows cut", "rows dropped",
                                         "padding per micro-batch (random/grouped)", "packed fill"]))
    lines.append("")
    lines.append(histogram_text(report, max_length=marker))
    if report.bad_rows:
        lines.append("")
        lines.append(f"{len(report.bad_rows)} bad row(s), skipped:")
        lines += [f"  {b.describe()}" for b in report.bad_rows[:20]]
        if len(report.bad_rows) > 20:
            lines.append(f"  ... and {len(report.bad_rows) - 20} more (see --json)")
    lines += [f"note: {n}" for n in report.notes if not n.startswith(f"{len(report.bad_rows)} bad row")]
    return "\n".join(lines)


def _preference(ns: argparse.Namespace, data, max_truncation: float) -> int:
    """Preference pairs (`advisor lengths --trainer dpo|reward`): the lengths of prompt + chosen and prompt +
    rejected, and for each max_length the chosen and the rejected tokens it cuts off (apart) and the pairs it
    drops."""
    from tabulate import tabulate

    from ..trainers.preference import preference_length_report

    report = preference_length_report(data, max_lengths=ns.max_length, max_truncation=max_truncation)
    if ns.json:
        print(emit_json(report.to_dict()))
        return 0
    kind = "synthetic preference data (no --dataset given)" if report.synthetic else "preference dataset"

    def pct(p) -> str:
        return f"p50 {p.p50}  p90 {p.p90}  p95 {p.p95}  p99 {p.p99}  max {p.max}"

    lines = [f"{report.name}: {kind}, {report.pairs} pairs",
             f"prompt:            {pct(report.prompt)}",
             f"prompt + chosen:   {pct(report.chosen)}",
             f"prompt + rejected: {pct(report.rejected)}",
             f"suggested max_length: {report.suggested_max_length} (neither chosen nor rejected loses more than "
             f"{report.max_truncation:.1%} of its tokens, a multiple of 64)", ""]
    rows = [[m.max_length, f"{m.chosen_lost_fraction:.2%}", f"{m.rejected_lost_fraction:.2%}", m.chosen_truncated,
             m.rejected_truncated, m.pairs_dropped] for m in report.max_lengths]
    lines.append(tabulate(rows, headers=["max_length", "chosen lost", "rejected lost", "chosen cut", "rejected cut",
                                         "pairs dropped"]))
    lines += [f"note: {n}" for n in report.notes]
    print("\n".join(lines))
    return 0


def _prompts(ns: argparse.Namespace, data, max_truncation: float) -> int:
    """Prompts (`advisor lengths --trainer grpo|rloo|distillation`): the prompts' lengths and prompt +
    max_completion_length (--max-completion-length, else TRL's 512): the online trainers truncate neither."""
    from ..trainers.prompts import DEFAULT_COMPLETION, prompt_length_report

    report = prompt_length_report(data, ns.max_completion_length or DEFAULT_COMPLETION)
    if ns.json:
        print(emit_json(report.to_dict()))
        return 0
    kind = "synthetic prompts (no --dataset given)" if report.synthetic else "prompt dataset"

    def pct(p) -> str:
        return f"p50 {p.p50}  p90 {p.p90}  p95 {p.p95}  p99 {p.p99}  max {p.max}"

    lines = [f"{report.name}: {kind}, {report.prompts} prompts",
             f"prompt:                      {pct(report.prompt)}",
             f"prompt + {report.max_completion_length} completion tokens: {pct(report.sequence)}",
             "TRL 1.16 truncates no prompt; every completion is counted at max_completion_length (the bound)"]
    lines += [f"note: {n}" for n in report.notes]
    print("\n".join(lines))
    return 0


# the length report of each kind of data (the Dataset protocol's `unit`)
_REPORTS = {"rows": _rows, "pairs": _preference, "prompts": _prompts}
