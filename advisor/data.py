"""Token-length data of a training set, as TRL will see it, and the built-in synthetic chat set.

Every number the advisor derives from the data (tokens lost to truncation, trained tokens per row, the
longest batch) comes from a `TokenizedDataset`: pre-tokenized rows in the columns SFTTrainer consumes
(`input_ids`, and `completion_mask` when only completions are trained).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .errors import DatasetError

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

    from .space import Candidate
    from .workload import ModelSpec

# The synthetic set: conversations whose total length is log-normal (median ~ 300 tokens, p99 ~ 1.7k, a tail past
# 4k, clipped to [16, 8192]) and whose prompt takes 20-60% of it. Documented in README.md.
SYNTHETIC_ROWS = 2048
SYNTHETIC_SEED = 0
SYNTHETIC_MEDIAN = 300
SYNTHETIC_SIGMA = 0.75
SYNTHETIC_MIN, SYNTHETIC_MAX = 16, 8192


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


@dataclass(frozen=True, eq=False)
class TokenizedDataset:
    """Rows as SFTTrainer's prepared dataset holds them, before truncation and packing."""

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


# --- Loading a user's dataset -------------------------------------------------------------------------------------

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_SHOWN_PROBLEMS = 10


def load_dataset(
    spec: str | None,
    model: ModelSpec,
    tokenizer: str | None = None,
    sample: int | None = None,
    seed: int = 0,
    progress: bool = False,
) -> TokenizedDataset:
    """Rows tokenized exactly as SFTTrainer prepares them (TRL's own code, `max_length=None`).

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
            data = _replace(data, notes=data.notes + (note,))
        return data

    raw = _read_raw(spec)
    population = len(raw.rows)
    indices = np.arange(population)
    if sample is not None and sample < population:
        indices = np.sort(np.random.default_rng(seed).choice(population, size=sample, replace=False))
    rows = [raw.rows[int(i)] for i in indices]
    lines = None if raw.lines is None else [raw.lines[int(i)] for i in indices]

    fmt = _detect_format(rows, raw.label)
    good: list[dict[str, Any]] = []
    good_index: list[int] = []
    bad: list[BadRow] = []
    for pos, row in enumerate(rows):
        index = int(indices[pos])
        problem = _check_row(row, fmt, model.vocab_size)
        if problem is None:
            good.append(_columns(row, fmt))
            good_index.append(index)
        else:
            bad.append(BadRow(index=index, field=problem[0], reason=problem[1],
                              line=None if lines is None else lines[pos]))
    if not good:
        raise DatasetError(
            f"--dataset {spec}: no usable row in {raw.label} (format {fmt.value}); "
            + _list_problems([b.describe() for b in bad])
            + "; fix the rows or omit --dataset to use the synthetic data"
        )

    tok = None if fmt is DataFormat.TOKENIZED else load_tokenizer(tokenizer, model)
    input_ids, labels = _prepare_with_trl(good, fmt, tok, spec, progress)
    completion_only = any(-100 in lab for lab in labels)
    out_rows = []
    for ids, lab in zip(input_ids, labels, strict=True):
        row = {"input_ids": list(ids)}
        if completion_only:
            row["completion_mask"] = [int(x != -100) for x in lab]
        out_rows.append(row)

    notes = []
    if bad:
        notes.append(f"{len(bad)} bad row(s) skipped: " + _list_problems([b.describe() for b in bad]))
    if sample is not None and sample < population:
        notes.append(f"a seeded random sample (seed {seed}) of {len(rows)} of {population} rows")
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


def load_tokenizer(tokenizer: str | None, model: ModelSpec) -> PreTrainedTokenizerBase:
    """`--tokenizer PATH`, else the model's directory, else its hub id; DatasetError says how to provide one."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        try:
            return _from_pretrained(tokenizer)
        except Exception as exc:  # transformers raises OSError, ValueError, EnvironmentError...
            raise DatasetError(
                f"--tokenizer {tokenizer}: no tokenizer could be loaded ({_first_line(exc)}); pass a directory that "
                f"holds one of {', '.join(TOKENIZER_FILES)}"
            ) from exc
    local = model.local_dir
    if local is not None and any((Path(local) / f).exists() for f in TOKENIZER_FILES):
        try:
            return _from_pretrained(str(local))
        except Exception as exc:
            raise DatasetError(
                f"--model {model.name}: the tokenizer in {local} could not be loaded ({_first_line(exc)}); "
                "pass --tokenizer PATH"
            ) from exc
    hint = ("pass --tokenizer PATH (a directory with tokenizer.json or tokenizer_config.json), "
            "or omit --dataset to use the built-in synthetic data")
    if model.source == "local":
        raise DatasetError(f"--model {model.name}: its directory has no tokenizer; {hint}")
    try:
        return AutoTokenizer.from_pretrained(model.name)
    except Exception as exc:
        raise DatasetError(
            f"--model {model.name}: no tokenizer reachable (not local, hub unreachable: {_first_line(exc)}); {hint}"
        ) from exc


