"""What scripts/gpu_validate.py measures in one case: a candidate probed for real next to the simulator's prediction.

The driver (scripts/gpu_validate.py) owns the plan, the budgets and the JSON; this module owns the measurements:
the matrices (SFT, online RL, several GPUs), the target every case shares (`Target`: model shape, GPU profile,
backend, length, batch), the random model saved once for every case (`save_random_models`), one case's probe with
where its time went (`probe_case`), one case's simulation (`simulate_case`, also run ahead in a process of its own by
`simulate_worker`), the row that puts them side by side (`case_row`) and the fit of the step-time model's constants
(`fit_time_constants`). Nothing runs on import.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from enum import Enum
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TINY_QWEN2 = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
    "max_position_embeddings": 4096, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "optuna", "nvidia-ml-py")
_FLASH = "kernels-community/flash-attn2"
# SFT: name -> Candidate fields on top of the base (bf16 autocast, sdpa, AdamW)
MATRIX: dict[str, dict] = {
    "full-ckpt": {},
    "full-no-ckpt": {"activation_checkpointing": False},
    "lora-ckpt": {"use_lora": True, "weights_dtype": "bfloat16"},
    # bfd packing is padding-free in TRL 1.16 (Candidate.effective_padding_free): "padding-free" runs the same step
    "packing-bfd": {"packing": True, "packing_strategy": "bfd"},
    "padding-free": {"packing": True, "packing_strategy": "bfd", "padding_free": True},
    # FlashAttention's varlen path (the simulator runs transformers' flash path on aten's flash meta kernels)
    "flash-packing-bfd": {"packing": True, "packing_strategy": "bfd", "attn_implementation": _FLASH},
    "flash-padding-free": {"padding_free": True, "max_length": None, "attn_implementation": _FLASH},
    # a long checkpointed run: packed rows of 4096 tokens (the synthetic rows are short; packing makes them long)
    "flash-long-ckpt": {"packing": True, "packing_strategy": "bfd", "max_length": 4096,
                        "attn_implementation": _FLASH},
}
# online RL: GRPO steps, generation inside the step; name -> GRPOConfig knobs on top of ONLINE_BASE. The vLLM cases
# run only where `import vllm` works (advisor[vllm]).
ONLINE_TRAINER = "grpo"
ONLINE_BASE = {"num_generations": 4, "max_completion_length": 128}
ONLINE_MATRIX: dict[str, dict] = {
    "grpo-generate": {"use_vllm": False},
    "grpo-vllm-colocate": {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3},
    "grpo-vllm-colocate-sleep": {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3,
                                 "vllm_enable_sleep_mode": True},
}
# several GPUs: FSDP2 resharding after forward, checkpointed, on N ranks of this machine
MULTI_CASE = {"activation_checkpointing": True, "parallelism": "fsdp2"}
TAIL_LINES = 40


class Kind(str, Enum):
    """What a step of the plan does."""

    PREPARE = "prepare"        # imports, the random model saved once for every case
    SFT = "sft"                # an SFT candidate probed next to its simulation
    ONLINE = "online"          # a GRPO candidate (generation inside the step) probed next to its simulation
    MULTI_GPU = "multi_gpu"    # MULTI_CASE on N ranks (accelerate launch) next to simulate_per_rank
    FRONT_DOOR = "front_door"  # `advisor suggest --backend <backend> --trials 3`, as a user runs it
    CALIBRATE = "calibrate"    # scripts/gpu_calibrate.py, where it exists
    PYTEST = "pytest"          # `pytest -m gpu` on the test files that hold GPU tests


class StepTimeout(BaseException):
    """A step reached its cap (raised by the driver's alarm). A BaseException, so that no library's `except
    Exception` swallows it; the probe's own cleanup (a `finally`) kills its child's process group on the way out."""


@dataclass(frozen=True)
class Step:
    """One step of the plan: what it runs, its planned time (an estimate until a run measures it: every row records
    its wall time, and --plan-from reads those back) and its cap (it is stopped there). A reserved step's planned time
    is held back from the steps before it."""

    name: str
    kind: Kind
    planned_s: float
    cap_s: float
    reserved: bool = False
    knobs: dict = field(default_factory=dict)
    world: int = 1



@dataclass(frozen=True)
class Target:
    """What every case of a run shares: the model shape, the GPU profile, the probe's backend, the sequence length,
    the synthetic data's rows and the per-device batch."""

    spec: Any  # advisor.workload.ModelSpec
    gpu: Any  # advisor.workload.GPUSpec
    backend: str
    max_length: int
    rows: int
    batch: int

    def to_dict(self) -> dict:
        import dataclasses

        return {"model": {"name": self.spec.name, "config": dict(self.spec.config), "source": self.spec.source,
                          "local_dir": str(self.spec.local_dir) if self.spec.local_dir else None},
                "gpu": dataclasses.asdict(self.gpu), "backend": self.backend, "max_length": self.max_length,
                "rows": self.rows, "batch": self.batch}

    @classmethod
    def from_dict(cls, d: dict) -> Target:
        from advisor.workload import GPUSpec, ModelSpec

        m = d["model"]
        spec = ModelSpec(name=m["name"], config=m["config"], source=m["source"],
                         local_dir=Path(m["local_dir"]) if m.get("local_dir") else None)
        gpu = GPUSpec(**{**d["gpu"], "aliases": tuple(d["gpu"].get("aliases") or ())})
        return cls(spec, gpu, d["backend"], int(d["max_length"]), int(d["rows"]), int(d["batch"]))

    def candidate(self, kind: Kind, knobs: dict):
        """The case's Candidate: SFT knobs over the base (bf16 autocast, sdpa, AdamW) at this batch and length; an
        online case as `online_candidate`."""
        from advisor.space import Candidate

        if kind is Kind.ONLINE:
            return online_candidate(knobs, self.batch)
        fields = {"max_length": self.max_length, "per_device_train_batch_size": self.batch, "precision": "bf16",
                  "optim": "adamw_torch", "attn_implementation": "sdpa", **knobs}
        return Candidate(**fields)

    def workload(self, kind: Kind, num_gpus: int = 1):
        """The seeded synthetic data of the case's trainer (the same in every process that builds it)."""
        from advisor.workload import Goals, Workload

        if kind is Kind.ONLINE:
            from advisor.trainers.prompts import synthetic_prompts

            data = synthetic_prompts(self.spec.vocab_size, rows=max(16, self.batch * 4), seed=0, median=64,
                                     max_len=128)
            return Workload(model=self.spec, gpu=self.gpu, dataset=data, goals=Goals(), trainer=ONLINE_TRAINER)
        from advisor.data import synthetic

        data = synthetic(vocab_size=self.spec.vocab_size, rows=self.rows, seed=0, median=self.max_length // 2,
                         max_len=self.max_length)
        return Workload(model=self.spec, gpu=self.gpu, dataset=data, goals=Goals(), num_gpus=num_gpus)


def online_candidate(knobs: dict, batch: int):
    """A GRPO candidate: `batch` completions a micro-batch, accumulated until the generation batch holds
    num_generations completions (TRL's rule: num_generations divides it), bf16, no checkpointing; sleep mode with
    expandable_segments off (vLLM's allocator refuses them together)."""
    from advisor.space import Candidate, with_knobs
    from advisor.trainers import get_trainer

    get_trainer(ONLINE_TRAINER)  # its own knobs (num_generations, ...) registered with the knob registry
    knobs = {**ONLINE_BASE, **knobs}
    ga = max(1, -(-knobs["num_generations"] // batch))
    base = Candidate(per_device_train_batch_size=batch, gradient_accumulation_steps=ga, precision="bf16",
                     optim="adamw_torch", attn_implementation="sdpa", activation_checkpointing=False,
                     expandable_segments=not knobs.get("vllm_enable_sleep_mode", False))
    return with_knobs(base, **knobs)


# ---- facts of the machine ----------------------------------------------------------------------------------------

def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_facts() -> dict:
    """GPU name, driver, CUDA runtime and memory from torch and NVML; creates no CUDA context (the probes' device
    readings would count it)."""
    import torch

    facts: dict = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                   "cuda_runtime": torch.version.cuda}
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
            gpu_count=int(pynvml.nvmlDeviceGetCount()),
        )
    except Exception as exc:  # no NVML on a CPU machine
        facts["nvml"] = f"unavailable: {exc}"
    return facts


def machine() -> dict:
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)), "os": platform.platform()}


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def tail(text: str, lines: int = TAIL_LINES) -> list[str]:
    kept = [line for line in text.splitlines() if line.strip() and not line.startswith("USDT:")]
    return kept[-lines:]


