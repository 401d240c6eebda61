"""The cold front door timed against another revision, the pool against serial simulation, and the pick against the
exhaustive grid's best.

    python scripts/bench_frontdoor.py [--rev REV] [--repeats 3] [--timeout 300] [--sections pool frontdoor quality]
                                      [--memo FILE.jsonl] [--grid-budget S] [--cases h100 l4 lora]

Sections (each prints its own table; every child process runs under a timeout):
- starts (not by default): seconds until --jobs workers that import torch, transformers, trl and
  advisor.simulate are ready, and for one replacement, with multiprocessing's spawn vs forkserver (preloaded).
- pool: the first N (8) candidates of the default front-door space (Qwen/Qwen2.5-0.5B on H100-80GB, full
  fine-tuning, in the grid's order) simulated one at a time in-process vs through the pool with --jobs J (2), each
  arm in a fresh process from the first simulation to the last result (both pay their warm-up: the in-process
  first simulation's lazy imports, the pool's forkserver), alternating, median of --repeats; the Measurements
  must be identical (the script fails otherwise).
- frontdoor: `advisor suggest --model Qwen/Qwen2.5-0.5B --format json` with an empty cache ($ADVISOR_CACHE_DIR a
  fresh directory each run) of this working tree and of REV (default: the merge-base with main, or HEAD~1 when
  that is HEAD), built in a temporary git worktree; alternating, median of --repeats; the ratio this / REV.
  --this-args / --rev-args add flags to one side (e.g. --this-args="--jobs 2" --rev-args="--jobs 1" --rev HEAD).
- quality: per case, the front door's pick (this tree, empty cache) in trained tokens/s over the best feasible
  candidate of the exhaustive grid of the same default space (the pick's method, without what the estimate puts
  far over the limit, as `--exhaustive`). Simulating all of it takes hours on 2 cores (10-30 s a candidate), so
  the grid's best is certified instead (grid_best): every candidate whose estimated tokens/s is at least the best
  simulated / `bound` is simulated, where `bound` is the largest simulated / estimated tokens/s over every
  simulated candidate (never below 1), plus --grid-sample candidates drawn at random from the whole grid (they
  test the bound where the estimate ranks low), plus any the estimate cannot rank. An unmeasured candidate can
  then beat the best only where the simulator is faster than bound x its estimate, which no measured candidate
  was. Measured through the pool into --memo (JSON lines, resumable) for at most --grid-budget seconds a run;
  while incomplete the ratio says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "Qwen/Qwen2.5-0.5B"
CASES = {"h100": (MODEL, "H100-80GB"), "l4": (MODEL, "L4"), "lora": ("meta-llama/Llama-3.1-8B", "L4")}


def _env(tree: Path, cache: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    if cache is not None:
        env["ADVISOR_CACHE_DIR"] = str(cache)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float, cwd: Path) -> tuple[int, float, str, str]:
    """(exit code, wall seconds, stdout, stderr); 124 when it ran past `timeout` (and was killed)."""
    start = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        return p.returncode, time.perf_counter() - start, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return 124, time.perf_counter() - start, out, err


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


# ---- pool vs serial ---------------------------------------------------------------------------------------
def _front_door_grid(model: str, gpu: str, n: int | None):
    """The default front-door workload and its full fine-tuning grid (the first `n`), in the grid's order."""
    from advisor import search
    from advisor.inputs import build_workload
    from advisor.search import RowTokens, default_tokens_per_step
    from advisor.workload import Goals, Method

    wl = build_workload(model, gpu=gpu, goals=Goals())
    return wl, _grid(wl, Method.FULL, n, search, RowTokens, default_tokens_per_step)


def _grid(wl, method, n, search, RowTokens, default_tokens_per_step):  # noqa: N803 (classes passed in)
    rows = RowTokens(wl.dataset)
    space = search._Space(wl, search.build_space(wl, method), default_tokens_per_step(wl, rows), rows)
    out = []
    for c in space.candidates():
        out.append(c)
        if n is not None and len(out) >= n:
            break
    return out