def _from_pretrained(path: str) -> PreTrainedTokenizerBase:
    """AutoTokenizer, except that a directory saved with the generic fast class keeps that class.

    transformers 5 lets a `config.json` beside the tokenizer pick the class from the model type (Qwen2Tokenizer
    for qwen2), which rebuilds the pipeline and loses a custom tokenizer saved as `TokenizersBackend`.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = Path(path) / "tokenizer_config.json"
    if config.is_file():
        with contextlib.suppress(ValueError, OSError):
            saved = json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class")
            if saved in ("TokenizersBackend", "PreTrainedTokenizerFast"):
                return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@dataclass(frozen=True)
class _Raw:
    rows: Sequence[Any]
    lines: list[int] | None  # 1-based file line of each row (jsonl), else None
    label: str
    source: Literal["local", "hub"]


def _read_raw(spec: str) -> _Raw:
    path = Path(spec).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            rows, lines = _read_jsonl(path)
            return _Raw(rows, lines, str(path), "local")
        if suffix == ".json":
            return _read_json(path)
        if suffix in (".parquet", ".csv"):
            return _Raw(_read_arrow(path, suffix), None, str(path), "local")
        raise DatasetError(
            f"--dataset {spec}: unsupported file type {suffix!r}; use one of {', '.join(LOCAL_SUFFIXES)}"
        )
    if path.is_dir():
        if any((path / f).is_file() for f in _SAVED_FILES):
            return _Raw(_load_from_disk(path, spec), None, str(path), "local")
        return _Raw(_load_hf(str(path), spec), None, str(path), "local")
    if path.suffix.lower() in LOCAL_SUFFIXES or spec.startswith((".", "/", "~")):
        raise DatasetError(f"--dataset {spec}: no such file; check the path")
    return _Raw(_load_hf(spec, spec), None, spec, "hub")


def _not_text(path: Path, exc: UnicodeDecodeError) -> DatasetError:
    head = path.read_bytes()[:4]
    kind = {b"\x1f\x8b": "gzip-compressed", b"PK": "a zip archive", b"PAR1": "a parquet file",
            b"\x28\xb5": "zstd-compressed"}
    what = next((v for k, v in kind.items() if head.startswith(k)), "binary")
    return DatasetError(
        f"--dataset {path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}; the file "
        f"looks {what}); a {path.suffix} dataset must be UTF-8 JSON: decompress it, or give the right suffix "
        f"({', '.join(LOCAL_SUFFIXES)})"
    )


def _read_jsonl(path: Path) -> tuple[list[Any], list[int]]:
    try:
        return _read_jsonl_text(path)
    except UnicodeDecodeError as exc:
        raise _not_text(path, exc) from None


def _read_jsonl_text(path: Path) -> tuple[list[Any], list[int]]:
    rows, lines, invalid = [], [], []
    with path.open(encoding="utf-8") as fh:
        for number, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                rows.append(json.loads(text))
            except json.JSONDecodeError as exc:
                invalid.append(f"line {number}: invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            lines.append(number)
    if invalid:
        raise DatasetError(f"--dataset {path}: {_list_problems(invalid)}; each line must be one JSON object")
    if not rows:
        raise DatasetError(f"--dataset {path}: the file has no rows")
    return rows, lines


def _read_json(path: Path) -> _Raw:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise _not_text(path, exc) from None
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # JSON lines under a .json name
            rows, lines = _read_jsonl(path)
            return _Raw(rows, lines, str(path), "local")
        raise DatasetError(
            f"--dataset {path}: invalid JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); the file must "
            "hold a list of objects, an object of columns, or one object per line"
        ) from exc
    if isinstance(data, dict):
        lists = {k: v for k, v in data.items() if isinstance(v, list)}
        if len(lists) == 1 and all(isinstance(r, dict) for r in next(iter(lists.values()))):
            data = next(iter(lists.values()))  # {"data": [...]} / {"train": [...]}
        elif lists and len(lists) == len(data) and len({len(v) for v in lists.values()}) == 1:
            keys = list(lists)
            data = [dict(zip(keys, values, strict=True)) for values in zip(*lists.values(), strict=True)]
    if not isinstance(data, list):
        raise DatasetError(f"--dataset {path}: expected a list of rows, got a JSON {type(data).__name__}")
    if not data:
        raise DatasetError(f"--dataset {path}: the file has no rows")
    return _Raw(data, None, str(path), "local")


def _read_arrow(path: Path, suffix: str) -> list[dict[str, Any]]:
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
        else:
            import pyarrow.csv as pcsv

            table = pcsv.read_csv(path)
    except Exception as exc:  # pyarrow.ArrowInvalid and friends
        raise DatasetError(f"--dataset {path}: cannot read the {suffix[1:]} file ({_first_line(exc)})") from exc
    if table.num_rows == 0:
        raise DatasetError(f"--dataset {path}: the file has no rows")
    return table.to_pylist()


# What `datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk` write into their directory.
_SAVED_FILES = ("state.json", "dataset_dict.json")


def _load_from_disk(path: Path, spec: str) -> Sequence[dict[str, Any]]:
    """A directory written by `save_to_disk`: the Dataset, or the `train` split of a DatasetDict."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # a truncated or foreign directory
        raise DatasetError(f"--dataset {spec}: a save_to_disk directory that datasets.load_from_disk cannot read "
                           f"({_first_line(exc)}); save it again, or pass a .jsonl/.parquet file") from exc
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DatasetError(f"--dataset {spec}: a saved DatasetDict without a 'train' split (it has "
                               f"{', '.join(ds)}); save the training split as 'train'")
        ds = ds["train"]
    if len(ds) == 0:
        raise DatasetError(f"--dataset {spec}: the saved dataset has no rows")
    return ds


