"""Several GPUs in closed form, beside the fake-tensor rank of distributed.py: ZeRO-2 / ZeRO-3's per-rank
bytes (modelled, not run: DeepSpeed cannot run on fake tensors), the collectives' time over the interconnect of
profiles/gpus/*.yaml, the host optimizer step of CPU offload, and the estimate's moments and step time of one rank."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace as NS
from typing import Any

from .. import profiles
from ..errors import ConfigError
from ..measurement import Category
from ..parallelism import Parallelism, Strategy
from .shapes import architecture, lora_parameters

__all__ = ["zero_bytes", "ZeroTerms", "comm_time_s", "interconnect", "Interconnect", "estimate_rank_moments",
           "estimate_rank_time", "offload_time_s", "LayoutTraffic", "layout_traffic", "apply_layout_traffic"]


# ---- ZeRO-2 / ZeRO-3 in closed form ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ZeroTerms:
    """One rank's model states under ZeRO (bytes), each term with its source in `zero_bytes`."""

    parameters: int
    gradients: int
    optimizer_state: int
    buffers: int  # communication buckets / prefetched parameters

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.buffers


def zero_bytes(stage: int, params: int, trainable: int, world: int, *, param_bytes: int = 2, mixed: bool = True,
               optimizer_moments: int = 2, offload_params: bool = False, offload_optimizer: bool = False,
               largest_layer: int = 0, bucket_elems: int = 500_000_000, prefetch_elems: int = 50_000_000,
               max_live_elems: int = 1_000_000_000) -> ZeroTerms:
    """Model-state bytes of one rank (activations excluded: they are the single-GPU run's, per micro-batch).

    Sources: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC'20), §3
    and Figure 1: mixed-precision Adam holds 2 B/param fp16 parameters, 2 B/param fp16 gradients and K = 12 B/param
    optimizer state (fp32 master copy, momentum, variance); stage 1 divides K by N, stage 2 also the gradients,
    stage 3 also the parameters. DeepSpeed's config docs (deepspeed.ai/docs/config-json, "ZeRO Optimizations"):
    stage 2 reduces gradients through `reduce_bucket_size` (default 5e8 elements) and `allgather_bucket_size`
    (5e8); stage 3 keeps up to `stage3_max_live_parameters` (1e9) gathered and prefetches
    `stage3_prefetch_bucket_size` (5e7) elements; `offload_optimizer` / `offload_param` move the partitions to the
    host (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity, Rajbhandari et al. 2021).

    The gradient bucket is `reduce_bucket_size` elements whatever the model's size: with contiguous_gradients (the
    default) DeepSpeed 0.19's stage_1_and_2.py and stage3.py allocate `torch.empty(reduce_bucket_size)` of the
    gradients' dtype (twice in stage 2 with overlap_comm, which defaults to off there). The accelerate config the
    advisor emits sets no bucket size, so DeepSpeed's default applies. Measured (scripts/zero_cpu_check.py, 2 gloo
    ranks on the CPU through that accelerate config, TRL's SFTTrainer, a 140k-parameter Qwen2): each rank peaked
    at 2.002 GB (ZeRO-2) and 2.013 GB (ZeRO-3), 5e8 fp32 elements plus about 13 MB, where min(bucket, trainable)
    had predicted 13 MB.
    """
    if stage not in (2, 3):
        raise ConfigError(f"zero stage {stage}: the closed form covers stages 2 and 3", context="zero_bytes")
    frozen = params - trainable
    # optimizer state: fp32 master weights (mixed precision only) + the moments, partitioned at every stage >= 1
    per = 4 * optimizer_moments + (4 if mixed else 0)
    optim = 0 if offload_optimizer else math.ceil(trainable * per / world)
    grads = math.ceil(trainable * param_bytes / world)  # stage 2 and 3: each rank keeps its gradient partition
    grad_bucket = bucket_elems * param_bytes if trainable else 0  # the contiguous gradient bucket (see above)
    if stage == 2:
        parameters = params * param_bytes
        buffers = grad_bucket
    else:
        parameters = 0 if offload_params else math.ceil(params * param_bytes / world)
        # gathered parameters: the layer being computed and the prefetched bucket, capped by max_live_parameters
        live = min(max_live_elems, max(largest_layer, 0) + prefetch_elems, params)
        buffers = live * param_bytes + grad_bucket
        if frozen and offload_params:
            buffers = live * param_bytes
    return ZeroTerms(parameters=parameters, gradients=grads, optimizer_state=optim, buffers=buffers)


