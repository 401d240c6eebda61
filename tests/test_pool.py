"""The pool of warm simulate workers (advisor/search/pool.py): the same Measurements and library messages as
in-process, a crash is one failed candidate, nothing is left running after close(), and --jobs is checked."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import pytest

from advisor.backends import register_backend, unregister_backend
from advisor.errors import ConfigError
from advisor.measurement import Status
from advisor.search import (
    InProcessPool,
    ProcessPool,
    check_jobs,
    default_jobs,
    messages_of,
    open_pool,
)
from advisor.space import Candidate

BASE = dict(max_length=128, precision="fp32", optim="adamw_torch")
# TRL warns "... per_device_train_batch_size of 1 with padding-free training ..." once per trainer it builds.
NOISY = Candidate(**{**BASE, "per_device_train_batch_size": 1, "padding_free": True, "packing": False,
                     "max_length": None})


def _descendants(pid: int) -> set[int]:
    """Every live (non-zombie) process below `pid`, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _gone(pids, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


def _same(a, b) -> bool:
    return dataclasses.replace(a, wall_time_s=None) == dataclasses.replace(b, wall_time_s=None)


# Backends a worker imports by name (module-level functions of this module). What they do depends on the
# candidate's micro-batch, so one space holds well-behaved and misbehaving candidates.
def misbehaving(workload, candidate):
    from advisor.simulator import simulate

    b = candidate.per_device_train_batch_size
    if b == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    if b == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    if b == 6:
        raise MemoryError("pretend the host ran out")
    if b == 7:
        raise ValueError("a bad candidate, as the backend says")
    return simulate(workload, candidate)


def forks_after_a_simulation(workload, candidate):
    """Simulates (autograd on fake tensors, as every worker does), then forks a child that runs a real backward and
    says how it went, with the GPUs this worker sees: a worker whose forkserver started autograd's device threads
    fails the child ("Unable to handle autograd's threading in combination with fork-based multiprocessing")."""
    import dataclasses

    import torch

    from advisor.simulator import simulate

    m = simulate(workload, candidate)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            x = torch.ones(2, requires_grad=True)
            (x * 3).sum().backward()
            os.write(write, b"ok")
        except BaseException as exc:  # noqa: BLE001
            os.write(write, f"{type(exc).__name__}: {exc}".encode()[:4000])
        os._exit(0)
    os.close(write)
    said = os.read(read, 4096).decode()
    os.waitpid(pid, 0)
    return dataclasses.replace(m, message=f"{said}|{os.environ.get('CUDA_VISIBLE_DEVICES')!r}")


def loud(workload, candidate):
    """Says things every way a library can: a warning, a log record, a print, and C-level writes to fds 1, 2."""
    import logging

    warnings.warn("a warning from the worker", UserWarning, stacklevel=1)
    logging.getLogger("trl.trainer").warning("a log record from the worker")
    print("a print from the worker")
    os.write(1, b"C-level stdout from the worker\n")
    os.write(2, b"C-level stderr from the worker\n")
    from advisor.estimator import estimate

    return estimate(workload, candidate)


@pytest.fixture
def backend():
    names = []

    def register(name, fn):
        register_backend(name, fn, parallel=True)
        names.append(name)
        return name

    yield register
    for name in names:
        unregister_backend(name)


@pytest.mark.slow
def test_pool_measures_what_simulate_measures_in_process_with_the_same_messages(tiny_workload):
    cands = [Candidate(**{**BASE, "per_device_train_batch_size": b}) for b in (2, 4)] + [NOISY]
    before = _descendants(os.getpid())
    with open_pool("simulate", jobs=2) as pool:
        assert isinstance(pool, ProcessPool) and pool.jobs == 2
        futures = [pool.submit(tiny_workload, c) for c in cands]
        pooled = [f.result(timeout=300) for f in futures]
        pids = pool.pids()
    assert len(pids) == 2 and not set(pids) & before
    serial = InProcessPool("simulate")
    local = [serial.submit(tiny_workload, c) for c in cands]
    for p, f in zip(pooled, local, strict=True):
        assert p.ok and p.peak_bytes > 0
        assert _same(p, f.result()), "the pool's Measurement is the in-process one, field for field"
    assert len({p.peak_bytes for p in pooled}) == 3
    said = [messages_of(f) for f in futures]
    assert said == [messages_of(f) for f in local], "the same library messages, with the same counts"
    assert any("padding-free" in text for (_, text) in said[2]), said[2]


@pytest.mark.slow
def test_a_worker_sees_no_gpu_and_its_forks_run_autograd(tiny_workload, backend):
    """The workers simulate on fake tensors: their forkserver hides the GPUs and initialises autograd's engine with
    no device, so that neither it nor a worker started autograd's device threads before a fork. With a CUDA build of
    torch (CI runs this module with one too) every simulation in the workers failed before: the engine counted the
    GPUs, or the no-op CUDA guard FakeTensorMode installs on a machine without one."""
    name = backend("pool-forks", forks_after_a_simulation)
    with open_pool(name, jobs=2) as pool:
        m = pool.submit(tiny_workload, Candidate(**{**BASE, "per_device_train_batch_size": 2})).result(timeout=300)
    assert m.ok and m.peak_bytes > 0
    assert m.message == "ok|''", m.message


@pytest.mark.slow
def test_a_crash_is_one_failed_candidate_and_the_others_finish(tiny_workload, backend):
    name = backend("pool-misbehaving", misbehaving)
    cands = {b: Candidate(**{**BASE, "per_device_train_batch_size": b}) for b in (1, 2, 3, 4, 5, 6, 7)}
    with open_pool(name, jobs=2) as pool:
        assert isinstance(pool, ProcessPool)
        futures = {b: pool.submit(tiny_workload, c) for b, c in cands.items()}
        for b in (1, 2, 4):
            assert futures[b].result(timeout=300).ok
        segv, killed, memory = (futures[b].result(timeout=300) for b in (3, 5, 6))
        assert segv.status is Status.ERROR and "SIGSEGV" in segv.message and "replaced" in segv.message
        assert "Fatal Python error" in segv.message, "the worker's log tail (faulthandler's report) is named"
        assert killed.status is Status.ERROR and "SIGKILL" in killed.message
        assert memory.status is Status.ERROR and "MemoryError" in memory.message
        with pytest.raises(ValueError, match="a bad candidate"):
            futures[7].result(timeout=300)  # an exception the backend raises is the future's, as in-process
        assert pool.replaced == 3 and len(pool.pids()) == 2
        again = pool.submit(tiny_workload, cands[2]).result(timeout=300)
        assert _same(again, futures[2].result()), "the replaced workers measure as before"


@pytest.mark.slow
def test_close_leaves_no_process_behind_even_after_an_exception_in_the_caller(tiny_workload):
    mine = os.getpid()
    before = _descendants(mine)
    with open_pool("simulate", jobs=2) as pool:
        pool.submit(tiny_workload, Candidate(**BASE)).result(timeout=300)
        pids = pool.pids()
    assert _gone(pids) and _descendants(mine) <= before, "workers, forkserver and resource tracker are gone"

    with pytest.raises(RuntimeError, match="the caller failed"):
        with open_pool("simulate", jobs=2) as pool:
            busy = [pool.submit(tiny_workload, Candidate(**{**BASE, "per_device_train_batch_size": b}))
                    for b in (1, 2, 4, 8)]
            busy[0].result(timeout=300)
            pids = pool.pids()
            raise RuntimeError("the caller failed while candidates were being measured")
    assert _gone(pids) and _descendants(mine) <= before
    assert all(f.done() for f in busy), "no future is left waiting: measured, or cancelled by close()"


@pytest.mark.slow
def test_workers_never_write_to_the_terminal_and_their_messages_come_back(tiny_workload, backend, capfd):
    name = backend("pool-loud", loud)
    with open_pool(name, jobs=2) as pool:
        fut = pool.submit(tiny_workload, Candidate(**BASE))
        assert fut.result(timeout=300).ok
    out, err = capfd.readouterr()
    assert "worker" not in out + err, f"a worker wrote to the terminal: {out!r} {err!r}"
    said = {(origin, text) for (origin, text) in messages_of(fut)}
    assert said >= {("UserWarning", "a warning from the worker"), ("trl.trainer", "a log record from the worker"),
                    ("stdout", "a print from the worker")}


def test_which_backends_run_in_worker_processes(backend):
    assert isinstance(open_pool("simulate", jobs=1), InProcessPool)
    assert isinstance(open_pool("estimate", jobs=4), InProcessPool), "microseconds: no process round trip"
    assert isinstance(open_pool("cpu", jobs=4), InProcessPool), "a probe runs its own child, one at a time"
    lam = backend("pool-lambda", lambda w, c: None)
    assert isinstance(open_pool(lam, jobs=4), InProcessPool), "a lambda cannot be imported by a child"
    from advisor.backends import get_backend

    real = get_backend("simulate")
    # a test's stand-in for simulate (even one declared parallel) must not be replaced by the real one in a worker
    register_backend("simulate", lambda w, c: None, parallel=True)
    try:
        assert isinstance(open_pool("simulate", jobs=4), InProcessPool)
    finally:  # the built-in back as it was declared (its Source, its parallel flag), not a re-registration
        register_backend("simulate", real.fn, real.cost, source=real.source, needs_gpu=real.needs_gpu,
                         deterministic=real.deterministic, parallel=real.parallel)
    assert get_backend("simulate") == real
    register_backend("pool-serial", loud)  # importable by a child, but not declared parallel: measured here
    try:
        assert isinstance(open_pool("pool-serial", jobs=4), InProcessPool)
    finally:
        unregister_backend("pool-serial")


def test_jobs_is_checked_and_defaults_to_the_usable_cores():
    assert default_jobs() == len(os.sched_getaffinity(0))
    assert check_jobs(None) == default_jobs() and check_jobs(3) == 3
    for bad in (0, -2, True, 1.5, "2"):
        with pytest.raises(ConfigError, match=r"--jobs .*jobs=.*1 or more"):
            check_jobs(bad)
        with pytest.raises(ConfigError, match="--jobs"):
            open_pool("simulate", jobs=bad)


def test_cli_checks_jobs_before_any_work_and_passes_it_on(monkeypatch, capsys, tmp_path):
    from advisor import search
    from advisor.cli import main

    assert main(["suggest", "--model", "Qwen/Qwen2.5-0.5B", "--jobs", "0"]) == 2
    assert "--jobs 0" in capsys.readouterr().err
    assert main(["worker", "--storage", str(tmp_path / "j.log"), "--study", "s", "--jobs", "-1"]) == 2
    assert "--jobs -1" in capsys.readouterr().err
    assert main(["suggest", "--model", "Qwen/Qwen2.5-0.5B", "--jobs", "two"]) == 2
    assert "--jobs" in capsys.readouterr().err

    seen = {}

    def fake_worker(storage, study, **kwargs):
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(search, "run_worker", fake_worker)
    assert main(["worker", "--storage", str(tmp_path / "j.log"), "--study", "s", "--jobs", "3"]) == 0
    assert seen["jobs"] == 3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
