"""The physics both predicting backends share, below them: the estimate (advisor/estimator.py with estimator/) and
the simulator (advisor/simulator/) depend on this package and never on each other.

- `shapes.py`: the model's shapes and parameter counts read from its transformers config, the adapters' and the
  quantized weights' sizes.
- `modelled.py`: the knobs fake tensors cannot run (Hub kernels' RMSNorm, offloaded checkpoints) in closed form:
  the device bytes each frees and its step-time terms; the estimate counts them, the simulator adds them to its
  fake run (advisor/simulator/modelled.py) with a note saying they are modelled.
- `cuda_rules.py`: the CUDA caching allocator's rules (rounding, the replay of allocation events into reserved
  bytes) and the memory outside it (CUDA context, cuBLAS workspace; profiles/measurements/cuda_constants.json).
- `timing/`: the step-time model: its terms, bases and constants (profiles/measurements/time_constants.json),
  the kernels' cost (GEMMs by tile and wave, attention per tile, memory-bound ops, dequantisation, offload
  copies), the optimizer as the target runs it, a step's cost and its expectation over the batches the sampler
  really makes (`batch_distribution`). Each backend fills a `StepCost` its own way: the estimate counts the terms
  from the shapes (estimator/step_time.py), the simulator observes the fake run's ops (simulator/timing_hook.py).
- `ranks_closed.py`: several GPUs in closed form: ZeRO-2/3's model states per rank, the collectives' time over the
  interconnect, CPU offload's host step, and the estimate's moments and step time of one rank.
- `vllm.py`: vLLM's pool (its CUDA graphs inside it), KV pages, refusals and sleep levels from vLLM's own
  accounting, as vLLM 0.31.0 has them (`VLLM_FOLLOWED`; checked against 0.22.0: TRL 1.16's range).
- `online_step.py`: online RL's (GRPO, RLOO) step as plain numbers (`OnlineStep`), built by both backends from the
  trainer's knob view and the training state's bytes (`build_step`), and its phases (`PhaseKind`).
- `distillation.py`: on-policy distillation's training pass: the resident teacher, its no-grad forward and TRL's
  chunked divergence over the vocabulary (its float32 tiles, the head's float32 weight gradient).
- `online_costs.py`: that step in closed form: each phase's device bytes (allocator and outside it), colocated
  vLLM's typed refusals, `device_peak` (the simulator's measured phase peaks combined with vLLM's bytes), the
  step-time terms of generation, weight sync and scoring.

Only the names in `__all__` may be used outside this package (`from .physics import X` inside advisor);
`advisor.physics` is the public way in for scripts and tests. tests/test_privacy.py fails on an import of a module of
this package from outside it; tests/test_imports.py on the estimate and the simulator reaching each other.

Each name is imported from its module on first use (PEP 562), so importing the package costs nothing.
"""

from __future__ import annotations

from .._lazy import lazy_exports

