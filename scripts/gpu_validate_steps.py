"""The steps of scripts/gpu_validate.py's plan: what each kind runs (the random model saved once, a case's probe
beside its simulation, several GPUs, the front door, the calibration, the GPU tests) and the simulations run ahead
of the probes in a process of their own. The driver (gpu_validate.py) orders them, caps them and writes their rows."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import gpu_validate_cases as cases
from gpu_validate_cases import ROOT, Kind, Step, StepTimeout, Target

GRACE_S = 15.0  # a stopped command's time to clean up (its probes' children) before its process group is killed
PROBE_STALL_S = 120.0  # the probe's own timeout: no heartbeat for this long
FRONT_DOOR_LAST_TRIAL_S = 45.0  # the search's --time-budget ends this much before the step's cap: one more trial
CALIBRATE_SCRIPT = ROOT / "scripts" / "gpu_calibrate.py"
# the calibration step's command: scripts/gpu_calibrate.py writes each row to --out as it finishes; the step's cap
# stops it (what it measured by then is kept)
CALIBRATE_ARGV = ("--out", "{out}")
PROBED = (Kind.SFT, Kind.ONLINE)


@dataclass
class Context:
    """What the steps share."""

    a: argparse.Namespace
    target: Target
    env: dict  # the versions and GPU every row records
    work: Path
    model_arg: str  # --model of the front door
    sims: Simulations
    steps: list[Step]
    started: float = field(default_factory=time.monotonic)
    weights: dict = field(default_factory=dict)


class Simulations:
    """The simulator's predictions for the probed cases: `ahead`, in a process of its own started before the
    probes (CUDA hidden from it, so it holds no device memory the probes' readings could count; on cores the
    probes do not use), each written to a file as it finishes; or `inline`, in this process before each probe."""

    def __init__(self, ctx_target: Target, steps: list[Step], work: Path, mode: str):
        self.mode, self.dir, self.proc, self.cores = mode, work / "simulations", None, None
        if mode != "ahead":
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        todo = [{"name": s.name, "kind": s.kind.value, "candidate": ctx_target.candidate(s.kind, s.knobs).to_dict()}
                for s in steps if s.kind in PROBED]
        plan = work / "simulations.json"
        plan.write_text(json.dumps({"target": ctx_target.to_dict(), "cases": todo}, default=str))
        usable = sorted(os.sched_getaffinity(0))
        split = len(usable) - max(1, len(usable) // 4)
        probe_cores, sim_cores = (usable[:split], usable[split:]) if split > 0 else (usable, usable)
        self.cores = usable
        pinned = _pin(0, probe_cores)  # this process and the probes it starts
        with open(work / "simulations.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, cases.__file__, str(plan), str(self.dir)], cwd=ROOT,
                env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": _pythonpath()},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        pinned = _pin(self.proc.pid, sim_cores) and pinned
        self.how = ("advisor.simulate in a separate process started before the probes (CUDA hidden from it), "
                    + (f"on cores {_span(sim_cores)} while the probes ran on cores {_span(probe_cores)}" if pinned
                       else "on the same cores as the probes (this machine refused CPU affinity)"))

    def describe(self) -> str:
        return self.how if self.mode == "ahead" else "advisor.simulate in the driver's process, before the probe"

    def poll(self) -> None:
        """Once the simulations are done, this process and its probes get every core back."""
        if self.proc is not None and self.proc.poll() is not None and self.cores:
            _pin(0, self.cores)
            self.cores = None

    def wait(self, name: str, until: float) -> dict | None:
        """The simulation of `name` once its file is there (None in inline mode); a timeout row past `until`."""
        if self.mode != "ahead":
            return None
        path = self.dir / f"{name}.json"
        while not path.exists():
            if time.monotonic() >= until or (self.proc.poll() is not None and not path.exists()):
                return {"status": "timeout" if self.proc.poll() is None else "error",
                        "message": "the simulation did not finish within the step's time"
                        if self.proc.poll() is None else "the simulations' process ended without this case"}
            time.sleep(0.1)
        return json.loads(path.read_text())

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _kill_group(self.proc.pid)
            self.proc.wait()
        self.poll()


def _pin(pid: int, cores: list[int]) -> bool:
    try:
        os.sched_setaffinity(pid, cores)
    except OSError:  # a sandbox that refuses it: the simulations share the cores
        return False
    return True


def _span(cores: list[int]) -> str:
    return f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else ",".join(map(str, cores))


def _pythonpath() -> str:
    extra = os.environ.get("PYTHONPATH")
    return str(ROOT) + (os.pathsep + extra if extra else "")


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---- the steps ---------------------------------------------------------------------------------------------------

def run_prepare(ctx: Context, step: Step, timeout_s: float) -> dict:
    """Import what the probes need and save the random model once per weights dtype."""
    import advisor.probing  # noqa: F401  (the import's time belongs here, not to the first case)

    if ctx.sims.mode == "inline":
        import advisor.simulator  # noqa: F401
    cands = [ctx.target.candidate(s.kind, s.knobs) for s in ctx.steps if s.kind in PROBED]
    ctx.weights = cases.save_random_models(ctx.target.spec, cands, ctx.work)
    size = sum(f.stat().st_size for d in ctx.weights.values() for f in Path(d).iterdir())
    return {"name": step.name, "status": "ok", "weights": ctx.weights, "saved_bytes": size,
            "how": "advisor.modeling.build_model (the probe child's own random model), saved once, cast per dtype"}


def run_case(ctx: Context, step: Step, timeout_s: float) -> dict:
    """One SFT or GRPO case: the probe and the simulation, side by side. The simulation comes from the process
    ahead (waited for until just before the cap) or runs here first (inline)."""
    a, target = ctx.a, ctx.target
    until = time.monotonic() + timeout_s - 1.0
    cand = target.candidate(step.kind, step.knobs)
    sim = None
    if ctx.sims.mode == "inline":
        try:
            sim = cases.simulate_case(target, step.kind, cand)
        except StepTimeout:
            return {"case": step.name, "status": "timeout", "simulate": {"status": "timeout"},
                    "probe": {"status": "not run", "message": "the step's time went to the simulation"}}
    weights = ctx.weights.get(cand.weights_dtype.value)
    try:
        probe = cases.probe_case(target, step.kind, cand, steps=a.steps, warmup=a.warmup,
                                 timeout_s=min(a.probe_stall, timeout_s), weights=weights)
    except StepTimeout as exc:
        probe = {"status": "timeout", "message": f"stopped at the step's cap of {timeout_s:.0f} s; the probe's "
                 "child process group was killed", **getattr(exc, "partial", {})}
        until = 0.0  # only a simulation already there
    if sim is None:
        sim = ctx.sims.wait(step.name, until)
    how = {"probe": f"advisor.probe, backend {target.backend}: a fresh child process, {a.warmup} warm-up + "
                    f"{a.steps} measured optimizer step(s) of TRL's own train() on the planned rows (the longest "
                    "first); cuda: peak = torch.cuda.max_memory_allocated, reserved = max_memory_reserved, device = "
                    "NVML's peak for the process (else the device's used memory less its baseline), over setup and "
                    "steps; cpu: the CPU allocator's events",
           "weights": "random, saved once by this script's prepare step and loaded by path" if weights
           else "random, saved by the probe's child",
           "simulate": ctx.sims.describe(), "ratios": "simulated / probed"}
    row = cases.case_row(step.name, step.kind, target, cand, probe, sim, steps=a.steps, warmup=a.warmup, how=how)
    row["status"] = probe.get("status", "error") if sim.get("status") == "ok" else f"simulate {sim.get('status')}"
    return row


def run_multi_gpu(ctx: Context, step: Step, timeout_s: float) -> dict:
    """MULTI_CASE on `step.world` ranks (FSDP2 through accelerate launch) next to the per-rank simulation."""
    from advisor.parallelism import Layout
    from advisor.probing import probe
    from advisor.simulator import simulate_per_rank

    n, target = step.world, ctx.target
    wl = target.workload(Kind.SFT, num_gpus=n)
    cand = target.candidate(Kind.SFT, step.knobs)
    sim = simulate_per_rank(wl, cand, n, Layout(cand.parallelism).parallelism, gpu=target.gpu)
    real = probe(wl, cand, target.backend, steps=ctx.a.steps, warmup=ctx.a.warmup,
                 timeout_s=min(ctx.a.probe_stall, timeout_s))
    tps = (round(sim.tokens_per_second / real.tokens_per_second, 4)
           if sim.tokens_per_second and real.tokens_per_second else None)
    return {"case": step.name, "status": real.status.value, "num_gpus": n, "batch_size": target.batch,
            "candidate": cand.to_dict(), "probe": cases.fields_of(real), "simulate": cases.fields_of(sim),
            "simulate_over_probe": {"peak_bytes_per_rank": [cases.ratio(sim.peak_bytes, r.peak_bytes)
                                                            for r in real.ranks],
                                    **{k: cases.ratio(getattr(sim, k), getattr(real, k))
                                       for k in ("peak_bytes", "reserved_bytes", "device_bytes")},
                                    "tokens_per_second": tps}}


def run_command(name: str, argv: list[str], timeout_s: float, work: Path, *, stop: int) -> dict:
    """Run `argv` in a session of its own; at `timeout_s` less GRACE_S send it `stop` (its own cleanup kills what it
    started), then kill its process group GRACE_S later. Its output goes to files under `work`."""
    out, err = work / f"{name}.out", work / f"{name}.err"
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                start_new_session=True)
    timed_out = False
    try:
        proc.wait(timeout=max(1.0, timeout_s - GRACE_S))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid, stop)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    finally:
        _kill_group(proc.pid)  # whatever happened, nothing it started survives
        proc.wait()
    stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    return {"name": name, "command": shlex.join(argv), "returncode": proc.returncode,
            "status": "timeout" if timed_out else "ok" if proc.returncode == 0 else "failed",
            "command_wall_s": round(time.monotonic() - start, 2), "stdout": stdout,
            "output_tail": cases.tail(stderr if stderr.strip() else stdout)}


def run_front_door(ctx: Context, step: Step, timeout_s: float) -> dict:
    """`advisor suggest --backend <backend> --trials 3` on the model, as a user runs it (no --gpu on cuda: the local
    GPU; the default workers); its search ends before the cap (--time-budget) to leave time for a last trial."""
    budget = max(10, int(timeout_s - GRACE_S - FRONT_DOOR_LAST_TRIAL_S))
    argv = [sys.executable, "-m", "advisor", "suggest", "--model", ctx.model_arg, "--backend", ctx.target.backend,
            "--trials", "3", "--format", "json", "--no-cache", "--time-budget", str(budget)]
    if ctx.target.backend == "cpu":
        argv += ["--gpu", "cpu"]
    row = run_command(step.name, argv, timeout_s, ctx.work, stop=signal.SIGTERM)
    row.update(front_door_summary(row.pop("stdout")))
    if row["status"] == "ok" and row.get("trial_statuses", {}).get("error"):
        row["status"] = "failed"  # a trial that errored is what this check is for
    return row


def front_door_summary(stdout: str) -> dict:
    """The pick and every trial's outcome from `suggest --format json`."""
    try:
        d = json.loads(stdout)
    except ValueError:
        return {"parsed": False}
    trials = [{"number": t.get("number"), "status": (t.get("measurement") or {}).get("status"), "why": t.get("why"),
               "message": ((t.get("measurement") or {}).get("message") or "")[:300],
               **{k: (t.get("measurement") or {}).get(k)
                  for k in ("peak_bytes", "device_bytes", "step_time_s", "wall_time_s")}}
              for t in d.get("trials", [])]
    return {"parsed": True, "pick": d.get("config"), "source": d.get("source"), "gpu": d.get("gpu"),
            "peak_bytes": d.get("peak_bytes"), "device_bytes": d.get("device_bytes"),
            "tokens_per_second": d.get("tokens_per_second"), "evaluations": d.get("evaluations"),
            "trial_statuses": dict(Counter(t["status"] for t in trials)), "trials": trials, "notes": d.get("notes")}


