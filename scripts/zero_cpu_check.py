"""DeepSpeed ZeRO-2 / ZeRO-3 run for real on 2 CPU ranks (gloo) through the accelerate config the advisor emits,
against the per-rank simulation's closed form (advisor/physics/ranks_closed.zero_bytes).

    pip install deepspeed      (the optional extra; DS_BUILD_OPS=0 is enough: its CPU accelerator uses gloo)
    python scripts/zero_cpu_check.py [--stages 2 3] [--steps 2]

For each stage: the advisor's `accelerate_config(...)` written to a file, `accelerate launch --config_file FILE
--num_processes 2 scripts/zero_cpu_check.py --_rank SPEC`, where each rank trains TRL's SFTTrainer on a small
Qwen2 (random weights) and reports its peak from the CPU allocator's events (advisor.probing.meters); then
`simulate_per_rank(..., 2, <the stage>, gpu="cpu")` for the same candidate. Prints both and their ratio.

accelerate's DeepSpeed path assumes an accelerator device: on a CPU-only host its PartialState picks no backend,
so the rank process gives it gloo (the only change to what `accelerate launch` runs).
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

ROOT = Path(__file__).resolve().parents[1]
# a small Qwen2: large enough that the model states are visible, small enough for two CPU ranks
QWEN2_SMALL = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


def _workload():
    from advisor.data import synthetic
    from advisor.workload import Goals, GPUSpec, ModelSpec, Workload

    cpu = GPUSpec(name="cpu", kind="cpu", memory_bytes=16 * 2**30, bf16_tflops=0.5, fp16_tflops=0.5, fp32_tflops=0.5,
                  memory_bandwidth_gbs=20.0, supports_bf16=True, supports_flash_attention=False)
    model = ModelSpec(name="qwen2-small", config=dict(QWEN2_SMALL), source="local")
    return Workload(model=model, gpu=cpu, goals=Goals(),
                    dataset=synthetic(vocab_size=1024, rows=64, seed=0, median=64, max_len=256))


def rank(spec: dict) -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend

    def prepare(self, cpu=False, sagemaker_dp=False, backend=None):
        b, t = original(self, cpu, sagemaker_dp, backend)
        if b is None and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_CPU
        return b, t

    PartialState._prepare_backend = prepare

    from advisor.modeling import placeholder_tokenizer
    from advisor.probing import meters
    from advisor.space import Candidate
    from advisor.trainers import get_trainer

    wl = _workload()
    cand = Candidate.from_dict(spec["candidate"])
    kind = get_trainer("sft")
    with tempfile.TemporaryDirectory() as out:
        args = kind.build_config(cand, wl, measured=True, output_dir=out, max_steps=spec["steps"], report_to="none",
                                 save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
                                 train_sampling_strategy="sequential", use_cpu=False)
        model = kind.build_model(wl.model, cand, device="cpu")
        prof = meters.memory_profiler(user_scopes=False)
        trainer = kind.trainer_class()(model=model, args=args, train_dataset=kind.train_dataset(wl),
                                       processing_class=placeholder_tokenizer(wl.model))
        trainer.train()
        prof.__exit__(None, None, None)
    peak = meters.cpu_peak(prof, backend_frees=True).peak_bytes
    print("RESULT " + json.dumps({"rank": int(os.environ["RANK"]), "engine": type(trainer.model_wrapped).__name__,
                                  "world": trainer.accelerator.num_processes, "peak_bytes": peak}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3], choices=(2, 3))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--_rank", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns._rank:
        rank(json.loads(ns._rank))
        return 0
    from advisor.accelerate_config import accelerate_config
    from advisor.parallelism import Layout, deepspeed_available
    from advisor.simulator import simulate_per_rank
    from advisor.space import Candidate

    if not deepspeed_available():
        print("deepspeed is not installed: pip install deepspeed (the advisor[deepspeed] extra)", file=sys.stderr)
        return 2
    wl = _workload()
    rows = []
    for stage in ns.stages:
        layout = Layout(f"zero{stage}")
        cand = Candidate(max_length=64, per_device_train_batch_size=1, precision="fp32", optim="adamw_torch",
                         activation_checkpointing=False, parallelism=layout.value)
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "accelerate.yaml"
            cfg.write_text(accelerate_config(cand, layout.parallelism, 2).yaml)
            spec = json.dumps({"candidate": cand.to_dict(), "steps": ns.steps})
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                       HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
            t = time.perf_counter()
            run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg),
                                  __file__, "--_rank", spec], env=env, capture_output=True, text=True,
                                 timeout=ns.timeout)
            wall = time.perf_counter() - t
        results = [json.loads(line.split("RESULT ", 1)[1]) for line in run.stdout.splitlines() if "RESULT " in line]
        if run.returncode != 0 or len(results) != 2:
            print(f"ZeRO-{stage}: the launch failed (exit {run.returncode}):\n{run.stderr[-3000:]}", file=sys.stderr)
            return 1
        sim = simulate_per_rank(wl, cand, 2, layout.parallelism, gpu="cpu")
        for r in sorted(results, key=lambda r: r["rank"]):
            rows.append([f"ZeRO-{stage}", r["rank"], r["engine"], f"{r['peak_bytes']:,}", f"{sim.peak_bytes:,}",
                         f"{sim.peak_bytes / r['peak_bytes']:.4f}", f"{wall:.0f}"])
    from tabulate import tabulate

    print(tabulate(rows, headers=["stage", "rank", "engine", "measured peak B", "simulated B", "sim/measured",
                                  "launch s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
