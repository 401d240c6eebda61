"""Unpaired preference data (prompt / completion / label) as KTOTrainer prepares it, and the built-in synthetic set.

`load_unpaired` reads a local .jsonl / .json / .parquet / .csv file (or a datasets directory / hub id, through
advisor.data's readers) and tokenizes it with TRL's own `KTOTrainer._prepare_dataset` (`max_length=None`, no KL
column): unpaired rows (`prompt`, `completion`, `label`) or paired ones (`chosen` / `rejected`, with an explicit or
implicit prompt), which TRL unpairs into one desirable and one undesirable example each; plain or conversational;
the EOS token TRL appends to a plain completion included. What depends on the candidate is applied per candidate,
as TRL applies it: the examples whose prompt alone fills `max_length` are dropped, and (loss_type "kto") each
micro-batch's completions are rotated by one to make its KL batch (`kl_completions`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..data import (
    SYNTHETIC_MAX,
    SYNTHETIC_MEDIAN,
    SYNTHETIC_SEED,
    SourcedRows,
    TokenizedDataset,
    load_tokenizer,
    read_raw,
    synthetic_lengths,
    tokenizer_note,
)
from ..errors import ConfigError, DatasetError, UsageError
from ..lengths import LengthRequest, Percentiles, max_length_candidates, percentile_line
from .preference import report_grid, trl_prepared
from .registry import get_trainer

if TYPE_CHECKING:
    import datasets

    from ..workload import ModelSpec

UNPAIRED_COLUMNS = ("prompt", "completion", "label")
TOKEN_COLUMNS = ("prompt_ids", "completion_ids", "label")
SYNTHETIC_EXAMPLES = 2048
SYNTHETIC_DESIRABLE = 0.5  # the share of desirable examples in the synthetic set


@dataclass(frozen=True, eq=False)
class UnpairedDataset(SourcedRows):
    """Examples as KTOTrainer's prepared dataset holds them: `prompt_ids`, `completion_ids`, `label` per row, in
    the dataset's order (TRL samples them sequentially for loss_type "kto"). A `Dataset` (advisor.data): a row is
    an example (`unit` "examples"), `lengths` prompt + completion, the trained tokens the completion's."""

    name: str
    source: Literal["synthetic", "local", "hub"]
    rows: tuple[dict[str, Any], ...]
    dataset_name: str | None = None
    notes: tuple[str, ...] = ()
    conversational: bool | None = None
    population: int | None = None  # the source's examples when `rows` is a seeded sample of them (--sample)
    prompt_lengths: np.ndarray = field(init=False, repr=False)
    trained: np.ndarray = field(init=False, repr=False)  # completion tokens per example
    labels: np.ndarray = field(init=False, repr=False)  # True: desirable

    unit = "examples"  # the Dataset protocol's word for one row
    completion_only_loss = True  # only the completion is scored (what a Workload reads of its dataset)
    bad_rows: tuple = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_lengths", np.array([len(r["prompt_ids"]) for r in self.rows], np.int64))
        object.__setattr__(self, "trained", np.array([len(r["completion_ids"]) for r in self.rows], np.int64))
        object.__setattr__(self, "labels", np.array([bool(r["label"]) for r in self.rows], dtype=bool))

    @property
    def lengths(self) -> np.ndarray:
        """Prompt + completion of each example: what the collator pads (before truncation)."""
        return self.prompt_lengths + self.trained



    @property
    def fingerprint(self) -> str:
        return self.fingerprint_of("unpaired", self.prompt_lengths, self.trained, self.labels)

    @property
    def desirable(self) -> int:
        return int(self.labels.sum())

    @property
    def total_trained(self) -> int:
        return int(self.trained.sum())

    @property
    def trained_positions(self) -> tuple[np.ndarray, ...]:
        """Per example, the positions of its completion tokens (what `max_length` cuts from the right)."""
        return tuple(np.arange(p, p + c) for p, c in zip(self.prompt_lengths, self.trained, strict=True))

    def kept(self, max_length: int | None) -> np.ndarray:
        """Indices of the examples TRL keeps: one whose prompt alone fills `max_length` is dropped
        (KTOTrainer._prepare_dataset)."""
        if max_length is None:
            return np.arange(len(self.rows))
        return np.flatnonzero(self.prompt_lengths < max_length)

    # ---- the Dataset protocol, and what the estimate and the search read ----------------------------------------
    def trained_after_truncation(self, max_length: int | None) -> np.ndarray:
        """Completion tokens of each example within `max_length` (the collator keeps the start); 0 where TRL drops
        the example."""
        if max_length is None:
            return self.trained
        return np.clip(np.minimum(self.lengths, max_length) - self.prompt_lengths, 0, None)

    def trained_tokens(self, max_length: int | None) -> np.ndarray:
        return self.trained_after_truncation(max_length)

    def truncated_fraction(self, max_length: int | None, packing: bool = False, strategy: str = "bfd") -> float:
        """Share of completion tokens that never reach the loss (KTOConfig has no packing)."""
        total = self.total_trained
        if max_length is None or total == 0:
            return 0.0
        return float(1.0 - self.trained_after_truncation(max_length).sum() / total)

    def truncated_share(self, max_length: int | None, packing: bool = False, strategy: str = "bfd") -> float:
        return self.truncated_fraction(max_length)

    def trained_tokens_per_row(self, candidate: Any) -> float:
        """Mean completion tokens one example carries at the candidate's max_length."""
        return float(self.trained_after_truncation(candidate.max_length).mean()) if len(self.rows) else 0.0

    def sequences(self) -> TokenizedDataset:
        """The examples as the sequences a step trains on: prompt + completion, the completion trained (the KL
        batch's sequences are bounded by the same max_length: StepShape.no_grad_batches)."""
        rows = tuple({"input_ids": [0] * int(p + c), "completion_mask": [0] * int(p) + [1] * int(c)}
                     for p, c in zip(self.prompt_lengths, self.trained, strict=True))
        return TokenizedDataset(name=f"{self.name} (examples as rows)", source=self.source, rows=rows,
                                completion_only_loss=True)

    def longest(self, n: int, max_length: int | None) -> list[int]:
        """The `n` longest examples TRL keeps at `max_length` (after truncation), longest first."""
        kept = self.kept(max_length)
        lengths = self.lengths[kept]
        if max_length is not None:
            lengths = np.minimum(lengths, max_length)
        return [int(kept[i]) for i in np.argsort(-lengths, kind="stable")[:n]]

    def to_hf(self, rows: Sequence[dict[str, Any]] | None = None) -> datasets.Dataset:
        import datasets  # lazy: loads datasets

        rows = list(self.rows if rows is None else rows)
        return datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in TOKEN_COLUMNS})


