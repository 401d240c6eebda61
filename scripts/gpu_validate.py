"""Real CUDA steps of a configuration matrix next to the simulator's prediction, written to profiles/measurements/.

Run by scripts/gpu_validate.sh (which installs missing dependencies offline first). Each row: the probe's
max_memory_allocated / max_memory_reserved / NVML device peak / step time (advisor.probe, backend cuda) and the
simulator's peak_bytes / reserved_bytes / device_bytes / step time for the same candidate and the same GPU profile.

  python scripts/gpu_validate.py                       # Qwen2.5-0.5B shape on the local GPU (detected via NVML)
  python scripts/gpu_validate.py --gpu H100-80GB       # name the profile instead of detecting it
  python scripts/gpu_validate.py --dry-run             # print the matrix and check imports; runs nothing
  python scripts/gpu_validate.py --backend cpu --tiny  # the same code path on a tiny model and the CPU probe
  python scripts/gpu_validate.py --multi-gpu 2 8       # also FSDP2 on 2 and on 8 GPUs, per rank (issue 16)

With --multi-gpu N... (scripts/gpu_validate.sh passes 2 and the machine's GPU count when it has several) one small
case (MULTI_CASE) is probed on N ranks with FSDP2 (`accelerate launch --num_processes N`, advisor/probing/ranks.py)
next to `simulate_per_rank`; the rows go to "multi_gpu_rows" of the same JSON, each with every rank's peaks.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TINY_QWEN2 = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
    "max_position_embeddings": 4096, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "optuna", "nvidia-ml-py")
_FLASH = "kernels-community/flash-attn2"
# name -> Candidate fields on top of the base (bf16 autocast, sdpa, AdamW); every one at each batch size
MATRIX: dict[str, dict] = {
    "full-ckpt": {},
    "full-no-ckpt": {"activation_checkpointing": False},
    "lora-ckpt": {"use_lora": True, "weights_dtype": "bfloat16"},
    "packing-bfd": {"packing": True, "packing_strategy": "bfd"},
    "padding-free": {"packing": True, "packing_strategy": "bfd", "padding_free": True},
    # FlashAttention's varlen path (the simulator runs transformers' flash path on aten's flash meta kernels)
    "flash-packing-bfd": {"packing": True, "packing_strategy": "bfd", "attn_implementation": _FLASH},
    "flash-padding-free": {"padding_free": True, "max_length": None, "attn_implementation": _FLASH},
    # a long checkpointed run: packed rows of 4096 tokens (the synthetic rows are short; packing makes them long)
    "flash-long-ckpt": {"packing": True, "packing_strategy": "bfd", "max_length": 4096,
                        "attn_implementation": _FLASH},
}


# online RL (issue 23): GRPO steps, generation inside the step; name -> online knobs (TRL's config names) on top of
# ONLINE_BASE, and the trainer (GRPO unless "trainer" says; distillation's teacher is the --model itself: a resident
# teacher of the student's architecture). The vLLM cases run only where `import vllm` works (advisor[vllm]); each is
# one probe + one simulation.
ONLINE_BASE = {"num_generations": 4, "max_completion_length": 128}
ONLINE_MATRIX: dict[str, dict] = {
    "grpo-generate": {"use_vllm": False},
    "grpo-vllm-colocate": {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3},
    "grpo-vllm-colocate-sleep": {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3,
                                 "vllm_enable_sleep_mode": True},
    "distillation-generate": {"trainer": "distillation", "use_vllm": False, "beta": 0.5},
    "distillation-vllm-colocate": {"trainer": "distillation", "use_vllm": True, "vllm_mode": "colocate",
                                   "vllm_gpu_memory_utilization": 0.3},
}


def online_trainer(name: str) -> str:
    return ONLINE_MATRIX[name].get("trainer", "grpo")


def online_cases(only: tuple[str, ...] | None, *, vllm: bool) -> list[str]:
    """The online RL cases to run: those named in `only` (all when None), the vLLM ones only when vLLM imports."""
    names = [n for n in ONLINE_MATRIX if only is None or n in only]
    return [n for n in names if vllm or not ONLINE_MATRIX[n].get("use_vllm")]


def online_candidate(name: str, batch: int):
    """A GRPO candidate of the online matrix: `batch` completions a micro-batch, accumulated until the generation batch
    holds num_generations completions (TRL's rule: num_generations divides it), bf16, no checkpointing; sleep mode with
    expandable_segments off (vLLM's allocator refuses them together)."""
    from advisor.space import Candidate, with_knobs

    knobs = {**ONLINE_BASE, **ONLINE_MATRIX[name]}
    knobs.pop("trainer", None)
    if online_trainer(name) == "distillation":  # one completion per prompt: no groups to fill
        knobs.pop("num_generations")
    ga = max(1, -(-knobs.get("num_generations", 1) // batch))
    base = Candidate(per_device_train_batch_size=batch, gradient_accumulation_steps=ga, precision="bf16",
                     optim="adamw_torch", attn_implementation="sdpa", activation_checkpointing=False,
                     expandable_segments=not knobs.get("vllm_enable_sleep_mode", False))
    return with_knobs(base, **knobs)


def online_rows(a: argparse.Namespace, spec, gpu) -> list[dict]:
    """GRPO and distillation cases probed (the real trainer's train(), every completion forced to
    max_completion_length) next to the simulation (its train() on fake tensors; vLLM's side in closed form)."""
    import importlib.util

    from advisor.probing import probe
    from advisor.simulator import simulate
    from advisor.trainers.prompts import synthetic_prompts
    from advisor.workload import Goals, Workload

    names = online_cases(tuple(a.online) if a.online is not None else None,
                         vllm=importlib.util.find_spec("vllm") is not None and a.backend == "cuda")
    if not names:
        return []
    data = synthetic_prompts(spec.vocab_size, rows=max(16, a.batch[0] * 4), seed=0, median=64, max_len=128)
    rows = []
    for name in names:
        trainer = online_trainer(name)
        wl = Workload(model=spec, gpu=gpu, dataset=data, goals=Goals(), trainer=trainer,
                      teacher=spec if trainer == "distillation" else None)
        cand = online_candidate(name, a.batch[0])
        sim = simulate(wl, cand, gpu)
        real = probe(wl, cand, a.backend, steps=a.steps, warmup=a.warmup, timeout_s=a.timeout)
        row = {"case": name, "trainer": trainer, "batch_size": a.batch[0], "candidate": cand.to_dict(),
               "probe": _fields(real), "simulate": _fields(sim),
               "simulate_over_probe": {k: _ratio(getattr(sim, k), getattr(real, k))
                                       for k in ("peak_bytes", "reserved_bytes", "device_bytes", "step_time_s")}}
        rows.append(row)
        r = row["simulate_over_probe"]
        print(f"{name:<24} b{a.batch[0]}  probe {real.status.value:<7} peak {real.peak_bytes or 0:>14,} "
              f"sim {sim.status.value:<7} {sim.peak_bytes or 0:>14,}  sim/probe peak {r['peak_bytes']} device "
              f"{r['device_bytes']} step {r['step_time_s']}", flush=True)
    return rows


# the multi-GPU case: FSDP2 resharding after forward, checkpointed, at the first --batch size (short: it runs once per
# world size inside the script's time budget)
MULTI_CASE = {"activation_checkpointing": True, "parallelism": "fsdp2"}


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    fields: dict

    def candidate(self, max_length: int):
        from advisor.space import Candidate

        return Candidate(**{"max_length": max_length, "per_device_train_batch_size": self.batch, "precision": "bf16",
                            "optim": "adamw_torch", "attn_implementation": "sdpa", **self.fields})


def cases(batches: tuple[int, ...], only: tuple[str, ...] | None) -> list[Case]:
    names = [n for n in MATRIX if not only or n in only]
    return [Case(n, b, MATRIX[n]) for b in batches for n in names]


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_facts() -> dict:
    """GPU name, driver, CUDA runtime and memory from torch and NVML (what exists on this machine)."""
    import torch

    facts: dict = {"cuda_available": torch.cuda.is_available(), "cuda_runtime": torch.version.cuda}
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        driver = pynvml.nvmlSystemGetDriverVersion()
        facts.update(
            gpu_name=name.decode() if isinstance(name, bytes) else str(name),
            driver=driver.decode() if isinstance(driver, bytes) else str(driver),
            memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
        )
    except Exception as exc:  # no NVML on a CPU machine
        facts["nvml"] = f"unavailable: {exc}"
    return facts


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _fields(m) -> dict:
    out = {"status": m.status.value, "peak_bytes": m.peak_bytes, "reserved_bytes": m.reserved_bytes,
           "device_bytes": m.device_bytes, "step_time_s": m.step_time_s, "tokens_per_second": m.tokens_per_second,
           "time_breakdown": dict(m.time_breakdown), "mfu": m.mfu, "worst_step_time_s": m.worst_step_time_s,
           "message": m.message, "notes": list(m.notes)}
    if m.ranks:  # a probe of several ranks: each rank's own peaks and step time
        out["ranks"] = m.to_dict()["ranks"]
    return out


def multi_gpu_rows(a: argparse.Namespace, wl, max_length: int) -> list[dict]:
    """MULTI_CASE probed on each world size of --multi-gpu (FSDP2 through accelerate launch) next to the per-rank
    simulation; ratios are simulated / probed, per rank (the budget applies to each) and for the global tokens/s."""
    import dataclasses

    from advisor.parallelism import Layout
    from advisor.probing import probe
    from advisor.simulator import simulate_per_rank

    rows = []
    for n in a.multi_gpu:
        wln = dataclasses.replace(wl, num_gpus=n)
        case = Case(f"fsdp2-{n}gpu", a.batch[0], MULTI_CASE)
        cand = case.candidate(max_length)
        sim = simulate_per_rank(wln, cand, n, Layout(cand.parallelism).parallelism, gpu=wl.gpu)
        real = probe(wln, cand, a.backend, steps=a.steps, warmup=a.warmup, timeout_s=a.timeout)
        per_rank = [_ratio(sim.peak_bytes, r.peak_bytes) for r in real.ranks]
        row = {"case": case.name, "num_gpus": n, "batch_size": case.batch, "candidate": cand.to_dict(),
               "probe": _fields(real), "simulate": _fields(sim),
               "simulate_over_probe": {"peak_bytes_per_rank": per_rank,
                                       **{k: _ratio(getattr(sim, k), getattr(real, k))
                                          for k in ("peak_bytes", "reserved_bytes", "device_bytes")},
                                       "tokens_per_second": (round(sim.tokens_per_second / real.tokens_per_second, 4)
                                                             if sim.tokens_per_second and real.tokens_per_second
                                                             else None)}}
        rows.append(row)
        print(f"{case.name:<14} b{case.batch}  probe {real.status.value:<7} peak {real.peak_bytes or 0:>14,} "
              f"sim {sim.peak_bytes or 0:>14,}  sim/probe per rank {per_rank} tokens/s "
              f"{row['simulate_over_probe']['tokens_per_second']} {real.message}", flush=True)
    return rows


def predicted_probe_step_s(sim, kinds: list[str]) -> float | None:
    """The simulator's prediction for the steps the probe timed: the worst batch's step time for its
    `longest` steps, the expected step time over the sampler's batches for its `typical` (random-row) steps."""
    if not sim.step_time_s or not kinds:
        return None
    worst = sim.worst_step_time_s or sim.step_time_s
    return sum(worst if k == "longest" else sim.step_time_s for k in kinds) / len(kinds)


# ---- fitting the step-time model's constants to the measured step times ------------------------------------------

# Each fitted multiplier scales one group of the model's terms (advisor/_physics/timing Term values) and is applied to
# the constants behind it: matmul -> gemm efficiency (the LM head's tile GEMMs included), attention -> attention
# efficiencies, memory_bound -> achievable bandwidth (memory-bound ops, dequantisation, the optimizer's passes,
# copies), launch_host -> host time per op.
FIT_GROUPS = {
    "matmul": ("matmul", "lm_head"),
    "attention": ("attention",),
    "memory_bound": ("memory_bound", "dequantization", "optimizer", "offload_copies"),
    "launch_host": ("launch_host",),
}


def fit_time_constants(rows: list[dict]) -> dict:
    """Multipliers per term group that best explain the measured step times: measured_i = sum_g m_g x predicted_ig.

    Non-negative least squares (active set: solve, drop groups with a negative or zero multiplier, solve again) when
    there are more cases than groups with a predicted share; otherwise, or when the system is rank-deficient, one
    ratio for every group: the median of measured / predicted. Rows without a measured or predicted time are
    skipped. Returns {"method", "multipliers", "cases", "rms_relative_error_before", "..._after"}."""
    import numpy as np

    cases = []
    for r in rows:
        probe, sim = r.get("probe") or {}, r.get("simulate") or {}
        measured, terms = probe.get("step_time_s"), sim.get("time_breakdown") or {}
        # the breakdown is of the expected step: scaled to the prediction for the steps the probe timed
        target = r.get("predicted_probe_step_s") or sim.get("step_time_s")
        total = sum(float(v) for v in terms.values())
        if probe.get("status") == "ok" and measured and terms and target and total > 0:
            scale = float(target) / total
            cases.append((float(measured), [scale * sum(float(terms.get(t, 0.0)) for t in ts)
                                            for ts in FIT_GROUPS.values()]))
    if not cases:
        return {"method": "none", "multipliers": {}, "cases": 0}
    y = np.array([c[0] for c in cases])
    x = np.array([c[1] for c in cases])
    names = list(FIT_GROUPS)
    active = [j for j in range(len(names)) if x[:, j].sum() > 0]
    multipliers = dict.fromkeys(names, 1.0)
    method = "ratio (median of measured / predicted)"
    if len(cases) > len(active) and np.linalg.matrix_rank(x[:, active]) == len(active):
        keep = list(active)
        while keep:
            sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            if (sol > 0).all():
                for j, v in zip(keep, sol, strict=True):
                    multipliers[names[j]] = float(v)
                method = "non-negative least squares per term group"
                break
            keep = [j for j, v in zip(keep, sol, strict=True) if v > 0]
    if method.startswith("ratio"):
        ratio = float(np.median(y / x.sum(axis=1)))
        multipliers = dict.fromkeys(names, ratio)
    m = np.array([multipliers[n] for n in names])

    def rms(pred):
        return float(np.sqrt(np.mean(((pred - y) / y) ** 2)))

    return {"method": method, "multipliers": {k: round(v, 4) for k, v in multipliers.items()}, "cases": len(cases),
            "groups": {k: list(v) for k, v in FIT_GROUPS.items()},
            "rms_relative_error_before": round(rms(x.sum(axis=1)), 4), "rms_relative_error_after": round(rms(x @ m), 4)}


def _ratio(a: int | None, b: int | None) -> float | None:
    return round(a / b, 4) if a and b else None


def run(a: argparse.Namespace) -> int:
    from advisor.data import synthetic
    from advisor.probing import probe
    from advisor.probing.runner import plan_batches
    from advisor.profiles import detect_gpu, resolve_gpu, resolve_model
    from advisor.simulator import simulate
    from advisor.workload import Goals, ModelSpec, Workload

    matrix = cases(tuple(a.batch), tuple(a.only) if a.only else None)
    if a.tiny:
        spec = ModelSpec(name="tiny-qwen2", config=dict(TINY_QWEN2), source="local")
    else:
        spec = resolve_model(a.model)
    if a.gpu:
        gpu = resolve_gpu(a.gpu)
    elif a.backend == "cuda":
        gpu = detect_gpu()
        if gpu is None:
            print("no CUDA GPU found through NVML: give --gpu NAME, or --backend cpu --tiny to test on the CPU",
                  file=sys.stderr)
            return 2
    else:
        gpu = resolve_gpu("cpu")
    max_length = a.max_length or (128 if a.tiny else 1024)
    print(f"model {spec.name} ({spec.num_layers} layers), gpu profile {gpu.name}, backend {a.backend}, "
          f"max_length {max_length}, {len(matrix)} cases")
    for c in matrix:
        print(f"  {c.name:<14} batch {c.batch}  {c.fields}")
    for n in a.multi_gpu:
        print(f"  fsdp2-{n}gpu     batch {a.batch[0]}  {MULTI_CASE} on {n} ranks")
    for n in online_cases(tuple(a.online) if a.online is not None else None, vllm=True):
        print(f"  {n:<24} batch {a.batch[0]}  {ONLINE_MATRIX[n]} (vLLM cases only where vllm imports)")
    print("versions:", json.dumps(versions()))
    if a.dry_run:
        for c in matrix:  # every candidate must be valid for TRL on this target before a GPU is spent on it
            c.candidate(max_length).check(gpu, spec)
        from advisor.trainers import get_trainer

        for n in online_cases(tuple(a.online) if a.online is not None else None, vllm=gpu.is_cuda):
            problems = get_trainer(online_trainer(n)).problems(online_candidate(n, a.batch[0]), gpu, spec)
            if problems:
                print(f"{n}: " + "; ".join(problems), file=sys.stderr)
                return 2
        for n in a.multi_gpu:
            from advisor.parallelism import Layout, layout_problems

            cand = Case("multi", a.batch[0], MULTI_CASE).candidate(max_length)
            cand.check(gpu, spec)
            problems = layout_problems(Layout(cand.parallelism), n)
            if problems:
                print("; ".join(problems), file=sys.stderr)
                return 2
        return 0

    data = synthetic(vocab_size=spec.vocab_size, rows=a.rows, seed=0, median=max_length // 2, max_len=max_length)
    wl = Workload(model=spec, gpu=gpu, dataset=data, goals=Goals())
    rows = []
    started = time.perf_counter()
    for c in matrix:
        cand = c.candidate(max_length)
        sim = simulate(wl, cand, gpu)
        real = probe(wl, cand, a.backend, steps=a.steps, warmup=a.warmup, timeout_s=a.timeout)
        kinds = [k.value for k in plan_batches(wl, cand, a.steps, a.warmup).kinds[a.warmup:]]
        row = {"case": c.name, "batch_size": c.batch, "candidate": cand.to_dict(), "probe": _fields(real),
               "simulate": _fields(sim), "probe_step_kinds": kinds,
               "predicted_probe_step_s": predicted_probe_step_s(sim, kinds),
               "simulate_over_probe": {k: _ratio(getattr(sim, k), getattr(real, k))
                                       for k in ("peak_bytes", "reserved_bytes", "device_bytes", "step_time_s")}}
        # the step time is compared for the batches the probe timed (its longest and typical steps)
        row["simulate_over_probe"]["step_time_s"] = _ratio(row["predicted_probe_step_s"], real.step_time_s)
        rows.append(row)
        r = row["simulate_over_probe"]
        print(f"{c.name:<14} b{c.batch}  probe {real.status.value:<7} peak {real.peak_bytes or 0:>14,} "
              f"sim {sim.peak_bytes or 0:>14,}  sim/probe peak {r['peak_bytes']} reserved {r['reserved_bytes']} "
              f"device {r['device_bytes']} step {r['step_time_s']} (measured {real.step_time_s} s, predicted "
              f"{row['predicted_probe_step_s']} s)", flush=True)
    multi = multi_gpu_rows(a, wl, max_length) if a.multi_gpu else []
    online = online_rows(a, spec, gpu)
    out = {
        "schema_version": 1,
        "source": "scripts/gpu_validate.sh",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "gpu_profile": gpu.name,
        "device": device_facts(),
        "versions": versions(),
        "model": spec.name,
        "backend": a.backend,
        "steps": a.steps,
        "warmup": a.warmup,
        "max_length": max_length,
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "os": platform.platform()},
        "dataset_rows": a.rows,
        "rows": rows,
        **({"multi_gpu_rows": multi} if multi else {}),
        **({"online_rows": online} if online else {}),
    }
    if a.backend == "cuda":
        out["fitted_time_constants"] = {
            **fit_time_constants(rows),
            "applies_to": "advisor/_physics/timing time_constants() for this GPU profile (multipliers of the "
                          "profiles/measurements/time_constants.json values)",
        }
        f = out["fitted_time_constants"]
        print(f"fitted time constants ({f['method']}, {f['cases']} cases): {f['multipliers']}; rms relative error "
              f"{f.get('rms_relative_error_before')} -> {f.get('rms_relative_error_after')}")
    path = Path(a.out) if a.out else ROOT / "profiles" / "measurements" / f"{slug(gpu.name)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B", help="a model shape from profiles/models/")
    p.add_argument("--gpu", help="GPU profile name (default: detected through NVML)")
    p.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer 64-wide Qwen2 instead of --model (CPU tests)")
    p.add_argument("--batch", type=int, nargs="+", default=[2, 4], help="per-device batch sizes (default 2 4)")
    p.add_argument("--only", nargs="+", choices=sorted(MATRIX), help="a subset of the matrix")
    p.add_argument("--max-length", type=int, help="default 1024 (128 with --tiny)")
    p.add_argument("--rows", type=int, default=64, help="synthetic dataset rows")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a probe may go without progress")
    p.add_argument("--out", help="default profiles/measurements/<gpu>.json")
    p.add_argument("--dry-run", action="store_true", help="print the matrix and check imports and candidates")
    p.add_argument("--multi-gpu", type=int, nargs="*", default=[], metavar="N",
                   help="also probe MULTI_CASE with FSDP2 on N ranks (each N > 1), per rank, next to the simulation")
    p.add_argument("--online", nargs="*", choices=sorted(ONLINE_MATRIX), default=None, metavar="CASE",
                   help="the online RL (GRPO, distillation) cases to run (default: all; the vLLM ones where vllm "
                        "imports; --online with no name: none)")
    a = p.parse_args(argv)
    bad = [n for n in a.multi_gpu if n < 2]
    if bad:
        p.error(f"--multi-gpu {bad[0]}: a world size of at least 2 (one GPU is the matrix above)")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