# ---- communication time --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CommTime:
    """Seconds of one optimizer step's collectives on one rank, and how much of it compute cannot hide."""

    all_gather_s: float
    reduce_s: float
    exposed_s: float
    link: str  # which bandwidth bounds it (nvlink, pcie, infiniband)


def ring_bytes(payload: int, world: int) -> float:
    """Bytes each rank sends in a ring all-gather or reduce-scatter of `payload` total bytes: (N-1)/N x payload
    (an all-reduce is a reduce-scatter plus an all-gather: twice this). Source: Patarasuk & Yuan, "Bandwidth optimal
    all-reduce algorithms for clusters of workstations" (JPDC 2009); NCCL's performance notes (nccl-tests
    PERFORMANCE.md: algorithm bandwidth vs bus bandwidth, factor (N-1)/N per phase)."""
    return payload * (world - 1) / max(world, 1)


def comm_time_s(*, strategy: Strategy, param_bytes: int, grad_bytes: int, num_gpus: int, num_machines: int,
                intra_gbs: float, inter_gbs: float | None, compute_s: float, accumulation: int = 1,
                reshard_after_forward: bool = True, offload_params: bool = False, pcie_gbs: float = 0.0) -> CommTime:
    """Collective time of one optimizer step: each phase's ring bytes over the slowest link it crosses.

    - DDP: one all-reduce of the gradients per optimizer step (no_sync during accumulation), in buckets overlapped
      with the backward.
    - FSDP2 / ZeRO-3: per micro-batch an all-gather of the parameters in forward, again in backward when they were
      resharded after forward, and a reduce-scatter of the gradients (FSDP2 reduce-scatters every micro-batch;
      accelerate does not use no_sync for FSDP2). Prefetching overlaps them with compute.
    - ZeRO-2: a reduce-scatter of the gradients per micro-batch plus an all-gather of the updated parameters per
      step.
    A collective spanning machines runs at the inter-node (InfiniBand) bandwidth per GPU; within one, at NVLink's
    (or PCIe's). Offloaded parameters also cross PCIe each use. Exposed time: what exceeds the compute it overlaps.
    """
    if num_gpus <= 1:
        return CommTime(0.0, 0.0, 0.0, "none")
    link_gbs, link = intra_gbs, "intra"
    if num_machines > 1 and inter_gbs:
        # hierarchical rings are bounded by the per-GPU share of the inter-node bandwidth
        per_gpu_inter = inter_gbs * num_machines / num_gpus
        if per_gpu_inter < intra_gbs:
            link_gbs, link = per_gpu_inter, "inter"
    bw = link_gbs * 1e9
    ag = rs = 0.0
    if strategy is Strategy.DDP:
        rs = 2 * ring_bytes(grad_bytes, num_gpus) / bw
    elif strategy in (Strategy.FSDP2, Strategy.ZERO3):
        gathers = 2 if reshard_after_forward or strategy is Strategy.ZERO3 else 1
        ag = accumulation * gathers * ring_bytes(param_bytes, num_gpus) / bw
        rs = accumulation * ring_bytes(grad_bytes, num_gpus) / bw
        if offload_params and pcie_gbs:
            ag += accumulation * gathers * (param_bytes / num_gpus) / (pcie_gbs * 1e9)
    else:  # ZeRO-2
        rs = accumulation * ring_bytes(grad_bytes, num_gpus) / bw
        ag = ring_bytes(param_bytes, num_gpus) / bw
    exposed = max(0.0, ag + rs - compute_s)
    return CommTime(all_gather_s=ag, reduce_s=rs, exposed_s=exposed, link=link)


@dataclass(frozen=True)
class Interconnect:
    """Per-GPU, per-direction bandwidths (GB/s) of one target, from its profiles/gpus/*.yaml `interconnect`."""

    intra_gbs: float  # GPU to GPU within a machine (NVLink, else PCIe)
    pcie_gbs: float  # GPU to host
    inter_gbs: float | None  # machine to machine (InfiniBand), per machine
    intra_kind: str = "nvlink"


