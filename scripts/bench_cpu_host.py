"""The CPU proves the host side: the step-time model's prediction (`advisor simulate --gpu cpu`) against the cpu probe's
steady-state step, side by side, for the test models, where one host does everything and a tiny model is host-bound.

  python scripts/bench_cpu_host.py                 # calibrate this CPU, then every case: predicted vs measured
  python scripts/bench_cpu_host.py --cases sft-padded grpo-generate --repeats 2
  python scripts/bench_cpu_host.py --json out.json

One thread (OMP_NUM_THREADS=1, torch.set_num_threads(1)) for the calibration, the prediction and the probe alike:
on a shared machine a second BLAS thread waits at every barrier for a core another process holds, which no model of
this host predicts. The run first measures this CPU (scripts/gpu_calibrate.py --device cpu: GEMMs, bandwidth,
attention, the host's cost per op; written under the advisor's cache, which the model then reads: "calibrated on
<date>, <host>"), then per case: the simulator's step on the worst batch (the batch the probe times) and the cpu
probe's steady state (advisor/probing/runner.Timing: the longest rows again and again, the median of the last 5 once
stable within 5%), as the CPU time of the probe's process (one thread: the step's own work; on a machine others share,
its wall time also counts what they take, which no model of this host predicts) and as wall time. Printed: the
prediction, both measurements, the ratio to the CPU time, the probe's spread, the machine's load, and the Kendall tau
of the rankings (predicted vs CPU time). Cases: SFT padded / packed / padding-free / LoRA / checkpointed, DPO, GRPO
with transformers' generate, on two sizes of a 2-layer Qwen2 (`--size`):

- host-bound: hidden 16, vocabulary 64, rows of at most 8 tokens (DPO 16, GRPO 8-token prompts and completions): the
  kernels take next to nothing, so the step is the host's issue of its ops, what item 4 of issue 30 asks the CPU to
  prove (the host side of the two-queue model, which a GPU's host runs too);
- small: hidden 64, vocabulary 1024, 64-token rows (the tests' tiny model): here the CPU's own kernels (GEMMs, and
  elementwise ops over the [128, 1024] logits) take about as long as the host's issue, so the ratio also reads the
  CPU's device model (its GEMM rate and bandwidth calibration), which no GPU prediction uses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SMALL_QWEN2 = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
    "max_position_embeddings": 4096, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
SFT = {"per_device_train_batch_size": 2, "max_length": 64, "activation_checkpointing": False,
       "precision": "fp32", "optim": "adamw_torch"}
HOST_BOUND_QWEN2 = {**SMALL_QWEN2, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "vocab_size": 64}
# size: (model config, max_length of SFT, DPO's max_length, the synthetic data's vocabulary / median / longest row)
SIZES: dict[str, dict] = {
    "host-bound": {"config": HOST_BOUND_QWEN2, "sft_len": 8, "dpo_len": 16, "vocab": 64, "median": 6, "longest": 8,
                   "prompt_median": 6, "prompt_longest": 8, "completion": 8},
    "small": {"config": SMALL_QWEN2, "sft_len": 64, "dpo_len": 128, "vocab": 1024, "median": 32, "longest": 64,
              "prompt_median": 16, "prompt_longest": 32, "completion": 16},
}
CASES: dict[str, tuple[str, dict]] = {
    "sft-padded": ("sft", SFT),
    "sft-packed": ("sft", {**SFT, "packing": True}),
    "sft-padding-free": ("sft", {**SFT, "max_length": None, "padding_free": True}),
    "sft-lora": ("sft", {**SFT, "use_lora": True}),
    "sft-checkpointed": ("sft", {**SFT, "activation_checkpointing": True}),
    "dpo": ("dpo", {**SFT, "max_length": 128}),
    "grpo-generate": ("grpo", {"per_device_train_batch_size": 4, "activation_checkpointing": False,
                               "precision": "fp32", "optim": "adamw_torch", "num_generations": 2,
                               "max_completion_length": 16}),
}


def _workload(trainer: str, size: str = "small"):
    from advisor.data import synthetic
    from advisor.profiles import resolve_gpu
    from advisor.workload import Goals, ModelSpec, Workload

    z = SIZES[size]
    spec = ModelSpec(name=f"tiny-qwen2-{size}", config=dict(z["config"]), source="local")
    if trainer == "dpo":
        from advisor.trainers.preference import synthetic_preferences

        data = synthetic_preferences(vocab_size=z["vocab"], rows=48, seed=0, median=z["median"], max_len=z["longest"])
    elif trainer == "grpo":
        from advisor.trainers.prompts import synthetic_prompts

        data = synthetic_prompts(z["vocab"], rows=16, median=z["prompt_median"], max_len=z["prompt_longest"])
    else:
        data = synthetic(vocab_size=z["vocab"], rows=64, seed=0, median=z["median"], max_len=z["longest"])
    return Workload(model=spec, gpu=resolve_gpu("cpu"), dataset=data, goals=Goals(), trainer=trainer)


def _candidate(trainer: str, knobs: dict, size: str = "small"):
    from advisor.space import Candidate, with_knobs
    from advisor.trainers import get_trainer

    get_trainer(trainer)  # a trainer's own knobs are declared by its module
    z = SIZES[size]
    if knobs.get("max_length"):
        knobs = {**knobs, "max_length": z["dpo_len"] if trainer == "dpo" else z["sft_len"]}
    if "max_completion_length" in knobs:
        knobs = {**knobs, "max_completion_length": z["completion"]}
    own = {k: v for k, v in knobs.items() if k in ("num_generations", "max_completion_length")}
    base = Candidate(**{k: v for k, v in knobs.items() if k not in own})
    return with_knobs(base, **own) if own else base


def kendall_tau(a: list[float], b: list[float]) -> float:
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += (1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0)
    return 2.0 * s / (n * (n - 1)) if n > 1 else 1.0


def run(cases: list[str], repeats: int, calibrate: bool, size: str = "small") -> list[dict]:
    import torch

    torch.set_num_threads(1)
    from advisor.physics import time_constants
    from advisor.probing.runner import probe
    from advisor.simulator import simulate

    if calibrate:
        from gpu_calibrate import calibrate as measure

        measure("cpu")
        time_constants.cache_clear()
    rows = []
    for name in cases:
        trainer, knobs = CASES[name]
        wl, cand = _workload(trainer, size), _candidate(trainer, knobs, size)
        m = simulate(wl, cand)
        pred = m.worst_step_time_s or m.step_time_s
        for r in range(repeats):
            load = os.getloadavg()[0]
            p = probe(wl, cand, "cpu", steps=2, warmup=1, timeout_s=600)
            d = p.time_detail or {}
            cpu = d.get("cpu_step_s")
            row = {"case": name, "size": size, "repeat": r, "predicted_s": pred, "measured_s": cpu,
                   "wall_s": p.step_time_s, "ratio": pred / cpu if cpu else None, "spread": d.get("spread"),
                   "timed_steps": d.get("timed_steps"), "stable": d.get("stable"), "load": load,
                   "status": p.status.value, "host_bound_s": m.time_detail.get("host_bound_s"),
                   "ops": m.time_detail.get("ops"), "calibration": m.time_detail.get("calibration"),
                   "host": m.time_detail.get("host")}
            rows.append(row)
            print(f"{name:<18}{size:<11}{pred * 1e3:10.2f}{(cpu or 0) * 1e3:10.2f}{(p.step_time_s or 0) * 1e3:10.2f}"
                  f"{row['ratio'] or 0:8.3f}{(row['spread'] or 0):8.1%}{row['timed_steps'] or 0:6d}"
                  f"{'' if row['stable'] else ' unstable':>9}{load:6.1f}  {p.status.value} {p.message[:60]}",
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    p.add_argument("--repeats", type=int, default=1, help="probes per case (the prediction is deterministic)")
    p.add_argument("--no-calibrate", action="store_true", help="use the CPU calibration already in the cache")
    p.add_argument("--size", nargs="*", default=list(SIZES), choices=list(SIZES),
                   help="the model sizes (module docstring): host-bound proves the host side, small adds CPU kernels")
    p.add_argument("--json", help="write the rows to this file")
    a = p.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    print(f"load before: {os.getloadavg()}")
    print(f"{'case':<18}{'size':<11}{'pred ms':>10}{'cpu ms':>10}{'wall ms':>10}{'p/cpu':>8}{'spread':>8}{'steps':>6}"
          f"{'':>9}{'load':>6}")
    rows = []
    for i, size in enumerate(a.size):
        rows += run(a.cases, a.repeats, not a.no_calibrate and i == 0, size)
    print(f"load after: {os.getloadavg()}")
    import statistics

    for size in a.size:
        by_case: dict[str, list[dict]] = {}
        for r in rows:
            if r["measured_s"] and r["size"] == size:
                by_case.setdefault(r["case"], []).append(r)
        names = sorted(by_case)
        pred = [by_case[n][0]["predicted_s"] for n in names]
        meas = [statistics.median(r["measured_s"] for r in by_case[n]) for n in names]
        within = sum(1 for x, y in zip(pred, meas, strict=True) if 0.8 <= x / y <= 1.2)
        print(f"\n{size}: " + ", ".join(f"{n} {x / y:.2f}" for n, x, y in zip(names, pred, meas, strict=True)))
        print(f"{size}: within 20%: {within} of {len(names)}; Kendall tau of the rankings (predicted vs measured "
              f"step): {kendall_tau(pred, meas):.2f}")
    if rows:
        print(f"host: {rows[0]['host']}; constants: {rows[0]['calibration']}")
    print(f"({time.perf_counter() - started:.0f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