def _load_hf(target: str, spec: str) -> Sequence[dict[str, Any]]:
    import datasets

    try:
        ds = datasets.load_dataset(target, split="train")
    except Exception as exc:  # offline, unknown id, no "train" split...
        from .profiles import hub_offline

        if hub_offline() and not Path(target).exists():
            raise DatasetError(
                f"--dataset {spec}: the hub is offline (HF_HUB_OFFLINE=1) and the dataset is not in the local "
                "datasets cache; download it where the hub is reachable (datasets.load_dataset), pass a local "
                ".jsonl/.json/.parquet/.csv file or save_to_disk directory, or omit --dataset for the synthetic data"
            ) from exc
        raise DatasetError(
            f"--dataset {spec}: cannot load it with datasets.load_dataset ({_first_line(exc)}); pass a local "
            f".jsonl/.json/.parquet/.csv file, or omit --dataset to use the built-in synthetic data"
        ) from exc
    return ds  # indexable row by row; only the sampled rows are materialized


_FORMAT_FIELDS = {
    DataFormat.TOKENIZED: "input_ids",
    DataFormat.PROMPT_COMPLETION: "prompt/completion",
    DataFormat.MESSAGES: "messages",
    DataFormat.CONVERSATIONS: "conversations",
    DataFormat.TEXT: "text",
}