def interconnect(gpu: Any) -> Interconnect:
    """The target's interconnect from its profile; ConfigError naming the file when it has none."""
    return _interconnect(gpu.name)


@functools.lru_cache(maxsize=32)
def _interconnect(name: str) -> Interconnect:
    import yaml  # lazy: loads yaml

    keys, _ = profiles._gpu_index(profiles.PROFILES_DIR)
    path = keys.get(profiles.normalize_gpu_name(name))
    data = yaml.safe_load(path.read_text()) if path is not None else {}
    ic = (data or {}).get("interconnect")
    if not ic:
        raise ConfigError(f"--gpu {name}: its profile has no `interconnect` bandwidths, so the communication "
                          "time of several GPUs cannot be predicted; add them to its profiles/gpus/*.yaml",
                          context="simulate")
    return Interconnect(intra_gbs=float(ic["intra_gbs"]), pcie_gbs=float(ic["pcie_gbs"]),
                        inter_gbs=float(ic["inter_gbs"]) if ic.get("inter_gbs") else None,
                        intra_kind=str(ic.get("intra_kind", "nvlink")))


# ---- the device traffic a layout adds to one rank's step ------------------------------------------------------------

@dataclass(frozen=True)
class LayoutTraffic:
    """What a multi-GPU layout changes in one rank's device time, beside the collectives (`comm_time_s`).

    per_micro_bytes: memory-bound bytes every micro-step adds: FSDP2's and ZeRO-3's gathers (copy-in of the shard,
    copy-out of the gathered buffer) and the reduce-scatter's copy-in of the gradients; ZeRO-2's bucket copy.
    per_step_bytes: once per optimizer step: DDP's bucket copies, ZeRO-2's cast of the updated shard.
    optimizer_fraction: the share of the trainable elements the device optimizer steps on this rank (1/N sharded,
    0 when it runs on the host)."""

    per_micro_bytes: float
    per_step_bytes: float
    optimizer_fraction: float
    gathers: float  # elements gathered a micro-step (forward, and backward when resharded)
    note: str


def layout_traffic(workload: Any, candidate: Any, parallelism: Parallelism | None = None,
                   num_gpus: int | None = None) -> LayoutTraffic:
    """The device copies of one rank's layout, in closed form from the model's shapes (every layer a unit, the
    embedding, final norm and LM head the root unit, as accelerate's transformer_based_wrap shards them):

    - FSDP2 (torch 2.13 _fsdp_collectives.py): each gather of P elements casts this rank's float32 shard to the
      compute dtype into the flat input (`_foreach_copy_`: (4 + c) P / N bytes, with a MixedPrecisionPolicy),
      copies it into its slice of the all-gather buffer (`all_gather_copy_in`: 2 c P / N) and copies the buffer out
      into the unsharded parameters (`split_with_sizes_copy`: 2 c P); every unit is gathered in the forward, and the
      non-root units again in the backward when resharded after forward; the reduce-scatter's copy-in reads the
      unsharded gradients and writes its input (`chunk_cat`: 2 c T).
    - ZeRO-3 (DeepSpeed partition_parameters.py): each parameter is gathered in the forward and again in the backward
      (released after use): its partition copied into the flat buffer (2 c P / N) and the buffer copied out into the
      parameter (torch.cat of the ranks' parts: 2 c P); the gradients copied into the reduce bucket (2 c T).
    - ZeRO-2 (stage_1_and_2.py): the gradients copied into the reduce bucket every micro-step (2 c T); once a step the
      updated float32 partition cast into the 16-bit flat group the all-gather fills in place ((4 + c) T / N).
    - DDP (gradient_as_bucket_view=False, accelerate's default): once a step the gradients copied into the buckets
      and the reduced buckets back (4 g T).
    c: the compute dtype's bytes (2 under bf16/fp16), g: the gradients' (the weights' dtype).
    """
    n = workload.num_gpus if num_gpus is None else num_gpus
    p = parallelism or candidate.parallelism.parallelism
    if n <= 1:
        return LayoutTraffic(0.0, 0.0, 1.0, 0.0, "")
    arch = architecture(workload.model)
    params, trainable = _model_counts(workload, candidate)
    mixed = candidate.precision.value in ("bf16", "fp16")
    weight = _weight_bytes(candidate)
    c = 2 if mixed else weight
    if p.strategy is Strategy.DDP:
        g = 4 if candidate.use_lora else weight
        return LayoutTraffic(0.0, 4.0 * g * trainable, 1.0, 0.0,
                             "DDP: the gradients copied into the reducer's buckets and back once a step")
    if p.strategy is Strategy.FSDP2:
        root = arch.embedding + arch.lm_head + arch.final_norm
        gathered = params + ((params - root) if p.reshard_after_forward else 0)
        master = 4 if mixed else weight  # accelerate keeps FSDP2's sharded parameters in float32 under mixed precision
        per_elem = 2 * c + (2 * c + ((master + c) if mixed else 0)) / n
        frac = 0.0 if p.offload_params else 1.0 / n
        return LayoutTraffic(gathered * per_elem + 2.0 * c * trainable, 0.0, frac, float(gathered),
                             f"FSDP2: {gathered:,} elements gathered a micro-step (copy-in and copy-out), the "
                             "gradients' reduce-scatter copy-in")
    frac = 0.0 if p.offload_optimizer else 1.0 / n
    if p.strategy is Strategy.ZERO3:
        gathered = 2 * params
        return LayoutTraffic(gathered * (2 * c + 2 * c / n) + 2.0 * c * trainable, 0.0, frac, float(gathered),
                             f"ZeRO-3: {gathered:,} elements gathered a micro-step (forward and backward; copy-in and "
                             "copy-out), the gradients' bucket copy")
    return LayoutTraffic(2.0 * c * trainable, (4 + c) * trainable / n, frac, 0.0,
                         "ZeRO-2: the gradients' bucket copy a micro-step, the updated partition's cast a step")


