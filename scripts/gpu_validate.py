"""Validate the simulator on a CUDA machine within one GPU lease: real probes next to the simulator's predictions,
the front door on the cuda backend, then the GPU tests, in 5 minutes by default after the install.

Run by scripts/gpu_validate.sh, which installs what the machine's image lacks from a wheel folder first (its header
has the exact command line for a lent device machine). The plan, in order of value (the most valuable lands first):

  prepare        imports; the random model saved once per weights dtype (every case's probe loads it by path)
  lora-ckpt      SFT: LoRA on bf16 weights, checkpointed
  full-ckpt      SFT: full fine-tuning, checkpointed
  grpo-generate  GRPO: transformers' generate inside the step (4 completions of 128 tokens)
  front-door     advisor suggest --backend cuda --trials 3, as a user runs it (the local GPU, default workers)
  full-no-ckpt   SFT: full fine-tuning, no checkpointing
  packing-bfd    SFT: bfd packing (padding-free in TRL 1.16)
  calibrate      scripts/gpu_calibrate.py, where it exists (its own planned time and cap; see CALIBRATE_ARGV)
  pytest-gpu     pytest -m gpu on the test files holding GPU tests (reserved: its planned time is held for it)

The cases: the Qwen2.5-0.5B shape (profiles/models/), batch 4 x 1024 (GRPO: 4 completions a micro-batch), bf16
autocast, sdpa, AdamW. Each row holds the probe's peak / reserved / device bytes and step time beside the
simulator's, their ratios (simulated / probed), how each was obtained, the versions, the GPU and the date.

Each step has a planned time and a cap. The whole run has a budget (--budget, 300 s): a step runs for at most its
cap or what is left of the budget less the planned time held for the reserved steps after it, whichever is less, and
is skipped when that is under half its planned time; a plan whose planned times exceed the budget drops its least
valuable steps first. The planned times are estimates (CATALOGUE) until a GPU run measures them. Each row is
written to the JSON (atomically: a temporary file renamed over it) as soon as its step ends, so a run killed at any
point keeps every row it finished. `--dry-run` prints the plan.

Where a case's time went (measured on the CPU, not yet on a GPU): each probe is a fresh child process (isolation the
memory readings need: a fresh allocator and CUDA context per case), which imports torch / transformers / trl, then
used to build and save its own random 0.5B model (2 GB of fp32 weights: 24 s on a loaded 2-core CPU, about 45 s of a
64 s child setup), loads it, builds the trainer and trains. Now the model is saved once and loaded by path (that
child's setup: 18 s on the same CPU), the probe trains 1 warm-up + 1 measured step, both on the longest rows (the
peak needs the second step, with the optimizer state resident; the second step repeats the first's shapes, so its
time is not a first-shape cost), and the simulations (the GRPO one ~40-60 s on that CPU) run ahead in a process of
their own on cores the probes do not use, while the probes run (--simulate inline: in this process before each
probe). Every row records its wall time, the probe's setup and per-step times, and the simulation's wall time.

  python scripts/gpu_validate.py --dry-run                       # the plan: each step's planned time, cap, total
  python scripts/gpu_validate.py --out $OUT/h200.json            # the run (the local GPU, detected through NVML)
  python scripts/gpu_validate.py --backend cpu --tiny --only lora-ckpt full-ckpt   # the same code on the CPU
  python scripts/gpu_validate.py --dry-run --plan-from profiles/measurements/h200.json   # planned = measured walls
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_validate_cases as cases  # noqa: E402  (beside this script)
from gpu_validate_cases import (  # noqa: E402,F401  (re-exported: tests and bench_time_model read them here)
    FIT_GROUPS,
    MATRIX,
    ONLINE_MATRIX,
    ROOT,
    Kind,
    Step,
    StepTimeout,
    Target,
    fit_time_constants,
)
from gpu_validate_steps import (  # noqa: E402
    CALIBRATE_SCRIPT,
    GRACE_S,
    IN_PROCESS,
    PROBE_STALL_S,
    PROBED,
    RUNNERS,
    Context,
    Simulations,
)

SCHEMA_VERSION = 2
BUDGET_S = 300.0



# In order of value. Planned times are estimates for one H200 (16 cores), unverified: a case's probe child ~8 s of
# setup (imports, CUDA context, loading 2 GB) + 2 steps of ~1-5 s (the first of a shape is the slowest; issue 30 saw
# 4.7 and 3.1 s first steps), the simulations hidden behind the probes; GRPO generates 128 tokens a step, eagerly;
# the front door's 3 cuda trials each save their own random model and run 4 steps.
CATALOGUE: tuple[Step, ...] = (
    Step("prepare", Kind.PREPARE, 15, 90),
    Step("lora-ckpt", Kind.SFT, 20, 60, knobs=MATRIX["lora-ckpt"]),
    Step("full-ckpt", Kind.SFT, 20, 60, knobs=MATRIX["full-ckpt"]),
    Step("grpo-generate", Kind.ONLINE, 30, 90, knobs=ONLINE_MATRIX["grpo-generate"]),
    # the step-time model's constants on this GPU (host cost per op under CUDA, GEMM rates, bandwidth, one decode
    # loop): what the speed predictions most lack (docs/benchmarks.md), so before the front door
    Step("calibrate", Kind.CALIBRATE, 40, 90),
    Step("front-door", Kind.FRONT_DOOR, 90, 150),
    Step("full-no-ckpt", Kind.SFT, 20, 60, knobs=MATRIX["full-no-ckpt"]),
    Step("packing-bfd", Kind.SFT, 20, 60, knobs=MATRIX["packing-bfd"]),
    Step("grpo-vllm-colocate", Kind.ONLINE, 60, 120, knobs=ONLINE_MATRIX["grpo-vllm-colocate"]),
    Step("grpo-vllm-colocate-sleep", Kind.ONLINE, 60, 120, knobs=ONLINE_MATRIX["grpo-vllm-colocate-sleep"]),
    # on request (--only): the same step as packing-bfd, FlashAttention (needs the kernels package)
    *(Step(n, Kind.SFT, 20, 60, knobs=MATRIX[n]) for n in MATRIX if n.startswith(("padding-free", "flash-"))),
    Step("pytest-gpu", Kind.PYTEST, 80, 120, reserved=True),
)
DEFAULT = ("prepare", "lora-ckpt", "full-ckpt", "grpo-generate", "calibrate", "front-door", "full-no-ckpt",
           "packing-bfd", "grpo-vllm-colocate", "grpo-vllm-colocate-sleep", "pytest-gpu")
SECTIONS = {Kind.SFT: "rows", Kind.ONLINE: "online_rows", Kind.MULTI_GPU: "multi_gpu_rows"}  # else "checks"


# ---- the plan ----------------------------------------------------------------------------------------------------

def select(names: list[str] | None, skip: list[str], multi_gpu: list[int], *, vllm: bool,
           calibrate: bool) -> tuple[list[Step], list[tuple[str, str]]]:
    """The steps to run, in order of value, and those left out with why. `names`: --only (None: DEFAULT)."""
    catalogue = list(CATALOGUE)
    at = next(i for i, s in enumerate(catalogue) if s.kind is Kind.PYTEST)
    catalogue[at:at] = [Step(f"fsdp2-{n}gpu", Kind.MULTI_GPU, 60, 120, knobs=cases.MULTI_CASE, world=n)
                        for n in multi_gpu]
    wanted = set(names) if names is not None else {*DEFAULT, *(s.name for s in catalogue if s.world > 1)}
    if any(s.kind in PROBED and s.name in wanted for s in catalogue):
        wanted.add("prepare")  # the probed cases load the model it saves
    wanted -= set(skip)
    steps, left_out = [], []
    for s in catalogue:
        if s.name not in wanted:
            continue
        if s.kind is Kind.CALIBRATE and not calibrate:
            left_out.append((s.name, f"{CALIBRATE_SCRIPT.relative_to(ROOT)} not found"))
        elif s.knobs.get("use_vllm") and not vllm:
            left_out.append((s.name, "vllm does not import here (or the backend is not cuda)"))
        else:
            steps.append(s)
    return steps, left_out


def fit_budget(steps: list[Step], budget_s: float) -> tuple[list[Step], list[tuple[str, str]]]:
    """Drop the least valuable unreserved steps until the planned times fit the budget."""
    kept, dropped = list(steps), []
    while sum(s.planned_s for s in kept) > budget_s:
        victims = [s for s in kept if not s.reserved and s.kind is not Kind.PREPARE]
        if not victims:
            break
        kept.remove(victims[-1])
        dropped.append((victims[-1].name, f"over the {budget_s:g} s budget (planned {victims[-1].planned_s:g} s)"))
    if not any(s.kind in PROBED for s in kept):  # nothing to prepare for
        kept = [s for s in kept if s.kind is not Kind.PREPARE]
    return kept, dropped


def planned_from(path: str) -> dict[str, float]:
    """Each step's measured wall time in an earlier run's JSON (its "plan"), for --plan-from."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--plan-from {path}: cannot read it as an earlier run's JSON ({exc})") from exc
    return {p["name"]: float(p["wall_s"]) for p in doc.get("plan", []) if p.get("status") == "ok" and p.get("wall_s")}