def arm(kind: str, n: int, jobs: int) -> None:
    """One arm in this (fresh) process: JSON {seconds, measurements} on stdout."""
    wl, cands = _front_door_grid(MODEL, "H100-80GB", n)
    start = time.perf_counter()
    if kind == "serial":
        from advisor._messages import capture
        from advisor.backends import get_backend

        fn = get_backend("simulate").measure
        ms = []
        for c in cands:
            with capture():  # as the search measures: what libraries say is collected, not printed
                ms.append(fn(wl, c))
    else:
        from advisor.search import open_pool

        with open_pool("simulate", jobs=jobs) as pool:
            futures = [pool.submit(wl, c) for c in cands]
            ms = [f.result() for f in futures]
    seconds = time.perf_counter() - start
    busy = sum(m.wall_time_s or 0.0 for m in ms)  # the simulations' own seconds: > seconds when they overlapped
    print(json.dumps({"seconds": seconds, "busy": busy, "load": os.getloadavg()[0], "measurements": [
        {k: v for k, v in m.to_dict().items() if k != "wall_time_s"} for m in ms]}))


def bench_pool(ns) -> list[list[str]]:
    times: dict[str, list[float]] = {"serial": [], "pool": []}
    overlap: dict[str, list[float]] = {"serial": [], "pool": []}
    loads: list[float] = []
    results: dict[str, list] = {}
    for i in range(ns.repeats):
        for kind in (("serial", "pool") if i % 2 == 0 else ("pool", "serial")):
            rc, wall, out, err = _run([sys.executable, __file__, "--_arm", kind, "--candidates", str(ns.candidates),
                                       "--jobs", str(ns.jobs)], _env(ROOT), ns.timeout, ROOT)
            if rc != 0:
                print(f"pool section: the {kind} arm failed (exit {rc}): {err[-2000:]}", file=sys.stderr)
                continue
            rec = json.loads(out.strip().splitlines()[-1])
            times[kind].append(rec["seconds"])
            overlap[kind].append(rec["busy"] / rec["seconds"])
            loads.append(rec["load"])
            if results.setdefault(kind, rec["measurements"]) != rec["measurements"]:
                raise SystemExit(f"pool section: the {kind} arm measured differently from one run to the next")
    if "serial" in results and "pool" in results and results["serial"] != results["pool"]:
        raise SystemExit("pool section: the pool's Measurements differ from the in-process ones")
    s, p = _median(times["serial"]), _median(times["pool"])
    same = "identical" if len(results) == 2 else "-"
    return [[f"first {ns.candidates} candidates, {MODEL} on H100-80GB", _fmt(s), _fmt(p),
             _fmt(s / p if s and p else None, ".2f"), ", ".join(f"{x:.1f}" for x in times["serial"]),
             ", ".join(f"{x:.1f}" for x in times["pool"]), _fmt(_median(overlap["pool"]), ".2f"),
             ", ".join(f"{x:.1f}" for x in loads), same]]


# ---- spawn vs forkserver ----------------------------------------------------------------------------------
def _warm_child(conn) -> None:
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import trl  # noqa: F401

    import advisor.simulator  # noqa: F401

    conn.send("ready")
    conn.close()


def starts(method: str, n: int) -> None:
    """In this (fresh) process: seconds until `n` workers of the `method` context have imported what a pool worker
    imports, and for one more (a replacement after a crash). JSON on stdout."""
    import multiprocessing as mp

    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "transformers", "trl", "advisor.simulator"])

    def start_ready(k: int) -> float:
        t0, pairs = time.perf_counter(), []
        for _ in range(k):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_warm_child, args=(w,), daemon=True)
            p.start()
            w.close()
            pairs.append((r, p))
        for r, p in pairs:
            r.recv()
            p.join()
        return time.perf_counter() - t0

    first = start_ready(n)
    print(json.dumps({"ready": first, "replacement": start_ready(1)}))


def bench_starts(ns) -> list[list[str]]:
    rows = []
    for method in ("spawn", "forkserver"):
        got: dict[str, list[float]] = {"ready": [], "replacement": []}
        for _ in range(ns.repeats):
            rc, wall, out, err = _run([sys.executable, __file__, "--_starts", method, "--jobs", str(ns.jobs)],
                                      _env(ROOT), ns.timeout, ROOT)
            if rc == 0:
                rec = json.loads(out.strip().splitlines()[-1])
                for k in got:
                    got[k].append(rec[k])
        rows.append([method, _fmt(_median(got["ready"]), ".2f"), _fmt(_median(got["replacement"]), ".2f")])
    return rows


