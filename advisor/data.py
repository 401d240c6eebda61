"""Token-length data of a training set, as TRL will see it, and the built-in synthetic chat set.

Every number the advisor derives from the data (tokens lost to truncation, trained tokens per row, the
longest batch) comes from a `TokenizedDataset`: pre-tokenized rows in the columns SFTTrainer consumes
(`input_ids`, and `completion_mask` when only completions are trained).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import datasets

    from .space import Candidate

# The synthetic set: conversations whose total length is log-normal (median ~ 300 tokens, p99 ~ 1.7k, a tail past
# 4k, clipped to [16, 8192]) and whose prompt takes 20-60% of it. Documented in README.md.
SYNTHETIC_ROWS = 2048
SYNTHETIC_SEED = 0
SYNTHETIC_MEDIAN = 300
SYNTHETIC_SIGMA = 0.75
SYNTHETIC_MIN, SYNTHETIC_MAX = 16, 8192


@dataclass(frozen=True, eq=False)
class TokenizedDataset:
    """Rows as SFTTrainer's prepared dataset holds them, before truncation and packing."""

    name: str
    source: Literal["synthetic", "local", "hub"]
    rows: tuple[dict[str, list[int]], ...]
    completion_only_loss: bool
    dataset_name: str | None = None  # what `trl sft --dataset_name` takes, when there is one
    notes: tuple[str, ...] = ()
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

    def longest_rows(self, n: int) -> list[dict[str, list[int]]]:
        """The `n` longest rows: the batch that needs the most memory comes first."""
        order = np.argsort(-self.lengths, kind="stable")[:n]
        return [self.rows[i] for i in order]

    def to_hf(self, rows: list[dict[str, Any]] | None = None) -> datasets.Dataset:
        """A pre-tokenized `datasets.Dataset` that SFTTrainer takes as is (no tokenizer needed)."""
        import datasets

        rows = list(self.rows if rows is None else rows)
        columns: dict[str, list] = {"input_ids": [r["input_ids"] for r in rows]}
        if self.completion_only_loss and rows and "completion_mask" in rows[0]:
            columns["completion_mask"] = [r["completion_mask"] for r in rows]
        return datasets.Dataset.from_dict(columns)


def synthetic(
    vocab_size: int,
    rows: int = SYNTHETIC_ROWS,
    seed: int = SYNTHETIC_SEED,
    median: int = SYNTHETIC_MEDIAN,
    max_len: int = SYNTHETIC_MAX,
) -> TokenizedDataset:
    """The built-in chat set: seeded token ids with a prompt/completion split; no tokenizer needed."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(
        np.rint(rng.lognormal(math.log(median), SYNTHETIC_SIGMA, size=rows)), SYNTHETIC_MIN, max_len
    ).astype(np.int64)
    prompt_share = rng.uniform(0.2, 0.6, size=rows)
    low = min(10, vocab_size - 1)
    out = []
    for n, share in zip(lengths, prompt_share, strict=True):
        ids = rng.integers(low, vocab_size, size=int(n)).tolist()
        n_prompt = max(1, int(n * share))
        out.append({"input_ids": ids, "completion_mask": [0] * n_prompt + [1] * (int(n) - n_prompt)})
    return TokenizedDataset(
        name=f"synthetic-chat(rows={rows},seed={seed},median={median})",
        source="synthetic",
        rows=tuple(out),
        completion_only_loss=True,
        notes=("synthetic data: no dataset was given; lengths are log-normal, see README",),
    )