def print_plan(steps: list[Step], left_out: list[tuple[str, str]], budget_s: float) -> None:
    print(f"plan (budget {budget_s:g} s, installs excluded; planned times are estimates until measured):")
    print(f"  {'#':>2}  {'step':<26}{'kind':<12}{'planned':>9}{'cap':>7}{'by then':>9}  reserved")
    total = 0.0
    for i, s in enumerate(steps, 1):
        total += s.planned_s
        print(f"  {i:>2}  {s.name:<26}{s.kind.value:<12}{s.planned_s:>8.0f}s{s.cap_s:>6.0f}s{total:>8.0f}s  "
              f"{'yes' if s.reserved else ''}")
    print(f"  total planned {total:.0f} s of the {budget_s:g} s budget; no step outlives its cap or the budget")
    for name, why in left_out:
        print(f"  not run: {name}: {why}")


# ---- the JSON, written as each step ends -------------------------------------------------------------------------

class Report:
    """The run's JSON: a header (date, machine, versions, target), the plan with each step's status, and a row per
    step in its section. Rewritten atomically after every step."""

    def __init__(self, path: Path, header: dict, steps: list[Step], left_out: list[tuple[str, str]]):
        self.path = path
        self.doc = {"schema_version": SCHEMA_VERSION, **header, "complete": False,
                    "plan": [{"name": s.name, "kind": s.kind.value, "planned_s": s.planned_s, "cap_s": s.cap_s,
                              "reserved": s.reserved, "status": "pending"} for s in steps]
                    + [{"name": n, "status": "not run", "reason": why} for n, why in left_out],
                    "rows": [], "online_rows": [], "multi_gpu_rows": [], "checks": []}
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def write(self) -> None:
        from advisor._files import write_atomic

        self.doc["updated"] = cases.now_iso()
        write_atomic(self.path, json.dumps(self.doc, indent=1, default=str) + "\n")

    def record(self, step: Step, status: str, row: dict | None, **info) -> None:
        entry = next(p for p in self.doc["plan"] if p["name"] == step.name)
        entry.update(status=status, **info)
        if row is not None:
            self.doc[SECTIONS.get(step.kind, "checks")].append(row)
            if step.kind is Kind.SFT and self.doc.get("backend") == "cuda":
                self.doc["fitted_time_constants"] = {
                    **fit_time_constants(self.doc["rows"]),
                    "applies_to": "advisor/physics/timing time_constants() for this GPU profile (multipliers of "
                                  "the profiles/measurements/time_constants.json values)"}
        self.write()

    def finish(self, status: str, wall_s: float) -> None:
        self.doc.update(complete=status == "complete", status=status, wall_s=round(wall_s, 1))
        self.write()