def apply_layout_traffic(m: Any, workload: Any, candidate: Any, parallelism: Parallelism, num_gpus: int,
                         target: Any, *, gathers_simulated: bool) -> Any:
    """One rank's simulated Measurement with its layout's device traffic (`layout_traffic`): the copies added to the
    memory-bound term (FSDP2's gathers are in the fake run already: `gathers_simulated`), the optimizer term scaled
    to this rank's share (FSDP2's fake run steps its local shards already: not scaled again). Only on a CUDA target
    (a CPU target's time is not the GPUs')."""
    if not target.is_cuda or num_gpus <= 1:
        return m
    from .timing import time_constants  # lazy: loads numpy

    tc = time_constants(target)
    lt = layout_traffic(workload, candidate, parallelism, num_gpus)
    ga = candidate.gradient_accumulation_steps
    times = dict(m.time_breakdown)
    add = 0.0
    if not gathers_simulated:
        add = (ga * lt.per_micro_bytes + lt.per_step_bytes) / tc.mem_bw
    elif lt.per_step_bytes:
        add = lt.per_step_bytes / tc.mem_bw
    times["memory_bound"] = times.get("memory_bound", 0.0) + add
    opt = times.get("optimizer", 0.0)
    share = lt.optimizer_fraction if not gathers_simulated else (0.0 if lt.optimizer_fraction == 0.0 else 1.0)
    times["optimizer"] = opt * share
    delta = add + opt * (share - 1.0)
    step = (m.step_time_s or 0.0) + delta
    return dataclasses.replace(m, time_breakdown=times, step_time_s=step if step > 0 else m.step_time_s,
                               notes=tuple(m.notes) + (f"layout's device traffic: {add:.3g} s a step memory-bound; "
                                                       f"optimizer x {share:.3g} ({lt.note})",))


# ---- the estimate's closed form of one rank -------------------------------------------------------------------------

