"""Side by side: the extrapolated simulation, the full-depth one, and one real CPU step of the same workload.

Usage: python scripts/bench_simulate.py [--model Qwen/Qwen2.5-0.5B] [--batch 4] [--seq 1024] [--no-real]
                                        [--against REF]
Prints wall times (after imports; the second call in the process) and their ratios, plus the predicted peaks.
`--against REF` also times the simulator as committed at git REF (e.g. HEAD~3), each tree in its own process,
alternating, and prints before/after side by side with the peaks to show the speed-up changed no byte.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _workload(a: argparse.Namespace):
    import numpy as np

    from advisor.data import TokenizedDataset
    from advisor.profiles import resolve_gpu, resolve_model
    from advisor.space import Candidate
    from advisor.workload import Goals, Workload

    spec = resolve_model(a.model)
    rng = np.random.default_rng(0)
    rows = tuple({"input_ids": rng.integers(10, spec.vocab_size, a.seq).tolist()} for _ in range(a.batch * 2))
    data = TokenizedDataset(name="bench", source="synthetic", rows=rows, completion_only_loss=False)
    wl = Workload(model=spec, gpu=resolve_gpu("cpu"), dataset=data, goals=Goals())
    cand = Candidate(max_length=a.seq, per_device_train_batch_size=a.batch, precision="bf16",
                     weights_dtype="bfloat16", optim="adamw_torch")
    return spec, rows, wl, cand


def _time_simulations(a: argparse.Namespace) -> dict:
    from advisor.simulator import simulate

    spec, rows, wl, cand = _workload(a)
    simulate(wl, cand, layers=(2, 3))  # warm imports and caches once
    out = {"layers": spec.num_layers}
    for name, layers in (("fast", (2, 3)), ("full", None)):
        t = time.perf_counter()
        m = simulate(wl, cand, layers=layers)
        out[name] = {"s": time.perf_counter() - t, "peak": m.peak_bytes, "breakdown": m.breakdown,
                     "step_time_s": m.step_time_s}
    return out


def _child(a: argparse.Namespace, pythonpath: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, __file__, "--child", "--model", a.model, "--batch", str(a.batch), "--seq", str(a.seq)]
    done = subprocess.run(cmd, env=env, cwd=pythonpath or ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _against(a: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-sim-") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.against, "advisor", "profiles"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for _ in range(a.repeat):
            runs["before"].append(_child(a, tmp))
            runs["after"].append(_child(a, None))
    best = {k: {n: min(r[n]["s"] for r in v) for n in ("fast", "full")} for k, v in runs.items()}
    first = {k: v[0] for k, v in runs.items()}
    print(f"simulate {a.model} batch {a.batch} x {a.seq}, bf16, 2 steps; best of {a.repeat}, after imports")
    print(f"{'run':<34}{'before s':>10}{'after s':>10}{'speed-up':>10}{'same peak':>11}")
    for n, label in (("fast", f"simulate (2,3 -> {first['after']['layers']})"), ("full", "simulate full depth")):
        same = all(r[n]["peak"] == first["before"][n]["peak"] and r[n]["breakdown"] == first["before"][n]["breakdown"]
                   for v in runs.values() for r in v)
        print(f"{label:<34}{best['before'][n]:>10.2f}{best['after'][n]:>10.2f}"
              f"{best['before'][n] / best['after'][n]:>10.2f}{'yes' if same else 'NO':>11}")
    print(f"{'full / extrapolated':<34}{best['before']['full'] / best['before']['fast']:>10.2f}"
          f"{best['after']['full'] / best['after']['fast']:>10.2f}")
    print(f"predicted step time (s): before {first['before']['fast']['step_time_s']:.4g}, "
          f"after {first['after']['fast']['step_time_s']:.4g}")


def _real_trl_step(a: argparse.Namespace) -> float:
    """Wall time of one real optimizer step of the same candidate through TRL's SFTTrainer on the CPU (the path
    the simulator replays: fused LM head, checkpointing, the same collator), excluding set-up."""
    from transformers import TrainerCallback
    from trl import SFTTrainer

    from advisor.emit import build_config
    from advisor.modeling import build_model, placeholder_tokenizer

    spec, _, wl, cand = _workload(a)
    times: list[float] = []

    class _StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            times[-1] = time.perf_counter() - times[-1]

    with tempfile.TemporaryDirectory(prefix="bench-real-") as tmp:
        args = build_config(cand, wl, output_dir=tmp, use_cpu=True, max_steps=1, report_to="none",
                                save_strategy="no", logging_steps=1, train_sampling_strategy="sequential",
                                dataloader_num_workers=0)
        trainer = SFTTrainer(model=build_model(spec, cand, device="cpu"), args=args,
                             train_dataset=wl.dataset.to_hf(), processing_class=placeholder_tokenizer(spec),
                             callbacks=[_StepTimer()])
        trainer.train()
    return times[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--no-real", action="store_true", help="skip the real TRL step on the CPU (minutes)")
    p.add_argument("--against", metavar="REF", help="also time the simulator as committed at this git ref")
    p.add_argument("--repeat", type=int, default=2, help="with --against: runs of each tree, alternating")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(_time_simulations(a)))
        return
    if a.against:
        _against(a)
        return

    t = _time_simulations(a)
    t_fast, t_full = t["fast"]["s"], t["full"]["s"]
    print(f"{'run':<28}{'wall s':>10}{'peak GiB':>12}{'ratio':>10}")
    label = f"simulate (2,3 -> {t['layers']})"
    print(f"{label:<28}{t_fast:>10.2f}{t['fast']['peak'] / 2**30:>12.3f}{1:>10.2f}")
    print(f"{'simulate full depth':<28}{t_full:>10.2f}{t['full']['peak'] / 2**30:>12.3f}{t_full / t_fast:>10.2f}")
    if not a.no_real:
        t_real = _real_trl_step(a)
        print(f"{'one real CPU step (TRL)':<28}{t_real:>10.2f}{'':>12}{t_real / t_fast:>10.2f}")
        print(f"simulator's predicted CPU step time: {t['fast']['step_time_s']:.2f} s (real {t_real:.2f} s)")
    print(f"extrapolated vs full peak: {t['fast']['peak'] / t['full']['peak'] - 1:+.4%}")


if __name__ == "__main__":
    main()