# ---- running the plan --------------------------------------------------------------------------------------------

@contextmanager
def alarm(seconds: float):
    """StepTimeout raised in this (the main) thread after `seconds`, once."""
    def fire(signum, frame):
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise StepTimeout(f"the step's cap of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def step_timeout(steps: list[Step], i: int, left_s: float) -> float:
    """What step i may take: its cap, or what is left of the budget less the planned time held for the reserved
    steps after it."""
    step = steps[i]
    held = 0.0 if step.reserved else sum(s.planned_s for s in steps[i + 1:] if s.reserved)
    return min(step.cap_s, left_s - held)


def run_plan(ctx: Context, steps: list[Step], report: Report, budget_s: float) -> bool:
    """Run the steps in order, each within its timeout, each row written as it ends. True when every step ran
    and ended ok."""
    all_ok = True
    for i, step in enumerate(steps):
        ctx.sims.poll()
        left = budget_s - (time.monotonic() - ctx.started)
        timeout = step_timeout(steps, i, left)
        if timeout < step.planned_s / 2:
            why = (f"{max(left, 0):.0f} s left of the {budget_s:g} s budget ({timeout:.0f} s for this step after "
                   f"the reserved steps' planned time), under half its planned {step.planned_s:g} s")
            print(f"{step.name}: skipped: {why}", flush=True)
            report.record(step, "skipped", None, reason=why)
            all_ok = False
            continue
        print(f"{step.name}: running (up to {timeout:.0f} s)", flush=True)
        start = time.monotonic()
        try:
            # the subprocess steps stop themselves at the timeout; the alarm is the in-process steps' cap
            safety = timeout + (0 if step.kind in IN_PROCESS else GRACE_S + 10)
            with alarm(safety):
                row = RUNNERS[step.kind](ctx, step, timeout)
        except StepTimeout:
            row = {"name": step.name, "status": "timeout", "message": f"stopped at its cap of {timeout:.0f} s"}
        except Exception as exc:  # a failed step is its row; the next step still runs
            row = {"name": step.name, "status": "error", "message": f"{type(exc).__name__}: {exc}"}
        wall = time.monotonic() - start
        row.update(wall_s=round(wall, 2), finished=cases.now_iso(), environment=ctx.env)
        status = row.get("status", "ok")
        all_ok &= status == "ok"
        report.record(step, status, row, wall_s=round(wall, 2), timeout_s=round(timeout, 1))
        print(f"{step.name}: {status} in {wall:.1f} s", flush=True)
    return all_ok




# ---- the command line --------------------------------------------------------------------------------------------

def resolve_target(a: argparse.Namespace) -> tuple[Target | None, str]:
    """The target of every case, or None with the error; the second item is a note for the plan."""
    from advisor.profiles import detect_gpu, resolve_gpu, resolve_model
    from advisor.workload import ModelSpec

    spec = (ModelSpec(name="tiny-qwen2", config=dict(cases.TINY_QWEN2), source="local") if a.tiny
            else resolve_model(a.model))
    note = ""
    if a.gpu:
        gpu = resolve_gpu(a.gpu)
    elif a.backend == "cpu":
        gpu = resolve_gpu("cpu")
    else:
        gpu = detect_gpu()
        if gpu is None and not a.dry_run:
            return None, ("--backend cuda: no CUDA GPU found through NVML; give --gpu NAME, or --backend cpu --tiny "
                          "to run the same code on the CPU")
        if gpu is None:
            gpu, note = resolve_gpu("H200"), "no GPU found through NVML: planned for the H200 profile (--gpu NAME)"
    return Target(spec, gpu, a.backend, a.max_length or (128 if a.tiny else 1024), a.rows, a.batch), note


def check_candidates(target: Target, steps: list[Step]) -> list[str]:
    """Every probed candidate is one TRL accepts on this target, before a GPU is spent on it."""
    from advisor.errors import AdvisorError
    from advisor.parallelism import Layout, layout_problems
    from advisor.trainers import get_trainer

    problems = []
    for s in steps:
        if s.kind not in (*PROBED, Kind.MULTI_GPU):
            continue
        cand = target.candidate(s.kind, s.knobs)
        if s.kind is Kind.ONLINE:
            problems += [f"{s.name}: {p}" for p in get_trainer(cases.ONLINE_TRAINER).problems(cand, target.gpu,
                                                                                               target.spec)]
            continue
        try:
            cand.check(target.gpu, target.spec)
        except AdvisorError as exc:
            problems.append(f"{s.name}: {exc}")
        if s.kind is Kind.MULTI_GPU:
            problems += [f"{s.name}: {p}" for p in layout_problems(Layout(cand.parallelism), s.world)]
    return problems


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B", help="a model shape from profiles/models/")
    p.add_argument("--gpu", help="GPU profile name (default: the local GPU through NVML)")
    p.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer 64-wide Qwen2 instead of --model (CPU runs)")
    p.add_argument("--batch", type=int, default=4, help="per-device batch size (default 4)")
    p.add_argument("--max-length", type=int, help="default 1024 (128 with --tiny)")
    p.add_argument("--rows", type=int, default=64, help="synthetic dataset rows")
    p.add_argument("--steps", type=int, default=1, help="measured optimizer steps a probe (default 1)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up optimizer steps a probe (default 1)")
    p.add_argument("--probe-stall", type=float, default=PROBE_STALL_S, help="a probe's no-progress timeout, s")
    names = [s.name for s in CATALOGUE]
    p.add_argument("--only", nargs="+", metavar="STEP", help=f"these steps (of {', '.join(names)}, fsdp2-Ngpu)")
    p.add_argument("--skip", nargs="+", default=[], metavar="STEP", help="leave these steps out")
    p.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for the whole run (default {BUDGET_S:g})")
    p.add_argument("--simulate", choices=("auto", "ahead", "inline"), default="auto",
                   help="simulations in a process of their own while the probes run (ahead; auto: on cuda with "
                        ">= 6 cores) or in this process before each probe (inline)")
    p.add_argument("--multi-gpu", type=int, nargs="*", default=[], metavar="N",
                   help="also probe MULTI_CASE with FSDP2 on N ranks (each N > 1), per rank")
    p.add_argument("--out", help="the JSON (default profiles/measurements/<gpu>.json)")
    p.add_argument("--work-dir", help="models, logs and simulations (default: a temporary folder, removed after)")
    p.add_argument("--plan-from", help="plan each step's time from an earlier run's JSON (its measured walls)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and check every candidate; run nothing")
    a = p.parse_args(argv)
    fsdp = re.compile(r"fsdp2-\d+gpu")
    for flag, values in (("--only", a.only or []), ("--skip", a.skip)):
        bad = [v for v in values if v not in names and not fsdp.fullmatch(v)]
        if bad:
            p.error(f"{flag} {bad[0]}: not a step; one of {', '.join(names)}")
    bad = [n for n in a.multi_gpu if n < 2]
    if bad:
        p.error(f"--multi-gpu {bad[0]}: a world size of at least 2 (one GPU is the cases above)")
    for flag, value in (("--budget", a.budget), ("--batch", a.batch), ("--steps", a.steps)):
        if value <= 0:
            p.error(f"{flag} {value:g}: must be positive")
    return a


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # the budget counts from here: imports and checks included
    a = parse(argv)
    target, note = resolve_target(a)
    if target is None:
        print(note, file=sys.stderr)
        return 2
    import importlib.util

    vllm = a.backend == "cuda" and importlib.util.find_spec("vllm") is not None
    steps, left_out = select(a.only, a.skip, a.multi_gpu, vllm=vllm, calibrate=CALIBRATE_SCRIPT.is_file())
    if a.plan_from:
        walls = planned_from(a.plan_from)
        steps = [dataclasses.replace(s, planned_s=round(walls.get(s.name, s.planned_s))) for s in steps]
    steps, dropped = fit_budget(steps, a.budget)
    print(f"model {target.spec.name}, gpu profile {target.gpu.name}, backend {target.backend}, batch {target.batch} "
          f"x {target.max_length}{'; ' + note if note else ''}")
    print_plan(steps, left_out + dropped, a.budget)
    problems = check_candidates(target, steps)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    if a.dry_run:
        return 0
    return execute(a, target, steps, left_out + dropped, started)


def execute(a: argparse.Namespace, target: Target, steps: list[Step], left_out: list[tuple[str, str]],
            started: float) -> int:
    """Run the plan, writing the JSON as each step ends; SIGTERM or Ctrl-C stop it with what it finished kept."""
    import shutil

    facts, vers = cases.device_facts(), cases.versions()
    env = {"date": cases.now_iso(), "gpu_name": facts.get("gpu_name"), "driver": facts.get("driver"),
           "torch": facts["torch"], "cuda_runtime": facts["cuda_runtime"],
           **{k: vers.get(k) for k in ("transformers", "trl", "peft")}}
    path = Path(a.out) if a.out else ROOT / "profiles" / "measurements" / f"{cases.slug(target.gpu.name)}.json"
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="gpu-validate-"))
    work.mkdir(parents=True, exist_ok=True)
    header = {"source": "scripts/gpu_validate.py", "date": env["date"], "gpu_profile": target.gpu.name,
              "device": facts, "versions": vers, "model": target.spec.name, "backend": target.backend,
              "batch_size": target.batch, "max_length": target.max_length, "dataset_rows": target.rows,
              "steps": a.steps, "warmup": a.warmup, "budget_s": a.budget, "machine": cases.machine()}
    report = Report(path, header, steps, left_out)
    model_arg = a.model
    if a.tiny:
        (work / "tiny-model").mkdir(exist_ok=True)
        (work / "tiny-model" / "config.json").write_text(json.dumps(cases.TINY_QWEN2))
        model_arg = str(work / "tiny-model")
    mode = a.simulate
    if mode == "auto":
        mode = "ahead" if a.backend == "cuda" and len(os.sched_getaffinity(0)) >= 6 else "inline"
    sims = Simulations(target, steps, work, mode)
    ctx = Context(a, target, env, work, model_arg, sims, steps, started=started)
    previous = signal.signal(signal.SIGTERM, _terminated)
    status, code = "complete", 1
    try:
        code = 0 if run_plan(ctx, steps, report, a.budget) else 1
    except (KeyboardInterrupt, Terminated) as exc:
        status, code = f"interrupted ({type(exc).__name__})", 130 if isinstance(exc, KeyboardInterrupt) else 143
    finally:
        signal.signal(signal.SIGTERM, previous)
        sims.close()
        report.finish(status, time.monotonic() - started)
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print_summary(report.doc, path)
    return code