# ---- front door vs another revision -----------------------------------------------------------------------
def _default_rev() -> str:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    base = subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, capture_output=True, text=True)
    rev = base.stdout.strip() if base.returncode == 0 else ""
    return rev if rev and rev != head else "HEAD~1"


@contextlib.contextmanager
def _worktree(rev: str):
    tmp = Path(tempfile.mkdtemp(prefix="advisor-rev-"))
    tree = tmp / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), rev], cwd=ROOT, check=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)
        with contextlib.suppress(OSError):
            tmp.rmdir()


def _suggest(tree: Path, args: list[str], timeout: float, model: str = MODEL, gpu: str | None = None
             ) -> tuple[int, float, dict | None, str]:
    """One cold front door: (exit code, seconds, the JSON answer or None, stderr)."""
    with tempfile.TemporaryDirectory(prefix="advisor-cold-cache-") as cache:
        cmd = [sys.executable, "-m", "advisor", "suggest", "--model", model, "--format", "json", *args]
        if gpu is not None:
            cmd += ["--gpu", gpu]
        rc, wall, out, err = _run(cmd, _env(tree, Path(cache)), timeout, Path(cache))
    answer = None
    if rc == 0:
        with contextlib.suppress(ValueError):
            answer = json.loads(out)
    return rc, wall, answer, err


def bench_frontdoor(ns) -> list[list[str]]:
    rev = ns.rev or _default_rev()
    label = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip() or rev
    this_args, rev_args = ns.this_args.split(), ns.rev_args.split()
    times: dict[str, list[float]] = {"this": [], "rev": []}
    picks: dict[str, set] = {"this": set(), "rev": set()}
    with _worktree(rev) as tree:
        sides = {"this": (ROOT, this_args), "rev": (tree, rev_args)}
        for i in range(ns.repeats):
            for side in (("this", "rev") if i % 2 == 0 else ("rev", "this")):
                where, args = sides[side]
                rc, wall, answer, err = _suggest(where, args, ns.timeout)
                if rc != 0:
                    why = "timed out" if rc == 124 else f"exit {rc}"
                    print(f"frontdoor: {side} {why} after {wall:.0f}s: {err[-1500:]}", file=sys.stderr)
                    times[side].append(float("nan") if rc != 124 else wall)
                    continue
                times[side].append(wall)
                picks[side].add(round(answer["tokens_per_second"] or 0))
    t, r = (_median([x for x in times[s] if x == x]) for s in ("this", "rev"))
    return [[f"this tree {' '.join(this_args)}".strip(), _fmt(t), ", ".join(f"{x:.1f}" for x in times["this"]),
             ", ".join(f"{x:,}" for x in sorted(picks["this"])), _fmt(t / r if t and r else None, ".2f")],
            [f"{label} {' '.join(rev_args)}".strip(), _fmt(r), ", ".join(f"{x:.1f}" for x in times["rev"]),
             ", ".join(f"{x:,}" for x in sorted(picks["rev"])), "1.00"]]


