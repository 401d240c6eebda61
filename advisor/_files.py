"""Writing a file the user asked for, atomically: a temporary file beside it, renamed over it once complete, so
that a failure (no space left, a file system that takes no new files) leaves the old file or none, never a
half-written or empty one for `trl sft --config` to read."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
