"""Extrapolated (2 and 3 layers, the full depth's stream built layer by layer) against a fake run of every layer.

For each configuration: the peak (allocated), reserved and device bytes of both, side by side with their ratios,
and whether each is within max(1%, 256 MiB) of the full-depth run. Exit 1 if any is not.

    python scripts/bench_extrapolation.py              # Qwen2.5-0.5B and Llama-3.1-8B profiles on H100-80GB
    python scripts/bench_extrapolation.py --only qwen  # a subset (substring of the configuration name)
"""

from __future__ import annotations

import argparse
import sys
import time

GiB = 2**30
TOLERANCE = (0.01, 256 * 2**20)

# name -> (model profile, candidate fields); the synthetic chat set's longest rows fill every batch
CONFIGS: dict[str, tuple[str, dict]] = {
    "qwen0.5b trl-defaults 8x1024 ckpt": ("Qwen/Qwen2.5-0.5B", dict(expandable_segments=False)),
    "qwen0.5b 4x4096 ckpt bf16-weights": (
        "Qwen/Qwen2.5-0.5B", dict(max_length=4096, per_device_train_batch_size=4, weights_dtype="bfloat16")),
    "qwen0.5b 2x8192 no-ckpt adamw_torch": (
        "Qwen/Qwen2.5-0.5B", dict(max_length=8192, per_device_train_batch_size=2, activation_checkpointing=False,
                                  optim="adamw_torch", expandable_segments=False)),
    "qwen0.5b lora 8x2048 ckpt": (
        "Qwen/Qwen2.5-0.5B", dict(max_length=2048, per_device_train_batch_size=8, use_lora=True,
                                  weights_dtype="bfloat16")),
    "qwen0.5b packing-bfd 4x4096 ckpt": (
        "Qwen/Qwen2.5-0.5B", dict(max_length=4096, per_device_train_batch_size=4, packing=True,
                                  packing_strategy="bfd")),
    "llama8b 2x8192 ckpt adamw_torch bf16-weights": (
        "meta-llama/Llama-3.1-8B", dict(max_length=8192, per_device_train_batch_size=2, weights_dtype="bfloat16",
                                        optim="adamw_torch", expandable_segments=False)),
    "llama8b 1x8192 ckpt every-2 bf16-weights": (
        "meta-llama/Llama-3.1-8B", dict(max_length=8192, per_device_train_batch_size=1, weights_dtype="bfloat16",
                                        checkpoint_every_n_layers=2)),
    "llama8b lora 4x4096 ckpt": (
        "meta-llama/Llama-3.1-8B", dict(max_length=4096, per_device_train_batch_size=4, use_lora=True,
                                        weights_dtype="bfloat16", expandable_segments=False)),
    "llama8b packing-bfd 2x8192 ckpt bf16-weights": (
        "meta-llama/Llama-3.1-8B", dict(max_length=8192, per_device_train_batch_size=2, packing=True,
                                        packing_strategy="bfd", weights_dtype="bfloat16")),
}


def _within(a: int, b: int) -> bool:
    return abs(a - b) <= max(TOLERANCE[0] * b, TOLERANCE[1])


def _cols(values: list[float], widths: tuple[int, ...], digits: int) -> str:
    return "".join(f"{v:>{w}.{digits}f}" for v, w in zip(values, widths, strict=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", default="H100-80GB")
    p.add_argument("--only", default="", help="run the configurations whose name contains this")
    ns = p.parse_args(argv)

    from advisor.data import synthetic
    from advisor.profiles import resolve_gpu, resolve_model
    from advisor.simulator import simulate
    from advisor.space import Candidate
    from advisor.workload import Workload

    gpu = resolve_gpu(ns.gpu)
    data = {}
    bad = 0
    head = (f"{'configuration':<46}{'':>4}{'peak GiB':>10}{'reserved GiB':>14}{'device GiB':>12}{'status':>8}"
            f"{'seconds':>9}")
    print(f"gpu={gpu.name}; 'fast' = 2 and 3 layers extrapolated (default), 'full' = every layer; "
          f"ratio = fast / full; ok = within max(1%, 256 MiB)")
    print(head)
    print("-" * len(head))
    for name, (model, fields) in CONFIGS.items():
        if ns.only not in name:
            continue
        spec = resolve_model(model)
        if spec.vocab_size not in data:
            data[spec.vocab_size] = synthetic(spec.vocab_size, rows=2048)
        wl = Workload(model=spec, gpu=gpu, dataset=data[spec.vocab_size])
        cand = Candidate(**fields)
        t0 = time.perf_counter()
        fast = simulate(wl, cand, gpu)
        t1 = time.perf_counter()
        full = simulate(wl, cand, gpu, layers=None)
        t2 = time.perf_counter()
        pairs = [(fast.peak_bytes, full.peak_bytes), (fast.reserved_bytes, full.reserved_bytes),
                 (fast.device_bytes, full.device_bytes)]
        ok = all(_within(a, b) for a, b in pairs)
        bad += not ok
        split = "" if any("layer by layer" in n for n in fast.notes) else " (fell back to full depth)"
        widths = (10, 14, 12)
        print(f"{name + split:<46}{'fast':>4}" + _cols([a / GiB for a, _ in pairs], widths, 3)
              + f"{fast.status.value:>8}{t1 - t0:>9.1f}")
        print(f"{'':<46}{'full':>4}" + _cols([b / GiB for _, b in pairs], widths, 3)
              + f"{full.status.value:>8}{t2 - t1:>9.1f}")
        print(f"{'':<46}{'ratio':>4}" + _cols([a / b for a, b in pairs], widths, 5) + f"{'ok' if ok else 'NOT OK':>8}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