def estimate_rank_moments(workload: Any, candidate: Any, moments: dict, parts: Any) -> tuple[dict, list[str]]:
    """The single-GPU estimate's moments (advisor/estimator.py: bytes by Category at the end of the forward, the start
    of the backward and the optimizer step) as one rank of `workload.num_gpus` holds them, in closed form:

    - DDP: every rank holds the whole model; plus the reducer's gradient buckets (a second copy of the trainable
      gradients, accelerate's default gradient_as_bucket_view=False), as `_modelled_rank` models the simulation.
    - FSDP2: parameters, gradients and optimizer state divided by N (CPUOffloadPolicy: on the host, none on the
      device); the gathered parameters in the compute dtype on top: the root unit (embedding, final norm, LM head:
      counted as one unit, an upper bound of accelerate's split) and, resharding after forward, the layer computed
      and the one prefetched; without resharding every layer stays gathered from its forward to its backward. In
      the backward one layer's unsharded gradient and its float32 reduce-scatter buffer. MixedPrecisionPolicy casts
      the gathered parameters, so autocast's cache of low-precision weight copies is not held.
    - ZeRO-2 / ZeRO-3: `zero_bytes` (its sources in its docstring); DeepSpeed runs the module in bf16/fp16, so
      autocast's cache is not held either.
    The activations are the single-GPU micro-batch's (data parallel: each rank runs its own micro-batch)."""
    n = workload.num_gpus
    p = candidate.parallelism.parallelism
    arch = architecture(workload.model)
    mixed = candidate.precision.value in ("bf16", "fp16")
    weight = _weight_bytes(candidate)
    compute = 2 if mixed else weight
    full_params, full_grads, full_optim = parts.parameters, parts.gradients, parts.optimizer
    autocast_cache = arch.decoder_linear * 2 if (mixed and weight == 4 and not candidate.use_lora) else 0
    P, G, OPT, A, T = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER, Category.ACTIVATIONS,
                     Category.TEMPORARIES)
    out: dict = {}
    if p.strategy is Strategy.DDP:
        for when, m in moments.items():
            out[when] = {**m, G: m[G] + full_grads}
        return out, [f"DDP on {n} ranks (estimate): the single-GPU states on every rank plus the reducer's gradient "
                     "buckets"]
    if p.strategy is Strategy.FSDP2:
        off = p.offload_params
        params = 0 if off else math.ceil(full_params / n)
        optim = 0 if off else math.ceil(full_optim / n)
        root = (arch.embedding + arch.lm_head + arch.final_norm) * compute
        layer = arch.per_layer * compute
        gathered = root + (2 * layer if p.reshard_after_forward else arch.layers * layer)
        reduce_buffer = arch.per_layer * (compute + 4)
        for when, m in moments.items():
            grads = 0 if off or not full_grads else math.ceil(m[G] / n)
            mid = when != "optimizer step"
            out[when] = {**m, P: params + (gathered if mid else 0), G: grads, OPT: optim,
                         A: max(0, m[A] - autocast_cache) if m[A] else 0,
                         T: m[T] + (reduce_buffer if when == "start of the backward" else 0)}
        return out, [f"FSDP2 on {n} ranks (estimate, closed form: advisor/physics/ranks_closed.estimate_rank_moments): "
                     f"model states / {n}" + (" on the host (CPU offload)" if off else "") + ", gathered units "
                     + ("resharded after forward" if p.reshard_after_forward else "kept from forward to backward")]
    stage = 2 if p.strategy is Strategy.ZERO2 else 3
    params_n, trainable = _model_counts(workload, candidate)
    terms = zero_bytes(stage, params_n, trainable, n, param_bytes=compute, mixed=mixed,
                       offload_params=p.offload_params, offload_optimizer=p.offload_optimizer,
                       largest_layer=arch.per_layer)
    for when, m in moments.items():
        share = m[G] / full_grads if full_grads else 0.0
        out[when] = {**m, P: terms.parameters + terms.buffers, G: math.ceil(terms.gradients * share),
                     OPT: terms.optimizer_state, A: max(0, m[A] - autocast_cache) if m[A] else 0}
    return out, [f"DeepSpeed ZeRO-{stage} on {n} ranks (estimate): zero_bytes' closed form"]


def estimate_rank_time(workload: Any, candidate: Any, step_s: float, trained_per_step: int
                       ) -> tuple[float, int, float, str]:
    """The estimate's step time with the collectives' exposed time (`comm_time_s`) and the global trained tokens."""
    n = workload.num_gpus
    p = candidate.parallelism.parallelism
    comm = _comm(workload, candidate, p, workload.gpu, n, workload.num_machines, NS(step_time_s=step_s))
    host = offload_time_s(workload, candidate, p, n)
    step = step_s + comm.exposed_s + host
    note = (f"communication (estimate): all-gather {comm.all_gather_s:.3g} s, reduce {comm.reduce_s:.3g} s a step "
            f"over the {comm.link} link, {comm.exposed_s:.3g} s not hidden by compute"
            + (f"; CPU offload {host:.3g} s a step (the host optimizer step and the gradients' copies)" if host else "")
            + f"; throughput counts all {n} ranks")
    return step, trained_per_step * n, comm.exposed_s + host, note