def kl_completions(completions: list[list[int]], batch_size: int) -> list[list[int]]:
    """KTOTrainer's KL completions (`add_kl_completion_ids`, a batched map of `batch_size` examples): within each
    micro-batch the completions rotated by one, so example i is scored with example i-1's completion."""
    out: list[list[int]] = []
    for start in range(0, len(completions), batch_size):
        chunk = completions[start:start + batch_size]
        out.extend([chunk[-1], *chunk[:-1]])
    return out


def synthetic_unpaired(vocab_size: int, rows: int = SYNTHETIC_EXAMPLES, seed: int = SYNTHETIC_SEED,
                       median: int = SYNTHETIC_MEDIAN, max_len: int = SYNTHETIC_MAX) -> UnpairedDataset:
    """The built-in unpaired set: prompt + completion drawn as the synthetic chat set's lengths (a log-normal
    sequence, the prompt 20-60% of it), each example desirable with probability 1/2, seeded token ids."""
    rng = np.random.default_rng(seed)
    lengths, share = synthetic_lengths(rng, rows, median, max_len)
    desirable = rng.random(size=rows) < SYNTHETIC_DESIRABLE
    low = min(10, vocab_size - 1)
    out = []
    for n, s, label in zip(lengths, share, desirable, strict=True):
        n_prompt = max(1, int(n * s))
        n_completion = max(1, int(n) - n_prompt)
        out.append({"prompt_ids": rng.integers(low, vocab_size, size=n_prompt).tolist(),
                    "completion_ids": rng.integers(low, vocab_size, size=n_completion).tolist(),
                    "label": bool(label)})
    return UnpairedDataset(
        name=f"synthetic-unpaired(examples={rows},seed={seed},median={median})", source="synthetic", rows=tuple(out),
        notes=("synthetic unpaired preference data: no dataset was given; lengths are log-normal, half the "
               "examples desirable, see README",))


# ---- checks ---------------------------------------------------------------------------------------------------
def missing_columns(row: Any) -> list[str]:
    """The columns a row lacks for KTOTrainer: unpaired (prompt, completion, label) or paired (chosen, rejected;
    TRL unpairs them); a row of prepared token ids is taken as it is."""
    if not isinstance(row, dict):
        return list(UNPAIRED_COLUMNS)
    if all(row.get(c) is not None for c in TOKEN_COLUMNS):
        return []
    if row.get("chosen") is not None and row.get("rejected") is not None:
        return []
    return [c for c in UNPAIRED_COLUMNS if row.get(c) is None]


