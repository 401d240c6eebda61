"""The dataset as SFTTrainer's prepared dataset holds it (`TokenizedDataset`: pre-tokenized rows before truncation
and packing), the rows that could not be used (`BadRow`), the formats TRL's SFT reads, and what the length
distribution says: trained tokens per row after truncation or packing, the share lost to truncation."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import datasets

    from ..space import Candidate


class DataFormat(str, Enum):
    """The dataset formats TRL's SFT accepts."""

    MESSAGES = "messages"  # conversational language modeling
    CONVERSATIONS = "conversations"  # from/value conversations; TRL converts them to ChatML
    PROMPT_COMPLETION = "prompt_completion"  # plain or conversational
    TEXT = "text"
    TOKENIZED = "input_ids"


@dataclass(frozen=True)
class BadRow:
    """A row that could not be used: where it is (0-based row, 1-based file line) and which field is wrong."""

    index: int
    field: str
    reason: str
    line: int | None = None

    def describe(self) -> str:
        where = f"line {self.line}" if self.line is not None else f"row {self.index}"
        return f"{where}: field {self.field!r}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "line": self.line, "field": self.field, "reason": self.reason}


@runtime_checkable
class Dataset(Protocol):
    """What the advisor reads of a trainer's prepared data, whatever its kind: chat rows (TokenizedDataset, SFT),
    preference pairs (advisor.trainers.preference.PreferenceDataset: DPO, Reward), prompts
    (advisor.trainers.prompts.PromptDataset: online RL; a row is a prompt, the trained tokens its completions').
    A trainer's `load_dataset` returns one; the search, the estimate, the length report and the Suggestion use
    only these members."""

    name: str
    source: Literal["synthetic", "local", "hub"]
    rows: tuple[dict[str, list[int]], ...]
    dataset_name: str | None  # what `trl <command> --dataset_name` takes, when there is one
    notes: tuple[str, ...]
    population: int | None  # rows (pairs, prompts) in the whole source when `rows` is a seeded sample of it
    unit: str  # what one row is, in words: "rows", "pairs", "prompts"
    completion_only_loss: bool | None  # only the completions trained (None: TRL decides from the data's columns)

    @property
    def lengths(self) -> np.ndarray: ...  # per row, the longest sequence the collator pads (before truncation)

    @property
    def synthetic(self) -> bool: ...

    @property
    def sampled(self) -> bool: ...

    @property
    def fingerprint(self) -> str: ...  # what identifies the data in a study's name

    def truncated_share(self, max_length: int | None, packing: bool = False, strategy: str = "bfd") -> float: ...
    # the share of trained tokens `max_length` keeps from the loss (for pairs: the worse of chosen and rejected)

    def trained_tokens(self, max_length: int | None) -> np.ndarray: ...  # per row, trained tokens after truncation

    def trained_tokens_per_row(self, candidate: Candidate) -> float: ...  # mean trained tokens of a micro-batch row

    def sequences(self) -> TokenizedDataset: ...  # the sequences a step runs, as rows (a pair: two)

    def to_hf(self, rows: Any = None) -> datasets.Dataset: ...


