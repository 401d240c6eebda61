"""The simulator's private package: fake-tensor training runs, the storage tracker, the CUDA allocator's rules, the
step-time model and one rank of a multi-GPU run.

Only the names in `__all__` may be used outside this package (`from advisor._sim import X`, or `from ._sim
import X` inside advisor); its modules are its insides, free to change. The public ways in are
`advisor.simulator` (`simulate` and the simulator's parts), `advisor.costs` (the step-time model, the CUDA memory
outside the allocator, the multi-GPU closed forms) and `advisor.parallelism`. tests/test_privacy.py fails on an
import of a module of this package from outside it.

Each name is imported from its module on first use (PEP 562), so importing the package costs nothing and a
module that needs one name does not load torch for another.
"""

from __future__ import annotations

from .._lazy import lazy_exports

# name -> (module of this package, the name there)
_EXPORTS: dict[str, tuple[str, str]] = {
    # ---- one simulated run (the simulate backend: advisor.simulator) ----------------------------------------------
    "DepthRun": ("depth", "DepthRun"),  # one fake run at one depth: the numbers that are extrapolated
    "simulate_depth": ("depth", "simulate_depth"),
    "with_depth": ("depth", "with_depth"),  # the architecture with N decoder layers
    "plan_depths": ("depth", "plan_depths"),  # the two shallow depths a full depth is built from
    "extrapolate": ("depth", "extrapolate"),  # the full depth from the two shallow runs
    "worst_rows": ("depth", "worst_rows"),  # the rows of the longest micro-batch (what a simulated step runs)
    "worst_batch": ("depth", "worst_batch"),  # that micro-batch through the trainer's collator
    "check_simulable": ("modelled", "check_simulable"),  # what fake tensors cannot run, refused by name
    "runnable": ("modelled", "runnable"),  # the candidate fake tensors run, and what is modelled instead
    "modelled_adjustments": ("modelled", "modelled_adjustments"),  # closed forms for what is not run
    "expected_time": ("modelled", "expected_time"),  # the step time over the batches the sampler makes
    "resolve_target": ("modelled", "resolve_target"),
    "batch_label": ("modelled", "batch_label"),  # Measurement.peak_batch
    # ---- the layer-by-layer build of a deeper run's allocation stream (layers.py) ---------------------------------
    "LayerStream": ("layers", "LayerStream"),
    "offload_peak": ("layers", "offload_peak"),  # activation offloading replayed on a whole stream
    "OffloadPeak": ("layers", "OffloadPeak"),
    "NotSeparable": ("layers", "NotSeparable"),
    "synthesize": ("layers", "synthesize"),
    "synthesize_checked": ("layers", "synthesize_checked"),
    # ---- the fake step's FlashAttention stand-in (flash.py) and the facts of a batch (fake_step.py) --------------
    "fake_flash_attention": ("flash", "fake_flash_attention"),
    "flash_attention_names": ("flash", "flash_attention_names"),
    "attention_flops": ("flash", "attention_flops"),
    "batch_facts": ("fake_step", "batch_facts"),
    "materialise": ("fake_step", "_materialise"),  # a meta model's parameters as fake tensors, ties kept
    # ---- the CUDA caching allocator and the memory outside it (cuda_rules.py) -------------------------------------
    "cuda_constants": ("cuda_rules", "constants"),
    "context_bytes": ("cuda_rules", "context_bytes"),
    "cublas_workspace_bytes": ("cuda_rules", "cublas_workspace_bytes"),
    "replay": ("cuda_rules", "replay"),
    "round_size": ("cuda_rules", "round_size"),
    # ---- the step-time model (timing/) ----------------------------------------------------------------------------
    **{name: ("timing", name) for name in (
        "Basis", "BatchDistribution", "BatchLayout", "BatchPoint", "OptimizerImpl", "StepCost", "Term", "TimingHook",
        "attention_kind", "attention_tile_s", "batch_distribution", "dequant_s", "evaluate", "gemm_s", "memory_s",
        "model_flops", "offload_copy_s_per_token", "optimizer_cost", "optimizer_impl", "peak_flops", "time_constants",
    )},
    # ---- one rank of N GPUs (distributed.py: advisor.parallelism, advisor.costs, the real multi-process probe) ----
    **{name: ("distributed", name) for name in ("simulate_per_rank", "prepare_fsdp2")},
    # ---- several GPUs in closed form (ranks_closed.py: ZeRO, the collectives' time, the estimate's rank) ----------
    **{name: ("ranks_closed", name) for name in (
        "estimate_rank_moments", "estimate_rank_time", "zero_bytes", "ZeroTerms", "comm_time_s", "interconnect",
    )},
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
