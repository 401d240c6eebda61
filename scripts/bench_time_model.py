"""The step-time model on reference workloads: predicted step time, its terms and MFU; predicted vs measured.

  python scripts/bench_time_model.py                      # the reference table (simulate and estimate), L4 and H100
  python scripts/bench_time_model.py --json out.json      # also write the rows
  python scripts/bench_time_model.py --calibrate-estimate # the estimate's per-layer op and byte counts, from fake runs
  python scripts/bench_time_model.py --h200 --json after.json  # the H200 runs of issue 30: 0.5B SFT and GRPO picks
      # (PYTHONPATH=<another checkout> with the same script: that revision's predictions, for the ratio)
  python scripts/bench_time_model.py --layouts --json after.json [--before before.json]
      # several GPUs: per term, simulate vs estimate for each layout (DDP, FSDP2 with and without resharding, FSDP2
      # offload, ZeRO-2/3) on Llama-3.1-8B x 8 H100 and Qwen2.5-0.5B x 2 L4, and the pick (the fastest layout that
      # fits, by the simulator); --before: the same rows from another revision (PYTHONPATH=<its checkout>), to print
      # the picks before/after

Reference workloads: Qwen2.5-0.5B and SmolLM2-135M full fine-tuning, Llama-3.1-8B LoRA (r 16, bf16 weights), each
on the synthetic chat set at max_length 1024 with bf16 autocast, checkpointing and the fused AdamW, micro-batch 4
(Llama: 2). Wherever profiles/measurements/*.json holds real step times from a GPU (scripts/gpu_validate.sh rows
with a probe-cuda step time), each is printed next to the simulator's prediction for the same candidate, with the
ratio; when none exists the script says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKLOADS = (
    ("Qwen/Qwen2.5-0.5B", "full", {"per_device_train_batch_size": 4}),
    ("HuggingFaceTB/SmolLM2-135M", "full", {"per_device_train_batch_size": 4}),
    ("meta-llama/Llama-3.1-8B", "lora", {"per_device_train_batch_size": 2, "use_lora": True,
                                         "weights_dtype": "bfloat16"}),
)
GPUS = ("L4", "H100-80GB")
BASE = {"max_length": 1024, "precision": "bf16", "activation_checkpointing": True, "optim": "adamw_torch_fused"}


def _workload(model: str, gpu: str, rows: int = 256):
    from advisor.data import synthetic
    from advisor.profiles import resolve_gpu, resolve_model
    from advisor.workload import Goals, Workload

    spec = resolve_model(model)
    data = synthetic(vocab_size=spec.vocab_size, rows=rows, seed=0, median=512, max_len=2048)
    return Workload(model=spec, gpu=resolve_gpu(gpu), dataset=data, goals=Goals())


def reference(rows: list[dict]) -> None:
    from advisor.estimator import estimate
    from advisor.simulator import simulate
    from advisor.space import Candidate

    for model, method, fields in WORKLOADS:
        for gpu in GPUS:
            wl = _workload(model, gpu)
            cand = Candidate(**{**BASE, **fields})
            started = time.perf_counter()
            sim = simulate(wl, cand)
            wall = time.perf_counter() - started
            est = estimate(wl, cand)
            for backend, m in (("simulate", sim), ("estimate", est)):
                rows.append({"model": model, "method": method, "gpu": wl.gpu.name, "backend": backend,
                             "candidate": f"{cand.per_device_train_batch_size}x{cand.gradient_accumulation_steps} "
                                          f"L={cand.max_length}", "step_time_s": m.step_time_s,
                             "tokens_per_second": m.tokens_per_second, "mfu": m.mfu,
                             "terms": dict(m.time_breakdown), "wall_s": round(wall, 1) if backend == "simulate"
                             else None})
    terms = ("matmul", "attention", "memory_bound", "lm_head", "dequantization", "optimizer", "offload_copies",
             "launch_host")
    head = f"{'model':<32}{'gpu':<15}{'backend':<9}{'step s':>8}{'tok/s':>9}{'MFU':>7}  " + " ".join(
        f"{t[:8]:>8}" for t in terms)
    print(head)
    print("-" * len(head))
    for r in rows:
        parts = " ".join(f"{1e3 * r['terms'].get(t, 0.0):8.1f}" for t in terms)
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        name = r["model"] + " " + r["method"]
        print(f"{name:<32}{r['gpu']:<15}{r['backend']:<9}{r['step_time_s']:8.3f}"
              f"{r['tokens_per_second']:9.0f}{mfu:>7}  {parts}")
    print("(terms in ms per optimizer step; they sum to the step time)")


def measured_rows() -> list[dict]:
    """Rows of profiles/measurements/*.json that carry a real (probe-cuda) step time."""
    out = []
    for path in sorted((ROOT / "profiles" / "measurements").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if not isinstance(data, dict) or data.get("backend") != "cuda":
            continue
        for row in data.get("rows", []):
            probe = row.get("probe") or {}
            if probe.get("status") == "ok" and probe.get("step_time_s"):
                out.append({"file": path.name, "gpu": data.get("gpu_profile"), "model": data.get("model"),
                            "rows": data.get("dataset_rows", 64), "max_length": data.get("max_length"), **row})
    return out


def predicted_probe_step_s(m, kinds: list[str]) -> float:
    """The prediction for the steps a probe timed: the worst batch for `longest` steps, the expectation else."""
    worst = m.worst_step_time_s or m.step_time_s
    return sum(worst if k == "longest" else m.step_time_s for k in kinds) / len(kinds)


def compare(rows: list[dict]) -> None:
    from advisor.simulator import simulate
    from advisor.space import Candidate

    found = measured_rows()
    if not found:
        print("\nno real step times in profiles/measurements/ yet (scripts/gpu_validate.sh writes them on a GPU): "
              "nothing to compare")
        return
    print(f"\n{'file':<24}{'case':<16}{'batch':>6}{'measured s':>12}{'predicted s':>13}{'pred/meas':>10}")
    for r in found:
        wl = _workload(r["model"], r["gpu"], rows=int(r.get("rows") or 64))
        if r.get("max_length"):
            from advisor.data import synthetic

            ml = int(r["max_length"])
            data = synthetic(vocab_size=wl.model.vocab_size, rows=int(r.get("rows") or 64), seed=0,
                             median=ml // 2, max_len=ml)
            wl = type(wl)(model=wl.model, gpu=wl.gpu, dataset=data, goals=wl.goals)
        cand = Candidate.from_dict(r["candidate"])
        m = simulate(wl, cand)
        meas = float(r["probe"]["step_time_s"])
        pred = predicted_probe_step_s(m, r.get("probe_step_kinds") or ["typical"])
        rows.append({"compare": True, "file": r["file"], "case": r["case"], "batch": r["batch_size"],
                     "measured_s": meas, "predicted_s": pred, "ratio": pred / meas})
        print(f"{r['file']:<24}{r['case']:<16}{r['batch_size']:>6}{meas:12.4f}{pred:13.4f}{pred / meas:10.3f}")


# ---- the estimate's per-layer counts, measured on the fake run ---------------------------------------------------

CALIBRATION = {
    "base": {"weights_dtype": "bfloat16", "activation_checkpointing": False},
    "base_ckpt": {"weights_dtype": "bfloat16"},
    "autocast": {"activation_checkpointing": False},
    "autocast_ckpt": {},
    "lora": {"use_lora": True, "weights_dtype": "bfloat16", "activation_checkpointing": False},
    "lora_ckpt": {"use_lora": True, "weights_dtype": "bfloat16"},
}


def calibrate() -> dict:
    """Per decoder layer and micro-step: kernel launches, host ops and memory-bound bytes per token, split into
    forward (what checkpointing recomputes) and backward, in multiples of hidden and intermediate (two models with
    different ratios solve the 2x2 system); the ops by how the host issues them (host.OpClass: grad off, grad on,
    autograd's engine), inside a layer and outside the layers, and the syncs."""
    import numpy as np

    from advisor.physics import Basis, OpClass, Term, time_constants
    from advisor.simulator import runnable as _runnable
    from advisor.simulator import simulate_depth

    _TERMS = tuple(Term)  # the order of the model's terms
    from advisor.space import Candidate

    mem = _TERMS.index(Term.MEMORY)
    classes = {c.name.lower(): int(c) for c in OpClass}

    def counts(trace, inside):
        ops = {k: int(((trace.cls == v) & inside).sum()) for k, v in classes.items()}
        launches = {k: int(((trace.cls == v) & inside & trace.kernel).sum()) for k, v in classes.items()}
        return ops, launches

    per: dict[str, dict[str, tuple]] = {}
    for model in ("Qwen/Qwen2.5-0.5B", "HuggingFaceTB/SmolLM2-135M"):
        wl = _workload(model, "H100-80GB", rows=64)
        tc = time_constants(wl.gpu)
        h, inter = wl.model.hidden_size, int(wl.model.text_value("intermediate_size"))
        for name, fields in CALIBRATION.items():
            c = Candidate(max_length=1024, per_device_train_batch_size=4, **fields)
            rc, _ = _runnable(c, wl.gpu)
            lo, hi = (simulate_depth(wl, rc, wl.gpu, n, steps=2, original=c).cost for n in (2, 3))
            dbytes = (hi.device[mem, Basis.TOKENS] - lo.device[mem, Basis.TOKENS]) * tc.mem_bw
            thi = hi.micro[-1][0]
            layer = thi.layer == 1  # a middle layer of the 3-layer run
            ops, launches = counts(thi, layer)
            out_ops, out_launches = counts(thi, thi.layer < 0)
            fwd = (thi.cls != int(OpClass.BACKWARD)) & layer
            row_mem = thi.device[:, Basis.TOKENS] * (thi.term == mem)
            fwd_share = float(row_mem[fwd].sum() / max(row_mem[layer].sum(), 1e-30))
            per.setdefault(name, {})[model] = (h, inter, float(dbytes), hi.launches - lo.launches,
                                               (hi.host_s - lo.host_s), lo.launches - 2 * (hi.launches
                                                                                          - lo.launches),
                                               ops, launches, out_ops, out_launches, fwd_share, thi.syncs)
    out: dict[str, dict] = {}
    for name, by_model in per.items():
        rows = list(by_model.values())
        (h1, i1, b1, l1, _, x1, *_), (h2, i2, b2, l2, _, x2, *_) = rows
        coef = np.linalg.solve(np.array([[h1, i1], [h2, i2]], dtype=float), np.array([b1, b2]))

        def mean(i, key, rows=rows):
            return round((rows[0][i][key] + rows[1][i][key]) / 2, 1)

        out[name] = {"bytes_per_token": {"hidden": round(float(coef[0]), 1), "intermediate": round(float(coef[1]), 1)},
                     "launches": round((l1 + l2) / 2, 1),
                     "ops": {k: mean(6, k) for k in ("nograd", "grad", "backward")},
                     "kernel_ops": {k: mean(7, k) for k in ("nograd", "grad", "backward")},
                     "outside_ops": {k: mean(8, k) for k in ("nograd", "grad", "backward")},
                     "outside_kernel_ops": {k: mean(9, k) for k in ("nograd", "grad", "backward")},
                     "forward_memory_share": round((rows[0][10] + rows[1][10]) / 2, 3),
                     "syncs": max(rows[0][11], rows[1][11]),
                     "outside_launches": round((x1 + x2) / 2, 1)}
    return out


# ---- several GPUs: the layouts per term, simulate vs estimate --------------------------------------------------------

# the knobs of the 8 x H100 example's pick (README "Several GPUs", issue 24): full fine-tuning, bf16 autocast over
# float32 weights, 1 x 3008 packed (bfd), FlashAttention 2, no checkpointing, 8-bit AdamW
MULTI = (
    ("meta-llama/Llama-3.1-8B", "H100-80GB", 8,
     {"max_length": 3008, "packing": True, "packing_strategy": "bfd", "per_device_train_batch_size": 1,
      "activation_checkpointing": False, "optim": "adamw_bnb_8bit", "precision": "bf16",
      "attn_implementation": "kernels-community/flash-attn2", "expandable_segments": True}),
    ("Qwen/Qwen2.5-0.5B", "L4", 2,
     {"max_length": 1024, "per_device_train_batch_size": 4, "activation_checkpointing": True,
      "optim": "adamw_torch_fused", "precision": "bf16", "attn_implementation": "sdpa"}),
)
LAYOUTS = ("ddp", "fsdp2", "fsdp2_no_reshard", "fsdp2_offload", "zero2", "zero3")
TERMS = ("matmul", "attention", "memory_bound", "lm_head", "optimizer", "launch_host", "communication_exposed")


def layouts(rows: list[dict]) -> None:
    """Each layout of each multi-GPU case through both backends; ZeRO modelled as if deepspeed were installed."""
    import advisor.parallelism as par
    from advisor.estimator import estimate
    from advisor.inputs import build_workload
    from advisor.measurement import Status
    from advisor.simulator import simulate_per_rank
    from advisor.space import Candidate

    par.deepspeed_available = lambda: True  # ZeRO is modelled in closed form either way (no deepspeed run)
    for model, gpu, n, knobs in MULTI:
        wl = build_workload(model, gpu=gpu, num_gpus=n)
        for layout in LAYOUTS:
            cand = Candidate(**knobs, parallelism=layout)
            started = time.perf_counter()
            sim = simulate_per_rank(wl, cand, parallelism=cand.parallelism.parallelism)
            wall = time.perf_counter() - started
            est = estimate(wl, cand)
            for backend, m in (("simulate", sim), ("estimate", est)):
                rows.append({"model": model, "gpu": gpu, "num_gpus": n, "layout": layout, "backend": backend,
                             "fits": m.status is Status.OK, "gib": (m.device_bytes or m.peak_bytes) / 2**30,
                             "step_time_s": m.step_time_s, "tokens_per_second": m.tokens_per_second,
                             "terms": dict(m.time_breakdown), "wall_s": round(wall, 1) if backend == "simulate"
                             else None})
            print(f"  {model} x {n} {gpu} {layout}: simulated in {wall:.0f} s", file=sys.stderr, flush=True)


def print_layouts(rows: list[dict], before: list[dict] | None) -> None:
    head = (f"{'case':<28}{'layout':<18}{'backend':<9}{'fits':>5}{'GiB':>7}{'tok/s':>9}  "
            + " ".join(f"{t[:8]:>8}" for t in TERMS))
    for case in dict.fromkeys((r["model"], r["gpu"], r["num_gpus"]) for r in rows if "layout" in r):
        print()
        print(head)
        print("-" * len(head))
        mine = [r for r in rows if (r.get("model"), r.get("gpu"), r.get("num_gpus")) == case and "layout" in r]
        name = f"{case[0].split('/')[-1]} x {case[2]} {case[1]}"
        for r in mine:
            parts = " ".join(f"{1e3 * r['terms'].get(t, 0.0):8.1f}" for t in TERMS)
            print(f"{name:<28}{r['layout']:<18}{r['backend']:<9}{'yes' if r['fits'] else 'no':>5}{r['gib']:7.2f}"
                  f"{r['tokens_per_second'] or 0:9.0f}  {parts}")
        for label, table in (("before", before), ("after", rows)):
            if table is None:
                continue
            for backend in ("simulate", "estimate"):
                ok = [r for r in table if (r.get("model"), r.get("gpu"), r.get("num_gpus")) == case
                      and r.get("backend") == backend and r.get("fits") and r.get("tokens_per_second")]
                if ok:
                    best = max(ok, key=lambda r: r["tokens_per_second"])
                    print(f"pick {label:<6} ({backend}): {best['layout']} {best['tokens_per_second']:,.0f} tok/s, "
                          f"{best['gib']:.2f} GiB a rank")
    print("(terms in ms per optimizer step; the pick: the fastest layout that fits, among these knobs)")


# the held-out H200 runs of issue 30: Qwen2.5-0.5B, 4 x 1024 packed with checkpointing and the fused AdamW (SFT);
# GRPO at TRL 1.16's defaults with transformers' generate (profiles/baselines/qwen2.5-0.5b-h100-grpo-trl-defaults)
H200_SFT = {"per_device_train_batch_size": 4, "max_length": 1024, "packing": True, "activation_checkpointing": True,
            "optim": "adamw_torch_fused", "precision": "bf16"}


def h200(rows: list[dict]) -> None:
    """Both cases through simulate and estimate on the H200 profile, with the time's parts and the two queues."""
    from advisor.baseline import load_baseline
    from advisor.estimator import estimate
    from advisor.inputs import build_workload
    from advisor.simulator import simulate
    from advisor.space import Candidate

    grpo = load_baseline(ROOT / "profiles" / "baselines" / "qwen2.5-0.5b-h100-grpo-trl-defaults.json")
    cases = (("sft 4x1024 packed ckpt fused", build_workload("Qwen/Qwen2.5-0.5B", gpu="H200"),
              Candidate(**H200_SFT)),
             ("grpo trl defaults (generate)", build_workload("Qwen/Qwen2.5-0.5B", gpu="H200", trainer="grpo"),
              grpo.candidate))
    for name, wl, cand in cases:
        cand = cand.for_model(wl.model)  # transformers' attention as the run resolves it
        for backend, fn in (("simulate", simulate), ("estimate", estimate)):
            started = time.perf_counter()
            m = fn(wl, cand)
            detail = getattr(m, "time_detail", {}) or {}
            rows.append({"case": name, "backend": backend, "step_time_s": m.step_time_s,
                         "tokens_per_second": m.tokens_per_second, "terms": dict(m.time_breakdown),
                         "detail": {k: v for k, v in detail.items() if not isinstance(v, list)}})
            print(f"  {name} {backend}: {time.perf_counter() - started:.0f} s, {m.step_time_s} s a step",
                  file=sys.stderr, flush=True)
    for r in rows:
        parts = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in sorted(r["terms"].items(), key=lambda kv: -kv[1]))
        d = r["detail"]
        queues = (f"; host-bound {1e3 * d['host_bound_s']:.1f} ms, {d['ops']:,.0f} ops, {d['syncs']:.0f} syncs"
                  if "host_bound_s" in d else "")
        gen = f"; decode {1e3 * d['decode_token_s']:.2f} ms a token" if "decode_token_s" in d else ""
        print(f"{r['case']:<30}{r['backend']:<9}{r['step_time_s']:9.4f} s  ({parts} ms{queues}{gen})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--calibrate-estimate", action="store_true",
                   help="print the estimate's per-layer counts measured on the fake run (time_constants.json)")
    p.add_argument("--layouts", action="store_true",
                   help="several GPUs: each layout per term, simulate vs estimate, and the pick")
    p.add_argument("--before", help="with --layouts: rows (--json) of another revision, to print its picks too")
    p.add_argument("--h200", action="store_true", help="the H200 runs of issue 30 (0.5B SFT, GRPO with generate)")
    a = p.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    if a.calibrate_estimate:
        print(json.dumps(calibrate(), indent=1))
        return 0
    started = time.perf_counter()
    rows: list[dict] = []
    if a.h200:
        h200(rows)
    elif a.layouts:
        layouts(rows)
        print_layouts(rows, json.loads(Path(a.before).read_text()) if a.before else None)
    else:
        reference(rows)
        compare(rows)
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