def _row_format(row: Any) -> DataFormat | None:
    if not isinstance(row, dict):
        return None
    if row.get("input_ids") is not None:
        return DataFormat.TOKENIZED
    if row.get("prompt") is not None and row.get("completion") is not None:
        return DataFormat.PROMPT_COMPLETION
    for fmt in (DataFormat.MESSAGES, DataFormat.CONVERSATIONS, DataFormat.TEXT):
        if row.get(fmt.value) is not None:
            return fmt
    return None


def _detect_format(rows: Sequence[Any], label: str) -> DataFormat:
    """The format most rows have; rows of another shape become bad rows."""
    votes = Counter(f for f in map(_row_format, rows) if f is not None)
    if not votes:
        first = rows[0]
        keys = sorted(first) if isinstance(first, dict) else type(first).__name__
        raise DatasetError(
            f"--dataset {label}: no row has a field TRL's SFT reads ({', '.join(_FORMAT_FIELDS.values())}); "
            f"row 0 has {keys}"
        )
    return votes.most_common(1)[0][0]


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_text(value: Any, name: str) -> tuple[str, str] | None:
    if value is None:
        return name, "missing"
    if not isinstance(value, str):
        return name, f"wrong type: expected a string, got {_type_name(value)}"
    if not value.strip():
        return name, "empty"
    return None


def _check_messages(value: Any, name: str, role: str = "role", content: str = "content") -> tuple[str, str] | None:
    if value is None:
        return name, "missing"
    if not isinstance(value, list):
        return name, f"wrong type: expected a list of messages, got {_type_name(value)}"
    if not value:
        return name, "empty"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"{name}[{i}]", f"wrong type: expected an object with {role!r} and {content!r}, got " \
                                   f"{_type_name(message)}"
        if not isinstance(message.get(role), str):
            return f"{name}[{i}].{role}", "missing" if message.get(role) is None else "wrong type: expected a string"
        body = message.get(content)
        if body is None and not message.get("tool_calls"):
            return f"{name}[{i}].{content}", "missing"
        if body is not None and not isinstance(body, (str, list)):
            return f"{name}[{i}].{content}", f"wrong type: expected a string, got {_type_name(body)}"
    return None


def _check_row(row: Any, fmt: DataFormat, vocab_size: int) -> tuple[str, str] | None:
    """(field, reason) of the first problem of a row in format `fmt`, or None when TRL can take it."""
    if not isinstance(row, dict):
        return "<row>", f"wrong type: expected an object, got {_type_name(row)}"
    if fmt is DataFormat.TEXT:
        return _check_text(row.get("text"), "text")
    if fmt is DataFormat.MESSAGES:
        return _check_messages(row.get("messages"), "messages")
    if fmt is DataFormat.CONVERSATIONS:
        return _check_messages(row.get("conversations"), "conversations", "from", "value")
    if fmt is DataFormat.PROMPT_COMPLETION:
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(prompt, list) or isinstance(completion, list):
            for value, name in ((prompt, "prompt"), (completion, "completion")):
                if isinstance(value, str):
                    return name, "wrong type: a string where the other field is a list of messages"
                problem = _check_messages(value, name)
                if problem:
                    return problem
            return None
        if prompt is None:
            return "prompt", "missing"
        if not isinstance(prompt, str):
            return "prompt", f"wrong type: expected a string, got {_type_name(prompt)}"
        return _check_text(completion, "completion")
    ids = row.get("input_ids")
    if ids is None:
        return "input_ids", "missing"
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return "input_ids", f"wrong type: expected a list of integers, got {_type_name(ids)}"
    if not ids:
        return "input_ids", "empty"
    if min(ids) < 0 or max(ids) >= vocab_size:
        return "input_ids", f"token id out of the model's vocabulary [0, {vocab_size})"
    mask = row.get("completion_mask")
    if mask is not None and (not isinstance(mask, list) or len(mask) != len(ids)):
        return "completion_mask", "wrong type: expected a list of 0/1 as long as input_ids"
    return None


