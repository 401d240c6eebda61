"""A pool of warm worker processes that measure candidates in parallel.

    with open_pool("simulate", jobs=None) as pool:          # one worker per usable core
        futures = [pool.submit(workload, c) for c in candidates]
        for f in futures:
            m = f.result()                                   # a Measurement
            said = messages_of(f)                            # what libraries warned while it was measured

Which pool a backend gets:
- `simulate` (and any backend whose function a child can import by name, such as a module-level function a test
  registers) runs in `ProcessPool`: N processes forked from one forkserver that imported torch, transformers, trl
  and advisor.simulate once (a worker is ready in ~0.05 s and a crashed one is replaced as fast; spawn takes 4-5 s
  a worker: scripts/bench_frontdoor.py --sections starts). A workload is pickled once per fingerprint and sent
  once to each worker, which keeps it by `Workload.fingerprint()`; each candidate sends only the candidate.
- `estimate` (microseconds: a process round trip costs more than the estimate), `cpu` and `cuda` (a probe runs its
  own child already, and probes run side by side would distort each other: a cpu probe's measured step time and
  host memory are the measurement; there is one GPU), jobs 1, and any backend a child cannot import by name (a
  lambda or closure registered in-process with `register_backend`) run in `InProcessPool`, one at a time in the
  caller's thread.

What a worker's libraries say is collected per candidate exactly as in-process (advisor._messages.capture): the
counter comes back with the result, `messages_of(future)`. A worker never writes to the terminal: its stdout and
stderr (C level included) go to a log file of its own, whose tail names a crash. A worker that dies while
measuring (a segfault, kill -9, the OOM killer; a MemoryError retires the worker after its answer) answers that
candidate with a failed Measurement (Status.ERROR) and is replaced; the pool goes on. An exception the backend
raises is the future's exception, as in-process. `close()` (also on leaving the `with` block by an exception)
stops every worker, and the forkserver and resource tracker the pool started, so no process is left behind.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import importlib
import itertools
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .._messages import capture
from ..backends import source_of as declared
from ..errors import ConfigError, UsageError
from ..measurement import Measurement, Source, Status
from .backends import get_backend
from .forkserver import PRELOAD as _PRELOAD
from .forkserver import Server as _Server
from .pool_child import _worker_main

if TYPE_CHECKING:
    from ..space import Candidate
    from ..workload import Workload

PRELOAD = _PRELOAD  # what the forkserver imports (advisor/search/forkserver.py)
# Backends never run in worker processes (see the module's docstring for why).
SERIAL_BACKENDS = frozenset({"estimate", "cpu", "cuda"})
# Consecutive workers that die before they are ready, after which the pool stops replacing them.
_MAX_START_FAILURES = 2
_STOP_GRACE_S = 2.0
_TAIL_CHARS = 65536  # the end of a worker's log searched for its last words (faulthandler lists ~90 modules)

Messages = collections.Counter  # (origin, text) -> count, as advisor._messages.capture() collects


def default_jobs() -> int:
    """The cores this process may run on (its affinity mask, not the machine's core count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def check_jobs(jobs: int | None) -> int:
    """`jobs` as a number of workers: None is one per usable core; anything else must be a whole number >= 1."""
    if jobs is None:
        return default_jobs()
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(
            f"--jobs {jobs!r} (jobs=): the number of worker processes that measure candidates must be a whole "
            f"number, 1 or more; give --jobs 1 to measure in this process, or omit it for one per usable core "
            f"({default_jobs()} here)"
        )
    return jobs


class MeasureFuture(Future):
    """A Future of a Measurement with the library messages said while it was measured (`messages`)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: Messages = collections.Counter()


def messages_of(future: Future) -> Messages:
    """What libraries warned, logged or printed while the future's candidate was measured (empty if unknown)."""
    return getattr(future, "messages", None) or collections.Counter()


class Pool(Protocol):
    backend: str
    jobs: int

    def submit(self, workload: Workload, candidate: Candidate) -> Future: ...

    def close(self) -> None: ...

    def __enter__(self) -> Pool: ...

    def __exit__(self, *exc: object) -> None: ...


def open_pool(backend: str, jobs: int | None = None) -> Pool:
    """A pool measuring with the backend named `backend`: worker processes where that pays, else in-process."""
    n = check_jobs(jobs)
    get_backend(backend)  # an unknown name is a UsageError naming --backend, here as anywhere
    ref = child_reference(backend)
    if n == 1 or ref is None:
        return InProcessPool(backend)
    return ProcessPool(backend, ref, n)


@contextlib.contextmanager
def prestarted(backend: str, jobs: int | None = None) -> Iterator[None]:
    """While the block runs, the forkserver the pools of `backend` fork from is up and importing (a no-op where
    `open_pool` would measure in-process): a caller that still has to import torch and resolve its workload
    (the CLI's front door) overlaps the servers' imports and warm-up with its own. Stopped on leaving the block
    unless a pool opened inside it still uses it."""
    started = False
    log_dir: Path | None = None
    try:
        if check_jobs(jobs) > 1 and child_reference(backend) is not None:
            log_dir = Path(tempfile.mkdtemp(prefix="advisor-prestart-"))
            _Server.acquire(log_dir / "forkserver.log")
            started = True
    except Exception:  # noqa: BLE001 (only a head start: the pool starts its server itself when it needs one)
        started = False
    try:
        yield
    finally:
        if started:
            _Server.release()
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)


