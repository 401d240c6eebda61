"""Online RL's search space: the engine knobs' values from the target, the generation engine as one searched
dimension, the knobs without effect reset, colocated vLLM's utilization derived (not searched), and the ranks that
train when vLLM serves from GPUs of its own. The online trainer's `search_values`, `joint_dimensions`,
`canonical`, `derive`, `derivation_notes` and `training_gpus` (online_trainer.py) are these."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..knobs import knob
from ..physics import architecture, online_vllm_side, vllm_min_utilization
from ..space import with_knobs
from .online_knobs import KNOBS, VllmMode

if TYPE_CHECKING:
    from ..space import Candidate
    from ..workload import Workload

ENGINE = "generation_engine"  # the name of the one searched dimension of the generation engine


def search_values(workload: Workload, values: Mapping[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
    """The default space's values of the engine knobs, from the target: vLLM (colocated with or without sleep
    mode) only on a CUDA target, server mode on k of --num-gpus (k in 1..num_gpus-1: at least one GPU trains)
    only when --num-gpus > 1; expandable_segments off offered beside the space's own value (it goes with sleep
    mode: `joint_dimensions`). `values`: the space so far (the shared knobs' values)."""
    out: dict[str, tuple[Any, ...]] = {}
    n = max(1, int(workload.num_gpus))
    if workload.gpu.is_cuda:
        out["use_vllm"] = (False, True)
        out["vllm_enable_sleep_mode"] = (False, True)
        out["expandable_segments"] = tuple(dict.fromkeys((*values.get("expandable_segments", (True,)), False)))
        if n > 1:
            out["vllm_mode"] = (VllmMode.COLOCATE.value, VllmMode.SERVER.value)
            out["vllm_server_gpus"] = tuple(range(1, n))
    else:
        out["use_vllm"] = (False,)  # vLLM generates on CUDA GPUs only
    return out


def joint_dimensions(values: Mapping[str, tuple[Any, ...]]) -> dict[str, tuple[tuple[str, dict], ...]]:
    """The generation engine as ONE categorical of the study (label -> the knobs it sets), the choices of what
    `values` (the space, --fix pins applied) offers: model.generate (and, where ZeRO-3 is offered, generating
    layer by layer: ds3_gather_for_generation False), vLLM colocate without sleep, vLLM colocate with sleep and
    expandable_segments off (vLLM's CuMemAllocator refuses them: one decision, not a refused combination), vLLM
    server on k GPUs. A knob the user pinned holds: sleep mode with expandable_segments pinned on stays a choice,
    refused by the rule with its fix. Empty when the space offers no choice of engine."""

    def offered(name: str, value: Any) -> bool:
        return value in values.get(name, (knob(name).default,))

    es = offered("expandable_segments", True)
    # ds3_gather_for_generation: both ways where a ZeRO-3 layout is offered (TRL reads it only there; the
    # --fix'd parallelism counts), as the user pinned it otherwise
    zero3 = any(str(getattr(layout, "value", layout)).startswith("zero3") for layout in values.get("parallelism", ()))
    gathers = tuple(values.get("ds3_gather_for_generation", (True, False) if zero3 else (True,)))
    opts: list[tuple[str, dict]] = []
    if offered("use_vllm", False):
        for gather in (True, False):
            if gather in gathers:
                opts.append(("generate" if gather else "generate-layerwise",
                             {"use_vllm": False, "ds3_gather_for_generation": gather, "expandable_segments": es}))
    if offered("use_vllm", True):
        opts.extend(_vllm_choices(offered, es, True in gathers, values))
    return {ENGINE: tuple(opts)} if opts else {}


def _vllm_choices(offered: Any, es: bool, gather: bool, values: Mapping[str, tuple[Any, ...]]
                  ) -> list[tuple[str, dict]]:
    on = {"use_vllm": True, "ds3_gather_for_generation": gather}  # TRL: vLLM needs the weights gathered
    colocate, server = VllmMode.COLOCATE.value, VllmMode.SERVER.value
    opts: list[tuple[str, dict]] = []
    if offered("vllm_mode", colocate):
        if offered("vllm_enable_sleep_mode", False):
            opts.append(("vllm-colocate", {**on, "vllm_mode": colocate, "vllm_enable_sleep_mode": False,
                                           "expandable_segments": es}))
        if offered("vllm_enable_sleep_mode", True):
            opts.append(("vllm-colocate-sleep", {
                **on, "vllm_mode": colocate, "vllm_enable_sleep_mode": True,
                "expandable_segments": not offered("expandable_segments", False)}))
    if offered("vllm_mode", server):
        for k in values.get("vllm_server_gpus", ()):
            if int(k) >= 1:
                opts.append((f"vllm-server-{k}", {**on, "vllm_mode": server, "vllm_server_gpus": int(k),
                                                  "expandable_segments": es}))
    return opts


def canonical(candidate: Candidate) -> Candidate:
    """The online knobs that have no effect (their `active`: sleep mode and the utilization off colocated vLLM,
    vllm_server_gpus off server mode, vllm_mode without vLLM, ds3_gather_for_generation off ZeRO-3) back to their
    defaults, so equivalent candidates compare equal (Candidate.canonical does it for the shared knobs)."""

    reset = {k.name: k.default for k in KNOBS
             if not k.is_active(candidate) and candidate.base.get(k.name, k.default) != k.default}
    if not reset:
        return candidate
    return with_knobs(candidate, **{n: v.value if isinstance(v, Enum) else v for n, v in reset.items()})


def training_gpus(k: Any, num_gpus: int) -> int:
    """The ranks that train (accelerate's num_processes): --num-gpus less the server's GPUs in server mode."""
    return max(1, num_gpus - k.vllm_server_gpus) if k.served else num_gpus


def vllm_pool_need(workload: Workload, candidate: Candidate, k: Any) -> Any:
    """vLLM's own accounting of the pool colocated vLLM needs for this candidate (advisor/physics/vllm.py
    `min_utilization`, on `online_vllm_side`'s weights, profile activations, non-torch memory, CUDA graphs and KV
    layout, as the estimate builds them): the generation batch TRL hands it (max_num_seqs =
    per_device_train_batch_size x steps_per_generation, tensor-parallel 1) at full length (the longest prompt +
    max_completion_length, capped at max_model_len), never below one max_model_len sequence (what vLLM needs to
    start)."""

    c = candidate
    b = c.per_device_train_batch_size
    world = training_gpus(k, max(1, int(workload.num_gpus)))
    spg = k.steps_per_generation or (k.generation_batch_size // (b * world) if k.generation_batch_size
                                     else c.gradient_accumulation_steps)
    gen = b * max(1, int(spg))
    lengths = workload.dataset.lengths
    prompt = int(max(lengths)) if len(lengths) else 0
    gpu = workload.gpu
    side = online_vllm_side(workload.model.config, parameters=architecture(workload.model).total,
                            generation_batch=gen, vllm_max_model_length=c.base.get("vllm_max_model_length"),
                            supports_bf16=gpu.supports_bf16)
    length = min(prompt + int(k.max_completion_length), side.max_model_len)
    need = vllm_min_utilization(gpu.memory_bytes, weights_bytes=side.weights_bytes,
                                activation_bytes=side.activation_bytes, non_torch_bytes=side.non_torch_bytes,
                                layout=side.layout, sequences=gen, sequence_length=length,
                                max_model_len=side.max_model_len, cudagraph_bytes=side.cudagraph_bytes)
    return need, side, gen, prompt, length


def derive(workload: Workload, candidate: Candidate, k: Any, values: Mapping[str, tuple[Any, ...]]
           ) -> Candidate | str:
    """The knobs the search derives rather than searches: colocated vLLM's `vllm_gpu_memory_utilization`, the
    smallest pool that holds the generation batch at full length (`vllm_pool_need`, rounded up to 0.01), unless
    the space pins it (the user's --fix: kept as given). A pool of the whole card or more is the reason the
    candidate is not admitted."""
    if not k.colocated or "vllm_gpu_memory_utilization" in values:
        return candidate
    try:
        need = vllm_pool_need(workload, candidate, k)[0]
    except ConfigError as exc:
        return "; ".join(exc.problems)
    if need.value >= 1.0:
        return (f"colocated vLLM: the pool that holds the generation batch at full length is {need.exact:.1%} of "
                f"the card ({need.pool_bytes / 2**30:.2f} GiB of {workload.gpu.memory_bytes / 2**30:.2f}): "
                "nothing is left to train; a smaller micro-batch or steps_per_generation, or vLLM server mode")

    return with_knobs(candidate, vllm_gpu_memory_utilization=need.value)


def derivation_notes(workload: Workload, candidate: Candidate, k: Any, values: Mapping[str, tuple[Any, ...]]
                     ) -> list[str]:
    """How the pick's derived knobs were derived (the search's notes)."""
    if not k.colocated:
        return []
    if "vllm_gpu_memory_utilization" in values:
        return [f"vllm_gpu_memory_utilization={k.vllm_gpu_memory_utilization:g}: yours (--fix), kept as given"]
    try:
        need, side, gen, prompt, length = vllm_pool_need(workload, candidate, k)
    except ConfigError:
        return []
    gib = 2**30
    return [f"vllm_gpu_memory_utilization={need.value:.2f}: derived, not searched: the smallest share of the "
            f"{workload.gpu.memory_bytes / gib:.2f} GiB card, rounded up to 0.01 (exact {need.exact:.4f}), whose "
            f"pool ({need.pool_bytes / gib:.2f} GiB) holds vLLM's weights ({side.weights_bytes / gib:.2f} GiB), "
            f"its profile run's activations ({side.activation_bytes / gib:.2f} GiB), non-torch memory "
            f"({side.non_torch_bytes / gib:.2f} GiB), its CUDA graphs ({side.cudagraph_bytes / gib:.2f} GiB, "
            f"inside the pool since vLLM 0.21) and KV pages ({need.kv_bytes / gib:.2f} GiB) for the "
            f"{need.binding} (the generation batch: {gen} sequences x {length} tokens = the longest prompt "
            f"{prompt} + max_completion_length {k.max_completion_length}; one sequence: max_model_len "
            f"{side.max_model_len}), by vLLM's accounting (advisor/physics/vllm.py min_utilization); "
            "--fix vllm_gpu_memory_utilization=X keeps yours"]