# ---- one case ----------------------------------------------------------------------------------------------------

def fields_of(m) -> dict:
    """A Measurement's numbers as the rows keep them."""
    out = {"status": m.status.value, "peak_bytes": m.peak_bytes, "reserved_bytes": m.reserved_bytes,
           "device_bytes": m.device_bytes, "step_time_s": m.step_time_s, "tokens_per_second": m.tokens_per_second,
           "time_breakdown": dict(m.time_breakdown), "mfu": m.mfu, "worst_step_time_s": m.worst_step_time_s,
           "peak_batch": m.peak_batch, "message": m.message, "notes": list(m.notes),
           "outside_allocator_bytes": m.outside_allocator_bytes}
    if m.ranks:  # a probe of several ranks: each rank's own peaks and step time
        out["ranks"] = m.to_dict()["ranks"]
    return out


def save_random_models(spec, candidates, directory: Path) -> dict[str, str]:
    """The random model each case's probe would save for itself (advisor.modeling.build_model, as the probe's
    child does), saved once per weights dtype and loaded by every case by path (`probe(weights=)`): one random
    initialisation, cast for the other dtypes (the values differ by rounding; sizes and kernels do not). Returns
    {weights dtype: directory}."""
    import torch

    from advisor.modeling import build_model

    dtypes = sorted({c.weights_dtype.value for c in candidates}, key=lambda d: d != "float32")
    if not dtypes:
        return {}
    model = build_model(spec, candidates[0].replace(weights_dtype=dtypes[0]))
    out = {}
    for name in dtypes:
        path = directory / f"model-{name}"
        model = model.to(getattr(torch, name))
        model.config.dtype = getattr(torch, name)
        model.save_pretrained(path, safe_serialization=True)
        out[name] = str(path)
    return out


