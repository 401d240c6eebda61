"""Preference data (prompt / chosen / rejected) as DPOTrainer and RewardTrainer prepare it, and the built-in
synthetic preference set.

`load_preferences` reads a local .jsonl / .json / .parquet file (or a datasets directory / hub id, through
advisor.data's readers) and tokenizes it with TRL's own `DPOTrainer._prepare_dataset` (`max_length=None`): plain
or conversational, explicit or implicit prompt, exactly as TRL reads them. An SFT dataset (messages, prompt /
completion, text) is refused naming the missing columns.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .._messages import capture, said_note
from ..data import (
    SYNTHETIC_MAX,
    SYNTHETIC_MEDIAN,
    SYNTHETIC_SEED,
    SourcedRows,
    TokenizedDataset,
    load_tokenizer,
    progress_bars,
    read_raw,
    synthetic_lengths,
    tokenizer_note,
)
from ..errors import ConfigError, DatasetError
from ..lengths import Percentiles, percentile_line
from .registry import get_trainer

if TYPE_CHECKING:
    import datasets

    from ..workload import ModelSpec

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")
TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")

# The synthetic preference set: prompt + chosen drawn as the synthetic chat set's lengths (data.synthetic_lengths:
# log-normal, median ~300 tokens, the prompt 20-60% of it, clipped to [16, 8192]), the rejected completion the
# chosen one's length times a log-normal factor (sigma 0.35). Documented in README.md.
SYNTHETIC_PAIRS = 2048
SYNTHETIC_REJECTED_SIGMA = 0.35


@dataclass(frozen=True, eq=False)
class PreferenceDataset(SourcedRows):
    """Pairs as DPOTrainer's prepared dataset holds them: `prompt_ids`, `chosen_ids`, `rejected_ids` per row."""

    name: str
    source: Literal["synthetic", "local", "hub"]
    rows: tuple[dict[str, list[int]], ...]
    dataset_name: str | None = None
    notes: tuple[str, ...] = ()
    conversational: bool | None = None
    population: int | None = None  # the file's pairs when `rows` is a seeded sample of them (--sample), else None
    prompt_lengths: np.ndarray = field(init=False, repr=False)
    chosen_lengths: np.ndarray = field(init=False, repr=False)  # prompt + chosen
    rejected_lengths: np.ndarray = field(init=False, repr=False)  # prompt + rejected

    def __post_init__(self) -> None:
        p = np.array([len(r["prompt_ids"]) for r in self.rows], dtype=np.int64)
        object.__setattr__(self, "prompt_lengths", p)
        object.__setattr__(self, "chosen_lengths", p + np.array([len(r["chosen_ids"]) for r in self.rows],
                                                                dtype=np.int64))
        object.__setattr__(self, "rejected_lengths", p + np.array([len(r["rejected_ids"]) for r in self.rows],
                                                                  dtype=np.int64))

    # what a Workload reads of its dataset
    completion_only_loss = True
    bad_rows: tuple = ()



    @property
    def lengths(self) -> np.ndarray:
        """The longer sequence of each pair (prompt + chosen or prompt + rejected): what the collator pads to."""
        return np.maximum(self.chosen_lengths, self.rejected_lengths)

    @property
    def fingerprint(self) -> str:
        return self.fingerprint_of("preference", self.prompt_lengths, self.chosen_lengths, self.rejected_lengths)

    def kept(self, max_length: int | None) -> np.ndarray:
        """Indices of the pairs TRL keeps: with `keep_start` truncation, a prompt that fills `max_length` is dropped
        (DPOTrainer._prepare_dataset)."""
        if max_length is None:
            return np.arange(len(self.rows))
        return np.flatnonzero(self.prompt_lengths < max_length)

    unit = "pairs"  # the Dataset protocol's word for one row

    def truncated_share(self, max_length: int | None, packing: bool = False, strategy: str = "bfd") -> float:
        """The Dataset protocol's truncated share: the worse of the chosen and the rejected completions' (pairs
        are not packed)."""
        return max(self.truncated_fraction(max_length))

    def trained_tokens(self, max_length: int | None) -> np.ndarray:
        """The Dataset protocol's trained tokens per pair: the chosen and the rejected completion tokens within
        `max_length` (keep_start); 0 for a pair TRL drops (its prompt fills max_length)."""
        p = self.prompt_lengths
        if max_length is None:
            return (self.chosen_lengths - p) + (self.rejected_lengths - p)
        out = np.zeros(len(self.rows), dtype=np.int64)
        keep = self.kept(max_length)
        for full in (self.chosen_lengths, self.rejected_lengths):
            out[keep] += np.minimum(full[keep], max_length) - p[keep]
        return out

    def sequences(self) -> TokenizedDataset:
        """The pairs as the sequences a step runs: prompt + chosen and prompt + rejected, each its own row, the
        completion trained (a micro-batch of 2B such rows pads as B pairs do: chosen and rejected share it)."""
        rows = []
        for p, ch, rj in zip(self.prompt_lengths, self.chosen_lengths, self.rejected_lengths, strict=True):
            for full in (int(ch), int(rj)):
                rows.append({"input_ids": [0] * full, "completion_mask": [0] * int(p) + [1] * (full - int(p))})
        return TokenizedDataset(name=f"{self.name} (pairs as rows)", source=self.source, rows=tuple(rows),
                                completion_only_loss=True)

    def trained_tokens_per_row(self, candidate: Any) -> float:
        """Trained tokens per micro-batch row, a row being one pair: its chosen and rejected completion tokens,
        untruncated (the effective batch is a number of pairs)."""
        n = self.trained_tokens(None)
        return float(n.mean()) if len(n) else 1.0

    def truncated_fraction(self, max_length: int | None) -> tuple[float, float]:
        """Shares of the chosen and of the rejected completion tokens that `max_length` cuts off (kept pairs)."""
        if max_length is None:
            return 0.0, 0.0
        keep = self.kept(max_length)
        p = self.prompt_lengths[keep]
        out = []
        for full in (self.chosen_lengths[keep], self.rejected_lengths[keep]):
            total = float((full - p).sum())
            lost = float((full - np.minimum(full, max_length)).sum())
            out.append(lost / total if total else 0.0)
        return out[0], out[1]

    def to_hf(self, rows: Sequence[dict[str, Any]] | None = None) -> datasets.Dataset:
        import datasets  # lazy: loads datasets

        rows = list(self.rows if rows is None else rows)
        return datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in TOKEN_COLUMNS})


