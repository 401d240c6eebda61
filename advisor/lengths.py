"""The token-length distribution of a dataset and what it means for `max_length`, padding and packing.

Every number follows TRL's own rules: truncation keeps the start and drops rows left without a trained token
(SFTTrainer's preparation), padding pads each micro-batch to its longest row (random order, or transformers'
`get_length_grouped_indices` for `group_by_length`), and packed rows come from `trl.data_utils.pack_dataset`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .data import BadRow, TokenizedDataset, progress_bars
from .errors import UsageError
from .space import PackingStrategy

PERCENTILES = (50, 90, 95, 99)
MICRO_BATCHES = (1, 2, 4, 8, 16)
DEFAULT_MAX_TRUNCATION = 0.01
HISTOGRAM_BINS = 20
BOOTSTRAP_RESAMPLES = 200
GROUPED_SEED = 42  # TrainingArguments.seed's default, which seeds the length-grouped sampler


@dataclass(frozen=True)
class Percentiles:
    """Nearest-rank percentiles (each one is a length that occurs in the data)."""

    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: np.ndarray) -> Percentiles:
        if len(values) == 0:
            return cls(0, 0, 0, 0, 0)
        p = [int(np.percentile(values, q, method="inverted_cdf")) for q in PERCENTILES]
        return cls(*p, max=int(values.max()))

    def to_dict(self) -> dict[str, float]:
        return {"p50": self.p50, "p90": self.p90, "p95": self.p95, "p99": self.p99, "max": self.max}


@dataclass(frozen=True)
class Interval:
    low: float
    high: float

    def to_dict(self) -> dict[str, float]:
        return {"low": self.low, "high": self.high}


@dataclass(frozen=True)
class SamplingError:
    """Bootstrap confidence intervals of statistics estimated from a random sample of the rows."""

    rows: int
    population: int
    confidence: float
    resamples: int
    percentiles: dict[str, Interval]
    mean_length: Interval
    mean_trained: Interval

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "population": self.population,
            "confidence": self.confidence,
            "method": f"bootstrap ({self.resamples} resamples)",
            "percentiles": {k: v.to_dict() for k, v in self.percentiles.items()},
            "mean_length": self.mean_length.to_dict(),
            "mean_trained_tokens": self.mean_trained.to_dict(),
            "note": "the max of a sample is only a lower bound of the population's max",
        }


@dataclass(frozen=True)
class Padding:
    """Share of the padded micro-batch that is padding, padding each batch to its longest row."""

    micro_batch: int
    random: float  # expected value over random orders (exact)
    group_by_length: float  # transformers' length-grouped order, seeded


@dataclass(frozen=True)
class Packing:
    """Packed rows of `max_length` tokens built by TRL's `pack_dataset`."""

    strategy: PackingStrategy
    rows: int
    fill_rate: float  # tokens / (rows x max_length)
    tokens_lost: int  # trained tokens that never reach the loss


@dataclass(frozen=True)
class MaxLengthStats:
    max_length: int
    rows_truncated: int
    rows_dropped: int  # left without a trained token by truncation; SFTTrainer drops them
    tokens_lost: int  # trained tokens cut by truncation (no packing)
    tokens_lost_fraction: float
    padding: tuple[Padding, ...]
    packing: tuple[Packing, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_length": self.max_length,
            "rows_truncated": self.rows_truncated,
            "rows_dropped": self.rows_dropped,
            "tokens_lost": self.tokens_lost,
            "tokens_lost_fraction": self.tokens_lost_fraction,
            "padding": {
                str(p.micro_batch): {"random": p.random, "group_by_length": p.group_by_length}
                for p in self.padding
            },
            "packing": {
                p.strategy.value: {"fill_rate": p.fill_rate, "rows": p.rows, "tokens_lost": p.tokens_lost}
                for p in self.packing
            },
        }