def check_unpaired_rows(rows: Sequence[Any], label: str, trainer: str = "kto") -> None:
    """ConfigError naming the missing columns (an SFT or prompt-only dataset), or a label TRL cannot use."""
    for i, row in enumerate(rows if len(rows) else [{}]):
        missing = missing_columns(row)
        if missing:
            have = sorted(row) if isinstance(row, dict) else type(row).__name__
            which = "the rows lack" if i == 0 else f"row {i} lacks"
            raise ConfigError(
                [f"dataset={label}: the {trainer} trainer reads unpaired preference data, and {which} the column(s) "
                 f"{', '.join(repr(c) for c in missing)} (row {i} has {have}); give prompt/completion/label rows "
                 "(label true for a desirable completion, false for an undesirable one), or prompt/chosen/rejected "
                 "pairs, which KTOTrainer unpairs" + (", or use trainer='sft' for this dataset" if i == 0 else
                                                      f", or remove row {i}")],
                context=f"trainer={trainer}")
        if "label" in row and "chosen" not in row:
            value = row["label"]
            if not (isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))):
                raise ConfigError(
                    [f"dataset={label}: row {i} has label={value!r}; KTOTrainer reads a label as desirable (true) "
                     "or undesirable (false) and sums the labels to count them, so write true or false (1 or 0)"],
                    context=f"trainer={trainer}")


def balance_note(data: UnpairedDataset) -> str | None:
    """What the notes say when every example has one label: TRL 1.16 trains it (the loss of the missing kind is
    empty; measured: KTOTrainer.train() runs with all-desirable and all-undesirable data), so it is not refused."""
    n, good = len(data.rows), data.desirable
    if n == 0 or 0 < good < n:
        return None
    kind = "desirable" if good else "undesirable"
    return (f"every one of the {n} examples is {kind}: KTOTrainer trains it (its loss has no "
            f"{'undesirable' if good else 'desirable'} term) and memory is unchanged, but KTO is meant for a mix; "
            "TRL warns to re-weight with desirable_weight / undesirable_weight")


# ---- loading ---------------------------------------------------------------------------------------------------
def load_unpaired(spec: str | None, model: ModelSpec, tokenizer: str | None = None, trainer: str = "kto",
                  sample: int | None = None, seed: int = 0) -> UnpairedDataset:
    """None: the synthetic set. Else the file / directory / hub id, tokenized by KTOTrainer's own preparation.
    `sample`: a seeded random sample of that many rows, drawn as advisor.data.load_dataset draws rows."""
    if sample is not None and sample <= 0:
        raise DatasetError(f"--sample {sample}: must be a positive number of examples, e.g. --sample 2000")
    if spec is None:
        data = synthetic_unpaired(model.vocab_size)
        if sample is not None:
            note = f"--sample {sample} ignored: the synthetic set is generated whole ({len(data.rows)} examples)"
            data = dataclasses.replace(data, notes=data.notes + (note,))
        return data
    raw = read_raw(spec)
    population = len(raw.rows)
    indices: Any = range(population)
    sampled = sample is not None and sample < population
    if sampled:
        indices = np.sort(np.random.default_rng(seed).choice(population, size=sample, replace=False))
    rows = [raw.rows[int(i)] for i in indices]
    check_unpaired_rows(rows, raw.label, trainer)
    notes: tuple[str, ...] = ((f"a seeded random sample (seed {seed}) of {len(rows)} of {population} rows",)
                              if sampled else ())
    conversational = None
    if all(rows[0].get(c) is not None for c in TOKEN_COLUMNS):
        prepared = [{"prompt_ids": list(r["prompt_ids"]), "completion_ids": list(r["completion_ids"]),
                     "label": bool(r["label"])} for r in rows]
    else:
        kind = get_trainer(trainer)
        tok = load_tokenizer(tokenizer, model, kind)
        loaded_as = tokenizer_note(tok, tokenizer, model, kind)
        prepared, conversational, said = prepare_with_trl(rows, tok, spec)
        notes += tuple(n for n in (loaded_as, said) if n is not None)
    data = UnpairedDataset(name=raw.label, source=raw.source, rows=tuple(prepared),
                           dataset_name=spec if raw.source == "hub" else None, notes=notes,
                           conversational=conversational, population=population if sampled else None)
    one_label = balance_note(data)
    return dataclasses.replace(data, notes=data.notes + (one_label,)) if one_label else data