def synthetic_preferences(vocab_size: int, rows: int = SYNTHETIC_PAIRS, seed: int = SYNTHETIC_SEED,
                          median: int = SYNTHETIC_MEDIAN, max_len: int = SYNTHETIC_MAX) -> PreferenceDataset:
    """The built-in preference set: seeded token ids, a shared prompt, two completions of different lengths."""
    rng = np.random.default_rng(seed)
    chosen, share = synthetic_lengths(rng, rows, median, max_len)
    factor = rng.lognormal(0.0, SYNTHETIC_REJECTED_SIGMA, size=rows)
    low = min(10, vocab_size - 1)
    out = []
    for n, s, f in zip(chosen, share, factor, strict=True):
        n_prompt = max(1, int(n * s))
        n_chosen = max(1, int(n) - n_prompt)
        n_rejected = int(np.clip(round(n_chosen * f), 1, max(1, max_len - n_prompt)))
        out.append({
            "prompt_ids": rng.integers(low, vocab_size, size=n_prompt).tolist(),
            "chosen_ids": rng.integers(low, vocab_size, size=n_chosen).tolist(),
            "rejected_ids": rng.integers(low, vocab_size, size=n_rejected).tolist(),
        })
    return PreferenceDataset(
        name=f"synthetic-preferences(pairs={rows},seed={seed},median={median})",
        source="synthetic",
        rows=tuple(out),
        notes=("synthetic preference data: no dataset was given; lengths are log-normal, see README",),
    )