@dataclass(frozen=True)
class LengthReport:
    name: str
    synthetic: bool
    count: int
    percentiles: Percentiles
    mean_length: float
    total_tokens: int
    trained_tokens: int
    trained_percentiles: Percentiles
    suggested_max_length: int
    max_truncation: float
    max_lengths: tuple[MaxLengthStats, ...]
    histogram_edges: tuple[int, ...]
    histogram_counts: tuple[int, ...]
    bad_rows: tuple[BadRow, ...] = ()
    sampling: SamplingError | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.name,
            "synthetic": self.synthetic,
            "count": self.count,
            "percentiles": self.percentiles.to_dict(),
            "mean_length": self.mean_length,
            "total_tokens": self.total_tokens,
            "trained_tokens": self.trained_tokens,
            "trained_percentiles": self.trained_percentiles.to_dict(),
            "suggested_max_length": self.suggested_max_length,
            "max_truncation": self.max_truncation,
            "max_lengths": [m.to_dict() for m in self.max_lengths],
            "histogram": {"edges": list(self.histogram_edges), "counts": list(self.histogram_counts)},
            "bad_rows": [b.to_dict() for b in self.bad_rows],
            "sampling_error": None if self.sampling is None else self.sampling.to_dict(),
            "notes": list(self.notes),
        }


def length_report(
    dataset: TokenizedDataset,
    max_lengths: Sequence[int] | None = None,
    micro_batches: Sequence[int] = MICRO_BATCHES,
    max_truncation: float = DEFAULT_MAX_TRUNCATION,
    seed: int = 0,
) -> LengthReport:
    """Statistics of the full prepared lengths and, per candidate `max_length`, truncation, padding and packing."""
    lengths = dataset.lengths
    if len(lengths) == 0:
        raise UsageError(f"dataset {dataset.name}: no rows to report on")
    bad = [f"max_length {m}: must be a positive number of tokens" for m in (max_lengths or ()) if m <= 0]
    bad += [f"micro-batch {b}: must be a positive number of rows" for b in micro_batches if b <= 0]
    if bad:
        raise UsageError("; ".join(bad))
    candidates = max_length_candidates(dataset, max_truncation)
    chosen = list(max_lengths) if max_lengths else candidates
    edges, counts = _histogram(lengths)
    return LengthReport(
        name=dataset.name,
        synthetic=dataset.synthetic,
        count=len(lengths),
        percentiles=Percentiles.of(lengths),
        mean_length=float(lengths.mean()),
        total_tokens=int(lengths.sum()),
        trained_tokens=dataset.total_trained,
        trained_percentiles=Percentiles.of(dataset.trained),
        suggested_max_length=candidates[0],
        max_truncation=max_truncation,
        max_lengths=tuple(_max_length_stats(dataset, m, micro_batches) for m in sorted(set(chosen))),
        histogram_edges=edges,
        histogram_counts=counts,
        bad_rows=dataset.bad_rows,
        sampling=_bootstrap(dataset, seed) if dataset.sampled else None,
        notes=dataset.notes,
    )


def max_length_candidates(dataset: TokenizedDataset, max_truncation: float, multiple: int = 64) -> list[int]:
    """The smallest `max_length` (a multiple of `multiple`) losing at most `max_truncation` of the trained tokens,
    then a few larger rungs (p95, p99, doublings) up to the longest row, all rounded up to `multiple`."""
    if not 0.0 <= max_truncation <= 1.0:
        raise UsageError(f"--max-truncation {max_truncation}: must be in [0, 1], e.g. 0.01 for 1%")
    if multiple <= 0:
        raise UsageError(f"multiple {multiple}: must be a positive number of tokens, e.g. 64")
    longest = int(dataset.lengths.max()) if len(dataset.lengths) else multiple
    top = _round_up(longest, multiple)
    positions = [p for p in dataset.trained_positions if len(p)]
    total = dataset.total_trained
    if total == 0:
        return [top]
    # kept(L) = trained tokens at positions < L; the smallest L with total - kept(L) <= allowed
    kept = np.cumsum(np.bincount(np.concatenate(positions), minlength=longest))
    smallest = int(np.searchsorted(total - kept <= max_truncation * total, True)) + 1
    base = _round_up(smallest, multiple)
    rungs = {base, top}
    pct = Percentiles.of(dataset.lengths)
    rungs |= {_round_up(int(v), multiple) for v in (pct.p95, pct.p99)}
    rungs |= {base * 2**k for k in range(1, 4)}
    return sorted(r for r in rungs if base <= r <= top)