def simulate_case(target: Target, kind: Kind, candidate) -> dict:
    """The simulator's prediction for the case, with how long it took."""
    from advisor.simulator import simulate

    start = time.perf_counter()
    sim = simulate(target.workload(kind), candidate, target.gpu)
    return {**fields_of(sim), "wall_s": round(time.perf_counter() - start, 2)}


def probe_case(target: Target, kind: Kind, candidate, *, steps: int, warmup: int, timeout_s: float,
               weights: str | None) -> dict:
    """The real probe (advisor.probe: a fresh child process, the trainer's own train()), with where its time went:
    the child's wall time, its setup before the first step (imports, CUDA context, model load, trainer build) and
    each optimizer step's time, read from the job directory the probe keeps when ADVISOR_PROBE_KEEP=1.

    Stopped by StepTimeout (the driver's cap), the probe's cleanup kills its child; the exception carries
    `.partial`: the child's last output."""
    from advisor.probing import probe
    from advisor.probing.runner import KEEP_ENV, LOG_FILE, RESULT_FILE

    jobs = Path(tempfile.mkdtemp(prefix="gpu-validate-probe-"))
    saved_tmp, saved_keep = tempfile.tempdir, os.environ.get(KEEP_ENV)
    tempfile.tempdir, os.environ[KEEP_ENV] = str(jobs), "1"
    start = time.perf_counter()
    try:
        m = probe(target.workload(kind), candidate, target.backend, steps=steps, warmup=warmup, timeout_s=timeout_s,
                  weights=weights)
    except StepTimeout as exc:
        logs = list(jobs.glob(f"*/{LOG_FILE}"))
        exc.partial = {"child_log_tail": tail(logs[0].read_text(errors="replace")) if logs else []}
        raise
    finally:
        tempfile.tempdir = saved_tmp
        if saved_keep is None:
            os.environ.pop(KEEP_ENV, None)
        else:
            os.environ[KEEP_ENV] = saved_keep
        wall = time.perf_counter() - start
        results = list(jobs.glob(f"*/{RESULT_FILE}"))
        records = json.loads(results[0].read_text()).get("steps", []) if results else []
        shutil.rmtree(jobs, ignore_errors=True)
    out = {**fields_of(m), "wall_s": round(wall, 2), "child_wall_s": m.wall_time_s,
           "step_times_s": [round(float(r["time_s"]), 4) for r in records],
           "steps": [r.get("description") for r in records]}
    if records and m.wall_time_s:
        out["setup_s"] = round(m.wall_time_s - sum(float(r["time_s"]) for r in records), 2)
    return out