def preference_max_lengths(dataset: PreferenceDataset, max_truncation: float) -> tuple[int, ...]:
    """max_length values for preference pairs: percentiles of the longer of prompt + chosen and prompt + rejected,
    rounded up to 64, kept where neither the chosen nor the rejected completions lose more than `max_truncation`
    of their tokens (PreferenceDataset.truncated_fraction); the shortest such value is always offered."""
    lengths = np.asarray(dataset.lengths)
    if lengths.size == 0:
        return (1024,)
    grid = sorted({max(64, int(math.ceil(float(np.percentile(lengths, q)) / 64.0) * 64))
                   for q in (50, 75, 90, 95, 99, 99.5, 100)})
    ok = [v for v in grid if max(dataset.truncated_fraction(v)) <= max_truncation]
    return tuple(ok) if ok else (grid[-1],)


def missing_columns(row: Any) -> list[str]:
    """The preference columns a row lacks (an implicit prompt inside chosen/rejected is TRL's too)."""
    if not isinstance(row, dict):
        return list(PREFERENCE_COLUMNS)
    if all(row.get(c) is not None for c in TOKEN_COLUMNS):
        return []
    return [c for c in ("chosen", "rejected") if row.get(c) is None]


def check_preference_rows(rows: Sequence[Any], label: str, trainer: str = "dpo") -> None:
    """ConfigError naming the missing columns when the data is not preference data (e.g. an SFT dataset)."""
    for i, row in enumerate(rows if len(rows) else [{}]):  # every row: one lacking 'rejected' is named, not TRL's
        missing = missing_columns(row)
        if missing:
            have = sorted(row) if isinstance(row, dict) else type(row).__name__
            which = "the rows lack" if i == 0 else f"row {i} lacks"
            raise ConfigError(
                [f"dataset={label}: the {trainer} trainer reads preference data, and {which} the column(s) "
                 f"{', '.join(repr(c) for c in missing)} (row {i} has {have}); give prompt/chosen/rejected rows "
                 "(plain or conversational)" + (", or use trainer='sft' for this dataset" if i == 0 else
                                                f", or remove row {i}")],
                context=f"trainer={trainer}",
            )


def load_preferences(spec: str | None, model: ModelSpec, tokenizer: str | None = None,
                     trainer: str = "dpo", sample: int | None = None, seed: int = 0) -> PreferenceDataset:
    """None: the synthetic set. Else the file / directory / hub id, tokenized by DPOTrainer's own preparation.
    `sample`: a seeded random sample of that many pairs, drawn as advisor.data.load_dataset draws rows (the same
    indices for the same file size and seed), so `--sample N` reads N pairs whatever the trainer."""

    if sample is not None and sample <= 0:
        raise DatasetError(f"--sample {sample}: must be a positive number of pairs, e.g. --sample 2000")
    if spec is None:
        data = synthetic_preferences(model.vocab_size)
        if sample is not None:
            note = f"--sample {sample} ignored: the synthetic set is generated whole ({len(data.rows)} pairs)"
            data = dataclasses.replace(data, notes=data.notes + (note,))
        return data

    raw = read_raw(spec)
    population = len(raw.rows)
    indices = range(population)
    sampled = sample is not None and sample < population
    if sampled:
        indices = np.sort(np.random.default_rng(seed).choice(population, size=sample, replace=False))
    rows = [raw.rows[int(i)] for i in indices]
    check_preference_rows(rows, raw.label, trainer)
    kept = {"population": population if sampled else None,
            "notes": (f"a seeded random sample (seed {seed}) of {len(rows)} of {population} pairs",) if sampled
            else ()}
    if all(rows[0].get(c) is not None for c in TOKEN_COLUMNS):
        prepared = [{c: list(r[c]) for c in TOKEN_COLUMNS} for r in rows]
        return PreferenceDataset(name=raw.label, source=raw.source, rows=tuple(prepared),
                                 dataset_name=spec if raw.source == "hub" else None, **kept)
    kind = get_trainer(trainer)
    tok = load_tokenizer(tokenizer, model, kind)
    loaded_as = tokenizer_note(tok, tokenizer, model, kind)
    if loaded_as is not None:
        kept["notes"] = (*kept["notes"], loaded_as)
    prepared, conversational, said = prepare_with_trl(rows, tok, spec)
    if said is not None:
        kept["notes"] = (*kept["notes"], said)
    return PreferenceDataset(name=raw.label, source=raw.source, rows=tuple(prepared),
                             dataset_name=spec if raw.source == "hub" else None, conversational=conversational,
                             **kept)