def _columns(row: dict[str, Any], fmt: DataFormat) -> dict[str, Any]:
    """The columns TRL's preparation reads, so one odd extra column cannot break the Arrow schema."""
    keep = {
        DataFormat.TEXT: ("text",),
        DataFormat.MESSAGES: ("messages", "tools"),
        DataFormat.CONVERSATIONS: ("conversations", "tools"),
        DataFormat.PROMPT_COMPLETION: ("prompt", "completion", "tools"),
        DataFormat.TOKENIZED: ("input_ids", "completion_mask", "assistant_masks"),
    }[fmt]
    return {k: row[k] for k in keep if row.get(k) is not None}


def _prepare_with_trl(
    rows: list[dict[str, Any]], fmt: DataFormat, tok: PreTrainedTokenizerBase | None, spec: str, progress: bool
) -> tuple[list[list[int]], list[list[int]]]:
    """Run SFTTrainer's own `_prepare_dataset` (no model, no trainer) with `max_length=None`."""
    import tempfile
    import types
    import warnings

    import datasets

    from .trainers import get_trainer

    sft = get_trainer("sft")
    SFTConfig, SFTTrainer = sft.config_class(), sft.trainer_class()  # noqa: N806
    columns = sorted({k for r in rows for k in r})
    try:
        hf = datasets.Dataset.from_dict({c: [r.get(c) for r in rows] for c in columns})
    except Exception as exc:  # pyarrow cannot unify the rows' types
        raise DatasetError(f"--dataset {spec}: rows of mixed types in one field ({_first_line(exc)})") from exc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        args = SFTConfig(output_dir=tempfile.gettempdir(), max_length=None, use_cpu=True, report_to="none")
    # SFTTrainer.__init__ decides these three attributes; `completion_only_loss=None` (the default) means
    # "prompt/completion data only", and no custom chat template unless `assistant_only_loss`.
    trainer_like = types.SimpleNamespace(
        _tokenizer=tok,
        completion_only_loss=fmt is DataFormat.PROMPT_COMPLETION,
        chat_template=None,
    )
    try:
        with progress_bars(progress):
            prepared = SFTTrainer._prepare_dataset(trainer_like, hf, tok, args, False, None, "train")
    except Exception as exc:  # TRL/transformers raise ValueError, TemplateError, KeyError...
        raise DatasetError(
            f"--dataset {spec}: TRL could not tokenize it ({_first_line(exc)}); a conversational dataset needs a "
            "tokenizer with a chat template (--tokenizer PATH)"
        ) from exc
    return prepared["input_ids"], prepared["labels"]


@contextlib.contextmanager
def progress_bars(enabled: bool) -> Iterator[None]:
    from datasets.utils import logging as dlogging

    was = dlogging.is_progress_bar_enabled()
    (dlogging.enable_progress_bar if enabled else dlogging.disable_progress_bar)()
    try:
        yield
    finally:
        (dlogging.enable_progress_bar if was else dlogging.disable_progress_bar)()


def _list_problems(problems: Sequence[str]) -> str:
    shown = "; ".join(problems[:_SHOWN_PROBLEMS])
    more = len(problems) - _SHOWN_PROBLEMS
    return shown + (f"; and {more} more" if more > 0 else "")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _replace(data: TokenizedDataset, **changes: Any) -> TokenizedDataset:
    """`dataclasses.replace` for TokenizedDataset (its derived fields are init=False)."""
    fields = {k: getattr(data, k) for k in ("name", "source", "rows", "completion_only_loss", "dataset_name",
                                            "notes", "bad_rows", "population", "format")}
    fields.update(changes)
    return TokenizedDataset(**fields)
