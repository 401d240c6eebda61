"""vLLM's device memory in closed form, from vLLM's own accounting: what GRPO/RLOO's colocated (or served) vLLM
claims, when it refuses to start, and what sleep mode gives back. Part of the physics package: it imports
advisor.errors and the weights' dtype sizes of shapes.py, nothing else of advisor.

What TRL 1.16 asks of vLLM (trl/generation/vllm_generation.py, `VLLMGeneration.__init__`, colocate mode):
`LLM(model=model.name_or_path, tensor_parallel_size=vllm_tensor_parallel_size, gpu_memory_utilization=
vllm_gpu_memory_utilization, max_model_len=vllm_max_model_length, max_num_seqs=per_device_train_batch_size x
vllm_tensor_parallel_size x steps_per_generation, enable_sleep_mode=vllm_enable_sleep_mode,
distributed_executor_backend="external_launcher", max_num_batched_tokens=4096, ...)` and no `dtype`: vLLM loads the
checkpoint from disk at its own `dtype="auto"`, whatever dtype the policy trains in. With sleep mode TRL calls
`llm.sleep(level=2)` right after building it and after each generation, `wake_up(tags=["weights"])` before each
weight sync and `wake_up(tags=["kv_cache"])` before each generate (`sync_weights`, `generate`).

The vLLM this follows: `VLLM_FOLLOWED` (0.31.0), checked line by line against `VLLM_CHECKED` (0.22.0 and 0.31.0),
the two ends of the range TRL 1.16 supports (trl/import_utils.py `is_vllm_available`: 0.22.0 <= vLLM <= 0.31.0;
tests/test_vllm_memory.py reads it back from the installed TRL). File:line citations below are of those releases'
wheels (vllm-0.22.0 / vllm-0.31.0, cp38-abi3 manylinux_2_28_x86_64, from PyPI); where the two differ it says so.

vLLM's rules, each term with its source (vLLM's code, vllm-project/vllm):
- The pool: `Worker.init_device` (vllm/v1/worker/gpu_worker.py, 0.22.0 :300, 0.31.0 :490) takes a `MemorySnapshot`
  after CUDA and the distributed group are up; `request_memory` (vllm/v1/worker/utils.py, 0.22.0 :403-423, 0.31.0
  :540-559) sets `requested_memory = ceil(total_memory * gpu_memory_utilization)` and, when the snapshot's
  `free_memory < requested_memory`, raises "Free memory on device (...) on startup is less than desired GPU memory
  utilization". Colocated, the training process's own bytes (its weights, a reference, the CUDA context) are on the
  device by then: they count against the free memory.
- The split: `Worker.determine_available_memory` (same file) runs `model_runner.profile_run()` inside
  `memory_profiling` (vllm/utils/mem_utils.py), whose non-KV memory is the weights as loaded, the profile run's
  activation peak (one `max_num_batched_tokens` forward and the sampler) and memory outside PyTorch's allocator that
  grew since the snapshot (NCCL, attention backends' buffers, kernels' modules): 0.22.0 sums them
  (`non_torch_increase + torch_peak_increase + weights_memory`, gpu_worker.py:417-421), 0.31.0 measures the first
  and last through free memory (`total_consumed + transient_peak_headroom`, mem_utils.py:312-321), the same bytes.
  `available_kv_cache_memory_bytes = requested_memory - non_kv_cache_memory - cudagraph_memory_estimate_applied`
  (0.22.0 gpu_worker.py:447-451, 0.31.0 gpu_worker.py:673-677): the CUDA graphs are inside the pool. The estimate is
  applied when VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS is set, which defaults to 1 since vLLM 0.21.0 (0.22.0
  envs.py:1954-1956, 0.31.0 envs.py:2162-2164; the log line "CUDA graph memory profiling is enabled (default since
  v0.21.0)", 0.22.0 gpu_worker.py:481-483), and TRL sets neither it nor `enforce_eager`
  (trl/generation/vllm_generation.py `LLM(...)`). The KV cache is the rest of the pool.
- CUDA graphs (`cudagraph_graphs`, `CudaGraphs.estimate_bytes`): vLLM's default mode is FULL_AND_PIECEWISE
  (optimization level O2, the default: 0.31.0 config/vllm.py:316 and :442, 0.22.0 :244). The capture sizes
  (`_set_cudagraph_sizes`, 0.31.0 config/vllm.py:2388-2590, 0.22.0 :1597-1700): the largest is
  min(2 x max_num_seqs, 512, max_num_batched_tokens) (1,024 instead of 512 on compute capability 10.x in 0.31.0:
  not modelled, it matters only above 256 sequences); 1, 2, 4, then every 8 below 256, every 16 from 256;
  max_num_batched_tokens when it fits; 0.31.0 also max_num_seqs (its uniform decode size; 0.22.0 does not).
  PIECEWISE graphs are captured at every size, FULL ones at the sizes up to max_num_seqs
  (`CudagraphDispatcher.initialize_cudagraph_keys`, 0.31.0 cudagraph_dispatcher.py:164-229, 0.22.0 :170-236).
  `GPUModelRunner.profile_cudagraph_memory` (0.22.0 gpu_model_runner.py:6265-6370, 0.31.0 :6606-6750) captures
  the two largest of each mode and estimates max over the modes of the first capture + per mode (graphs - 1) x
  the second capture, at least 1 MiB a graph (0.22.0 :6305-6332 and :6362-6364; 0.31.0 :6668-6696 and
  :6739-6746). What a capture takes depends on the kernels: an input here (online_rl.py `vllm_cudagraph_bytes`:
  modelled, unverified).
- One sequence must fit: `check_enough_kv_cache_memory` (vllm/v1/core/kv_cache_utils.py) raises "No available
  memory for the cache blocks" when the KV memory is <= 0, and "To serve at least one request with the models's max
  seq len (...)" when `max_memory_usage_bytes` of every layer's `KVCacheSpec` at `max_model_len` exceeds it
  (0.31.0 first holds back one block of each group, the null block `BlockPool` keeps, kv_cache_utils.py:1018-1026;
  0.22.0 checks the whole, kv_cache_utils.py:794-819: one page more starts there).
- KV bytes: `AttentionSpec.page_size_bytes` (vllm/v1/kv_cache_interface.py) = block_size x num_kv_heads x
  (head_size + head_size_v) x dtype bytes per layer (MLA: one latent of kv_lora_rank + qk_rope_head_dim, no x2);
  `FullAttentionSpec.max_memory_usage_bytes` = cdiv(max_model_len, block_size) pages; `SlidingWindowSpec`'s =
  (cdiv(min(sliding_window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1) pages. block_size is
  `CacheConfig.block_size`, 16 on CUDA. KV heads are split over tensor-parallel ranks (at least one per rank).
- dtype "auto": `_resolve_auto_dtype` (vllm/config/model.py) keeps the checkpoint's dtype and downcasts float32 to
  the platform's first supported dtype (bfloat16 on compute capability >= 8.0, else float16; never float16 for
  gemma2/gemma3/glm4).
- Sleep: `CuMemAllocator.sleep(offload_tags)` (vllm/device_allocator/cumem.py, 0.31.0 :233-298) unmaps every
  allocation made under its pool, copying those tagged for offload to (pinned) CPU memory and discarding the rest,
  then empties PyTorch's cache. `Worker.sleep(level)` offloads the "weights" tag at level 1 and nothing at level 2
  (weights and KV cache both discarded; level 2 copies the model's buffers to the CPU first; 0.31.0 goes through
  `CuMemBackend.suspend`, sleep_mode_backend.py:127-133, "NCCL buffers left untouched"). Only the "weights"
  (load_model) and "kv_cache" (initialize_from_config) pools are under the allocator (0.22.0 gpu_worker.py:337, :557;
  0.31.0 :540, :813): the non-torch memory (NCCL, workspaces, kernels' modules) and the CUDA-graph pool stay on the
  device while asleep (`asleep`). vLLM PR 11743, which brought sleep mode, measured it: 79.22 GiB card, 0.90, model
  weights 2.32 GiB, non_torch_memory 0.67 GiB; free before sleep 8.34 GiB, after 78.29 GiB: 0.93 GiB stays (its
  CUDA context, the non-torch memory and the CUDA-graph pool, "cudagraph memory pool is not released"). Colocated in
  TRL, vLLM shares the training process's CUDA context (counted there: cuda_constants.json); what it keeps of its
  own is the non-torch memory and the graphs. NCCL communicator suspension (`enable_nccl_comm_suspend`, 0.31.0
  gpu_worker.py:289) is opt-in and off in TRL.
- Server mode (`trl vllm-serve`): vLLM runs on GPUs of its own; the training GPUs hold no pool.

Modelled, not run: the profile run's activation peak and the non-torch increase depend on vLLM's kernels; they are
inputs here (measured, or an estimate the caller names). Prefix caching (on by default in vLLM's V1 engine) shares
the full prompt blocks of a prompt's num_generations completions; `generation_pool` does not count that sharing,
so its KV need is an upper bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..errors import ConfigError
from .shapes import DTYPE_BYTES as _WEIGHT_BYTES

# The vLLM release this closed form follows, and those it was checked against line by line: the two ends of the
# range TRL 1.16 supports (trl/import_utils.py is_vllm_available: "TRL currently supports vLLM versions from 0.22.0
# to 0.31.0"); where they differ the docstring above says which rule is whose.
VLLM_FOLLOWED = "0.31.0"
VLLM_CHECKED = ("0.22.0", "0.31.0")
BLOCK_SIZE = 16  # vllm/config/cache.py CacheConfig.DEFAULT_BLOCK_SIZE (0.22.0 :45, 0.31.0 :71; FlashAttention keeps it)
TRL_MAX_NUM_BATCHED_TOKENS = 4096  # trl/generation/vllm_generation.py: LLM(max_num_batched_tokens=4096)
CUDAGRAPH_MAX_CAPTURE = 512  # vllm/config/vllm.py _set_cudagraph_sizes default_max_graph_size (not sm100)
CUDAGRAPH_MIN_GRAPH_BYTES = 1 << 20  # gpu_model_runner.py profile_cudagraph_memory: "at least 1 MiB per graph"

# the weights' dtypes (shapes.py, one place) and the KV cache's fp8 kinds (vllm/config/cache.py CacheDType)
DTYPE_BYTES = {**{d.value: n for d, n in _WEIGHT_BYTES.items()}, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
_NO_FLOAT16 = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4"})  # vllm/config/model.py
# vllm/config/model.py _get_and_verify_max_len: the config keys that bound the model's length (the smallest wins)
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_sequence_length", "max_seq_length", "seq_len")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return config.get("text_config") or config


# ---- dtype and length as vLLM derives them ----------------------------------------------------------------------
def vllm_dtype(config: Mapping[str, Any], *, supports_bf16: bool = True) -> str:
    """The dtype vLLM's `dtype="auto"` (what TRL passes) loads the checkpoint in (`_resolve_auto_dtype`)."""
    c = _text_config(config)
    name = str(c.get("torch_dtype") or c.get("dtype") or config.get("torch_dtype") or "float32")
    name = name.removeprefix("torch.")
    name = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)
    supported = (["bfloat16"] if supports_bf16 else []) + ["float16", "float32"]
    if str(c.get("model_type", "")) in _NO_FLOAT16:
        supported.remove("float16")
    if name == "float32":
        return supported[0]
    return name if name in supported else supported[0]


