"""A probe of several ranks: the launch command, every process of the job, and one Measurement of N.

CUDA: `accelerate launch --config_file JOBDIR/accelerate.yaml --num_processes N` (the config advisor emits for the
candidate, advisor/accelerate_config.py), so accelerate's own FSDP2 / DDP runs. CPU: `accelerate launch --cpu`
starts one process unless mpirun is installed (accelerate/commands/launch.py: simple_launcher), so the ranks are
started by `torch.distributed.run` (the launcher accelerate's multi-GPU path calls) and run gloo.

torch.distributed.run starts every rank in a session of its own (elastic's SubprocessHandler: start_new_session),
so killing the launcher's process group does not reach them. Three things make sure nothing is left: each rank
dies with its launcher (PR_SET_PDEATHSIG), writes its pid first (JOBDIR/pid.R; the runner kills each rank's group),
and every process of the job carries ADVISOR_PROBE_JOB=JOBDIR in its environment, by which the runner finds and
kills whatever remains (`job_processes`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..measurement import Measurement, RankResult, Source, Status

if TYPE_CHECKING:
    from ..space import Candidate

MARK_ENV = "ADVISOR_PROBE_JOB"
ACCELERATE_FILE = "accelerate.yaml"
WORKER = ("-m", "advisor.probing.worker")


def launch_argv(jobdir: Path, backend: str, world: int, candidate: Candidate) -> list[str]:
    """The launcher's command line for `world` ranks of the worker on `jobdir` (CUDA: writes the accelerate config)."""
    worker = [*WORKER, str(jobdir)]
    if backend == "cuda":
        from ..accelerate_config import accelerate_config  # lazy: loads yaml

        launch = accelerate_config(candidate, candidate.parallelism.parallelism, world,
                                   config_file=ACCELERATE_FILE)
        (jobdir / ACCELERATE_FILE).write_text(launch.yaml)
        # port 0: accelerate picks a free one (accelerate/utils/launch.py), so probes side by side do not collide
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(jobdir / ACCELERATE_FILE),
                "--num_processes", str(world), "--num_machines", "1", "--main_process_port", "0", *worker]
    # --standalone: a rendezvous on a free local port
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
            "--max_restarts", "0", *worker]


def result_path(jobdir: Path, rank: int) -> Path:
    return jobdir / f"result.{rank}.json"


def read_results(jobdir: Path, world: int) -> dict[int, dict[str, Any]]:
    """The ranks' results written so far (a rank writes its file atomically, last)."""
    out = {}
    for r in range(world):
        path = result_path(jobdir, r)
        if path.is_file():
            try:
                out[r] = json.loads(path.read_text())
            except ValueError as exc:
                out[r] = {"status": "error", "message": f"rank {r}'s result file is unreadable ({exc})"}
    return out


def any_failed(jobdir: Path, world: int) -> bool:
    """True once a rank has reported a failure: the others would wait for it in a collective, so stop them."""
    return any(r.get("status") != "ok" for r in read_results(jobdir, world).values())


def rank_pids(jobdir: Path) -> list[int]:
    out = []
    for path in jobdir.glob("pid.*"):
        try:
            out.append(int(path.read_text()))
        except (OSError, ValueError):
            pass
    return out


def job_processes(marker: str) -> list[int]:
    """Every live process whose environment carries ADVISOR_PROBE_JOB=`marker` (Linux /proc; a zombie has none)."""
    mark = f"{MARK_ENV}={marker}".encode()
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = fh.read()
        except OSError:  # gone, or not ours
            continue
        if mark in env.split(b"\0"):
            out.append(int(name))
    return out


def kill_job(pgid: int, jobdir: Path, marker: str, wait_s: float = 5.0) -> tuple[int, ...]:
    """SIGKILL the launcher's group, every rank's group and whatever else carries the job's mark; returns what is
    still alive after `wait_s` (nothing, unless a process cannot be killed)."""
    targets = {pgid, *rank_pids(jobdir)}
    for p in targets:
        for kill in (os.killpg, os.kill):
            try:
                kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + wait_s
    left = job_processes(marker)
    while left:
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
        left = job_processes(marker)
    return tuple(left)


def merge(jobdir: Path, world: int, source: Source, *, timed_out: bool, timeout_s: float, wall_s: float,
          exit_message: str) -> Measurement:
    """One Measurement of the `world` ranks' results: the highest rank's peaks, the slowest rank's step time, the
    trained tokens of every rank; an OOM on any rank is the outcome (which rank in `ranks` and the message)."""
    results = read_results(jobdir, world)
    ranks = tuple(_rank(r, results.get(r)) for r in range(world))
    failed = [r for r in ranks if r.status is not Status.OK and results.get(r.rank) is not None]
    common = {"source": source, "wall_time_s": wall_s, "ranks": ranks}
    if timed_out:
        done = ", ".join(f"rank {r.rank} {r.status.value}" for r in ranks if r.rank in results) or "no rank finished"
        return Measurement(status=Status.TIMEOUT, message=f"no progress on any of the {world} ranks for "
                           f"{timeout_s:g} s (--timeout); every rank was killed ({done})", **common)
    for status in (Status.OOM, Status.ERROR):
        hit = [r for r in failed if r.status is status]
        if hit:
            which = ", ".join(str(r.rank) for r in hit)
            first = results[hit[0].rank]
            return Measurement(status=status, message=f"rank {which} of {world}: {first.get('message', '')}; the "
                               "other ranks were stopped", notes=tuple(first.get("notes") or ()), **common)
    if len(results) < world:
        missing = ", ".join(str(r.rank) for r in ranks if r.rank not in results)
        return Measurement(status=Status.ERROR, message=f"rank {missing} of {world} left no result: {exit_message}",
                           **common)
    top = max(ranks, key=lambda r: r.peak_bytes or 0)
    best = results[top.rank]
    times = [r.step_time_s for r in ranks if r.step_time_s]
    step = max(times) if len(times) == world else None
    trained = sum(r.trained_tokens_per_step or 0 for r in ranks)
    notes = [*(best.get("notes") or ()),
             "per rank: " + ", ".join(f"rank {r.rank} peak {r.peak_bytes} B, reserved {r.reserved_bytes} B, step "
                                      f"{_s(r.step_time_s)}" for r in ranks),
             f"{world} ranks: peaks the highest rank's (rank {top.rank}), step time the slowest rank's, trained "
             "tokens every rank's"]
    return Measurement(
        status=Status.OK, peak_bytes=top.peak_bytes, reserved_bytes=max(r.reserved_bytes or 0 for r in ranks),
        device_bytes=max(r.device_bytes or 0 for r in ranks), breakdown=dict(best.get("breakdown") or {}),
        step_time_s=step, tokens_per_second=trained / step if step else None, trained_tokens_per_step=trained,
        peak_batch=f"rank {top.rank}: {best.get('peak_batch')}", notes=tuple(notes), **common,
    )


def _s(t: float | None) -> str:
    return "-" if t is None else f"{t:.3f} s"


def _rank(rank: int, data: dict[str, Any] | None) -> RankResult:
    if data is None:
        return RankResult(rank=rank, status=Status.ERROR, message="no result (stopped, or killed with the job)")
    return RankResult(
        rank=rank, status=Status(data.get("status", "error")), peak_bytes=data.get("peak_bytes"),
        reserved_bytes=data.get("reserved_bytes"), device_bytes=data.get("device_bytes"),
        step_time_s=data.get("step_time_s"), trained_tokens_per_step=data.get("trained_tokens_per_step"),
        message=data.get("message", ""),
    )