def child_reference(backend: str) -> str | None:
    """"module:qualname" of the backend's function when a child process can import it by that name and gets the
    same function (so a test that replaces `simulate` in-process is not silently measured by the real one);
    None for a backend not declared `parallel`, a serial one, a lambda, a closure, or a function of `__main__`."""
    if backend in SERIAL_BACKENDS or not get_backend(backend).parallel:
        return None  # declared cheap (or a probe): workers' start-up would cost more than they save
    fn = get_backend(backend).fn
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return None
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if obj is fn else None


def source_of(backend: str) -> Source:
    """The Source the registry declares for `backend` (an unregistered name is EXTERNAL, never an estimate)."""
    try:
        return declared(backend)
    except UsageError:
        return Source.EXTERNAL


# ---- in-process -------------------------------------------------------------------------------------------
class InProcessPool:
    """One candidate at a time in the caller's thread: `submit` measures and returns a finished future."""

    def __init__(self, backend: str):
        self.backend, self.jobs = backend, 1
        self._measure = get_backend(backend).measure
        self._closed = False

    def submit(self, workload: Workload, candidate: Candidate) -> MeasureFuture:
        if self._closed:
            raise RuntimeError("submit() on a closed pool")
        fut = MeasureFuture()
        fut.set_running_or_notify_cancel()
        with capture() as said:
            try:
                m = self._measure(workload, candidate)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:
                fut.messages.update(said)
                fut.set_exception(exc)
                return fut
        fut.messages.update(said)
        fut.set_result(m)
        return fut

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> InProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the forkserver, shared by the pools open at once -----------------------------------------------------
class RemoteError(Exception):
    """An exception a worker's backend raised that could not be sent back as itself."""


# ---- the process pool (the caller's side) -----------------------------------------------------------------
@dataclass
class _Task:
    id: int
    future: MeasureFuture
    fp: str
    candidate: Any
    started: bool = False  # its future is RUNNING (a task handed back after its worker vanished stays so)


@dataclass
class _Worker:
    index: int
    proc: Any
    conn: Any
    log: Path
    ready: bool = False
    task: _Task | None = None
    known: set[str] = field(default_factory=set)
    dead: bool = False
    retiring: bool = False  # it answered its last candidate and is leaving (after a MemoryError)