def prepare_with_trl(rows: list[dict[str, Any]], tok: Any, spec: str
                     ) -> tuple[list[dict[str, list[int]]], bool, str | None]:
    """DPOTrainer's own `_prepare_dataset` (no model, no trainer) with `max_length=None`; with whether the pairs
    are conversational and a note of what the libraries said meanwhile, each distinct message once (or None)."""
    prepared, conversational, said = trl_prepared(rows, (*PREFERENCE_COLUMNS, "tools", "chat_template_kwargs"), tok,
                                                  spec, "DPO", "the pairs")
    out = [{c: list(prepared[i][c]) for c in TOKEN_COLUMNS} for i in range(len(prepared))]
    return out, conversational, said


def trl_prepared(rows: list[dict[str, Any]], columns: Sequence[str], tok: Any, spec: str, trl_name: str, what: str,
                 **attributes: Any) -> tuple[datasets.Dataset, bool, str | None]:
    """`trl.<trl_name>Trainer._prepare_dataset` on the rows' `columns` (no model, no trainer: the trainer's own
    attributes it reads are `attributes`, besides the tokenizer), with `<trl_name>Config(max_length=None)`; with
    whether the rows are conversational and a note of what the libraries said meanwhile (about `what`), each distinct
    message once (or None). What TRL cannot tokenize is a DatasetError naming the dataset."""

    import datasets  # lazy: loads datasets
    import trl  # lazy: loads trl
    from trl.data_utils import is_conversational  # lazy: loads trl

    keep = [c for c in columns if any(c in r for r in rows)]
    try:
        hf = datasets.Dataset.from_dict({c: [r.get(c) for r in rows] for c in keep})
    except Exception as exc:  # pyarrow cannot unify the rows' types
        raise DatasetError(f"--dataset {spec}: rows of mixed types in one field ({exc})") from exc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        args = getattr(trl, f"{trl_name}Config")(output_dir=tempfile.gettempdir(), max_length=None, use_cpu=True,
                                                 report_to="none")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    trainer_like = types.SimpleNamespace(_tokenizer=tok, **attributes)

    try:
        with progress_bars(False), capture() as said:
            prepared = getattr(trl, f"{trl_name}Trainer")._prepare_dataset(trainer_like, hf, tok, args, "train")
    except Exception as exc:  # TRL/transformers raise ValueError, TemplateError, KeyError...
        hint = ("; a conversational dataset needs a tokenizer with a chat template (--tokenizer PATH)"
                if is_conversational(hf[0]) else "")
        raise DatasetError(
            f"--dataset {spec}: TRL could not tokenize it ({str(exc).strip().splitlines()[0] if str(exc) else exc})"
            + hint
        ) from exc
    return prepared, bool(is_conversational(hf[0])), said_note(said, f"tokenizing {what}")


