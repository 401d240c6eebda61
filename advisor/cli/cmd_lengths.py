"""`advisor lengths`: the token-length distribution of a dataset, as TRL prepares it, and what each max_length costs."""

from __future__ import annotations

import argparse
import sys

from ..errors import UsageError
from ..lengths import MICRO_BATCHES, LengthRequest
from ..profiles import resolve_model
from ..trainers import generating, get_trainer
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
                   help="prompt data (the trainers that generate): the completion length each prompt is "
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
    max_truncation = parse_fraction(ns.max_truncation, "--max-truncation")
    check_writable(ns.plot, "--plot")
    bad = [v for v in (ns.max_length or []) if v < 1] + [v for v in (ns.micro_batch or []) if v < 1]
    if ns.max_completion_length is not None and ns.max_completion_length < 1:
        bad.append(ns.max_completion_length)
    if bad:
        raise UsageError(f"--max-length / --micro-batch / --max-completion-length {bad}: must be positive integers, "
                         "e.g. --max-length 1024")
    model = resolve_model(ns.model)
    trainer = get_trainer(ns.trainer)
    # the trainer reads its own data, and reports on its kind of data (rows, pairs, prompts, ...)
    data = trainer.load_dataset(ns.dataset, model, ns.tokenizer, sample=ns.sample, seed=ns.seed,
                                progress=sys.stderr.isatty())
    request = LengthRequest(trainer=ns.trainer, max_lengths=tuple(ns.max_length) if ns.max_length else None,
                            max_truncation=max_truncation, micro_batches=tuple(ns.micro_batch or MICRO_BATCHES),
                            seed=ns.seed, max_completion_length=ns.max_completion_length, plot=ns.plot,
                            generating=generating())
    report = trainer.length_report(data, request)
    print(emit_json(report.to_dict()) if ns.json else report.text())
    return 0