class SourcedRows:
    """What a trainer's own dataset type (pairs, prompts, examples) shares: synthetic or read from a source, sampled
    or whole (`source`, `population`: its fields), and a fingerprint of its kind, name and length arrays."""

    source: str
    population: int | None
    name: str

    @property
    def synthetic(self) -> bool:
        return self.source == "synthetic"

    @property
    def sampled(self) -> bool:
        return self.population is not None

    def fingerprint_of(self, kind: str, *arrays: np.ndarray) -> str:
        """The first 16 hex digits of sha256 over `kind`, the name and the arrays' bytes."""
        h = hashlib.sha256()
        h.update(f"{kind}:".encode() + self.name.encode())
        for a in arrays:
            h.update(a.tobytes())
        return h.hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class TokenizedDataset:
    """Rows as SFTTrainer's prepared dataset holds them, before truncation and packing (a `Dataset`)."""

    name: str
    source: Literal["synthetic", "local", "hub"]
    rows: tuple[dict[str, list[int]], ...]
    completion_only_loss: bool
    dataset_name: str | None = None  # what `trl sft --dataset_name` takes, when there is one
    notes: tuple[str, ...] = ()
    bad_rows: tuple[BadRow, ...] = ()
    # rows in the whole source when `rows` is a seeded random sample of it (`--sample N`), else None
    population: int | None = None
    format: DataFormat | None = None
    lengths: np.ndarray = field(init=False, repr=False)
    trained: np.ndarray = field(init=False, repr=False)
    # token positions (within each row) that are trained; used to count tokens lost to truncation
    _trained_positions: tuple[np.ndarray, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        lengths = np.array([len(r["input_ids"]) for r in self.rows], dtype=np.int64)
        positions = []
        for r in self.rows:
            if self.completion_only_loss and "completion_mask" in r:
                positions.append(np.flatnonzero(np.asarray(r["completion_mask"], dtype=bool)))
            else:
                positions.append(np.arange(len(r["input_ids"])))
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "trained", np.array([len(p) for p in positions], dtype=np.int64))
        object.__setattr__(self, "_trained_positions", tuple(positions))

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(self.name.encode())
        h.update(self.lengths.tobytes())
        h.update(self.trained.tobytes())
        return h.hexdigest()[:16]

    @property
    def synthetic(self) -> bool:
        return self.source == "synthetic"

    @property
    def sampled(self) -> bool:
        return self.population is not None and self.population > len(self.rows)

    @property
    def trained_positions(self) -> tuple[np.ndarray, ...]:
        """Per row, the token positions whose label is not -100."""
        return self._trained_positions

    @property
    def total_trained(self) -> int:
        return int(self.trained.sum())

    def trained_after_truncation(self, max_length: int | None) -> np.ndarray:
        """Trained tokens of each row once truncated to `max_length` (keep_start, as TRL's default)."""
        if max_length is None:
            return self.trained
        return np.array([int((p < max_length).sum()) for p in self._trained_positions], dtype=np.int64)

    def truncated_fraction(self, max_length: int | None, packing: bool = False, strategy: str = "bfd") -> float:
        """Share of trained tokens that never reach the loss.

        Without packing TRL truncates each row; `bfd` packing also drops what overflows `max_length`;
        `bfd_split` and `wrapped` keep every token.
        """
        if max_length is None or self.total_trained == 0:
            return 0.0
        if packing and strategy in ("bfd_split", "wrapped"):
            return 0.0
        kept = self.trained_after_truncation(max_length).sum()
        return float(1.0 - kept / self.total_trained)

    unit = "rows"  # the Dataset protocol's word for one row

    def truncated_share(self, max_length: int | None, packing: bool = False, strategy: str = "bfd") -> float:
        """The Dataset protocol's truncated share: `truncated_fraction`."""
        return self.truncated_fraction(max_length, packing, strategy)

    def trained_tokens(self, max_length: int | None) -> np.ndarray:
        """The Dataset protocol's trained tokens per row: `trained_after_truncation`."""
        return self.trained_after_truncation(max_length)

    def trained_tokens_per_row(self, candidate: Candidate) -> float:
        """Mean trained tokens in one micro-batch row (one example, or one packed row)."""
        if candidate.packing and candidate.max_length:
            kept = self.total_trained * (1.0 - self.truncated_fraction(
                candidate.max_length, True, candidate.packing_strategy.value))
            total_tokens = float(np.minimum(self.lengths, candidate.max_length).sum()) if \
                candidate.packing_strategy.value == "bfd" else float(self.lengths.sum())
            rows = max(1.0, math.ceil(total_tokens / candidate.max_length))
            return kept / rows
        return float(self.trained_after_truncation(candidate.max_length).mean()) if len(self.rows) else 0.0

    def sequences(self) -> TokenizedDataset:
        """The Dataset protocol's sequences: the rows themselves."""
        return self

    def longest_rows(self, n: int) -> list[dict[str, list[int]]]:
        """The `n` longest rows: the batch that needs the most memory comes first."""
        order = np.argsort(-self.lengths, kind="stable")[:n]
        return [self.rows[i] for i in order]

    def to_hf(self, rows: list[dict[str, Any]] | None = None) -> datasets.Dataset:
        """A pre-tokenized `datasets.Dataset` that SFTTrainer takes as is (no tokenizer needed)."""
        import datasets  # lazy: loads datasets

        rows = list(self.rows if rows is None else rows)
        columns: dict[str, list] = {"input_ids": [r["input_ids"] for r in rows]}
        if self.completion_only_loss and rows and "completion_mask" in rows[0]:
            columns["completion_mask"] = [r["completion_mask"] for r in rows]
        return datasets.Dataset.from_dict(columns)


def replace_dataset(data: TokenizedDataset, **changes: Any) -> TokenizedDataset:
    """`dataclasses.replace` for TokenizedDataset (its derived fields are init=False)."""
    fields = {k: getattr(data, k) for k in ("name", "source", "rows", "completion_only_loss", "dataset_name",
                                            "notes", "bad_rows", "population", "format")}
    fields.update(changes)
    return TokenizedDataset(**fields)
