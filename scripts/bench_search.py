"""Search vs exhaustive grid vs TRL defaults vs batch-size finders, side by side, on one backend.

    python scripts/bench_search.py [--backend simulate] [--gpus L4 H100-80GB] [--share 0.2] [--memo FILE.jsonl]
    python scripts/bench_search.py --sweep ...   (the search alone over the walk's NEIGHBOUR_PARENTS x SEEDS)

Every method gets its own count of distinct candidates (its cost); measurements are memoised across methods
only to save wall time, and each method's seconds are the sum of its own candidates' measuring time.
The space is narrowed with --fix (as `advisor suggest --fix`) to a few hundred valid candidates.
`--memo FILE` keeps measurements (with their measuring seconds) on disk between runs, to iterate on the
search without re-measuring the grid; leave it out for numbers that all come from one run.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from advisor import search
from advisor.errors import NoFitError
from advisor.inputs import build_workload
from advisor.measurement import Measurement
from advisor.search import RowTokens, candidate_key, default_tokens_per_step, with_accumulation
from advisor.space import Candidate
from advisor.workload import Goals

# Free: micro-batch, max_length, packing and its strategy, padding-free, checkpointing (full/selective), the
# four optimizers of a CUDA target. On the synthetic set with the 1% truncation limit that is 216 valid
# candidates on each GPU (264 before the +-25% effective-batch rule refused micro-batches no accumulation fits).
FIX = {"group_by_length": "false", "attn_implementation": "sdpa", "activation_offloading": "false",
       "checkpoint_every_n_layers": "1"}


class Memo:
    """One shared table of measurements; each method records which candidates it asked for."""

    def __init__(self, backend: str, gpu: str, path: Path | None = None):
        self.fn = search.get_backend(backend)
        self.tag, self.path = f"{backend}/{gpu}", path
        self.table: dict[str, tuple[Measurement, float]] = {}
        if path is not None and path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec["tag"] == self.tag:
                    self.table[rec["key"]] = (Measurement.from_dict(rec["measurement"]), rec["seconds"])
        self.loaded = frozenset(self.table)

    def measure(self, wl, c, asked: dict[str, float]):
        key = candidate_key(c)
        if key not in self.table:
            t = time.perf_counter()
            m = self.fn.measure(wl, c)
            self.table[key] = (m, time.perf_counter() - t)
            if self.path is not None:
                rec = {"tag": self.tag, "key": key, "seconds": self.table[key][1],
                       "measurement": {k: list(v) if isinstance(v, tuple) else v for k, v in m.to_dict().items()}}
                with self.path.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
        m, secs = self.table[key]
        asked[key] = secs
        return m


def _method(name: str, memo: Memo, wl, run):
    asked: dict[str, float] = {}
    search.register_backend(f"bench-{name}", lambda w, c: memo.measure(w, c, asked))
    try:
        best = run(f"bench-{name}", asked)
    finally:
        search.unregister_backend(f"bench-{name}")
    return best, len(asked), sum(asked.values())


def finder(memo: Memo, wl, sizes, asked) -> tuple[Candidate | None, float | None]:
    """Batch finders on TRL's defaults, keeping the effective batch fixed by the search's own rule
    (`with_accumulation`: accumulation = round(rows / micro-batch), and a micro-batch whose trained tokens per
    optimizer step would land more than 25% off the target is skipped, as the search refuses it): try
    micro-batches in order, stop at the first that fits (x0.9) or the last before a failure (power of two)."""
    rows, tps = RowTokens(wl.dataset), default_tokens_per_step(wl)
    best = None
    for b in sizes:
        c = with_accumulation(Candidate.trl_defaults().replace(per_device_train_batch_size=b), tps, rows)
        if c is None:
            continue
        m = memo.measure(wl, c, asked)
        if m.feasible(wl.limit_bytes):
            best = (c, m.tokens_per_second)
            if sizes[0] > sizes[-1]:
                break  # x0.9 from the top: the first that fits
        elif sizes[0] < sizes[-1]:
            break  # power of two from the bottom: stop at the first failure
    return best if best else (None, None)


def bench(gpu: str, backend: str, share: float, memo_path: Path | None) -> list[list[str]]:
    wl = build_workload("Qwen/Qwen2.5-0.5B", gpu=gpu, goals=Goals())
    memo = Memo(backend, gpu, memo_path)
    out = []

    def row(name, tps_value, n, secs, grid_tps, grid_n):
        ratio = f"{tps_value / grid_tps:.3f}" if tps_value and grid_tps else "-"
        cost = f"{n / grid_n:.3f}" if grid_n else "-"
        out.append([gpu, name, f"{tps_value:,.0f}" if tps_value else "none fits", ratio, str(n), cost, f"{secs:.1f}"])

    t = time.perf_counter()
    grid, grid_n, grid_s = _method("grid", memo, wl, lambda b, a: search.suggest(
        wl, backend=b, cache=False, exhaustive=True, fix=FIX, method="full"))
    grid_tps = grid.measurement.tokens_per_second
    row("grid (exhaustive)", grid_tps, grid_n, grid_s, grid_tps, grid_n)
    budget = max(1, math.floor(share * grid_n))
    try:
        found, n, s = _method("search", memo, wl, lambda b, a: search.suggest(
            wl, backend=b, cache=False, trials=budget, fix=FIX, method="full"))
        row("search", found.measurement.tokens_per_second, n, s, grid_tps, grid_n)
    except NoFitError:
        row("search", None, budget, 0.0, grid_tps, grid_n)
    asked: dict[str, float] = {}
    m = memo.measure(wl, Candidate.trl_defaults(), asked)
    row("TRL defaults (8x1, len 1024)", m.tokens_per_second if m.feasible(wl.limit_bytes) else None, 1,
        sum(asked.values()), grid_tps, grid_n)
    for name, sizes in (("x0.9-on-OOM finder", _x09(64)), ("power-of-two finder", [1, 2, 4, 8, 16, 32, 64])):
        asked = {}
        _, v = finder(memo, wl, sizes, asked)
        row(name, v, len(asked), sum(asked.values()), grid_tps, grid_n)
    fresh = sum(1 for k in memo.table if k not in memo.loaded)
    out.append([gpu, f"(wall {time.perf_counter() - t:.0f}s, {fresh} measured now, {len(memo.loaded)} from --memo)",
                "", "", "", "", ""])
    return out


def sweep(gpu: str, backend: str, share: float, memo_path: Path | None) -> list[list[str]]:
    """The search's reach and cost over the walk's parameters (NEIGHBOUR_PARENTS x SEEDS)."""

    wl = build_workload("Qwen/Qwen2.5-0.5B", gpu=gpu, goals=Goals())
    memo = Memo(backend, gpu, memo_path)
    grid, grid_n, _ = _method("grid", memo, wl, lambda b, a: search.suggest(
        wl, backend=b, cache=False, exhaustive=True, fix=FIX, method="full"))
    grid_tps = grid.measurement.tokens_per_second
    budget = max(1, math.floor(share * grid_n))
    out = []
    for parents in (1, 2, 4, 8):
        for seeds in (2, 4, 8, 16):
            with search.walk_parameters(parents=parents, seeds=seeds):
                found, n, _ = _method("search", memo, wl, lambda b, a: search.suggest(
                    wl, backend=b, cache=False, trials=budget, fix=FIX, method="full"))
            tps = found.measurement.tokens_per_second
            out.append([gpu, str(parents), str(seeds), f"{tps:,.0f}", f"{tps / grid_tps:.3f}", str(n),
                        f"{n / grid_n:.3f}"])
    return out


def _x09(start: int) -> list[int]:
    sizes, b = [], start
    while b >= 1:
        sizes.append(b)
        b = int(b * 0.9) if int(b * 0.9) < b else b - 1
    return sizes


def main() -> None:
    from tabulate import tabulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="simulate")
    ap.add_argument("--gpus", nargs="+", default=["L4", "H100-80GB"])
    ap.add_argument("--share", type=float, default=0.2, help="search budget as a share of the grid's candidates")
    ap.add_argument("--memo", type=Path, help="JSON-lines file of measurements kept between runs (iterating only)")
    ap.add_argument("--sweep", action="store_true", help="the search alone over NEIGHBOUR_PARENTS x SEEDS")
    ns = ap.parse_args()
    if ns.sweep:
        rows = [r for gpu in ns.gpus for r in sweep(gpu, ns.backend, ns.share, ns.memo)]
        print(f"backend={ns.backend}  fix={FIX}  share={ns.share}")
        print(tabulate(rows, headers=["gpu", "parents", "seeds", "tokens/s", "vs grid", "candidates", "vs grid cost"]))
        return
    rows = []
    for gpu in ns.gpus:
        rows += bench(gpu, ns.backend, ns.share, ns.memo)
    print(f"backend={ns.backend}  fix={FIX}")
    print(tabulate(rows, headers=["gpu", "method", "tokens/s", "vs grid", "candidates", "vs grid cost", "seconds"]))


if __name__ == "__main__":
    main()
