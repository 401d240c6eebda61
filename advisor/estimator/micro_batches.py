"""The micro-batches the estimate sizes memory and time for: the worst one (the longest rows, truncated) and a
typical one, as rows x sequence length with what the loss scores."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from ..space import Candidate, PackingStrategy

if TYPE_CHECKING:
    from ..data import TokenizedDataset


@dataclass(frozen=True)
class BatchShape:
    """One micro-batch as the model sees it: rows x sequence length, and what the loss scores."""

    rows: int
    seq: int
    trained: int  # labelled positions (what the CUDA LM head scores)
    attention_sq: float  # sum over sequences of length^2 (attention FLOPs and eager scores)
    mask_bytes: int  # the materialised attention mask, when there is one


def batches(dataset: TokenizedDataset, c: Candidate) -> tuple[BatchShape, BatchShape]:
    """The worst micro-batch (the longest rows, truncated) and a typical one (for throughput)."""
    flash = c.attn_implementation is not None and c.attn_implementation.is_flash
    return _batch_shapes(
        dataset, c.per_device_train_batch_size, c.max_length, c.packing, c.packing_strategy,
        c.effective_padding_free, c.padding_free, c.pad_to_multiple_of, c.group_by_length, flash,
    )


@lru_cache(maxsize=256)
def _length_stats(dataset: TokenizedDataset, max_length: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row order longest first, trained tokens per row after truncation, lengths after truncation)."""
    order = np.argsort(-dataset.lengths, kind="stable")
    cap = max_length if max_length is not None else np.iinfo(np.int64).max
    return order, dataset.trained_after_truncation(max_length), np.minimum(dataset.lengths, cap)


@lru_cache(maxsize=256)
def _packed_per_row(dataset: TokenizedDataset, c: Candidate) -> float:
    return dataset.trained_tokens_per_row(c)


@lru_cache(maxsize=4096)
def _batch_shapes(
    dataset: TokenizedDataset, b: int, ml: int | None, packing: bool, strategy: PackingStrategy, flat: bool,
    padding_free: bool, multiple: int | None, group_by_length: bool, flash: bool,
) -> tuple[BatchShape, BatchShape]:
    order, trained_rows, lengths = _length_stats(dataset, ml)
    if packing:
        assert ml is not None
        per_row = _packed_per_row(dataset, Candidate(max_length=ml, packing=True, packing_strategy=strategy))
        mean_doc = float(lengths.mean()) if len(lengths) else float(ml)
        attn = b * (ml * ml if strategy is PackingStrategy.WRAPPED else ml * mean_doc)
        wrapped_rows = strategy is PackingStrategy.WRAPPED and not padding_free
        rows, seq = (1, b * ml) if flat else (b, ml)
        mask = 0 if (flash or wrapped_rows) else rows * seq * seq
        shape = BatchShape(rows, seq, int(round(b * per_row)), float(attn), mask)
        return shape, shape
    top = order[:b]
    lens = lengths[top]
    trained_worst = int(trained_rows[top].sum())
    if flat:
        total = int(lens.sum())
        worst = BatchShape(1, total, trained_worst, float((lens.astype(float) ** 2).sum()),
                           0 if flash else total * total)
        mean_len = float(lengths.mean())
        typical = BatchShape(1, int(b * mean_len), int(b * trained_rows.mean()), b * mean_len**2, 0)
        return worst, typical
    seq = round_up(int(lens.max()) if len(lens) else 1, multiple)
    worst = BatchShape(b, seq, trained_worst, float(b * seq * seq), 0 if flash else b * seq * seq)
    if group_by_length or b == 1:
        typ_seq = float(lengths.mean())
    else:
        # E[max of b random lengths] ~ the b/(b+1) quantile
        typ_seq = float(np.quantile(lengths, b / (b + 1.0)))
    typ_seq = float(round_up(int(math.ceil(typ_seq)), multiple))
    typical = BatchShape(b, int(typ_seq), int(b * trained_rows.mean()), b * typ_seq**2, 0)
    return worst, typical


def round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple
