"""Side by side: the extrapolated simulation, the full-depth one, and one real CPU step of the same workload.

Usage: python scripts/bench_simulate.py [--model Qwen/Qwen2.5-0.5B] [--batch 4] [--seq 1024] [--no-real]
Prints wall times (after imports) and their ratios, plus the predicted peaks.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--no-real", action="store_true", help="skip the real CPU step (needs ~10 GB RAM and minutes)")
    a = p.parse_args()

    import numpy as np
    import torch

    from advisor.data import TokenizedDataset
    from advisor.profiles import resolve_gpu, resolve_model
    from advisor.simulate import simulate
    from advisor.space import Candidate
    from advisor.workload import Goals, Workload

    spec = resolve_model(a.model)
    rng = np.random.default_rng(0)
    rows = tuple({"input_ids": rng.integers(10, spec.vocab_size, a.seq).tolist()} for _ in range(a.batch * 2))
    data = TokenizedDataset(name="bench", source="synthetic", rows=rows, completion_only_loss=False)
    wl = Workload(model=spec, gpu=resolve_gpu("cpu"), dataset=data, goals=Goals())
    cand = Candidate(max_length=a.seq, per_device_train_batch_size=a.batch, precision="bf16",
                     weights_dtype="bfloat16", optim="adamw_torch")
    simulate(wl, cand, layers=(2, 3))  # warm imports and caches once

    t = time.perf_counter()
    fast = simulate(wl, cand, layers=(2, 3))
    t_fast = time.perf_counter() - t
    t = time.perf_counter()
    full = simulate(wl, cand, layers=None)
    t_full = time.perf_counter() - t
    print(f"{'run':<28}{'wall s':>10}{'peak GiB':>12}{'ratio':>10}")
    label = f"simulate (2,3 -> {spec.num_layers})"
    print(f"{label:<28}{t_fast:>10.2f}{fast.peak_bytes / 2**30:>12.3f}{1:>10.2f}")
    print(f"{'simulate full depth':<28}{t_full:>10.2f}{full.peak_bytes / 2**30:>12.3f}{t_full / t_fast:>10.2f}")
    if not a.no_real:
        from advisor.modeling import build_model

        model = build_model(spec, cand, device="cpu")
        opt = torch.optim.AdamW(model.parameters())
        ids = torch.tensor([r["input_ids"] for r in rows[: a.batch]])
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        t_real = time.perf_counter() - t
        print(f"{'one real CPU step':<28}{t_real:>10.2f}{'':>12}{t_real / t_fast:>10.2f}")
    print(f"extrapolated vs full peak: {fast.peak_bytes / full.peak_bytes - 1:+.4%}")


if __name__ == "__main__":
    main()
