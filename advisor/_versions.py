"""Installed versions of the libraries whose changes move a result: one list, for the study key and baselines."""

from __future__ import annotations

from collections.abc import Iterable
from importlib import metadata

# advisor itself (its models), the libraries that decide a run's memory and time, and the one that proposes
# candidates. A study is keyed by all of them; a baseline records all of them and names any that changed.
TRACKED = ("advisor", "torch", "transformers", "trl", "peft", "accelerate", "optuna")


def library_versions(names: Iterable[str] = TRACKED) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out
