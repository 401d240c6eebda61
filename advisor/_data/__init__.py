"""The data layer's parts, private to `advisor/data.py` (the public way to them): the dataset type and its length
statistics, the synthetic set, the raw readers, the row formats and checks, TRL's tokenization. Import from here,
never from the modules inside."""

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

__all__ = [  # noqa: RUF022
    "Dataset", "TokenizedDataset", "SourcedRows", "BadRow", "DataFormat", "replace_dataset",
    "RawRows", "read_raw", "LOCAL_SUFFIXES", "list_problems", "first_line",
    "detect_format", "check_row", "columns",
    "synthetic", "synthetic_lengths", "SYNTHETIC_ROWS", "SYNTHETIC_SEED", "SYNTHETIC_MEDIAN", "SYNTHETIC_SIGMA",
    "SYNTHETIC_MIN", "SYNTHETIC_MAX",
    "load_tokenizer", "load_processing_class", "prepare_with_trl", "progress_bars", "TOKENIZER_FILES", "tokenizer_note",
]
