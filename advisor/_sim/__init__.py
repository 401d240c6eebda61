"""The simulator's private package: fake-tensor training runs, the storage tracker, the fake run's ops observed for
the step-time model, and one rank of a multi-GPU run on the fake process group. The physics it shares with the
estimate (the model's shapes, the allocator's rules, the step-time model, the multi-GPU closed forms, the modelled
knobs) lives in advisor.physics, below both; nothing here imports the estimate.

Only the names in `__all__` may be used outside this package (`from advisor._sim import X`, or `from ._sim
import X` inside advisor); its modules are its insides, free to change. The public ways in are
`advisor.simulator` (`simulate`, `simulate_per_rank` and the simulator's parts). tests/test_privacy.py fails on an
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
    # the branches the fake run patches to the target's real path (transformers' masking, TRL's fused LM head on CUDA)
    "real_path_patches": ("fake_step", "real_path_patches"),
    "materialise": ("fake_step", "_materialise"),  # a meta model's parameters as fake tensors, ties kept
    "fake_out_dtype_matmuls": ("out_dtype", "fake_out_dtype_matmuls"),  # torch 2.11's fake addmm(out_dtype=)
    # ---- model.generate on fake tensors, every sequence at its maximum length (generation.py; online RL) -------
    **{name: ("generation", name) for name in ("simulate_generate", "GenerationRun", "full_length_generate",
                                                "IncompleteGeneration", "filler_token")},
    "DataShadow": ("shadow", "DataShadow"),  # the shadow a generating run enters above the tracker
    # ---- GRPOTrainer/RLOOTrainer.train() on fake tensors (online_rl.py), its generate extrapolated from short decode
    # loops (decode_extrapolation.py) ------------------------------------------------------------------------------
    **{name: ("online_rl", name) for name in ("make_online_trainer_class", "online_construction", "run_online_fake",
                                               "OnlineRunResult")},
    **{name: ("decode_extrapolation", name) for name in ("GenerateExtrapolation", "NotAffine")},
    # the simulate backend's online RL: the fake train() built through the trainer seam, vLLM's side, the step time
    "simulate_online": ("online_simulate", "simulate_online"),
    # ---- the fake run's ops costed by the step-time model (timing_hook.py; the model itself: advisor.physics) -----
    **{name: ("timing_hook", name) for name in ("TimingHook", "BatchLayout")},
    "StorageTracker": ("tracker", "StorageTracker"),  # what hands the hook each op (`on_op`) of a fake run
    # ---- one rank of N GPUs (distributed.py: advisor.simulator.simulate_per_rank, the real multi-process probe) ---
    **{name: ("distributed", name) for name in ("fake_process_group", "fsdp2_sharding", "prepare_fsdp2")},
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