# name -> (module of this package, the name there)
_EXPORTS: dict[str, tuple[str, str]] = {
    # ---- the model's shapes (shapes.py) ---------------------------------------------------------------------------
    **{name: ("shapes", name) for name in (
        "Architecture", "architecture", "lora_parameters", "quantized_linear_bytes", "DTYPE_BYTES", "resident_bytes",
    )},
    # ---- the knobs fake tensors cannot run, in closed form (modelled.py) -------------------------------------------
    **{name: ("modelled", name) for name in ("knob_memory_savings", "knob_time")},
    # ---- the CUDA caching allocator and the memory outside it (cuda_rules.py) -------------------------------------
    "cuda_constants": ("cuda_rules", "constants"),
    **{name: ("cuda_rules", name) for name in ("context_bytes", "cublas_workspace_bytes", "local_cuda_major", "replay",
                                                 "round_size", "RESERVED_FACTOR")},
    # ---- the step-time model (timing/) ----------------------------------------------------------------------------
    **{name: ("timing", name) for name in (
        "AttentionKind", "Basis", "BatchDistribution", "BatchPoint", "OptimizerCost", "OptimizerImpl", "SamplerSpec",
        "StepCost", "StepTime", "Term", "TimeConstants", "_TERMS", "attention_kind", "attention_tile_s",
        "attention_units", "batch_distribution", "causal_tiles", "dequant_s", "evaluate", "extrapolate_cost",
        "fitted_multipliers", "full_tiles", "gemm_s", "memory_s", "model_flops", "offload_copy_s_per_token",
        "optimizer_cost", "optimizer_impl", "peak_flops", "raw_constants", "sampler_spec", "time_constants",
        "HostCost", "OpClass", "OpTrace", "QueueShare", "QueueTimes", "TraceBuilder", "deepen", "extrapolate_trace",
        "host_cost", "op_class", "run_queues", "uniform_trace", "time_detail", "calibration_rows",
        "calibration_path", "read_calibration", "write_calibration_row", "host_name", "Segment", "segment_times",
    )},
    # the cost matrix's sizes (terms x bases), which the fake run's timing hook (advisor/simulator/timing_hook.py) fills
    **{name: ("timing.constants", name) for name in ("_NB", "_NT")},
    # ---- several GPUs in closed form (ranks_closed.py) ------------------------------------------------------------
    **{name: ("ranks_closed", name) for name in (
        "estimate_rank_moments", "estimate_rank_time", "zero_bytes", "ZeroTerms", "comm_time_s", "CommTime",
        "interconnect", "Interconnect", "offload_time_s", "LayoutTraffic", "layout_traffic", "apply_layout_traffic",
    )},
    # what one rank of the fake run (advisor/simulator/distributed.py) shares with the estimate's rank
    "model_counts": ("ranks_closed", "_model_counts"),  # (parameters, trainable) as the candidate trains the model
    "trainable_bytes": ("ranks_closed", "_trainable_bytes"),
    "rank_comm": ("ranks_closed", "_comm"),  # one step's collectives on the workload's target
    # ---- vLLM's memory in closed form (vllm.py), for online RL's generation engine: its names are generic there
    # (start, Pool, Mode, ...), so each is exported here as "vllm_<name>" ("vllm_dtype" as itself)
    **{name: ("vllm", name if name == "vllm_dtype" else name.removeprefix("vllm_")) for name in (
        "vllm_BLOCK_SIZE", "vllm_Mode", "vllm_Pool", "vllm_PoolSplit", "vllm_Refusal", "vllm_Refused",
        "vllm_Sleep", "vllm_Started", "vllm_asleep", "vllm_derived_max_model_len", "vllm_kv_layout",
        "vllm_min_utilization", "vllm_start", "vllm_training_gpu_peak", "vllm_dtype", "vllm_KVLayout",
        "vllm_LayerKV", "vllm_batch_kv_bytes", "vllm_UtilizationNeed", "vllm_Asleep", "vllm_DevicePeak",
        "vllm_TRL_SLEEP_LEVEL", "vllm_TRL_MAX_NUM_BATCHED_TOKENS", "vllm_NULL_BLOCKS", "vllm_VLLM_FOLLOWED",
        "vllm_VLLM_CHECKED", "vllm_CudaGraphs", "vllm_cudagraph_capture_sizes", "vllm_cudagraph_graphs",
        "vllm_CUDAGRAPH_MIN_GRAPH_BYTES",
    )},
    # ---- online RL's step (online_step.py) and its closed form (online_costs.py): per-phase device bytes, vLLM's
    # refusals, step time; their names are generic there (Reference, step_time, ...), so each is exported as
    # "online_<name>"
    **{name: ("online_step", name.removeprefix("online_")) for name in (
        "online_OnlineStep", "online_VllmSide", "online_Reference", "online_TrainingState", "online_build_step",
        "online_constants", "online_PHASES", "online_PhaseKind", "online_vllm_side", "online_Loss",
        "online_vllm_profile_activation_bytes", "online_vllm_cudagraph_bytes",
    )},
    **{name: ("online_costs", name.removeprefix("online_")) for name in (
        "online_HeadBytes", "online_PhaseBytes", "online_VllmTerms", "online_VllmRefusal", "online_OnlineDevicePeak",
        "online_OnlineTime", "online_hf_kv_cache_bytes", "online_lm_head_bytes", "online_phase_allocator_bytes",
        "online_vllm_terms", "online_startup_bytes", "online_device_peak", "online_step_time", "online_step_time_on",
        "online_colocated_vllm",
    )},
    # ---- on-policy distillation's training pass (distillation.py): the teacher and the chunked divergence --------
    **{name: ("distillation", name) for name in (
        "Teacher", "DivergenceBytes", "divergence_bytes", "step_divergence", "teacher_train_flops",
        "vocabulary_note", "teacher_of",
    )},
    "divergence_tiles": ("distillation", "tiles"),
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