def histogram_text(report: LengthReport, width: int = 40, max_length: int | None = None) -> str:
    """A terminal histogram of the full lengths; the bin holding `max_length` is marked."""
    marker = report.suggested_max_length if max_length is None else max_length
    peak = max(report.histogram_counts) or 1
    edges = report.histogram_edges
    label_width = len(str(edges[-1]))
    lines = []
    for i, count in enumerate(report.histogram_counts):
        lo, hi = edges[i], edges[i + 1]
        bar = "#" * math.ceil(width * count / peak) if count else ""
        mark = f"  <- max_length {marker}" if lo <= marker < hi or (i == len(edges) - 2 and marker >= hi) else ""
        lines.append(f"{lo:>{label_width}}-{hi - 1:<{label_width}} | {bar:<{width}} {count}{mark}")
    return "\n".join(lines)


def plot_lengths(report: LengthReport, path: str | Path, max_length: int | None = None) -> Path:
    """A PNG of the length histogram with `max_length` marked (needs matplotlib, an optional extra)."""
    try:
        import matplotlib  # lazy: loads matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: loads matplotlib
    except ImportError as exc:
        raise UsageError(
            f"--plot {path}: needs matplotlib; install it (pip install matplotlib) or drop --plot"
        ) from exc
    marker = report.suggested_max_length if max_length is None else max_length
    edges = np.asarray(report.histogram_edges)
    fig, ax = plt.subplots(figsize=(8, 4))
    try:
        ax.bar(edges[:-1], report.histogram_counts, width=np.diff(edges), align="edge", edgecolor="black")
        ax.axvline(marker, color="red", linestyle="--", label=f"max_length = {marker}")
        ax.set_xlabel("tokens per prepared row")
        ax.set_ylabel("rows")
        kind = "synthetic" if report.synthetic else "dataset"
        ax.set_title(f"{report.name} ({kind}, {report.count} rows)")
        ax.legend()
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out)
    finally:
        plt.close(fig)
    return out


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)