class Terminated(BaseException):
    """SIGTERM (a scheduler's or the device run's limit): raised where the driver is, so that every `finally` cleans
    up (the running probe's child, the running command's process group, the simulations' process)."""


def _terminated(signum, frame):
    raise Terminated()


def print_summary(doc: dict, path: Path) -> None:
    print(f"\n{'case':<26}{'status':<9}{'probe peak':>15}{'sim/probe peak':>15}{'reserved':>10}{'device':>8}"
          f"{'step':>8}{'wall s':>8}")
    for r in doc["rows"] + doc["online_rows"] + doc["multi_gpu_rows"]:
        x = r.get("simulate_over_probe") or {}
        print(f"{r.get('case', r.get('name')):<26}{r.get('status', ''):<9}"
              f"{(r.get('probe') or {}).get('peak_bytes') or 0:>15,}{x.get('peak_bytes') or '-':>15}"
              f"{x.get('reserved_bytes') or '-':>10}{x.get('device_bytes') or '-':>8}{x.get('step_time_s') or '-':>8}"
              f"{r.get('wall_s', 0):>8.1f}")
    for r in doc["checks"]:
        extra = r.get("summary") or r.get("trial_statuses") or r.get("message") or ""
        print(f"{r['name']:<26}{r.get('status', ''):<9}{extra}  ({r.get('wall_s', 0):.1f} s)")
    for p in doc["plan"]:
        if p["status"] in ("skipped", "not run"):
            print(f"{p['name']:<26}{p['status']:<9}{p.get('reason', '')}")
    print(f"{doc['status']} in {doc['wall_s']} s; wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
