"""The built-in synthetic chat set, and the length sampler the synthetic preference set shares
(advisor/trainers/preference.py)."""

from __future__ import annotations

import math

import numpy as np

from .dataset import TokenizedDataset

# The synthetic set: conversations whose total length is log-normal (median ~ 300 tokens, p99 ~ 1.7k, a tail past
# 4k, clipped to [16, 8192]) and whose prompt takes 20-60% of it. Documented in README.md.
SYNTHETIC_ROWS = 2048
SYNTHETIC_SEED = 0
SYNTHETIC_MEDIAN = 300
SYNTHETIC_SIGMA = 0.75
SYNTHETIC_MIN, SYNTHETIC_MAX = 16, 8192


def synthetic_lengths(rng: np.random.Generator, rows: int, median: int = SYNTHETIC_MEDIAN,
                      max_len: int = SYNTHETIC_MAX) -> tuple[np.ndarray, np.ndarray]:
    """`rows` sequence lengths, log-normal around `median` (sigma SYNTHETIC_SIGMA) clipped to [SYNTHETIC_MIN,
    `max_len`], then each one's prompt share, uniform in [0.2, 0.6): drawn from `rng` in that order."""
    lengths = np.clip(
        np.rint(rng.lognormal(math.log(median), SYNTHETIC_SIGMA, size=rows)), SYNTHETIC_MIN, max_len
    ).astype(np.int64)
    return lengths, rng.uniform(0.2, 0.6, size=rows)


def synthetic(
    vocab_size: int,
    rows: int = SYNTHETIC_ROWS,
    seed: int = SYNTHETIC_SEED,
    median: int = SYNTHETIC_MEDIAN,
    max_len: int = SYNTHETIC_MAX,
) -> TokenizedDataset:
    """The built-in chat set: seeded token ids with a prompt/completion split; no tokenizer needed."""
    rng = np.random.default_rng(seed)
    lengths, prompt_share = synthetic_lengths(rng, rows, median, max_len)
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