def _histogram(lengths: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    step = max(1, math.ceil((int(lengths.max()) + 1) / HISTOGRAM_BINS))
    edges = np.arange(0, step * (HISTOGRAM_BINS + 1), step)
    counts, _ = np.histogram(lengths, bins=edges)
    return tuple(int(e) for e in edges), tuple(int(c) for c in counts)


def _max_length_stats(dataset: TokenizedDataset, max_length: int, micro_batches: Sequence[int]) -> MaxLengthStats:
    kept_trained = dataset.trained_after_truncation(max_length)
    keep = kept_trained > 0  # SFTTrainer drops rows left without a trained token
    truncated = np.minimum(dataset.lengths, max_length)[keep]
    lost = dataset.total_trained - int(kept_trained.sum())
    return MaxLengthStats(
        max_length=max_length,
        rows_truncated=int((dataset.lengths > max_length).sum()),
        rows_dropped=int((~keep).sum()),
        tokens_lost=lost,
        tokens_lost_fraction=lost / dataset.total_trained if dataset.total_trained else 0.0,
        padding=tuple(
            Padding(b, _random_padding(truncated, b), _grouped_padding(truncated, b)) for b in micro_batches
        ),
        packing=tuple(_packing(dataset, max_length, s) for s in PackingStrategy),
    )


def _random_padding(lengths: np.ndarray, batch: int) -> float:
    """Expected padding share in random order: each micro-batch is a uniform random subset of `batch` rows, whose
    longest row is the i-th smallest with probability C(i-1, batch-1) / C(n, batch)."""
    n = len(lengths)
    if n == 0:
        return 0.0
    ordered = np.sort(lengths).astype(np.float64)
    if batch >= n:
        expected_max = ordered[-1]
    elif batch == 1:
        return 0.0
    else:
        i = np.arange(batch, n + 1, dtype=np.float64)  # 1-based ranks that can be a batch's longest row
        log_p = _log_comb(i - 1, batch - 1) - _log_comb(np.float64(n), batch)
        expected_max = float(np.sum(ordered[batch - 1:] * np.exp(log_p)))
    return float(max(0.0, 1.0 - ordered.sum() / (n * expected_max)))


_lgamma = np.vectorize(math.lgamma, otypes=[np.float64])


def _log_comb(n: np.ndarray | np.float64, k: int) -> np.ndarray:
    return _lgamma(n + 1) - math.lgamma(k + 1) - _lgamma(n - k + 1)


def _grouped_padding(lengths: np.ndarray, batch: int, seed: int = GROUPED_SEED) -> float:
    """Padding share in the order transformers' LengthGroupedSampler yields (its own index function)."""
    import torch  # lazy: loads torch
    from transformers.trainer_pt_utils import get_length_grouped_indices  # lazy: loads transformers

    if len(lengths) == 0:
        return 0.0
    order = get_length_grouped_indices(
        lengths.tolist(), batch, generator=torch.Generator().manual_seed(seed)
    )
    ordered = lengths[np.asarray(order)]
    padded = sum(len(chunk) * int(chunk.max()) for chunk in np.array_split(ordered, range(batch, len(ordered), batch)))
    return float(1.0 - ordered.sum() / padded)


def _packing(dataset: TokenizedDataset, max_length: int, strategy: PackingStrategy) -> Packing:
    """Pack with TRL's own `pack_dataset`, as SFTTrainer does (input_ids and labels, no prior truncation)."""
    import pyarrow.compute as pc  # lazy: loads pyarrow
    from trl.data_utils import pack_dataset  # lazy: loads trl

    hf = _labelled(dataset)
    with progress_bars(False):
        packed = pack_dataset(hf, max_length, strategy.value, {})
    ids = packed.data.column("input_ids")
    labels = pc.list_flatten(packed.data.column("labels"))
    tokens = int(pc.sum(pc.list_value_length(ids)).as_py() or 0)
    trained = int(pc.sum(pc.cast(pc.not_equal(labels, -100), "int64")).as_py() or 0)
    rows = len(packed)
    return Packing(
        strategy=strategy,
        rows=rows,
        fill_rate=tokens / (rows * max_length) if rows else 0.0,
        tokens_lost=dataset.total_trained - trained,
    )


def _labelled(dataset: TokenizedDataset):
    """The columns SFTTrainer packs: input_ids and labels (-100 where not trained); cached per dataset."""
    cached = _LABELLED.get(id(dataset))
    if cached is not None and cached[0] is dataset:
        return cached[1]
    import datasets  # lazy: loads datasets

    labels = []
    for row, positions in zip(dataset.rows, dataset.trained_positions, strict=True):
        lab = np.full(len(row["input_ids"]), -100, dtype=np.int64)
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        lab[positions] = ids[positions]
        labels.append(lab.tolist())
    hf = datasets.Dataset.from_dict({"input_ids": [list(r["input_ids"]) for r in dataset.rows], "labels": labels})
    _LABELLED.clear()
    _LABELLED[id(dataset)] = (dataset, hf)
    return hf


_LABELLED: dict[int, tuple[TokenizedDataset, Any]] = {}


def _bootstrap(dataset: TokenizedDataset, seed: int, confidence: float = 0.95) -> SamplingError:
    rng = np.random.default_rng(seed)
    n = len(dataset.lengths)
    idx = rng.integers(0, n, size=(BOOTSTRAP_RESAMPLES, n))
    lengths = dataset.lengths[idx]
    alpha = (1.0 - confidence) / 2 * 100

    def interval(values: np.ndarray) -> Interval:
        lo, hi = np.percentile(values, [alpha, 100 - alpha])
        return Interval(float(lo), float(hi))

    pct = {
        f"p{q}": interval(np.percentile(lengths, q, axis=1, method="inverted_cdf")) for q in PERCENTILES
    }
    return SamplingError(
        rows=n,
        population=int(dataset.population or n),
        confidence=confidence,
        resamples=BOOTSTRAP_RESAMPLES,
        percentiles=pct,
        mean_length=interval(lengths.mean(axis=1)),
        mean_trained=interval(dataset.trained[idx].mean(axis=1)),
    )


# ---- what `advisor lengths` asks of a trainer (`Trainer.length_report`), and the chat rows' answer -----------------
@dataclass(frozen=True)
class LengthRequest:
    """What `advisor lengths` asks for; each trainer's `length_report` reads what its kind of data has and refuses,
    naming the flag, what it has none of (`trainer`: the --trainer named in those errors)."""

    trainer: str = ""
    max_lengths: tuple[int, ...] | None = None
    max_truncation: float = DEFAULT_MAX_TRUNCATION
    micro_batches: tuple[int, ...] = MICRO_BATCHES
    seed: int = 0
    max_completion_length: int | None = None  # the online trainers' completion bound
    plot: str | None = None  # a histogram PNG to write (chat rows)
    generating: tuple[str, ...] = ()  # the trainers that generate completions (named in the errors)

    def refuse_completion_length(self) -> None:
        """A trainer that generates no completions has no completion length: --max-completion-length refused,
        naming the trainers that generate."""
        if self.max_completion_length is not None:
            which = f" (--trainer {'|'.join(self.generating)})" if self.generating else ""
            raise UsageError(f"--max-completion-length {self.max_completion_length} with --trainer {self.trainer}: "
                             f"only the online trainers{which} generate completions; use --max-length")


@dataclass(frozen=True)
class RowsLength:
    """The chat rows' answer to `advisor lengths`: the report, the max_length its histogram marks, the plot
    written (or None)."""

    report: LengthReport
    marker: int
    plot: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        out = self.report.to_dict()
        out["plot"] = None if self.plot is None else str(self.plot)
        return out

    def text(self) -> str:
        from tabulate import tabulate  # lazy: loads tabulate

        report = self.report
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
        lines.append(histogram_text(report, max_length=self.marker))
        if report.bad_rows:
            lines.append("")
            lines.append(f"{len(report.bad_rows)} bad row(s), skipped:")
            lines += [f"  {b.describe()}" for b in report.bad_rows[:20]]
            if len(report.bad_rows) > 20:
                lines.append(f"  ... and {len(report.bad_rows) - 20} more (see --json)")
        lines += [f"note: {n}" for n in report.notes if not n.startswith(f"{len(report.bad_rows)} bad row")]
        if self.plot is not None:
            lines += ["", f"histogram written to {self.plot}"]
        return "\n".join(lines)


def rows_length(data: TokenizedDataset, request: LengthRequest) -> RowsLength:
    """Chat rows (SFT): percentiles, truncation, padding per micro-batch and packing fill per max_length, and the
    histogram's PNG when asked."""
    request.refuse_completion_length()
    report = length_report(data, max_lengths=request.max_lengths, micro_batches=request.micro_batches,
                           max_truncation=request.max_truncation, seed=request.seed)
    marker = request.max_lengths[0] if request.max_lengths else report.suggested_max_length
    plot = plot_lengths(report, request.plot, max_length=marker) if request.plot else None
    return RowsLength(report, marker, plot)


def percentile_line(p: Percentiles) -> str:
    """One line of a length report: p50 / p90 / p95 / p99 / max."""
    return f"p50 {p.p50}  p90 {p.p90}  p95 {p.p95}  p99 {p.p99}  max {p.max}"
