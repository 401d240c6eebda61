"""Writing a file the user asked for, atomically: a temporary file beside it, renamed over it once complete, so
that a failure (no space left, a file system that takes no new files) leaves the old file or none, never a
half-written or empty one for `trl sft --config` to read."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from .errors import ConfigError


def write_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file in the same directory and os.replace; the file gets the
    mode a plain open() would give it (an existing file keeps its own). Raises OSError; nothing is left behind."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            mode = path.stat().st_mode & 0o7777
        except OSError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def check_names(names: dict[str, object]) -> None:
    """Each flag's value (a path or a hub id) that the file system refuses to even look up (a name longer than it
    allows: OSError ENAMETOOLONG from every stat) is a UsageError naming the flag, before anything looks it up."""
    problems = []
    for flag, value in names.items():
        if not isinstance(value, (str, os.PathLike)):
            continue
        try:
            os.stat(os.path.expanduser(os.fspath(value)))
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:
                text = os.fspath(value)
                shown = text if len(text) <= 80 else f"{text[:40]}...{text[-20:]} ({len(text)} characters)"
                problems.append(f"{flag} {shown}: longer than the file system allows for a path ({exc.strerror}); "
                                "give a shorter path (a symbolic link or a relative path) or a hub id")
        except ValueError:  # an embedded NUL byte
            problems.append(f"{flag} {value!r}: not a path (it holds a NUL byte)")
    if problems:
        raise ConfigError(problems)


def cache_dir() -> Path:
    """$ADVISOR_CACHE_DIR, else $XDG_CACHE_HOME/advisor, else ~/.cache/advisor: where the search's studies and the
    host's measured cost per op (advisor/physics/timing/host.py) are kept."""
    env = os.environ.get("ADVISOR_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "advisor"
