"""Where studies live: SQLite under the user's cache by default, any Optuna RDB URL, or a journal file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from .._versions import library_versions as _library_versions
from ..errors import UsageError

if TYPE_CHECKING:
    from optuna.storages import BaseStorage

_VERSIONED = ("advisor", "torch", "transformers", "trl", "peft", "accelerate", "optuna")


def cache_dir() -> Path:
    """$ADVISOR_CACHE_DIR, else $XDG_CACHE_HOME/advisor, else ~/.cache/advisor."""
    env = os.environ.get("ADVISOR_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "advisor"


def library_versions() -> dict[str, str]:
    return _library_versions(_VERSIONED)




def default_storage_url() -> str:
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{d / 'studies.sqlite3'}"


def open_storage(url: str | None) -> BaseStorage:
    """None -> in memory; 'scheme://...' -> RDB storage; anything else is a journal file path."""
    import optuna
    from optuna.storages import InMemoryStorage, JournalStorage, RDBStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if url is None:
        return InMemoryStorage()
    if "://" in url:
        try:
            kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
            return RDBStorage(url, engine_kwargs=kwargs)
        except Exception as exc:  # sqlalchemy raises many kinds for a bad URL or driver
            raise UsageError(f"--storage {url!r}: cannot open ({exc}); use sqlite:///FILE, postgresql://... "
                             "or a journal file path") from None
    path = Path(url).expanduser()
    fix = "choose a writable file path, e.g. ./advisor-journal.log, or an RDB URL such as sqlite:///studies.db"
    if not path.parent.exists():
        raise UsageError(f"--storage {url!r}: directory {path.parent} does not exist; create it or {fix}")
    if path.is_dir():
        raise UsageError(f"--storage {url!r}: is a directory; {fix}")
    try:
        return JournalStorage(JournalFileBackend(str(path)))
    except OSError as exc:  # /proc, a read-only mount, no permission
        raise UsageError(f"--storage {url!r}: cannot create or open the journal file "
                         f"({exc.strerror or exc}); {fix}") from None
