"""The target's cost model shared by the two predicting backends (`estimate` and `simulate`), public.

The step-time model (kernels by tile and wave, attention per tile, memory-bound ops, host dispatch, the
optimizer as the target runs it, the batches the sampler makes; its constants in
profiles/measurements/time_constants.json), the CUDA caching allocator's rules and the memory that lives outside
it (CUDA context, cuBLAS workspace; profiles/measurements/cuda_constants.json), and the multi-GPU closed forms
(ZeRO's model states per rank, the collectives' time over the interconnect) are implemented in the private physics
package `advisor._physics`, below both backends; this module is the public way in for scripts and tests. The
fake run's observer of the step-time model (`TimingHook`, `BatchLayout`) is the simulator's: `advisor.simulator`.

Each name is imported from advisor._physics on first use (PEP 562).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# advisor._physics's names that scripts and tests use
_NAMES = (
    "Basis", "BatchDistribution", "BatchPoint", "OptimizerImpl", "StepCost", "Term",
    "attention_kind", "attention_tile_s", "batch_distribution", "context_bytes", "cublas_workspace_bytes",
    "cuda_constants", "local_cuda_major", "dequant_s", "evaluate", "gemm_s", "memory_s", "model_flops",
    "offload_copy_s_per_token", "optimizer_cost", "optimizer_impl", "peak_flops", "replay", "round_size",
    "time_constants",
    "zero_bytes", "ZeroTerms", "comm_time_s", "interconnect",
    # host and device as two queues: this host's cost per op, a micro-step's ops in issue order
    "HostCost", "OpClass", "OpTrace", "TraceBuilder", "host_cost", "run_queues", "uniform_trace",
    # the constants measured where the target runs (scripts/gpu_calibrate.py)
    "calibration_rows", "calibration_path", "read_calibration", "write_calibration_row", "host_name",
    # vLLM's memory in closed form (advisor/_physics/vllm.py), prefixed vllm_
    "vllm_BLOCK_SIZE", "vllm_Mode", "vllm_Pool", "vllm_PoolSplit", "vllm_Refusal", "vllm_Refused", "vllm_Sleep",
    "vllm_Started", "vllm_asleep", "vllm_derived_max_model_len", "vllm_kv_layout", "vllm_min_utilization",
    "vllm_start", "vllm_training_gpu_peak", "vllm_dtype", "vllm_KVLayout", "vllm_LayerKV",
    "vllm_batch_kv_bytes", "vllm_UtilizationNeed", "vllm_Asleep", "vllm_DevicePeak", "vllm_TRL_SLEEP_LEVEL",
    "vllm_TRL_MAX_NUM_BATCHED_TOKENS", "vllm_NULL_BLOCKS", "vllm_VLLM_FOLLOWED", "vllm_VLLM_CHECKED",
    "vllm_CudaGraphs", "vllm_cudagraph_capture_sizes", "vllm_cudagraph_graphs", "vllm_CUDAGRAPH_MIN_GRAPH_BYTES",
    # online RL's step (advisor/_physics/online_step.py) and its closed form (online_costs.py), prefixed online_
    "online_PhaseKind", "online_TrainingState", "online_OnlineStep", "online_VllmSide", "online_Reference",
    "online_HeadBytes", "online_PhaseBytes",
    "online_VllmTerms", "online_VllmRefusal", "online_OnlineDevicePeak", "online_OnlineTime",
    "online_hf_kv_cache_bytes", "online_lm_head_bytes", "online_phase_allocator_bytes", "online_vllm_terms",
    "online_vllm_profile_activation_bytes",
    "online_startup_bytes", "online_device_peak", "online_step_time", "online_constants", "online_PHASES",
    "online_vllm_side", "online_colocated_vllm", "online_vllm_cudagraph_bytes",
)

__all__ = [*_NAMES]


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module("._physics", __package__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(_NAMES)