def prepare_with_trl(rows: list[dict[str, Any]], tok: Any, spec: str
                     ) -> tuple[list[dict[str, Any]], bool, str | None]:
    """KTOTrainer's own `_prepare_dataset` (no model, no trainer) with `max_length=None` and no KL column (both
    depend on the candidate and are applied per candidate); with whether the rows are conversational and a note of
    what the libraries said meanwhile, each distinct message once (or None)."""
    columns = (*UNPAIRED_COLUMNS, "chosen", "rejected", "tools", "chat_template_kwargs")
    prepared, conversational, said = trl_prepared(rows, columns, tok, spec, "KTO", "the examples", calculate_KL=False,
                                                  desirable_weight=1.0, undesirable_weight=1.0)
    out = [{"prompt_ids": list(p), "completion_ids": list(c), "label": bool(lab)} for p, c, lab in
           zip(prepared["prompt_ids"], prepared["completion_ids"], prepared["label"], strict=True)]
    return out, conversational, said


# ---- the lengths report (`advisor lengths --trainer kto`) --------------------------------------------------------
@dataclass(frozen=True)
class UnpairedTruncation:
    """What one max_length costs: the share of completion tokens cut off (kept examples), the examples cut, and
    the examples dropped (a prompt that fills max_length: KTOTrainer drops them)."""

    max_length: int
    completion_lost_fraction: float
    examples_truncated: int
    examples_dropped: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class UnpairedLengthReport:
    """Lengths of prompt, completion and prompt + completion, the label balance, and what each max_length costs."""

    name: str
    synthetic: bool
    examples: int
    desirable: int
    prompt: Any  # advisor.lengths.Percentiles
    completion: Any
    sequence: Any  # prompt + completion
    max_truncation: float
    suggested_max_length: int
    max_lengths: tuple[UnpairedTruncation, ...]
    notes: tuple[str, ...] = ()

    def text(self) -> str:
        """`advisor lengths`' text for unpaired examples."""
        from tabulate import tabulate  # lazy: loads tabulate

        kind = "synthetic unpaired data (no --dataset given)" if self.synthetic else "unpaired dataset"
        lines = [f"{self.name}: {kind}, {self.examples} examples ({self.desirable} desirable, "
                 f"{self.examples - self.desirable} undesirable)",
                 f"prompt:              {percentile_line(self.prompt)}",
                 f"completion:          {percentile_line(self.completion)}",
                 f"prompt + completion: {percentile_line(self.sequence)}",
                 f"suggested max_length: {self.suggested_max_length} (loses at most {self.max_truncation:.1%} of "
                 "the completion tokens, a multiple of 64); each micro-batch's KL batch (loss_type kto) pairs its "
                 "prompts with its completions rotated by one, truncated at the same max_length", ""]
        rows = [[m.max_length, f"{m.completion_lost_fraction:.2%}", m.examples_truncated, m.examples_dropped]
                for m in self.max_lengths]
        lines.append(tabulate(rows, headers=["max_length", "completion lost", "examples cut", "examples dropped"]))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "synthetic": self.synthetic, "examples": self.examples,
                "desirable": self.desirable, "undesirable": self.examples - self.desirable,
                "prompt": self.prompt.to_dict(), "completion": self.completion.to_dict(),
                "prompt_completion": self.sequence.to_dict(), "max_truncation": self.max_truncation,
                "suggested_max_length": self.suggested_max_length,
                "max_lengths": [m.to_dict() for m in self.max_lengths], "notes": list(self.notes)}


def unpaired_truncation(data: UnpairedDataset, max_length: int) -> UnpairedTruncation:
    keep = data.kept(max_length)
    return UnpairedTruncation(max_length, data.truncated_fraction(max_length),
                              int((data.lengths[keep] > max_length).sum()), int(len(data.rows) - len(keep)))


def unpaired_length_report(data: UnpairedDataset, request: LengthRequest, multiple: int = 64
                           ) -> UnpairedLengthReport:
    """The report (`advisor lengths --trainer kto`); the suggested max_length is the smallest multiple of
    `multiple` that loses at most `request.max_truncation` of the completion tokens (the advisor's own max_length
    candidates, advisor.lengths)."""
    request.refuse_completion_length()
    if not len(data.rows):
        raise UsageError(f"dataset {data.name}: no examples to report on")
    suggested = max_length_candidates(data, request.max_truncation, multiple)[0]
    max_lengths = request.max_lengths or report_grid(data.lengths, suggested, multiple)
    return UnpairedLengthReport(
        name=data.name, synthetic=data.synthetic, examples=len(data.rows), desirable=data.desirable,
        prompt=Percentiles.of(data.prompt_lengths), completion=Percentiles.of(data.trained),
        sequence=Percentiles.of(data.lengths), max_truncation=request.max_truncation, suggested_max_length=suggested,
        max_lengths=tuple(unpaired_truncation(data, int(v)) for v in max_lengths), notes=tuple(data.notes))
