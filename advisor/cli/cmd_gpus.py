"""`advisor gpus`: the GPU profiles `--gpu` accepts."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("gpus", help="list the GPU profiles --gpu accepts",
                              description="The target profiles in profiles/gpus/ (name, aliases, memory, speed).")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from ..profiles import (  # lazy: keeps start-up light (loads yaml)
        PROFILES_DIR,
        list_gpus,
        resolve_gpu,
    )
    from ._common import emit_json  # lazy: loads numpy

    specs = [resolve_gpu(name) for name in list_gpus()]
    if ns.json:
        print(emit_json({"profiles": str(PROFILES_DIR / "gpus"), "gpus": [
            {"name": g.name, "kind": g.kind, "memory_bytes": g.memory_bytes, "aliases": list(g.aliases),
             "bf16_tflops": g.bf16_tflops, "fp16_tflops": g.fp16_tflops, "memory_bandwidth_gbs": g.memory_bandwidth_gbs,
             "supports_bf16": g.supports_bf16, "supports_flash_attention": g.supports_flash_attention,
             "compute_capability": g.compute_capability, "description": g.description} for g in specs]}))
        return 0
    from tabulate import tabulate  # lazy: loads tabulate

    rows = [[g.name, ", ".join(g.aliases),
             f"{g.memory_bytes / 2**30:.1f}" + (" (this host)" if g.kind == "cpu" else ""),
             f"{g.bf16_tflops:g}" if g.supports_bf16 else "-", f"{g.memory_bandwidth_gbs:g}",
             "yes" if g.supports_flash_attention else "no"] for g in specs]
    print(tabulate(rows, headers=["--gpu", "aliases", "memory GiB", "bf16 TFLOP/s", "GB/s", "FlashAttention"],
                   tablefmt="simple"))
    print(f"\nprofiles: {PROFILES_DIR / 'gpus'} (names and aliases match case- and separator-insensitively)")
    return 0