# ---- the pick against the exhaustive grid -----------------------------------------------------------------
class GridMemo:
    """JSON lines {tag, key, seconds, measurement}, as scripts/bench_search.py's Memo writes, tagged
    backend/gpu/model."""

    def __init__(self, path: Path, tag: str):
        from advisor.measurement import Measurement

        self.path, self.tag, self.table = path, tag, {}
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec["tag"] == tag:
                    self.table[rec["key"]] = Measurement.from_dict(rec["measurement"])

    def add(self, key: str, m, seconds: float) -> None:
        self.table[key] = m
        rec = {"tag": self.tag, "key": key, "seconds": seconds,
               "measurement": {k: list(v) if isinstance(v, tuple) else v for k, v in m.to_dict().items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")


def _method_of(config: dict):
    from advisor.workload import Method

    if config.get("load_in_4bit") or config.get("load_in_8bit"):
        return Method.QLORA
    return Method.LORA if config.get("use_peft") else Method.FULL


@dataclass(frozen=True)
class GridResult:
    """What grid_best established about one default space."""

    best: float | None  # best feasible simulated tokens/s among the measured candidates
    measured: int  # candidates of the grid measured (in the memo)
    needed: int  # candidates the certificate needs measured: est >= best / bound, estimate failures, the sample
    missing: int  # of those, not measured yet
    total: int  # candidates measured by `--exhaustive` (not put far over the limit by the estimate)
    bound: float  # max(1, simulated / estimated tokens/s) over every measured candidate
    sample: int  # of which drawn at random from the whole grid, to test the bound away from the top

    @property
    def complete(self) -> bool:
        return self.missing == 0


def grid_best(model: str, gpu: str, method, memo_path: Path, budget_s: float, jobs: int | None,
              sample: int = 24, seed: int = 0) -> GridResult:
    """The best feasible candidate of the method's default grid, certified without simulating all of it.

    A candidate can beat the best measured one (B) only if its simulated tokens/s exceeds B. Over every measured
    candidate the simulated tokens/s is at most `bound` x the estimate's (bound: the largest ratio seen, never
    below 1), so an unmeasured candidate whose estimate is under B / bound cannot win unless the bound fails on
    it. The grid is measured best estimate first down to B / bound (both move as it goes), plus `sample`
    candidates drawn at random from the whole grid to test the bound where the estimate ranks low, plus every
    candidate the estimate could not rank. The simulations go through the pool into the memo (resumable) for at
    most `budget_s` a call."""
    import random

    from advisor import search
    from advisor.estimator import estimate
    from advisor.inputs import build_workload
    from advisor.search import RowTokens, candidate_key, default_tokens_per_step, device_bytes, feasible, open_pool
    from advisor.workload import Goals

    wl = build_workload(model, gpu=gpu, goals=Goals())
    cands = _grid(wl, method, None, search, RowTokens, default_tokens_per_step)
    limit = wl.limit_bytes
    ranked = []  # (estimated tokens/s or None, key, candidate), best estimate first
    for c in cands:
        try:
            e = estimate(wl, c)
        except Exception:
            e = None
        d = device_bytes(e) if e is not None else None
        if d is not None and d > limit * search.PRUNE_FACTOR:
            continue  # as --exhaustive: the estimate puts it far over the limit, never measured
        ranked.append((e.tokens_per_second if e is not None and e.ok and e.tokens_per_second else None,
                       candidate_key(c), c))
    ranked.sort(key=lambda r: (-(r[0] or 0.0), r[1]))
    drawn = {k for _, k, _ in random.Random(seed).sample(ranked, min(sample, len(ranked)))}
    memo = GridMemo(memo_path, f"simulate/{gpu}/{model}/{method.value}")

    def state():
        best, bound = None, 1.0
        for est, k, _ in ranked:
            m = memo.table.get(k)
            if m is None or not m.tokens_per_second:
                continue
            if est:
                bound = max(bound, m.tokens_per_second / est)
            if feasible(m, limit):
                best = max(best or 0.0, m.tokens_per_second)
        floor = (best / bound) if best else 0.0
        needed = [(est, k, c) for est, k, c in ranked if k in drawn or est is None or est >= floor]
        return best, bound, needed

    deadline = time.monotonic() + budget_s
    pool, live = None, []
    try:
        while time.monotonic() < deadline:
            best, bound, needed = state()
            busy = {k for k, _, _ in live}
            # the sample first (it calibrates the bound), then the best estimates
            todo = sorted((r for r in needed if r[1] not in memo.table and r[1] not in busy),
                          key=lambda r: (r[1] not in drawn, -(r[0] or 0.0), r[1]))
            if not todo and not live:
                break
            if pool is None:
                pool = open_pool("simulate", jobs=jobs).__enter__()
            window = max(2, 2 * pool.jobs)
            for _, k, c in todo[: window - len(live)]:
                live.append((k, pool.submit(wl, c), time.perf_counter()))
            k, f, t0 = live.pop(0)
            with contextlib.suppress(Exception):
                memo.add(k, f.result(timeout=max(1.0, deadline - time.monotonic() + 600)), time.perf_counter() - t0)
    finally:
        if pool is not None:
            pool.__exit__(None, None, None)
    best, bound, needed = state()
    return GridResult(best, sum(1 for _, k, _ in ranked if k in memo.table), len(needed),
                      sum(1 for _, k, _ in needed if k not in memo.table), len(ranked), bound, len(drawn))


def bench_quality(ns) -> list[list[str]]:
    rows = []
    for case in ns.cases:
        model, gpu = CASES[case]
        rc, wall, answer, err = _suggest(ROOT, ns.this_args.split(), ns.timeout, model=model, gpu=gpu)
        if answer is None:
            rows.append([case, model, gpu, "-", f"front door failed ({rc}): {err[-300:]}", "", "", "", "", ""])
            continue
        method = _method_of(answer["config"])
        pick = answer["tokens_per_second"] or 0.0
        g = grid_best(model, gpu, method, ns.memo, ns.grid_budget, ns.jobs, sample=ns.grid_sample)
        ratio = _fmt(pick / g.best if g.best else None, ".3f") + ("" if g.complete else " (incomplete)")
        rows.append([case, model, gpu, method.value, f"{pick:,.0f}", _fmt(g.best, ",.0f"), ratio,
                     f"{g.bound:.3f}", f"{g.needed - g.missing}/{g.needed} needed (sample {g.sample}; {g.measured} of "
                     f"{g.total} measured)",
                     f"{wall:.0f}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", nargs="+", default=["pool", "frontdoor", "quality"],
                    choices=("starts", "pool", "frontdoor", "quality"))
    ap.add_argument("--rev", default=None, help="the revision to compare with (default: merge-base with main)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side (median)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one child process may run")
    ap.add_argument("--this-args", default="", help="extra flags for this tree's `advisor suggest`")
    ap.add_argument("--rev-args", default="", help="extra flags for REV's `advisor suggest`")
    ap.add_argument("--candidates", type=int, default=8, help="pool section: candidates simulated")
    ap.add_argument("--jobs", type=int, default=2, help="pool section and the grid: worker processes")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--memo", type=Path, default=None, help="the grid's measurements (JSON lines, kept between "
                    "runs; default: bench_frontdoor_grid.jsonl in the advisor cache directory)")
    ap.add_argument("--grid-budget", type=float, default=120.0, metavar="S",
                    help="quality section: seconds of grid measuring per case and run (0: only what the memo has)")
    ap.add_argument("--grid-sample", type=int, default=24, metavar="K",
                    help="quality section: candidates drawn at random from the whole grid to test the estimate's "
                    "bound away from the top (seeded; the same K each run)")
    ap.add_argument("--_arm", choices=("serial", "pool"), help=argparse.SUPPRESS)
    ap.add_argument("--_starts", choices=("spawn", "forkserver"), help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns._arm:
        arm(ns._arm, ns.candidates, ns.jobs)
        return
    if ns._starts:
        starts(ns._starts, ns.jobs)
        return
    from tabulate import tabulate

    if ns.memo is None:
        from advisor.search import cache_dir

        ns.memo = cache_dir() / "bench_frontdoor_grid.jsonl"
        ns.memo.parent.mkdir(parents=True, exist_ok=True)
    print(f"host: {len(os.sched_getaffinity(0))} usable cores, load {os.getloadavg()[0]:.1f}")
    if "starts" in ns.sections:
        print(tabulate(bench_starts(ns), headers=[f"start method (median of {ns.repeats})",
                                                  f"{ns.jobs} workers ready s", "a replacement s"]))
        print()
    if "pool" in ns.sections:
        print(tabulate(bench_pool(ns), headers=[f"pool (median of {ns.repeats})", "serial s", "pool s",
                                                 "serial/pool", "serial runs", "pool runs",
                                                 "pool overlap", "host load", "results"]))
        print()
    if "frontdoor" in ns.sections:
        print(tabulate(bench_frontdoor(ns), headers=[f"cold front door, {MODEL} (median of {ns.repeats})",
                                                      "median s", "runs s", "pick tok/s", "ratio"]))
        print()
    if "quality" in ns.sections:
        print(tabulate(bench_quality(ns), headers=["case", "model", "gpu", "method", "pick tok/s", "grid best",
                                                    "pick/grid", "bound", "grid measured", "front door s"]))


if __name__ == "__main__":
    main()