def gpu_test_files() -> list[str]:
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_*.py"))
            if "mark.gpu" in p.read_text(errors="replace")]


def run_pytest(ctx: Context, step: Step, timeout_s: float) -> dict:
    """`pytest -m gpu` on the test files that hold GPU tests (collecting only those); stopped with SIGINT (its
    fixtures and the probes' cleanup run) at the cap."""
    argv = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rfEs", *gpu_test_files()]
    row = run_command(step.name, argv, timeout_s, ctx.work, stop=signal.SIGINT)
    stdout = row.pop("stdout")
    summary = next((line.strip("= ") for line in reversed(stdout.splitlines())
                    if re.search(r"\d+ (passed|failed|skipped|error)", line)), "")
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    row.update(summary=summary, counts=counts, output_tail=cases.tail(stdout))
    if row["status"] == "ok" and ctx.target.backend == "cuda" and (counts.get("skipped") or not counts.get("passed")):
        row.update(status="failed", message="GPU tests skipped or none passed on a CUDA machine: pytest saw no CUDA")
    return row


def run_calibrate(ctx: Context, step: Step, timeout_s: float) -> dict:
    """scripts/gpu_calibrate.py with its own budget; the JSON it writes is embedded in the row."""
    out = ctx.work / "calibrate.json"
    args = [x.format(out=out) for x in CALIBRATE_ARGV] + (["--device", "cpu"] if ctx.target.backend == "cpu" else [])
    row = run_command(step.name, [sys.executable, str(CALIBRATE_SCRIPT), *args], timeout_s, ctx.work,
                      stop=signal.SIGTERM)
    row.pop("stdout")
    if out.is_file():
        row["result"] = json.loads(out.read_text())
    return row


RUNNERS = {Kind.PREPARE: run_prepare, Kind.SFT: run_case, Kind.ONLINE: run_case, Kind.MULTI_GPU: run_multi_gpu,
           Kind.FRONT_DOOR: run_front_door, Kind.PYTEST: run_pytest, Kind.CALIBRATE: run_calibrate}
IN_PROCESS = (Kind.PREPARE, Kind.SFT, Kind.ONLINE, Kind.MULTI_GPU)
