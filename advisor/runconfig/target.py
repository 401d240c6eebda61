"""What the emitted file needs beyond the candidate to run as written where it was measured: the target's
device keys and the data the search measured, as `trl <command> --config FILE` reads them.

- The target: `use_cpu: true` for the CPU target (transformers refuses bf16 / fp16 on a machine without an
  accelerator unless it is set, and the cpu backend measures with it: advisor/probing/worker.py), `use_cpu: false`
  for a GPU target, written explicitly like every other device-relevant field.
- The data: a hub id as `dataset_name`; a local file or directory as one `datasets:` entry of TRL's
  DatasetMixtureConfig (trl/scripts/utils.py `get_dataset` passes `path`, `data_files`, `split` to
  `datasets.load_dataset`): a .jsonl / .json file as `path: json`, .parquet / .csv by their builder, a
  `save_to_disk` directory as `path: arrow` over its train split's files, any other directory as its path. The
  synthetic set has nothing to write (the file says where `trl` takes the data from instead).

The reader (reader.py) carries these keys in `RunConfig`, never in the candidate's base, so an emitted file reads
back to the candidate it came from, and `--config FILE` alone names the same data again.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..workload import GPUSpec, Workload

# datasets' packaged builders for the files the advisor reads (advisor/data/readers.py LOCAL_SUFFIXES)
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
SAVED_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")  # what `save_to_disk` writes
# the keys this module writes; reader.py keeps them out of the base
TARGET_KEYS = ("use_cpu",)
DATA_KEYS = ("dataset_name", "datasets")


def target_keys(gpu: GPUSpec) -> dict[str, Any]:
    """The device keys of the target: `use_cpu` (true on the CPU target, false on a GPU)."""
    return {"use_cpu": not gpu.is_cuda}


def dataset_entry(name: str) -> dict[str, Any] | None:
    """One DatasetMixtureConfig entry (as `get_dataset` reads it) for a local file or directory, or None when
    `name` is not a local path. Paths are made absolute: the file runs from any directory."""
    path = Path(name).expanduser()
    if not path.exists():
        return None
    path = path.resolve()
    if path.is_file():
        return {"path": BUILDERS.get(path.suffix.lower(), "json"), "data_files": str(path), "split": "train"}
    if (path / "dataset_dict.json").is_file():  # a saved DatasetDict: its train split (readers._load_from_disk)
        path = path / "train"
    if any((path / f).is_file() for f in SAVED_FILES):
        return {"path": "arrow", "data_files": str(path / "data-*.arrow"), "split": "train"}
    return {"path": str(path), "split": "train"}


def dataset_keys(dataset: Any) -> dict[str, Any]:
    """`dataset_name` for a hub id, a `datasets:` entry for local data, nothing for the synthetic set."""
    if dataset.dataset_name:
        return {"dataset_name": dataset.dataset_name}
    if dataset.source == "local":
        entry = dataset_entry(dataset.name)
        if entry is not None:
            return {"datasets": [entry]}
    return {}


def workload_keys(workload: Workload) -> dict[str, Any]:
    return {**dataset_keys(workload.dataset), **target_keys(workload.gpu)}


def add_workload_keys(out: dict[str, Any], workload: Workload | None) -> dict[str, Any]:
    """`out` (a run config's keys) with the target's and the data's keys: the data right after
    model_name_or_path, `use_cpu` after output_dir; the workload's data replaces any other data key."""
    if workload is None:
        return out
    keys = workload_keys(workload)
    data = {k: v for k, v in keys.items() if k in DATA_KEYS}
    rest = {k: v for k, v in out.items() if not (data and k in DATA_KEYS)}
    new: dict[str, Any] = {}
    if "model_name_or_path" in rest:
        new["model_name_or_path"] = rest.pop("model_name_or_path")
    new.update(data)
    for k, v in rest.items():
        if k in TARGET_KEYS:
            continue
        new[k] = v
        if k == "output_dir":
            new.update({t: keys[t] for t in TARGET_KEYS})
    for t in TARGET_KEYS:
        new.setdefault(t, keys[t])
    return new


def load_line(workload: Workload | None, dataset_name: str | None, example: str) -> str:
    """The snippet's `dataset = ...` right-hand side: what `trl` loads for the same data."""
    entry = None
    if workload is not None and not dataset_name and workload.dataset.source == "local":
        entry = dataset_entry(workload.dataset.name)
    if entry is not None:
        files = f", data_files={entry['data_files']!r}" if "data_files" in entry else ""
        return f"load_dataset({entry['path']!r}{files}, split=\"train\")"
    if dataset_name:
        return f"load_dataset({dataset_name!r}, split=\"train\")"
    return f'load_dataset("json", data_files="train.jsonl", split="train")  # {example}'


def dataset_of(entries: Any) -> str | None:
    """What `--dataset` takes for a `datasets:` value this module writes (one local entry, the train split, nothing
    selected or mixed), else None: a user's own mixture stays in the base as written."""
    if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], dict):
        return None
    e = dict(entries[0])
    if e.pop("split", "train") != "train" or set(e) - {"path", "data_files"}:
        return None
    path, files = e.get("path"), e.get("data_files")
    if not isinstance(path, str):
        return None
    if files is None:
        return path if Path(path).expanduser().is_dir() else None
    if not isinstance(files, str):
        return None
    if path == "arrow":
        where = Path(files).parent
        if where.name == "train" and (where.parent / "dataset_dict.json").is_file():
            where = where.parent
        return str(where)
    return files if path in set(BUILDERS.values()) else None


def carried_by_run_config(key: str, value: Any) -> bool:
    """A key the reader keeps out of the candidate's base: the target's, or the data this module writes."""
    return key in TARGET_KEYS or (key == "datasets" and dataset_of(value) is not None)
