"""The parent side of a real probe: plan the batches, start the child, watch it, read its result.

The child (advisor.probing.worker) runs in a new session so that a timeout kills its whole process group
without touching the caller; it holds every device resource, so nothing survives it. Whatever the child
does (OOM, crash, hang, exception), `probe` returns a Measurement and leaves no process behind.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError, UsageError
from ..measurement import Measurement, Source, Status
from ..packages import install_hint, missing
from ..parallelism import Layout, layout_problems
from . import ranks
from .ranks import MARK_ENV, launch_argv, merge

# The real probes, each by its backend name (`advisor probe --backend`, `advisor.probe(backend=)`, the search's
# backends of the same names) and the Source its measurements carry.
PROBE_SOURCES: dict[str, Source] = {"cuda": Source.PROBE_CUDA, "cpu": Source.PROBE_CPU}
PROBE_BACKENDS = tuple(PROBE_SOURCES)

if TYPE_CHECKING:
    from ..space import Candidate
    from ..workload import Workload

# Test hook, read by the worker only: makes the child fail deterministically. Values: `kill` (SIGKILL itself in
# the first training step), `hang` (stop making progress in the first training step), `raise` (raise in the first
# training step), and `kill:start` / `hang:start` (the same before importing torch, for fast tests).
FAULT_ENV = "ADVISOR_PROBE_FAULT"
# Keep the job directory (job.json, the child's log, result.json) for debugging when set to 1.
KEEP_ENV = "ADVISOR_PROBE_KEEP"

JOB_FILE, RESULT_FILE, HEARTBEAT_FILE, LOG_FILE = "job.json", "result.json", "heartbeat", "child.log"
POLL_S = 0.05


class BatchKind(str, Enum):
    """Which rows a training step gets: the longest (worst case for memory) or a typical sample."""

    LONGEST = "longest"
    TYPICAL = "typical"


@dataclass(frozen=True)
class Timing:
    """How a probe times its steps once memory is measured (its `warmup + steps` steps, with the CPU's
    profiler): a second `train()` on the worst batch (the longest rows) again and again, without the profiler, the
    first step untimed (its shape's warm-up), then timed until the median of the last `window` steps moves less than
    `tolerance` from the median of the `window` before them, at most `max_steps` timed steps or `max_s` seconds.
    Several ranks are not timed so (their step time is the mean of the measured steps)."""

    window: int = 5
    tolerance: float = 0.05
    max_steps: int = 40
    max_s: float = 120.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BatchPlan:
    """The rows the child trains on, in order, and the kind of each optimizer step."""

    rows: tuple[dict[str, list[int]], ...]
    kinds: tuple[BatchKind, ...]
    rows_per_step: int


def plan_batches(workload: Workload, candidate: Candidate, steps: int, warmup: int) -> BatchPlan:
    """Worst case first: the first two optimizer steps (the first with optimizer state allocated, after one
    warm-up) get the longest rows, longest first; later steps get a seeded sample of the other rows.

    With packing TRL re-packs the rows, so enough rows to fill every step's packed batches are given. On several
    ranks a step takes a micro-batch per rank (the rows are the global step's; micro-batch k goes to rank k mod N,
    as accelerate deals them), so rank 0 gets the longest micro-batch.
    """
    total_steps = warmup + steps
    from ..trainers import trainer_of  # lazy: loads yaml

    kind = trainer_of(workload)
    # micro-batch rows per dataset row: online RL samples num_generations completions of each prompt
    per_row = kind.completions_per_row(candidate)
    rows_per_step = -(-candidate.per_device_train_batch_size * candidate.gradient_accumulation_steps
                      * workload.num_gpus // per_row)
    ds = workload.dataset
    if len(ds.rows) == 0:
        raise UsageError(f"dataset {ds.name}: no rows to probe with; give a --dataset with data")

    # only rows TRL keeps (e.g. not those a short max_length leaves fully masked): a dropped row would leave its
    # step short of the planned micro-batches, or with no step at all
    kept = np.asarray(kind.kept_rows(workload, candidate))
    if len(kept) == 0:
        raise UsageError(f"max_length={candidate.max_length}: every row of dataset {ds.name} has all its trained "
                         "tokens past it, and TRL drops fully masked rows, so nothing would train; raise max_length "
                         "(--max-length) or use a dataset whose completions start earlier")
    lengths = ds.lengths[kept]
    if candidate.packing and candidate.max_length:
        mean = max(1.0, float(np.minimum(lengths, candidate.max_length).mean()))
        rows_per_step *= max(1, math.ceil(candidate.max_length / mean))
    n_longest = min(2, total_steps)
    kinds = tuple([BatchKind.LONGEST] * n_longest + [BatchKind.TYPICAL] * (total_steps - n_longest))
    order = kept[np.argsort(-lengths, kind="stable")]
    longest_idx = order[:rows_per_step].tolist()
    rest = order[rows_per_step:]
    typical_pool = np.random.default_rng(0).permutation(rest).tolist() if len(rest) else list(longest_idx)
    rows: list[dict[str, list[int]]] = []
    for _ in range(n_longest):
        rows.extend(ds.rows[i] for i in _cycle(longest_idx, rows_per_step))
    typical_needed = rows_per_step * (total_steps - n_longest)
    rows.extend(ds.rows[i] for i in _cycle(typical_pool, typical_needed))
    return BatchPlan(rows=tuple(rows), kinds=kinds, rows_per_step=rows_per_step)


def _cycle(pool: list[int], n: int) -> list[int]:
    return [pool[i % len(pool)] for i in range(n)] if pool else []


def job_dict(
    workload: Workload, candidate: Candidate, backend: str, *, steps: int, warmup: int,
    memory_budget_bytes: int | None, weights: str | None, timing: Timing | None = None,
) -> dict[str, Any]:
    """Everything the child needs, as JSON: it rebuilds the workload from this, never from the parent's objects."""
    if workload.num_gpus > 1:
        timing = None
    plan = plan_batches(workload, candidate, steps, warmup)
    ds = workload.dataset
    from ..inputs import WorkloadRef, goals_to_dict  # lazy: loads yaml

    return {
        "backend": backend,
        "steps": steps,
        "warmup": warmup,
        "memory_budget_bytes": memory_budget_bytes,
        "weights": weights,
        "candidate": candidate.to_dict(),
        "model": _model_dict(workload.model),
        # the models beside the policy (a trainer's ModelInput: online RL's reward model), by role: resident; the
        # child loads one of each architecture
        "models": {role: _model_dict(spec) for role, spec in workload.models},
        "gpu": dataclasses.asdict(workload.gpu),
        "goals": goals_to_dict(workload.goals),
        # what names the workload (as a baseline or a study does); the child rebuilds from the values above
        "workload": WorkloadRef.of(workload).to_dict(),
        "trainer": workload.trainer,
        "dataset": {
            "name": ds.name,
            "source": ds.source,
            "completion_only_loss": ds.completion_only_loss,
            "dataset_name": ds.dataset_name,
            "rows": [dict(r) if isinstance(r, dict) else list(r) for r in plan.rows],  # prompts: token ids
        },
        "kinds": [k.value for k in plan.kinds],
        "timing": timing.to_dict() if timing is not None else None,
        "rows_per_step": plan.rows_per_step,
        "num_gpus": workload.num_gpus,
        "parallelism": candidate.parallelism.value,
    }


def _model_dict(spec: Any) -> dict[str, Any]:
    return {"name": spec.name, "config": dict(spec.config), "source": spec.source,
            "local_dir": str(spec.local_dir) if spec.local_dir else None}


def probe(
    workload: Workload,
    candidate: Candidate,
    backend: str = "cpu",
    *,
    steps: int = 3,
    warmup: int = 1,
    timeout_s: float = 300,
    memory_budget_bytes: int | None = None,
    weights: str | None = None,
    timing: Timing | None = Timing(),
) -> Measurement:
    """Measure `candidate` with `warmup` + `steps` real SFTTrainer steps in a child process: the peaks over those
    steps, then the step time in steady state (`timing`, Timing's docstring; None: the mean of the `steps` after the
    warm-up, as measured with the peaks).

    `memory_budget_bytes` is a hard cap (CUDA: the allocator's fraction less the CUDA context; CPU: RLIMIT_AS at
    the address space after loading, plus the budget less the weights loaded; lenient by the free heap already
    mapped then, so a candidate within ~10% over the budget can still pass on the CPU).

    `timeout_s` is the longest the child may go without progress
    (a heartbeat per step); then its process group is killed and the status is `timeout`.

    `workload.num_gpus` N > 1: N ranks on this machine (advisor/probing/ranks.py), the budget a cap on each; the
    Measurement has the highest rank's peaks, the slowest rank's step time, every rank's trained tokens, and `ranks`.
    """
    candidate = candidate.for_model(workload.model)  # transformers' attention, PEFT's targets, as the run resolves
    problems = []
    if backend not in PROBE_BACKENDS:
        problems.append(f"--backend {backend!r}: a real probe runs on {' or '.join(map(repr, PROBE_BACKENDS))}")
    if steps < 1:
        problems.append(f"--steps {steps}: at least 1 measured step")
    if warmup < 0:
        problems.append(f"warmup={warmup}: must be >= 0")
    if timeout_s <= 0:
        problems.append(f"--timeout {timeout_s}: must be a positive number of seconds")
    if memory_budget_bytes is not None and memory_budget_bytes <= 0:
        problems.append(f"--memory-budget {memory_budget_bytes}: must be positive, e.g. 40GB")
    world = workload.num_gpus
    if world > 1:  # several ranks: never one GPU measured silently for N
        problems.extend(_world_problems(workload, candidate, backend))
    if not problems:
        problems.extend(_device_problems(workload, candidate, backend, weights))
    if problems:
        raise ConfigError(problems, context="probe")
    source = PROBE_SOURCES[backend]
    job = job_dict(workload, candidate, backend, steps=steps, warmup=warmup,
                   memory_budget_bytes=memory_budget_bytes, weights=weights, timing=timing)
    from ..emit import env_vars  # lazy: loads yaml

    jobdir = Path(tempfile.mkdtemp(prefix="advisor-probe-"))
    try:
        (jobdir / JOB_FILE).write_text(json.dumps(job))
        argv = None
        if world > 1:
            argv = launch_argv(jobdir, backend, world, candidate)
        return run_child(jobdir, source, timeout_s=timeout_s, env=env_vars(candidate), argv=argv, world=world)
    finally:
        if os.environ.get(KEEP_ENV) != "1":
            shutil.rmtree(jobdir, ignore_errors=True)


@dataclass(frozen=True)
class ChildExit:
    """How the child ended: its exit status (negative: killed by that signal) and whether we killed it. Several
    ranks: the launcher's; `marker` is the job's mark in every process's environment (ranks.job_processes),
    `left` what was still alive after the job was killed (nothing), `rank_failed` whether a rank's failure
    stopped the others."""

    returncode: int
    timed_out: bool
    pgid: int
    wall_time_s: float
    marker: str = ""
    left: tuple[int, ...] = ()
    rank_failed: bool = False


def run_child(
    jobdir: Path, source: Source, *, timeout_s: float, env: dict[str, str] | None = None,
    on_start: Callable[[int], None] | None = None, argv: list[str] | None = None, world: int = 1,
) -> Measurement:
    """Start the worker on `jobdir` (`argv`: a launcher of `world` ranks instead), wait for it, and turn whatever it
    left into a Measurement."""
    exit_ = _spawn_and_wait(jobdir, timeout_s=timeout_s, env=env or {}, on_start=on_start, argv=argv, world=world)
    if world > 1:
        return merge(jobdir, world, source, timed_out=exit_.timed_out, timeout_s=timeout_s,
                     wall_s=round(exit_.wall_time_s, 3), exit_message=_exit_message(exit_.returncode)
                     + _log_hint(jobdir))
    return _collect(jobdir, source, exit_, timeout_s)


def _child_env(extra: dict[str, str], jobdir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    if jobdir is not None:
        env[MARK_ENV] = str(jobdir)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _spawn_and_wait(
    jobdir: Path, *, timeout_s: float, env: dict[str, str], on_start: Callable[[int], None] | None,
    argv: list[str] | None = None, world: int = 1,
) -> ChildExit:
    heartbeat = jobdir / HEARTBEAT_FILE
    start = time.monotonic()
    with open(jobdir / LOG_FILE, "wb") as log:
        proc = subprocess.Popen(
            argv or [sys.executable, "-m", "advisor.probing.worker", str(jobdir)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=_child_env(env, jobdir), start_new_session=True, cwd=jobdir,
        )
    pgid = proc.pid  # the leader of its new session and process group
    timed_out = rank_failed = False
    left: tuple[int, ...] = ()
    try:
        if on_start is not None:
            on_start(pgid)
        last_beat: float | None = None
        last_progress = time.monotonic()
        while True:
            # WNOWAIT: learn that the leader exited without reaping it, so its pgid can't be reused before the
            # rest of the group is killed below.
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                break
            try:
                beat = heartbeat.stat().st_mtime
            except FileNotFoundError:
                beat = last_beat
            if beat != last_beat:
                last_beat, last_progress = beat, time.monotonic()
            if time.monotonic() - last_progress > timeout_s:
                timed_out = True
                _kill_group(pgid)
                break
            if world > 1 and ranks.any_failed(jobdir, world):  # the others would wait for it in a collective
                rank_failed = True
                break
            time.sleep(POLL_S)
    finally:
        # Whatever happened (normal exit, timeout, an exception or Ctrl-C in the caller): nothing survives.
        if world > 1:
            left = ranks.kill_job(pgid, jobdir, str(jobdir))
        _kill_group(pgid)
        proc.wait()
    return ChildExit(returncode=proc.returncode, timed_out=timed_out, pgid=pgid,
                     wall_time_s=time.monotonic() - start, marker=str(jobdir), left=left, rank_failed=rank_failed)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """True while any process of the group `pgid` exists (zombies included)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _collect(jobdir: Path, source: Source, exit_: ChildExit, timeout_s: float) -> Measurement:
    wall = round(exit_.wall_time_s, 3)
    if exit_.timed_out:
        return Measurement(
            status=Status.TIMEOUT, source=source, wall_time_s=wall,
            message=f"no progress for {timeout_s:g} s (--timeout); the probe's process group was killed"
            + _log_hint(jobdir),
        )
    result_path = jobdir / RESULT_FILE
    if result_path.is_file():
        try:
            data = json.loads(result_path.read_text())
        except ValueError as exc:
            return Measurement(status=Status.ERROR, source=source, wall_time_s=wall,
                               message=f"the probe's result file is unreadable ({exc})")
        data["source"] = source.value
        data["wall_time_s"] = wall
        return Measurement.from_dict(data)
    message = _exit_message(exit_.returncode)
    return Measurement(status=Status.ERROR, source=source, wall_time_s=wall, message=message + _log_hint(jobdir))


def _exit_message(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        hint = " (the kernel's OOM killer sends SIGKILL when host memory runs out)" if -rc == signal.SIGKILL else ""
        return f"the probe's child process was killed by {name}{hint}"
    return f"the probe's child process exited with status {rc} without a result"


def _log_hint(jobdir: Path, lines: int = 8) -> str:
    try:
        text = (jobdir / LOG_FILE).read_text(errors="replace")
    except OSError:
        return ""
    tail = [line for line in text.splitlines() if line.strip() and not line.startswith("USDT:")][-lines:]
    return ("; last output:\n" + "\n".join(tail)) if tail else ""


def _world_problems(workload: Workload, candidate: Candidate, backend: str) -> list[str]:
    """What a probe of `workload.num_gpus` ranks on this machine cannot run, each naming the flag and the fix."""
    n, layout = workload.num_gpus, candidate.parallelism
    out = [p.replace("--fix parallelism", "--parallelism") for p in layout_problems(layout, n)]
    if workload.num_machines > 1:
        out.append(f"--num-machines {workload.num_machines}: a probe runs its ranks on this machine only; probe "
                   f"--num-gpus {n // workload.num_machines} --num-machines 1 (one machine's share), or predict the "
                   "whole run with `advisor simulate`")
    if backend == "cuda":
        import torch  # lazy: loads torch

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < n:
            out.append(f"--num-gpus {n}: {found} CUDA device(s) visible here, one per rank is needed; give "
                       f"--num-gpus {max(found, 1)}, or --backend cpu for a gloo run of {n} ranks on the host")
    elif layout.deepspeed or layout is Layout.FSDP2_OFFLOAD:
        out.append(f"--parallelism {layout.value}: the cpu backend runs ddp, fsdp2 and fsdp2_no_reshard over gloo "
                   "(DeepSpeed and CPU offload have no CPU run); use one of those, or --backend cuda")
    return out


def _device_problems(workload: Workload, candidate: Candidate, backend: str, weights: str | None) -> list[str]:
    """What would only fail inside the child: no CUDA for a cuda probe, a candidate the CPU can't run,
    real weights that are not there."""
    out = []
    if backend == "cuda":
        import torch  # lazy: loads torch

        if not torch.cuda.is_available():
            out.append("--backend cuda: no CUDA device is visible here; use --backend cpu, or run on a GPU machine")
    elif backend == "cpu":
        from ..profiles import resolve_gpu  # lazy: loads yaml

        out.extend(f"--backend cpu: {p}" for p in candidate.problems(resolve_gpu("cpu")))
    if weights is not None and not Path(weights).is_dir() and os.environ.get("HF_HUB_OFFLINE"):
        out.append(f"--weights {weights}: not a directory, and the hub is offline; give a local model directory")

    absent = missing(candidate.requirements())
    if absent:  # the run is here: it would stop at once with transformers' or TRL's ImportError
        out.append(f"--backend {backend}: the configuration needs {', '.join(absent)}, which is not installed here; "
                   f"{install_hint(absent)}, or change the configuration")
    return out
