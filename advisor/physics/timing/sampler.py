"""The micro-batches the sampler really makes, with their probabilities (the package docstring: "Expectation over
batches")."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from ...data import progress_bars
from ...lengths import GROUPED_SEED, _labelled
from ...lengths import _log_comb as log_comb
from .constants import AttentionKind
from .kernels import attention_kind, attention_units, causal_tiles
from .step import BatchDistribution, BatchPoint

if TYPE_CHECKING:
    from ...data import TokenizedDataset
    from ...space import Candidate


@dataclass(frozen=True)
class SamplerSpec:
    """What decides the batches: hashable, so distributions are cached per dataset."""

    batch: int
    max_length: int | None
    packing: bool
    strategy: str
    flat: bool  # effective padding-free
    group_by_length: bool
    multiple: int | None
    attn: str


def sampler_spec(c: Candidate) -> SamplerSpec:
    return SamplerSpec(
        batch=c.per_device_train_batch_size, max_length=c.max_length, packing=c.packing,
        strategy=c.packing_strategy.value, flat=c.effective_padding_free, group_by_length=c.group_by_length,
        multiple=c.pad_to_multiple_of, attn=c.attn_implementation.value,
    )


def batch_distribution(dataset: TokenizedDataset, c: Candidate, block: int = 128) -> BatchDistribution:
    return _distribution(dataset, sampler_spec(c), block)


def _round(n: np.ndarray, multiple: int | None) -> np.ndarray:
    return n if not multiple else -(-n // multiple) * multiple


def _kept(dataset: TokenizedDataset, ml: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(lengths after truncation, trained tokens) of the rows SFTTrainer keeps (those with a trained token)."""
    trained = np.asarray(dataset.trained_after_truncation(ml), dtype=np.int64)
    lengths = np.asarray(dataset.lengths, dtype=np.int64)
    if ml is not None:
        lengths = np.minimum(lengths, ml)
    keep = trained > 0
    return lengths[keep], trained[keep]


@lru_cache(maxsize=512)
def _distribution(dataset: TokenizedDataset, s: SamplerSpec, block: int) -> BatchDistribution:
    b = s.batch
    if s.packing and s.max_length:
        return _packed(dataset, s, block)
    lengths, trained = _kept(dataset, s.max_length)
    if len(lengths) == 0:
        return BatchDistribution.single(BatchPoint(1.0, 0.0, 1.0))
    if s.flat:
        order = _epoch(len(lengths), b, s.group_by_length, lengths)
        return _flat_batches(order, lengths, trained, b, s, block)
    if s.group_by_length:
        order = _epoch(len(lengths), b, True, lengths)
        chunks = [order[i:i + b] for i in range(0, len(order), b)]
        rows = np.array([len(ch) for ch in chunks], dtype=float)
        longest = _round(np.array([lengths[ch].max() for ch in chunks]), s.multiple).astype(float)
        tr = np.array([trained[ch].sum() for ch in chunks], dtype=float)
        real = np.array([lengths[ch].sum() for ch in chunks], dtype=float)
        sq = np.array([(lengths[ch].astype(float) ** 2).sum() for ch in chunks])
        att = np.array([_padded_units(s.attn, lengths[ch], int(m), block) for ch, m in zip(chunks, longest,
                                                                                           strict=True)])
        w = np.ones(len(chunks)) / len(chunks)  # every batch of the epoch once
        return BatchDistribution(w, rows * longest, tr, att, rows, real, sq)
    # random order: the longest row of a uniform random subset of b rows is the i-th smallest with probability
    # C(i-1, b-1) / C(n, b) (the same order statistics advisor.lengths uses for its padding report)
    n = len(lengths)
    order = np.argsort(lengths, kind="stable")
    ordered = lengths[order].astype(float)
    bb = min(b, n)
    i = np.arange(bb, n + 1, dtype=float)
    log_p = _log_comb(i - 1, bb - 1) - _log_comb(float(n), bb)
    p = np.exp(log_p)
    p = p / p.sum()
    longest = _round(ordered[bb - 1:].astype(np.int64), s.multiple).astype(float)
    mean_len = float(lengths.mean())
    mean_sq = float((lengths.astype(float) ** 2).mean())
    kind = attention_kind(s.attn, masked=bb > 1 and len(set(lengths.tolist())) > 1)
    if kind is AttentionKind.CAUSAL and "flash" in s.attn:
        # varlen unpads: the expected per-sequence tiles of bb random rows
        att = np.full(len(p), bb * float(np.mean(causal_tiles(lengths, block))))
    else:
        att = np.array([attention_units(kind, np.full(bb, m), bb, int(m), block) for m in longest])
    ones = np.ones(len(p))
    return BatchDistribution(p, bb * longest, ones * bb * float(trained.mean()), att, ones * bb, ones * bb * mean_len,
                             ones * bb * mean_sq)