def derived_max_model_len(config: Mapping[str, Any], vllm_max_model_length: int | None = None) -> int:
    """vLLM's `max_model_len`: TRL's `vllm_max_model_length` when given, else the model's own (the smallest length
    key of the config; `vllm/config/model.py` `_get_and_verify_max_len`). The one-sequence check is at this length,
    not at prompt + completion."""
    c = _text_config(config)
    found = [int(c[k]) for k in _LENGTH_KEYS if isinstance(c.get(k), int)]
    if not found:
        raise ConfigError("the model's config has none of vLLM's length keys (max_position_embeddings, ...); set "
                          "vllm_max_model_length", context="vllm_max_model_length")
    derived = min(found)
    if vllm_max_model_length is not None:
        if vllm_max_model_length > derived:
            raise ConfigError(f"vllm_max_model_length={vllm_max_model_length} exceeds the model's {derived} "
                              "(vLLM refuses it); lower it", context="vllm_max_model_length")
        return int(vllm_max_model_length)
    return derived


# ---- KV bytes ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerKV:
    """One decoder layer's KV cache as vLLM's `KVCacheSpec` holds it (per tensor-parallel rank)."""

    kv_heads: int
    head_size: int
    head_size_v: int
    dtype_bytes: int
    sliding_window: int | None = None
    mla: bool = False

    @property
    def bytes_per_token(self) -> int:
        if self.mla:  # MLAAttentionSpec.real_page_size_bytes: one latent per token
            return self.kv_heads * self.head_size * self.dtype_bytes
        return self.kv_heads * (self.head_size + self.head_size_v) * self.dtype_bytes

    def page_bytes(self, block_size: int = BLOCK_SIZE) -> int:
        return block_size * self.bytes_per_token

    def max_memory_usage_bytes(self, max_model_len: int, block_size: int = BLOCK_SIZE,
                               max_num_batched_tokens: int = TRL_MAX_NUM_BATCHED_TOKENS) -> int:
        """vLLM's bytes for one request of `max_model_len` tokens (FullAttentionSpec / SlidingWindowSpec)."""
        if self.sliding_window is None:
            return _cdiv(max_model_len, block_size) * self.page_bytes(block_size)
        tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return (_cdiv(tokens, block_size) + 1) * self.page_bytes(block_size)


