"""Token-length data of a training set, as TRL will see it, and the built-in synthetic chat set.

Every number the advisor derives from the data (tokens lost to truncation, trained tokens per row, the
longest batch) comes from a `TokenizedDataset`: pre-tokenized rows in the columns SFTTrainer consumes
(`input_ids`, and `completion_mask` when only completions are trained).

The package's modules are private to it (tests/test_privacy.py): the `TokenizedDataset` type and its length
statistics (`dataset.py`), the synthetic set (`synthetic_set.py`), the raw readers (`readers.py`), the row formats and
checks (`rows.py`) and TRL's tokenization (`tokenize.py`). This `__init__` loads a user's dataset (`load_dataset`) and
is the one way to all of them (`__all__`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import DatasetError
from .dataset import BadRow, DataFormat, Dataset, SourcedRows, TokenizedDataset, replace_dataset
from .readers import LOCAL_SUFFIXES, RawRows, first_line, list_problems, read_raw
from .rows import check_row, columns, detect_format
from .synthetic_set import (
    SYNTHETIC_MAX,
    SYNTHETIC_MEDIAN,
    SYNTHETIC_MIN,
    SYNTHETIC_ROWS,
    SYNTHETIC_SEED,
    SYNTHETIC_SIGMA,
    synthetic,
    synthetic_lengths,
)
from .tokenize import (
    TOKENIZER_FILES,
    load_processing_class,
    load_tokenizer,
    prepare_with_trl,
    progress_bars,
    tokenizer_note,
)

if TYPE_CHECKING:
    from ..trainers import Trainer
    from ..workload import ModelSpec

__all__ = [  # noqa: RUF022
    "Dataset", "TokenizedDataset", "SourcedRows", "BadRow", "DataFormat", "load_dataset", "load_tokenizer",
    "load_processing_class",
    "synthetic",
    "synthetic_lengths",
    "progress_bars", "tokenizer_note", "read_raw", "RawRows", "LOCAL_SUFFIXES", "TOKENIZER_FILES", "SYNTHETIC_ROWS",
    "SYNTHETIC_SEED", "SYNTHETIC_MEDIAN", "SYNTHETIC_SIGMA", "SYNTHETIC_MIN", "SYNTHETIC_MAX",
    # the parts' names the rest of advisor uses (rows, readers, the dataset type)
    "replace_dataset", "list_problems", "first_line", "detect_format", "check_row", "columns", "prepare_with_trl",
]


def load_dataset(
    spec: str | None,
    model: ModelSpec,
    tokenizer: str | None = None,
    sample: int | None = None,
    seed: int = 0,
    progress: bool = False,
    trainer: Trainer | None = None,
) -> TokenizedDataset:
    """Rows tokenized exactly as SFTTrainer prepares them (TRL's own code, `max_length=None`), with the tokenizer
    `trainer` loads (`Trainer.load_processing_class`; without one, TRL's AutoProcessor).

    `spec`: None (the synthetic set), a local .jsonl/.json/.parquet/.csv file or dataset directory, or a hub id.
    Bad rows are kept in `bad_rows` with their index, line and field; a file with only bad rows, or a line of
    invalid JSON, raises DatasetError. `sample` draws a seeded random sample of that many rows.
    """
    if sample is not None and sample <= 0:
        raise DatasetError(f"--sample {sample}: must be a positive number of rows, e.g. --sample 2000")
    if spec is None:
        data = synthetic(model.vocab_size)
        if sample is not None:
            note = f"--sample {sample} ignored: the synthetic set is generated whole ({len(data.rows)} rows)"
            data = replace_dataset(data, notes=data.notes + (note,))
        return data

    raw = read_raw(spec)
    population = len(raw.rows)
    indices = np.arange(population)
    if sample is not None and sample < population:
        indices = np.sort(np.random.default_rng(seed).choice(population, size=sample, replace=False))
    rows = [raw.rows[int(i)] for i in indices]
    lines = None if raw.lines is None else [raw.lines[int(i)] for i in indices]

    fmt = detect_format(rows, raw.label)
    good, bad = _checked(rows, indices, lines, fmt, model.vocab_size)
    if not good:
        raise DatasetError(
            f"--dataset {spec}: no usable row in {raw.label} (format {fmt.value}); "
            + list_problems([b.describe() for b in bad])
            + "; fix the rows or omit --dataset to use the synthetic data"
        )

    tok = None if fmt is DataFormat.TOKENIZED else load_tokenizer(tokenizer, model, trainer)
    loaded_as = None if tok is None else tokenizer_note(tok, tokenizer, model, trainer)
    input_ids, labels, said = prepare_with_trl(good, fmt, tok, spec, progress)
    completion_only = any(-100 in lab for lab in labels)
    out_rows = []
    for ids, lab in zip(input_ids, labels, strict=True):
        row = {"input_ids": list(ids)}
        if completion_only:
            row["completion_mask"] = [int(x != -100) for x in lab]
        out_rows.append(row)

    notes = []
    if bad:
        notes.append(f"{len(bad)} bad row(s) skipped: " + list_problems([b.describe() for b in bad]))
    if sample is not None and sample < population:
        notes.append(f"a seeded random sample (seed {seed}) of {len(rows)} of {population} rows")
    notes.extend(n for n in (loaded_as, said) if n is not None)
    return TokenizedDataset(
        name=raw.label,
        source=raw.source,
        rows=tuple(out_rows),
        completion_only_loss=completion_only,
        dataset_name=spec if raw.source == "hub" else None,
        notes=tuple(notes),
        bad_rows=tuple(bad),
        population=population if sample is not None and sample < population else None,
        format=fmt,
    )


def _checked(rows: list[Any], indices: np.ndarray, lines: list[Any] | None, fmt: DataFormat, vocab_size: int
             ) -> tuple[list[dict[str, Any]], list[BadRow]]:
    """The rows of format `fmt` in the columns TRL reads, and the bad ones with their index, line and field."""
    good: list[dict[str, Any]] = []
    bad: list[BadRow] = []
    for pos, row in enumerate(rows):
        problem = check_row(row, fmt, vocab_size)
        if problem is None:
            good.append(columns(row, fmt))
        else:
            bad.append(BadRow(index=int(indices[pos]), field=problem[0], reason=problem[1],
                              line=None if lines is None else lines[pos]))
    return good, bad