# ---- the lengths report for preference data (`advisor lengths --trainer dpo|reward`) ---------------------------
@dataclass(frozen=True)
class PairTruncation:
    """What one max_length costs preference pairs: the shares of chosen and of rejected completion tokens cut off
    (kept pairs; PreferenceDataset.truncated_fraction), the sequences cut, and the pairs dropped (a prompt that
    fills max_length: DPOTrainer drops them under keep_start)."""

    max_length: int
    chosen_lost_fraction: float
    rejected_lost_fraction: float
    chosen_truncated: int
    rejected_truncated: int
    pairs_dropped: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class PreferenceLengthReport:
    """Lengths of prompt, prompt + chosen and prompt + rejected, and what each candidate max_length costs."""

    name: str
    synthetic: bool
    pairs: int
    prompt: Any  # advisor.lengths.Percentiles
    chosen: Any  # prompt + chosen
    rejected: Any  # prompt + rejected
    max_truncation: float
    suggested_max_length: int
    max_lengths: tuple[PairTruncation, ...]
    notes: tuple[str, ...] = ()

    def text(self) -> str:
        """`advisor lengths`' text for pairs."""
        from tabulate import tabulate  # lazy: loads tabulate

        kind = "synthetic preference data (no --dataset given)" if self.synthetic else "preference dataset"
        lines = [f"{self.name}: {kind}, {self.pairs} pairs",
                 f"prompt:            {percentile_line(self.prompt)}",
                 f"prompt + chosen:   {percentile_line(self.chosen)}",
                 f"prompt + rejected: {percentile_line(self.rejected)}",
                 f"suggested max_length: {self.suggested_max_length} (neither chosen nor rejected loses more than "
                 f"{self.max_truncation:.1%} of its tokens, a multiple of 64)", ""]
        rows = [[m.max_length, f"{m.chosen_lost_fraction:.2%}", f"{m.rejected_lost_fraction:.2%}",
                 m.chosen_truncated, m.rejected_truncated, m.pairs_dropped] for m in self.max_lengths]
        lines.append(tabulate(rows, headers=["max_length", "chosen lost", "rejected lost", "chosen cut",
                                             "rejected cut", "pairs dropped"]))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "synthetic": self.synthetic, "pairs": self.pairs,
                "prompt": self.prompt.to_dict(), "prompt_chosen": self.chosen.to_dict(),
                "prompt_rejected": self.rejected.to_dict(), "max_truncation": self.max_truncation,
                "suggested_max_length": self.suggested_max_length,
                "max_lengths": [m.to_dict() for m in self.max_lengths], "notes": list(self.notes)}


def pair_truncation(data: PreferenceDataset, max_length: int) -> PairTruncation:
    chosen, rejected = data.truncated_fraction(max_length)
    keep = data.kept(max_length)
    return PairTruncation(max_length, chosen, rejected, int((data.chosen_lengths[keep] > max_length).sum()),
                          int((data.rejected_lengths[keep] > max_length).sum()), int(len(data.rows) - len(keep)))


def preference_length_report(data: PreferenceDataset, max_lengths: Sequence[int] | None = None,
                             max_truncation: float = 0.01, multiple: int = 64) -> PreferenceLengthReport:
    """The report; the suggested max_length is the smallest multiple of `multiple` at which neither the chosen nor
    the rejected completions lose more than `max_truncation` of their tokens."""

    longest = int(data.lengths.max()) if len(data.rows) else multiple
    top = max(multiple, -(-longest // multiple) * multiple)
    steps = np.arange(multiple, top + multiple, multiple)
    ok = [int(v) for v in steps if max(data.truncated_fraction(int(v))) <= max_truncation]
    suggested = ok[0] if ok else top
    if max_lengths is None:
        max_lengths = report_grid(data.lengths, suggested, multiple)
    return PreferenceLengthReport(
        name=data.name, synthetic=data.synthetic, pairs=len(data.rows), prompt=Percentiles.of(data.prompt_lengths),
        chosen=Percentiles.of(data.chosen_lengths), rejected=Percentiles.of(data.rejected_lengths),
        max_truncation=max_truncation, suggested_max_length=suggested,
        max_lengths=tuple(pair_truncation(data, int(v)) for v in max_lengths), notes=tuple(data.notes))


def report_grid(lengths: np.ndarray, suggested: int, multiple: int) -> list[int]:
    """The max_length values a length report shows by default: the suggested one, the longest sequence and the
    p50 / p90 / p99 lengths, each rounded up to `multiple`."""
    top = max(multiple, -(-int(lengths.max()) // multiple) * multiple)
    grid = {suggested, top}
    grid |= {max(multiple, -(-int(np.percentile(lengths, q)) // multiple) * multiple) for q in (50, 90, 99)}
    return sorted(grid)
