"""A golden run: the picks, trials and bytes of a fixed set of searches, to compare two trees side by side.

A refactor that must not change what the advisor answers (a redesign of the trainer seam) is checked by running the
same searches before and after and comparing what they print. Each case runs `advisor suggest ... --json` and
`--format yaml` / `--format python` with `--no-cache` in a subprocess of the chosen tree; the record keeps the
pick's config, its peak / reserved / device bytes and tokens/s, every trial's config, status and bytes, and the
emitted texts (their header's timing-free lines). Wall times are dropped.

    python scripts/golden_run.py --tree /path/to/old/checkout --out before.json
    python scripts/golden_run.py --tree . --out after.json
    python scripts/golden_run.py --compare before.json after.json     # exit 1 on any difference, listed

The comparison also says which differences of the emitted texts are of order only (the YAML the same mapping, the
snippet the same lines), so a change of the writer's key order is told apart from a change of what is written.

The cases cover SFT, DPO, Reward, GRPO and RLOO (model.generate, colocated vLLM, vLLM server mode on several GPUs,
a --reward-model, --fix of the online knobs, a CPU target), one GPU and several (DDP / FSDP2 / ZeRO in the space),
full, LoRA and QLoRA, on the estimate backend (deterministic, seconds) and five on the simulate backend (fake
tensors, a few trials).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CASES: dict[str, list[str]] = {
    "sft-qwen05-h100": ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "H100-80GB"],
    "sft-qwen05-l4-auto": ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "L4", "--method", "auto"],
    "sft-llama8b-l4-qlora": ["--model", "meta-llama/Llama-3.1-8B", "--gpu", "L4", "--method", "qlora"],
    "dpo-qwen05-h100": ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "H100-80GB", "--trainer", "dpo"],
    "dpo-llama8b-l4-qlora": ["--model", "meta-llama/Llama-3.1-8B", "--gpu", "L4", "--trainer", "dpo",
                             "--method", "qlora"],
    "reward-qwen05-l4": ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "L4", "--trainer", "reward"],
    "reward-qwen15-l4-lora": ["--model", "Qwen/Qwen2.5-1.5B", "--gpu", "L4", "--trainer", "reward",
                              "--method", "lora"],
    "sft-qwen05-2xl4": ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "L4", "--num-gpus", "2"],
    "dpo-qwen05-2xl4": ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "L4", "--num-gpus", "2", "--trainer", "dpo"],
    "reward-llama8b-8xh100": ["--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100-80GB", "--num-gpus", "8",
                              "--trainer", "reward", "--method", "full"],
    "grpo-qwen05-h100": ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "H100-80GB", "--trainer", "grpo"],
    "grpo-qwen05-l4-lora": ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "L4", "--trainer", "grpo", "--method", "lora"],
    "grpo-qwen05-4xh100": ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "H100-80GB", "--num-gpus", "4",
                           "--trainer", "grpo"],
    "grpo-qwen05-h100-fix": ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "H100-80GB", "--trainer", "grpo",
                             "--fix", "num_generations=4", "--fix", "beta=0.04", "--fix", "max_completion_length=256",
                             "--fix", "vllm_gpu_memory_utilization=0.4"],
    "grpo-smol-cpu": ["--model", "HuggingFaceTB/SmolLM2-135M", "--gpu", "cpu", "--trainer", "grpo"],
    "rloo-qwen05-h100": ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "H100-80GB", "--trainer", "rloo"],
    "rloo-qwen05-l4-rm": ["--model", "Qwen/Qwen2.5-0.5B", "--gpu", "L4", "--trainer", "rloo",
                          "--reward-model", "Qwen/Qwen2.5-0.5B"],
}
SIMULATE_CASES: dict[str, list[str]] = {
    "sim-sft-smol-l4": ["--model", "HuggingFaceTB/SmolLM2-135M", "--gpu", "L4", "--trials", "3", "--jobs", "1"],
    "sim-dpo-smol-l4": ["--model", "HuggingFaceTB/SmolLM2-135M", "--gpu", "L4", "--trainer", "dpo",
                        "--trials", "3", "--jobs", "1"],
    "sim-reward-smol-l4": ["--model", "HuggingFaceTB/SmolLM2-135M", "--gpu", "L4", "--trainer", "reward",
                           "--trials", "2", "--jobs", "1"],
    "sim-grpo-smol-l4": ["--model", "HuggingFaceTB/SmolLM2-135M", "--gpu", "L4", "--trainer", "grpo",
                         "--trials", "2", "--jobs", "1"],
    "sim-rloo-smol-l4-rm": ["--model", "HuggingFaceTB/SmolLM2-135M", "--gpu", "L4", "--trainer", "rloo",
                            "--reward-model", "HuggingFaceTB/SmolLM2-135M", "--trials", "2", "--jobs", "1"],
}


def _run(tree: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    cmd = [sys.executable, "-c", "import sys; from advisor.cli import main; sys.exit(main(sys.argv[1:]))",
           "suggest", *args, "--no-cache"]
    return subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=1800)


def _measurement(m: dict) -> dict:
    keys = ("status", "peak_bytes", "reserved_bytes", "device_bytes", "breakdown", "tokens_per_second",
            "trained_tokens_per_step", "peak_batch")
    return {k: m.get(k) for k in keys}


def _strip_text(text: str) -> list[str]:
    """The emitted text without lines that carry a version or a time."""
    return [line for line in text.splitlines() if "wall" not in line and " s)" not in line]


def record_case(tree: Path, args: list[str], backend: str) -> dict:
    full = [*args, "--backend", backend]
    done = _run(tree, [*full, "--json"])
    if done.returncode not in (0, 1):
        return {"exit": done.returncode, "stderr": done.stderr.strip().splitlines()[-3:]}
    out = json.loads(done.stdout)
    record = {
        "exit": done.returncode,
        "config": out.get("config"),
        "pick": {k: out.get(k) for k in ("peak_bytes", "reserved_bytes", "device_bytes", "tokens_per_second",
                                         "evaluations")},
        "trials": [{"config": t["config"], "why": t.get("why"), "measurement": _measurement(t["measurement"])}
                   for t in out.get("trials", [])],
    }
    if done.returncode == 0:
        for fmt in ("yaml", "python"):
            emitted = _run(tree, [*full, "--format", fmt])
            record[fmt] = _strip_text(emitted.stdout) if emitted.returncode == 0 else {"exit": emitted.returncode}
    return record


def record(tree: Path, only: list[str] | None) -> dict:
    results = {}
    for name, args in {**CASES, **SIMULATE_CASES}.items():
        if only and name not in only:
            continue
        backend = "simulate" if name in SIMULATE_CASES else "estimate"
        print(f"{name} ...", file=sys.stderr, flush=True)
        results[name] = record_case(tree, args, backend)
    return results


def _diff(a, b, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            _diff(a.get(key), b.get(key), f"{path}.{key}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(f"{path}: {a!r} -> {b!r}")


def order_only(before: dict, after: dict) -> list[str]:
    """The cases whose emitted YAML is the same mapping and whose snippet has the same lines, in another order."""
    import yaml

    out = []
    for name in sorted(set(before) & set(after)):
        a, b = before[name], after[name]
        ya, yb = a.get("yaml"), b.get("yaml")
        if not isinstance(ya, list) or not isinstance(yb, list) or ya == yb:
            continue
        same_yaml = yaml.safe_load("\n".join(ya)) == yaml.safe_load("\n".join(yb)) and \
            [line for line in ya if line.startswith("#")] == [line for line in yb if line.startswith("#")]
        pa, pb = a.get("python"), b.get("python")
        same_python = isinstance(pa, list) and isinstance(pb, list) and sorted(pa) == sorted(pb)
        if same_yaml and same_python:
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    ns = parser.parse_args(argv)
    if ns.compare:
        before, after = (json.loads(p.read_text()) for p in ns.compare)
        differences: list[str] = []
        for name in sorted(set(before) | set(after)):
            _diff(before.get(name), after.get(name), name, differences)
        for line in differences:
            print(line)
        cases = len(set(before) & set(after))
        print(f"{cases} cases compared, {len(differences)} differences")
        reordered = order_only(before, after)
        if reordered:
            rest = [d for d in differences if d.split(".", 1)[0] not in reordered
                    or not d.split(".", 1)[1].startswith(("yaml[", "python["))]
            print(f"of which in the emitted texts' order only (the same YAML mapping, the same snippet lines): "
                  f"{len(differences) - len(rest)}, in {len(reordered)} cases ({', '.join(reordered)}); "
                  f"{len(rest)} other differences")
        return 1 if differences else 0
    results = record(ns.tree.resolve(), ns.only)
    text = json.dumps(results, indent=1, sort_keys=True)
    if ns.out:
        ns.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
