"""Ctrl-C that is never lost. Python raises KeyboardInterrupt wherever the main thread is when SIGINT arrives; when
that is a weakref callback or a __del__ (SQLAlchemy's connection pool has many), the exception is printed as
"Exception ignored in ..." and dropped, and the search went on. The CLI's SIGINT handler (advisor.cli) also
records the request here; the search loop checks it at every trial (a safe point: the trials in flight are
failed for a rerun, the finished ones stay) and the CLI checks it when the command returns."""

from __future__ import annotations

import threading

_requested = threading.Event()


def request() -> None:
    _requested.set()


def requested() -> bool:
    return _requested.is_set()


def clear() -> None:
    _requested.clear()


def raise_if_requested() -> None:
    """At a safe point: a Ctrl-C that was swallowed where it landed ends the run here."""
    if _requested.is_set():
        raise KeyboardInterrupt
