"""Installed versions of the libraries whose changes move memory predictions."""

from __future__ import annotations

from collections.abc import Iterable
from importlib import metadata


def library_versions(names: Iterable[str]) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out
