"""Reading a dataset's raw rows: a local .jsonl / .json / .parquet / .csv file, a `save_to_disk` directory, a
datasets directory or a hub id, each failure a DatasetError naming `--dataset`, the cause and the fix."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import DatasetError

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
_SHOWN_PROBLEMS = 10


def list_problems(problems: Sequence[str]) -> str:
    shown = "; ".join(problems[:_SHOWN_PROBLEMS])
    more = len(problems) - _SHOWN_PROBLEMS
    return shown + (f"; and {more} more" if more > 0 else "")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@dataclass(frozen=True)
class RawRows:
    rows: Sequence[Any]
    lines: list[int] | None  # 1-based file line of each row (jsonl), else None
    label: str
    source: Literal["local", "hub"]


def read_raw(spec: str) -> RawRows:
    path = Path(spec).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            rows, lines = _read_jsonl(path)
            return RawRows(rows, lines, str(path), "local")
        if suffix == ".json":
            return _read_json(path)
        if suffix in (".parquet", ".csv"):
            return RawRows(_read_arrow(path, suffix), None, str(path), "local")
        raise DatasetError(
            f"--dataset {spec}: unsupported file type {suffix!r}; use one of {', '.join(LOCAL_SUFFIXES)}"
        )
    if path.is_dir():
        if any((path / f).is_file() for f in _SAVED_FILES):
            return RawRows(_load_from_disk(path, spec), None, str(path), "local")
        return RawRows(_load_hf(str(path), spec), None, str(path), "local")
    if path.suffix.lower() in LOCAL_SUFFIXES or spec.startswith((".", "/", "~")):
        raise DatasetError(f"--dataset {spec}: no such file; check the path")
    return RawRows(_load_hf(spec, spec), None, spec, "hub")


def _not_text(path: Path, exc: UnicodeDecodeError) -> DatasetError:
    head = path.read_bytes()[:8192]
    kind = {b"\x1f\x8b": "gzip-compressed", b"PK": "a zip archive", b"PAR1": "a parquet file",
            b"\x28\xb5": "zstd-compressed"}
    what = next((v for k, v in kind.items() if head.startswith(k)), None)
    if what is None and b"\x00" not in head:  # text, in another encoding: say which, and how to convert it
        sample = head[max(0, exc.start - 20):exc.start + 20].decode("cp1252", errors="replace")
        return DatasetError(
            f"--dataset {path}: text in another encoding than UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start}, ...{sample!r}... read as Latin-1 / Windows-1252); datasets and TRL read UTF-8 only: "
            f"convert it, e.g. iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8{path.suffix}"
        )
    what = what or "binary"
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
    with path.open(encoding="utf-8-sig") as fh:  # a byte-order mark, which datasets reads too, is skipped
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
        raise DatasetError(f"--dataset {path}: {list_problems(invalid)}; each line must be one JSON object")
    if not rows:
        raise DatasetError(f"--dataset {path}: the file has no rows")
    return rows, lines


def _read_json(path: Path) -> RawRows:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise _not_text(path, exc) from None
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # JSON lines under a .json name
            rows, lines = _read_jsonl(path)
            return RawRows(rows, lines, str(path), "local")
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
    return RawRows(data, None, str(path), "local")


def _read_arrow(path: Path, suffix: str) -> list[dict[str, Any]]:
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq  # lazy: loads pyarrow

            table = pq.read_table(path)
        else:
            import pyarrow.csv as pcsv  # lazy: loads pyarrow

            table = pcsv.read_csv(path)
    except Exception as exc:  # pyarrow.ArrowInvalid and friends
        raise DatasetError(f"--dataset {path}: cannot read the {suffix[1:]} file ({first_line(exc)})") from exc
    if table.num_rows == 0:
        raise DatasetError(f"--dataset {path}: the file has no rows")
    return table.to_pylist()


# What `datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk` write into their directory.
_SAVED_FILES = ("state.json", "dataset_dict.json")


def _load_from_disk(path: Path, spec: str) -> Sequence[dict[str, Any]]:
    """A directory written by `save_to_disk`: the Dataset, or the `train` split of a DatasetDict."""
    import datasets  # lazy: loads datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # a truncated or foreign directory
        raise DatasetError(f"--dataset {spec}: a save_to_disk directory that datasets.load_from_disk cannot read "
                           f"({first_line(exc)}); save it again, or pass a .jsonl/.parquet file") from exc
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DatasetError(f"--dataset {spec}: a saved DatasetDict without a 'train' split (it has "
                               f"{', '.join(ds)}); save the training split as 'train'")
        ds = ds["train"]
    if len(ds) == 0:
        raise DatasetError(f"--dataset {spec}: the saved dataset has no rows")
    return ds


def _load_hf(target: str, spec: str) -> Sequence[dict[str, Any]]:
    import datasets  # lazy: loads datasets

    try:
        ds = datasets.load_dataset(target, split="train")
    except Exception as exc:  # offline, unknown id, no "train" split...
        from ..profiles import hub_offline  # lazy: loads yaml

        if hub_offline() and not Path(target).exists():
            raise DatasetError(
                f"--dataset {spec}: the hub is offline (HF_HUB_OFFLINE=1) and the dataset is not in the local "
                "datasets cache; download it where the hub is reachable (datasets.load_dataset), pass a local "
                ".jsonl/.json/.parquet/.csv file or save_to_disk directory, or omit --dataset for the synthetic data"
            ) from exc
        raise DatasetError(
            f"--dataset {spec}: cannot load it with datasets.load_dataset ({first_line(exc)}); pass a local "
            f".jsonl/.json/.parquet/.csv file, or omit --dataset to use the built-in synthetic data"
        ) from exc
    return ds  # indexable row by row; only the sampled rows are materialized