# the bytes a host optimizer step streams per trainable parameter: fp32 parameter, gradient, exp_avg, exp_avg_sq read,
# parameter and both moments written (torch/optim/adamw.py; DeepSpeed's CPUAdam the same per element)
_HOST_ADAM_BYTES = 28


@functools.lru_cache(maxsize=1)
def _host_bandwidth_gbs() -> float:
    """The host's memory bandwidth (profiles/gpus/cpu.yaml memory_bandwidth_gbs)."""
    from ..profiles import resolve_gpu  # lazy: loads yaml

    return float(resolve_gpu("cpu").memory_bandwidth_gbs)


def offload_time_s(workload: Any, candidate: Any, parallelism: Parallelism, num_gpus: int) -> float:
    """Seconds a step spends on CPU offload that compute does not hide (0 without offload): the optimizer step of this
    rank's shard on the host at the host profile's memory bandwidth (profiles/gpus/cpu.yaml), and the gradients'
    device-to-host copies (each micro-batch for FSDP2's CPUOffloadPolicy, each step for ZeRO's offload_optimizer,
    with the updated parameters copied back) over the target's PCIe bandwidth (profiles/gpus/*.yaml interconnect).
    A conservative model: DeepSpeed overlaps part of these copies; FSDP2 runs the optimizer synchronously."""
    if not (parallelism.offload_optimizer or parallelism.offload_params) or not workload.gpu.is_cuda:
        return 0.0

    _, trainable = _model_counts(workload, candidate)
    shard = trainable / num_gpus
    host_gbs = _host_bandwidth_gbs()
    pcie = interconnect(workload.gpu).pcie_gbs * 1e9
    low = 2 if candidate.precision.value in ("bf16", "fp16") else 4
    optimizer = shard * _HOST_ADAM_BYTES / (host_gbs * 1e9)
    if parallelism.strategy is Strategy.FSDP2:
        copies = candidate.gradient_accumulation_steps * shard * 4 / pcie
    else:
        copies = 2 * shard * low / pcie
    return optimizer + copies


# ---- what the fake-tensor rank and the estimate's rank share -------------------------------------------------

def _model_counts(workload: Any, candidate: Any) -> tuple[int, int]:
    """(parameters, trainable parameters) of the model as the candidate trains it (advisor/estimate.py's shapes)."""
    arch = architecture(workload.model)
    if candidate.use_lora:
        adapters = lora_parameters(arch, candidate)
        return arch.total + adapters, adapters
    return arch.total, arch.total


def _weight_bytes(candidate: Any) -> int:
    return 4 if candidate.weights_dtype.value == "float32" else 2


def _trainable_bytes(workload: Any, candidate: Any) -> int:
    _, trainable = _model_counts(workload, candidate)
    return trainable * (4 if candidate.use_lora else _weight_bytes(candidate))


def _comm(workload: Any, candidate: Any, parallelism: Parallelism, target: Any, num_gpus: int, num_machines: int,
          m: Any) -> CommTime:
    if not target.is_cuda:
        return CommTime(0.0, 0.0, 0.0, "none (a CPU target: gloo's time is not modelled)")
    link = interconnect(target)
    params, trainable = _model_counts(workload, candidate)
    low = candidate.precision.value in ("bf16", "fp16")
    param_bytes = params * (2 if low else 4)
    grad_bytes = trainable * (2 if low else 4)
    out = comm_time_s(
        strategy=parallelism.strategy, param_bytes=param_bytes, grad_bytes=grad_bytes, num_gpus=num_gpus,
        num_machines=num_machines, intra_gbs=link.intra_gbs, inter_gbs=link.inter_gbs,
        compute_s=m.step_time_s or 0.0, accumulation=candidate.gradient_accumulation_steps,
        reshard_after_forward=parallelism.reshard_after_forward, offload_params=parallelism.offload_params,
        pcie_gbs=link.pcie_gbs,
    )
    named = {"intra": link.intra_kind, "inter": "InfiniBand (between machines)"}.get(out.link, out.link)
    return dataclasses.replace(out, link=named)