@dataclass(frozen=True)
class KVLayout:
    """Every layer's KV spec of a model, as vLLM builds them from a transformers config."""

    layers: tuple[LayerKV, ...]
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token holds over all layers (a full-attention layer's per token; a sliding one's too while
        the sequence is within its window)."""
        return sum(layer.bytes_per_token for layer in self.layers)

    def page_bytes(self, block_size: int = BLOCK_SIZE) -> int:
        return sum(layer.page_bytes(block_size) for layer in self.layers)

    def sequence_bytes(self, max_model_len: int, block_size: int = BLOCK_SIZE,
                       max_num_batched_tokens: int = TRL_MAX_NUM_BATCHED_TOKENS) -> int:
        """`max_memory_usage_bytes` summed over the layers: what one request of `max_model_len` tokens needs."""
        return sum(layer.max_memory_usage_bytes(max_model_len, block_size, max_num_batched_tokens)
                   for layer in self.layers)


def kv_layout(config: Mapping[str, Any], dtype: str | None = None, *, tensor_parallel_size: int = 1,
              supports_bf16: bool = True) -> KVLayout:
    """The KV layout vLLM builds for a transformers config: layers, KV heads (split over tensor-parallel ranks, at
    least one each), head size, the KV dtype (the model's vLLM dtype unless `dtype` says otherwise: `kv_cache_dtype`),
    sliding-window layers (gemma2's every other layer, `layer_types`, mistral's `sliding_window`; Qwen2's only with
    `use_sliding_window`) and MLA (DeepSeek's `kv_lora_rank`)."""
    c = _text_config(config)
    problems = []
    layers = c.get("num_hidden_layers")
    heads = c.get("num_attention_heads")
    if not isinstance(layers, int) or layers < 1:
        problems.append("num_hidden_layers is missing or not a positive integer")
    if not isinstance(heads, int) or heads < 1:
        problems.append("num_attention_heads is missing or not a positive integer")
    if tensor_parallel_size < 1:
        problems.append(f"tensor_parallel_size={tensor_parallel_size} must be >= 1")
    name = dtype or vllm_dtype(config, supports_bf16=supports_bf16)
    if name not in DTYPE_BYTES:
        problems.append(f"dtype={name!r} is not one of {', '.join(DTYPE_BYTES)}")
    if problems:
        raise ConfigError(problems, context="vLLM KV layout")
    nbytes = DTYPE_BYTES[name]
    if c.get("kv_lora_rank"):  # MLA: DeepSeek-V2/V3; one latent (kv_lora_rank + qk_rope_head_dim) per token
        size = int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim", 0))
        layer = LayerKV(kv_heads=1, head_size=size, head_size_v=size, dtype_bytes=nbytes, mla=True)
        return KVLayout(layers=(layer,) * layers, dtype=name)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_size = int(c.get("head_dim") or c["hidden_size"] // heads)
    per_rank = max(1, kv_heads // tensor_parallel_size)
    kinds = _sliding_layers(c, layers)
    window = c.get("sliding_window")
    out = tuple(LayerKV(kv_heads=per_rank, head_size=head_size, head_size_v=head_size, dtype_bytes=nbytes,
                        sliding_window=int(window) if sliding and window else None)
                for sliding in kinds)
    return KVLayout(layers=out, dtype=name)


def _sliding_layers(c: Mapping[str, Any], layers: int) -> list[bool]:
    types = c.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return [t == "sliding_attention" for t in types]
    if not c.get("sliding_window"):
        return [False] * layers
    model_type = str(c.get("model_type", ""))
    if model_type == "gemma2":  # vLLM's Gemma2: even layers slide
        return [i % 2 == 0 for i in range(layers)]
    if model_type.startswith("qwen2"):  # Qwen2 slides only with use_sliding_window, above max_window_layers
        if not c.get("use_sliding_window"):
            return [False] * layers
        first = int(c.get("max_window_layers", layers))
        return [i >= first for i in range(layers)]
    return [True] * layers


# ---- CUDA graphs: the sizes vLLM captures and its estimate of their memory -----------------------------------------
def cudagraph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int = TRL_MAX_NUM_BATCHED_TOKENS
                            ) -> tuple[int, ...]:
    """The token counts vLLM captures graphs at (`VllmConfig._set_cudagraph_sizes`, vLLM 0.31.0, no speculative
    decoding): up to min(2 x max_num_seqs, 512, max_num_batched_tokens); 1, 2, 4, every 8 below 256, every 16 from
    256, max_num_batched_tokens when it fits, and max_num_seqs (the uniform decode size) when it fits."""
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ConfigError(f"max_num_seqs={max_num_seqs} and max_num_batched_tokens={max_num_batched_tokens} must be "
                          ">= 1", context="vLLM CUDA graphs")
    cap = min(max_num_seqs * 2, CUDAGRAPH_MAX_CAPTURE)
    decode = [max_num_seqs] if max_num_seqs <= cap else []
    cap = min(max_num_batched_tokens, cap)
    sizes = [i for i in (1, 2, 4) if i <= cap]
    if cap >= 8:
        sizes += range(8, min(cap + 1, 256), 8)
    if cap >= 256:
        sizes += range(256, cap + 1, 16)
    if max_num_batched_tokens <= cap:
        sizes.append(max_num_batched_tokens)
    sizes += [n for n in decode if n <= max_num_batched_tokens]
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class CudaGraphs:
    """The graphs vLLM captures in FULL_AND_PIECEWISE mode: PIECEWISE at every capture size (mixed prefill/decode
    batches), FULL at those up to max_num_seqs (uniform decode batches)."""

    piecewise: tuple[int, ...]
    full: tuple[int, ...]

    @property
    def largest_tokens(self) -> int:
        return max((*self.piecewise, *self.full), default=0)

    def estimate_bytes(self, first_capture_bytes: int, per_graph_bytes: int) -> int:
        """`profile_cudagraph_memory`'s estimate: the largest first capture (both modes share one pool: taken once) +
        per mode (graphs - 1) x the per-graph bytes, at least 1 MiB a graph."""
        per = max(int(per_graph_bytes), CUDAGRAPH_MIN_GRAPH_BYTES)
        graphs = sum(max(0, len(mode) - 1) for mode in (self.piecewise, self.full))
        return (int(first_capture_bytes) if self.largest_tokens else 0) + per * graphs


def cudagraph_graphs(max_num_seqs: int, max_num_batched_tokens: int = TRL_MAX_NUM_BATCHED_TOKENS) -> CudaGraphs:
    """The graphs of vLLM's default mode for `max_num_seqs` (TRL: the local generation batch x tensor-parallel size)
    (`CudagraphDispatcher.initialize_cudagraph_keys`)."""
    sizes = cudagraph_capture_sizes(max_num_seqs, max_num_batched_tokens)
    return CudaGraphs(piecewise=sizes, full=tuple(n for n in sizes if n <= max_num_seqs))


# ---- the pool, its split, and the refusals ------------------------------------------------------------------------
@dataclass(frozen=True)
class Pool:
    """What `gpu_memory_utilization` claims: utilization x the device's total memory (`Worker.init_device`)."""

    total_bytes: int
    utilization: float

    def __post_init__(self) -> None:
        problems = []
        if not 0.0 < self.utilization <= 1.0:
            problems.append(f"vllm_gpu_memory_utilization={self.utilization} must be in (0, 1]")
        if self.total_bytes <= 0:
            problems.append(f"the device's total memory ({self.total_bytes} bytes) must be positive")
        if problems:
            raise ConfigError(problems, context="vLLM pool")

    @property
    def requested_bytes(self) -> int:
        """`requested_memory = ceil(total_memory * gpu_memory_utilization)` (vllm/v1/worker/utils.py
        `request_memory`)."""
        return math.ceil(self.total_bytes * self.utilization)


@dataclass(frozen=True)
class PoolSplit:
    """The pool as `determine_available_memory` splits it; the KV cache is the rest (may be <= 0: refused)."""

    pool_bytes: int
    weights_bytes: int  # memory_profiling's weights_memory: the checkpoint as vLLM loaded it
    activation_bytes: int  # torch_peak_increase of profile_run
    non_torch_bytes: int  # non_torch_increase since the startup snapshot (NCCL, attention buffers)
    cudagraph_bytes: int = 0  # cudagraph_memory_estimate_applied (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS, on by
    # default since vLLM 0.21.0; 0 only with it set to 0, or enforce_eager)

    @property
    def non_kv_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes + self.non_torch_bytes

    @property
    def kv_cache_bytes(self) -> int:
        return self.pool_bytes - self.non_kv_bytes - self.cudagraph_bytes

    def kv_blocks(self, layout: KVLayout, block_size: int = BLOCK_SIZE) -> int:
        """Whole KV pages (of every layer) the cache holds (`get_num_blocks`: available // page // layers)."""
        return max(0, self.kv_cache_bytes) // layout.page_bytes(block_size)


class Refusal(str, Enum):
    """Why vLLM refuses to start (each a ValueError at engine start, in TRL's GRPOTrainer.__init__)."""

    POOL_EXCEEDS_FREE = "pool_exceeds_free_memory"  # Worker.init_device
    NO_KV_MEMORY = "no_kv_cache_memory"  # check_enough_kv_cache_memory: available <= 0
    SEQUENCE_DOES_NOT_FIT = "max_model_len_does_not_fit"  # check_enough_kv_cache_memory: one request too big


_FIX = {
    Refusal.POOL_EXCEEDS_FREE: "lower vllm_gpu_memory_utilization, or free the device (a smaller training state "
                               "at startup: LoRA, a lower-precision dtype, no separate reference)",
    Refusal.NO_KV_MEMORY: "raise vllm_gpu_memory_utilization: the pool does not even hold vLLM's weights, profile "
                          "activations and non-torch memory",
    Refusal.SEQUENCE_DOES_NOT_FIT: "raise vllm_gpu_memory_utilization or lower vllm_max_model_length (vLLM checks "
                                   "one sequence of max_model_len, the model's own length when it is not set)",
}
_SOURCE = {
    Refusal.POOL_EXCEEDS_FREE: "vllm/v1/worker/gpu_worker.py Worker.init_device",
    Refusal.NO_KV_MEMORY: "vllm/v1/core/kv_cache_utils.py check_enough_kv_cache_memory",
    Refusal.SEQUENCE_DOES_NOT_FIT: "vllm/v1/core/kv_cache_utils.py check_enough_kv_cache_memory",
}


@dataclass(frozen=True)
class Refused:
    """A typed OOM outcome: vLLM would not start, and why (bytes needed vs available, vLLM's own rule)."""

    cause: Refusal
    needed_bytes: int
    available_bytes: int
    max_model_len: int | None = None

    @property
    def fix(self) -> str:
        return _FIX[self.cause]

    @property
    def source(self) -> str:
        return _SOURCE[self.cause]

    @property
    def message(self) -> str:
        gib = 2**30
        if self.cause is Refusal.POOL_EXCEEDS_FREE:
            head = (f"vLLM refuses to start: free memory at startup ({self.available_bytes / gib:.2f} GiB, after the "
                    f"training process's own bytes) is less than the pool it is asked for "
                    f"({self.needed_bytes / gib:.2f} GiB)")
        elif self.cause is Refusal.NO_KV_MEMORY:
            head = (f"vLLM refuses to start: no memory left for the KV cache (the pool is "
                    f"{-self.available_bytes / gib:.2f} GiB short of its weights, activations and non-torch memory)")
        else:
            head = (f"vLLM refuses to start: one sequence of max_model_len={self.max_model_len} needs "
                    f"{self.needed_bytes / gib:.2f} GiB of KV cache, the pool leaves {self.available_bytes / gib:.2f}"
                    " GiB")
        return f"{head} ({self.source}); {self.fix}"


@dataclass(frozen=True)
class Started:
    """vLLM starts: its pool's split and how many full-length sequences its KV cache holds."""

    split: PoolSplit
    max_model_len: int
    sequence_bytes: int  # one request of max_model_len
    kv_blocks: int

    @property
    def full_length_sequences(self) -> int:
        return (self.split.kv_cache_bytes) // self.sequence_bytes


NULL_BLOCKS = 1  # the null block BlockPool holds back (recent vLLM's check_enough_kv_cache_memory reserves it)


def start(pool: Pool, *, free_at_startup: int, weights_bytes: int, activation_bytes: int, non_torch_bytes: int,
          layout: KVLayout, max_model_len: int, cudagraph_bytes: int = 0, block_size: int = BLOCK_SIZE,
          max_num_batched_tokens: int = TRL_MAX_NUM_BATCHED_TOKENS) -> Started | Refused:
    """vLLM's start-up in order: the free-memory check, the profile split, the one-sequence check.

    `free_at_startup`: the device's free bytes when vLLM snapshots it; colocated in TRL, the total less the training
    process's bytes by then (the CUDA context, the policy's and any reference's weights: the optimizer state does
    not exist yet, Trainer creates it in train())."""
    requested = pool.requested_bytes
    if free_at_startup < requested:
        return Refused(Refusal.POOL_EXCEEDS_FREE, needed_bytes=requested, available_bytes=free_at_startup)
    split = PoolSplit(requested, weights_bytes, activation_bytes, non_torch_bytes, cudagraph_bytes)
    available = split.kv_cache_bytes
    if available <= 0:
        return Refused(Refusal.NO_KV_MEMORY, needed_bytes=split.non_kv_bytes + cudagraph_bytes,
                       available_bytes=available)
    seq = layout.sequence_bytes(max_model_len, block_size, max_num_batched_tokens)
    check = available - NULL_BLOCKS * layout.page_bytes(block_size)
    if seq > check:
        return Refused(Refusal.SEQUENCE_DOES_NOT_FIT, needed_bytes=seq, available_bytes=check,
                       max_model_len=max_model_len)
    return Started(split, max_model_len, seq, split.kv_blocks(layout, block_size))


# ---- the generation batch: the smallest pool that holds it ------------------------------------------------------
def batch_kv_bytes(layout: KVLayout, sequences: int, sequence_length: int, block_size: int = BLOCK_SIZE,
                   max_num_batched_tokens: int = TRL_MAX_NUM_BATCHED_TOKENS) -> int:
    """KV bytes of `sequences` requests of `sequence_length` tokens each (prompt + max_completion_length) all
    running at once, plus the null block; prompt blocks shared by prefix caching are not subtracted (a bound)."""
    per = layout.sequence_bytes(sequence_length, block_size, max_num_batched_tokens)
    return sequences * per + NULL_BLOCKS * layout.page_bytes(block_size)


@dataclass(frozen=True)
class UtilizationNeed:
    """The smallest `vllm_gpu_memory_utilization` whose pool holds the generation batch at full length and one
    sequence of max_model_len: exact (`exact`) and rounded up to the emitted precision (`value`)."""

    exact: float
    value: float
    pool_bytes: int
    kv_bytes: int
    binding: str  # "generation batch" or "one max_model_len sequence"


def min_utilization(total_bytes: int, *, weights_bytes: int, activation_bytes: int, non_torch_bytes: int,
                    layout: KVLayout, sequences: int, sequence_length: int, max_model_len: int,
                    cudagraph_bytes: int = 0, block_size: int = BLOCK_SIZE,
                    max_num_batched_tokens: int = TRL_MAX_NUM_BATCHED_TOKENS, decimals: int = 2) -> UtilizationNeed:
    """`sequences`: the requests vLLM runs at once (TRL's max_num_seqs = per_device_train_batch_size x
    vllm_tensor_parallel_size x steps_per_generation, the local generation batch); `sequence_length`: prompt +
    max_completion_length of the longest."""
    if sequences < 1 or sequence_length < 1:
        raise ConfigError(f"sequences={sequences} and sequence_length={sequence_length} must be >= 1",
                          context="vLLM generation batch")
    if sequence_length > max_model_len:
        raise ConfigError(f"prompt + completion ({sequence_length} tokens) exceeds vllm_max_model_length="
                          f"{max_model_len}; raise it or lower max_completion_length", context="vllm_max_model_length")
    batch = batch_kv_bytes(layout, sequences, sequence_length, block_size, max_num_batched_tokens)
    one = layout.sequence_bytes(max_model_len, block_size, max_num_batched_tokens) + NULL_BLOCKS * layout.page_bytes(
        block_size)
    kv = max(batch, one)
    pool = weights_bytes + activation_bytes + non_torch_bytes + cudagraph_bytes + kv
    exact = pool / total_bytes
    scale = 10**decimals
    value = math.ceil(exact * scale - 1e-9) / scale
    while math.ceil(total_bytes * value) < pool:  # rounding of the float product
        value += 1 / scale
    return UtilizationNeed(exact=exact, value=round(value, decimals), pool_bytes=pool, kv_bytes=kv,
                           binding="generation batch" if batch >= one else "one max_model_len sequence")


# ---- sleep mode and the device's peak across a step's phases ---------------------------------------------------------
class Sleep(str, Enum):
    """`vllm_enable_sleep_mode`: off, or the level slept at (TRL sleeps at level 2)."""

    OFF = "off"
    LEVEL_1 = "1"  # weights offloaded to CPU, KV cache discarded
    LEVEL_2 = "2"  # weights and KV cache discarded (TRL: re-pushed from the policy at each weight sync)


TRL_SLEEP_LEVEL = Sleep.LEVEL_2  # trl/generation/vllm_generation.py: self.llm.sleep(level=2)


@dataclass(frozen=True)
class Asleep:
    """What vLLM holds while asleep: on the device (outside the cumem pool: non-torch memory, CUDA graphs), on
    the host (level 1: the weights' backup), and what it released from the device."""

    level: Sleep
    device_bytes: int
    host_bytes: int
    released_bytes: int


def asleep(split: PoolSplit, level: Sleep) -> Asleep:
    """`CuMemAllocator.sleep`: the "weights" and "kv_cache" allocations are unmapped (level 1 backs the weights up
    in CPU memory first); PyTorch's cache (the profile/generation activations) is emptied; what is not under the
    allocator's pool stays: the non-torch memory and the CUDA graphs (PR 11743: "cudagraph memory pool is not
    released")."""
    if level is Sleep.OFF:
        return Asleep(level, device_bytes=split.pool_bytes, host_bytes=0, released_bytes=0)
    kept = split.non_torch_bytes + split.cudagraph_bytes
    return Asleep(level, device_bytes=kept, host_bytes=split.weights_bytes if level is Sleep.LEVEL_1 else 0,
                  released_bytes=split.pool_bytes - kept)


class Mode(str, Enum):
    """`vllm_mode` (or generation without vLLM)."""

    GENERATE = "generate"  # use_vllm=False: transformers' model.generate on the policy
    COLOCATE = "colocate"
    SERVER = "server"


@dataclass(frozen=True)
class DevicePeak:
    """A training GPU's peak over a step's phases with vLLM beside the policy: generation (vLLM awake, the
    training state resident) and training (the training state, its activations, and vLLM's pool or what stays of
    it asleep). Bytes of the training process are the caller's (the simulator's phases); vLLM's are this module's."""

    generation_bytes: int
    training_bytes: int
    vllm_during_training_bytes: int

    @property
    def peak_bytes(self) -> int:
        return max(self.generation_bytes, self.training_bytes)


def training_gpu_peak(mode: Mode, *, training_state_bytes: int, training_activation_bytes: int,
                      generation_extra_bytes: int = 0, split: PoolSplit | None = None,
                      sleep: Sleep = Sleep.OFF) -> DevicePeak:
    """The peak of one training GPU.

    `training_state_bytes`: resident through the step (weights, gradients, optimizer state, reference);
    `training_activation_bytes`: the training phase's peak above it; `generation_extra_bytes`: the generation phase's
    own bytes of the training process above the state (scoring forwards, the prompts). Server mode: vLLM is on GPUs of
    its own, no pool here. Colocate without sleep: the pool is held all the time. With sleep: the pool during
    generation, what stays asleep during training; the peak drops by min(released, training activations) when
    generation_extra is 0 (the smaller of the pool and the training phase's activations when nothing stays)."""
    if mode is not Mode.COLOCATE:
        return DevicePeak(training_state_bytes + generation_extra_bytes,
                          training_state_bytes + training_activation_bytes, 0)
    if split is None:
        raise ConfigError("colocated vLLM needs its pool's split", context="vllm_mode=colocate")
    during_training = asleep(split, sleep).device_bytes
    return DevicePeak(training_state_bytes + generation_extra_bytes + split.pool_bytes,
                      training_state_bytes + training_activation_bytes + during_training, during_training)
