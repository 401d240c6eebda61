"""The forkserver the open ProcessPools fork their workers from (multiprocessing's, with the pool's preload), and
its log: started by the first pool (or `prestarted`), stopped when the last one closes, if this process started it."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .pool_child import _WARM_ENV, HIDE_GPUS

# What every worker needs imported: the forkserver imports it once, every worker is a fork of that. The last one
# (pool_child.py, with _WARM_ENV set in the forkserver's environment only) also simulates two tiny candidates
# there: a first simulation imports and initialises about 2,000 more modules (TRL's trainer, accelerate,
# datasets, sympy for the fake tensors' shapes, peft; ~6 s here), which every fork then starts with.
PRELOAD = ("torch", "transformers", "trl", "advisor.simulator", "advisor.search.pool_child")


class Server:
    """The forkserver (and multiprocessing's resource tracker) the open ProcessPools fork from. Started with the
    preload by the first pool, with its stdout/stderr on a log file; stopped when the last pool closes, if this
    module started it."""

    lock = threading.Lock()
    users = 0
    own_server = own_tracker = False

    @classmethod
    def acquire(cls, log: Path) -> Any:
        import multiprocessing as mp  # lazy: only when a pool starts
        from multiprocessing import forkserver, resource_tracker  # lazy: only when a pool starts

        ctx = mp.get_context("forkserver")
        with cls.lock:
            if cls.users == 0:
                fs, rt = forkserver._forkserver, resource_tracker._resource_tracker
                server_up = fs._forkserver_pid is not None and running(fs._forkserver_pid)
                tracker_up = rt._fd is not None
                if not server_up:
                    ctx.set_forkserver_preload(list(PRELOAD))
                # What the server (and the tracker) say goes to the log; the variables reach only the server,
                # which imports the preload from this process's sys.path (a script may have extended it) and
                # sees no GPU (HIDE_GPUS: why, in pool_child.py).
                path = os.pathsep.join(p for p in sys.path if p)
                with fds_to(log), _env(_WARM_ENV, "1"), _env("PYTHONPATH", path), _hidden_gpus():
                    forkserver.ensure_running()
                cls.own_server, cls.own_tracker = not server_up, not tracker_up
            cls.users += 1
        return ctx

    @classmethod
    def release(cls) -> None:
        from multiprocessing import forkserver, resource_tracker  # lazy: only when a pool starts

        with cls.lock:
            cls.users -= 1
            if cls.users > 0:
                return
            if cls.own_server:
                # SIGTERM first: the server holds nothing to save, and its graceful exit (Python's finalisation
                # of torch, transformers and TRL) took ~2 s of every front door's exit
                pid = forkserver._forkserver._forkserver_pid
                if pid is not None and running(pid):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGTERM)
                with contextlib.suppress(Exception):
                    forkserver._forkserver._stop()
            if cls.own_tracker:
                with contextlib.suppress(Exception):
                    resource_tracker._resource_tracker._stop()
            cls.own_server = cls.own_tracker = False


@contextlib.contextmanager
def _hidden_gpus() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for name in HIDE_GPUS:
            stack.enter_context(_env(name, ""))
        yield


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def running(pid: int) -> bool:
    """True while `pid` runs (not a zombie); never reaps it (multiprocessing's own waitpid must find it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


@contextlib.contextmanager
def fds_to(path: Path) -> Iterator[None]:
    """Point this process's fds 1 and 2 at `path` for the block (children started in it inherit that)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