class ProcessPool:
    """N warm worker processes; a dispatcher thread hands each idle worker the next candidate."""

    def __init__(self, backend: str, ref: str, jobs: int):
        self.backend, self.jobs, self._ref = backend, jobs, ref
        self.remote = True  # measured in worker processes: each future carries its own messages
        self._dir = Path(tempfile.mkdtemp(prefix="advisor-pool-"))
        self._ctx: Any = None  # the forkserver and the workers start at the first submit: a search that stops
        self._thread: threading.Thread | None = None  # before measuring anything (bad input) starts no process
        self._threads = max(1, default_jobs() // jobs)
        self._lock = threading.Lock()
        self._queue: collections.deque[_Task] = collections.deque()
        self._blobs: dict[str, bytes] = {}
        self._workers: list[_Worker] = []
        self._ids = itertools.count()
        self._spawned = itertools.count()
        self._start_failures = 0
        self._broken: str | None = None
        self._closing = self._closed = False
        self.started = self.replaced = 0
        _OPEN.add(self)

    def _start(self) -> None:
        """The forkserver, the wake pipe and the dispatcher (which starts the workers); under self._lock."""
        self._ctx = _Server.acquire(self._dir / "forkserver.log")
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._dispatch, name=f"advisor-pool-{self.backend}", daemon=True)
        self._thread.start()

    # -- the caller's side ---------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Start the forkserver and the workers now, so that their imports and warm-up overlap what the caller
        does before its first submit (ranking the space with the estimate); a no-op once started or closed."""
        with self._lock:
            if self._thread is None and not self._closing:
                self._start()

    def submit(self, workload: Workload, candidate: Candidate) -> MeasureFuture:
        fp = workload.fingerprint()
        fut = MeasureFuture()
        with self._lock:
            if self._closing:
                raise RuntimeError("submit() on a closed pool")
            if self._thread is None:
                self._start()
            if fp not in self._blobs:
                self._blobs[fp] = pickle.dumps(workload, protocol=pickle.HIGHEST_PROTOCOL)
            if self._broken is not None:
                fut.set_running_or_notify_cancel()
                fut.set_result(self._failed(self._broken))
                return fut
            self._queue.append(_Task(next(self._ids), fut, fp, candidate))
        self._wake()
        return fut

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closing = self._closed = True
        if self._thread is None:  # never started: no process to stop
            shutil.rmtree(self._dir, ignore_errors=True)
            _OPEN.discard(self)
            return
        self._wake()
        if threading.current_thread() is not self._thread:  # close() from a future's callback: no self-join
            # Until the dispatcher has returned: a worker it is still starting (the forkserver's first start
            # preloads torch and simulates, tens of seconds on a loaded host) must be in the list stopped below,
            # else it keeps the forkserver's alive pipe open and stopping the forkserver waits for ever.
            self._thread.join(timeout=600.0)
        with self._lock:
            queued, self._queue = list(self._queue), collections.deque()
            workers = list(self._workers)
        for task in queued:
            if task.started:
                task.future.set_exception(CancelledError("the pool closed before this candidate was measured"))
            else:
                task.future.cancel()
        for w in workers:
            if w.task is not None and not w.task.future.done():
                w.task.future.set_exception(CancelledError("the pool closed while this candidate was measured"))
            if w.task is None and not w.dead:
                with contextlib.suppress(Exception):
                    w.conn.send(("stop",))
            else:
                with contextlib.suppress(Exception):
                    w.proc.terminate()
        deadline = time.monotonic() + _STOP_GRACE_S
        for w in workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
            if w.proc.exitcode is None:
                with contextlib.suppress(Exception):
                    w.proc.kill()
                w.proc.join(5.0)
            with contextlib.suppress(Exception):
                w.conn.close()
        for c in (self._wake_r, self._wake_w):
            with contextlib.suppress(Exception):
                c.close()
        _Server.release()
        shutil.rmtree(self._dir, ignore_errors=True)
        _OPEN.discard(self)

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pids(self) -> list[int]:
        """The live workers' process ids."""
        with self._lock:
            return [w.proc.pid for w in self._workers if not w.dead and w.proc.pid is not None]

    # -- the dispatcher thread -----------------------------------------------------------------------------
    def _wake(self) -> None:
        with contextlib.suppress(Exception):
            self._wake_w.send_bytes(b"")

    def _spawn(self) -> None:
        index = next(self._spawned)
        parent, child = self._ctx.Pipe(duplex=True)
        log = self._dir / f"worker-{index}.log"
        proc = self._ctx.Process(target=_worker_main, args=(child, str(log), self._ref, self._threads),
                                 name=f"advisor-pool-{self.backend}-{index}", daemon=True)
        proc.start()
        child.close()
        with self._lock:
            self._workers.append(_Worker(index, proc, parent, log))
        self.started += 1

    def _dispatch(self) -> None:
        try:
            for _ in range(self.jobs):
                if self._closing:
                    return
                self._spawn()
            while not self._closing:
                self._assign()
                with self._lock:
                    workers = [w for w in self._workers if not w.dead]
                handles: dict[Any, tuple[_Worker, str]] = {}
                for w in workers:
                    handles[w.conn] = (w, "conn")
                    handles[w.proc.sentinel] = (w, "exit")
                for ready in wait([self._wake_r, *handles]):
                    if ready is self._wake_r:
                        with contextlib.suppress(Exception):
                            while self._wake_r.poll():
                                self._wake_r.recv_bytes()
                        continue
                    w, what = handles[ready]
                    if w.dead:
                        continue
                    if what == "conn":
                        self._receive(w)
                    else:
                        self._drain(w)
                        if not w.dead:
                            self._died(w)
        except BaseException as exc:  # the dispatcher must never leave a caller waiting forever
            self._break(f"the pool's dispatcher failed: {type(exc).__name__}: {exc}")

    def _assign(self) -> None:
        while True:
            with self._lock:
                if self._closing or not self._queue:
                    return
                idle = next((w for w in self._workers if w.ready and w.task is None and not w.dead), None)
                if idle is None:
                    return
                task = self._queue.popleft()
                if not task.started:
                    if not task.future.set_running_or_notify_cancel():
                        continue  # the caller cancelled it
                    task.started = True
                idle.task = task
                blob = None if task.fp in idle.known else self._blobs[task.fp]
            try:
                if blob is not None:
                    idle.conn.send(("workload", task.fp, blob))
                    idle.known.add(task.fp)
                idle.conn.send(("measure", task.id, task.fp, task.candidate))
            except (OSError, EOFError, ValueError):  # it died between two candidates: this one goes to another
                with self._lock:
                    idle.task = None
                    self._queue.appendleft(task)
                self._drain(idle)
                if not idle.dead:
                    self._died(idle)

    def _receive(self, w: _Worker) -> bool:
        """Handle one message of `w`; False (and `w` handled as dead) when its pipe is closed."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            self._died(w)
            return False
        if msg[0] == "ready":
            w.ready = True
            self._start_failures = 0
            return True
        _, task_id, reply, said = msg
        task = w.task
        w.task = None
        if task is None or task.id != task_id:
            return True
        fut = task.future
        fut.messages.update(said)
        kind, payload = reply
        if kind == "result":
            fut.set_result(payload)
        elif kind == "memory":
            w.ready, w.retiring = False, True  # it leaves: nothing more is sent to it
            fut.set_result(self._failed(f"{payload} (the host ran out of memory measuring it in worker "
                                        f"{w.proc.pid}; the worker was replaced)"))
        elif isinstance(payload, BaseException):
            fut.set_exception(payload)
        else:
            fut.set_exception(RemoteError(f"{payload[0]}: {payload[1]}"))
        return True

    def _drain(self, w: _Worker) -> None:
        """Read what `w` sent before it exited (an answer may precede its death)."""
        with contextlib.suppress(Exception):
            while not w.dead and w.conn.poll():
                if not self._receive(w):
                    return

    def _died(self, w: _Worker) -> None:
        w.proc.join(1.0)
        code = w.proc.exitcode
        with self._lock:
            w.dead = True
            self._workers.remove(w)
            task, w.task = w.task, None
        with contextlib.suppress(Exception):
            w.conn.close()
        how = _exit_text(code)
        if task is not None:
            task.future.set_result(self._failed(
                f"the {self.backend} worker process (pid {w.proc.pid}) died measuring this candidate: {how}"
                f"{_tail(w.log)}; the worker was replaced"))
        if self._closing:
            return
        if not w.ready and not w.retiring:
            self._start_failures += 1
            if self._start_failures >= _MAX_START_FAILURES:
                self._break(f"the {self.backend} worker processes could not start ({how}){_tail(w.log)}")
                return
        self._spawn()
        self.replaced += 1

    def _break(self, why: str) -> None:
        """No more workers: every queued and later candidate fails with `why`."""
        with self._lock:
            self._broken = why
            queued, self._queue = list(self._queue), collections.deque()
        for task in queued:
            if task.started or task.future.set_running_or_notify_cancel():
                task.future.set_result(self._failed(why))

    def _failed(self, message: str) -> Measurement:
        return Measurement(Status.ERROR, source_of(self.backend), message=message)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "it stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if -code == signal.SIGKILL:
            return f"killed by {name} (kill -9, or the host's out-of-memory killer)"
        return f"killed by {name}"
    return f"exit code {code}"


def _tail(log: Path) -> str:
    try:
        with log.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _TAIL_CHARS))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("Extension modules:")]
    fatal = [i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error")]
    shown = lines[fatal[-1]:fatal[-1] + 5] if fatal else lines[-6:]  # faulthandler's report: the error, the frames
    return f"; its last output: {' | '.join(shown)}" if shown else ""


_OPEN: set[ProcessPool] = set()


@atexit.register
def _close_open_pools() -> None:
    for pool in list(_OPEN):
        with contextlib.suppress(Exception):
            pool.close()