def _padded_units(attn: str, lens: np.ndarray, longest: int, block: int) -> float:
    masked = len(lens) > 1 and bool((lens != longest).any())
    kind = attention_kind(attn, masked)
    if kind is AttentionKind.CAUSAL and "flash" in attn:
        return float(np.sum(causal_tiles(lens, block)))
    return attention_units(kind, np.full(len(lens), longest), len(lens), longest, block)


def _epoch(n: int, b: int, grouped: bool, lengths: np.ndarray) -> np.ndarray:
    """The order of one epoch: transformers' LengthGroupedSampler (seeded as advisor.lengths does) or a seeded
    random permutation (RandomSampler)."""
    if grouped:
        import torch  # lazy: loads torch
        from transformers.trainer_pt_utils import get_length_grouped_indices  # lazy: loads transformers


        return np.asarray(get_length_grouped_indices(lengths.tolist(), b,
                                                     generator=torch.Generator().manual_seed(GROUPED_SEED)))
    return np.random.default_rng(0).permutation(n)


def _flat_batches(order: np.ndarray, lengths: np.ndarray, trained: np.ndarray, b: int, s: SamplerSpec,
                  block: int) -> BatchDistribution:
    chunks = [order[i:i + b] for i in range(0, len(order), b)]
    tokens = np.array([lengths[ch].sum() for ch in chunks], dtype=float)
    tr = np.array([trained[ch].sum() for ch in chunks], dtype=float)
    sq = np.array([(lengths[ch].astype(float) ** 2).sum() for ch in chunks])
    kind = attention_kind(s.attn, masked=True)
    if kind is AttentionKind.CAUSAL:
        att = np.array([float(np.sum(causal_tiles(lengths[ch], block))) for ch in chunks])
    else:
        att = np.array([attention_units(kind, np.array([t]), 1, int(t), block) for t in tokens])
    w = np.ones(len(chunks)) / len(chunks)
    return BatchDistribution(w, tokens, tr, att, np.ones(len(chunks)), tokens.copy(), sq)


def _packed(dataset: TokenizedDataset, s: SamplerSpec, block: int) -> BatchDistribution:
    """Packed rows from TRL's own pack_dataset; b random rows per micro-batch (one seeded epoch)."""
    rows_len, rows_trained, docs = _packed_rows(dataset, int(s.max_length), s.strategy)
    b = s.batch
    order = np.random.default_rng(0).permutation(len(rows_len))
    chunks = [order[i:i + b] for i in range(0, len(order), b)]
    wrapped = s.strategy == "wrapped"
    flat = s.flat
    tokens, tr, att, sq, rows = [], [], [], [], []
    for ch in chunks:
        lens = rows_len[ch]
        seqs = np.concatenate([docs[i] for i in ch]) if not wrapped else lens
        total = float(lens.sum())
        padded = total if flat else float(len(ch) * (lens.max() if not wrapped else s.max_length))
        tokens.append(padded)
        tr.append(float(rows_trained[ch].sum()))
        sq.append(float((seqs.astype(float) ** 2).sum()))
        rows.append(1.0 if flat else float(len(ch)))
        if flat:
            kind = attention_kind(s.attn, masked=True)
            if kind is AttentionKind.CAUSAL:
                att.append(float(np.sum(causal_tiles(seqs, block))))
            else:
                att.append(attention_units(kind, np.array([total]), 1, int(total), block))
        else:
            att.append(_padded_units(s.attn, lens, int(lens.max()), block))
    n = len(chunks)
    return BatchDistribution(np.ones(n) / n, np.array(tokens), np.array(tr), np.array(att), np.array(rows),
                             np.array([float(rows_len[ch].sum()) for ch in chunks]), np.array(sq))


@lru_cache(maxsize=32)
def _packed_rows(dataset: TokenizedDataset, max_length: int, strategy: str) -> tuple[np.ndarray, np.ndarray, list]:
    """(tokens per packed row, trained tokens per packed row, document lengths per row) from TRL's pack_dataset,
    on the same input_ids/labels columns SFTTrainer packs (advisor.lengths)."""
    import pyarrow.compute as pc  # lazy: loads pyarrow
    from trl.data_utils import pack_dataset  # lazy: loads trl


    hf = _labelled(dataset)
    with progress_bars(False):
        packed = pack_dataset(hf, max_length, strategy, {})
    lens = np.asarray(pc.list_value_length(packed.data.column("input_ids")).to_numpy(zero_copy_only=False),
                      dtype=np.int64)
    labels = packed.data.column("labels").to_pylist()
    trained = np.array([sum(1 for x in row[1:] if x != -100) for row in labels], dtype=np.int64)
    if "seq_lengths" in packed.column_names:
        docs = [np.asarray(x, dtype=np.int64) for x in packed.data.column("seq_lengths").to_pylist()]
    else:
        docs = [np.array([n]) for n in lens]
    return lens, trained, docs


def _log_comb(n: np.ndarray | float, k: int) -> np.ndarray:
    return log_comb(np.asarray(n, dtype=np.float64), k)