def ratio(a, b) -> float | None:
    return round(a / b, 4) if a and b else None


def predicted_probe_step_s(sim: dict, kinds: list[str]) -> float | None:
    """The simulator's prediction for the steps the probe timed: the worst batch's step time for its `longest`
    steps, the expected step time over the sampler's batches for its `typical` (random-row) steps."""
    if not sim.get("step_time_s") or not kinds:
        return None
    worst = sim.get("worst_step_time_s") or sim["step_time_s"]
    return sum(worst if k == "longest" else sim["step_time_s"] for k in kinds) / len(kinds)


def case_row(name: str, kind: Kind, target: Target, candidate, probe: dict, sim: dict, *, steps: int,
             warmup: int, how: dict) -> dict:
    """One case's row: the probe's peak / reserved / device bytes and step time beside the simulator's, their
    ratios (simulated / probed), and how each was obtained."""
    from advisor.probing import plan_batches

    kinds = [k.value for k in plan_batches(target.workload(kind), candidate, steps, warmup).kinds[warmup:]]
    predicted = predicted_probe_step_s(sim, kinds)
    ratios = {k: ratio(sim.get(k), probe.get(k)) for k in ("peak_bytes", "reserved_bytes", "device_bytes")}
    # the step time is compared for the batches the probe timed (its longest and typical steps)
    ratios["step_time_s"] = ratio(predicted, probe.get("step_time_s"))
    return {"case": name, "trainer": ONLINE_TRAINER if kind is Kind.ONLINE else "sft", "batch_size": target.batch,
            "max_length": target.max_length, "candidate": candidate.to_dict(), "probe": probe, "simulate": sim,
            "probe_step_kinds": kinds, "predicted_probe_step_s": predicted, "simulate_over_probe": ratios,
            "how": how}


def simulate_worker(plan_path: Path, out_dir: Path) -> int:
    """Simulate every case of a plan file ({"target": Target.to_dict(), "cases": [{name, kind, candidate}]}) in
    order, each result written to OUT_DIR/<name>.json atomically as it finishes (the driver reads them while its
    probes run)."""
    from advisor._files import write_atomic
    from advisor.space import Candidate

    plan = json.loads(Path(plan_path).read_text())
    target = Target.from_dict(plan["target"])
    for case in plan["cases"]:
        try:
            result = simulate_case(target, Kind(case["kind"]), Candidate.from_dict(case["candidate"]))
        except Exception as exc:  # one case's failure is that case's row, not the end of the others
            result = {"status": "error", "message": f"{type(exc).__name__}: {exc}"}
        write_atomic(Path(out_dir) / f"{case['name']}.json", json.dumps(result, default=str))
    return 0


# ---- fitting the step-time model's constants to the measured step times ------------------------------------------

# Each fitted multiplier scales one group of the model's terms (advisor/physics/timing Term values) and is applied to
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
        ratio_ = float(np.median(y / x.sum(axis=1)))
        multipliers = dict.fromkeys(names, ratio_)
    m = np.array([multipliers[n] for n in names])

    def rms(pred):
        return float(np.sqrt(np.mean(((pred - y) / y) ** 2)))

    return {"method": method, "multipliers": {k: round(v, 4) for k, v in multipliers.items()}, "cases": len(cases),
            "groups": {k: list(v) for k, v in FIT_GROUPS.items()},
            "rms_relative_error_before": round(rms(x.sum(axis=1)), 4), "rms_relative_error_after": round(rms(x @ m), 4)}


if __name__ == "__main__":  # the simulations run ahead of the probes (gpu_validate_steps.Simulations)
    sys.exit(simulate_worker(Path(sys.argv[1]), Path(sys.argv[2])))
