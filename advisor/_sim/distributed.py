"""One rank of a multi-GPU run, simulated on fake tensors; ZeRO in closed form; communication time.

FSDP2 runs for real on fake tensors: `torch.distributed` with the `fake` backend (FakeStore, world size N) and
accelerate's own `fsdp2_prepare_model` (each decoder layer, then the embedding and the tail [final norm, LM head]
as units, then the root; `reshard_after_forward`, the mixed-precision policy and the CPU offload policy from
accelerate's `FullyShardedDataParallelPlugin`), then TRL's `SFTTrainer.train()` as the single-GPU simulation runs it
(advisor/_sim/fake_step.py). accelerate's own FSDP path (`Accelerator(fsdp_plugin=...)`) refuses a CPU process
group (accelerate/state.py sets DistributedType.FSDP for GPU-like devices only), so the model is sharded by
accelerate's function on a stand-in accelerator and the trainer's accelerator stays single-process.

The fake group's collectives return at once and allocate nothing; every buffer FSDP2 communicates through is its
own allocation, so the tracker sees them as on the real NCCL path: the all-gather's flat output
(`foreach_all_gather`: torch.empty), the per-parameter unsharded outputs (`alloc_storage` / `free_storage`: storage
resizes, which no dispatch mode sees, so they are reported to the tracker here), the reduce-scatter's flat input
and output (`foreach_reduce`: torch.empty). What NCCL allocates inside itself (its channel buffers, outside
PyTorch's allocator) is not counted: the device bytes are low by them (the notes say so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ..errors import ConfigError
from ..measurement import Category
from ..parallelism import Parallelism, Strategy

__all__ = ["fake_process_group", "fsdp2_sharding", "zero_bytes", "ZeroTerms", "comm_time_s", "simulate_per_rank"]


# ---- the fake process group -------------------------------------------------------------------------------------

@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Any]:
    """The default process group as the `fake` backend with `world_size` ranks (this process is rank 0), and its
    1-D device mesh (built outside any fake mode: the mesh computes its coordinates with real tensors)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError(
            "simulate_per_rank: a torch.distributed process group is already initialised in this process; the "
            "per-rank simulation needs its own (the fake backend): run it in a fresh process",
            context="simulate",
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def fsdp2_plugin(parallelism: Parallelism, precision: str):
    """accelerate's FSDP2 plugin as `accelerate launch` builds it from the emitted config (accelerate_config)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=parallelism.reshard_after_forward,
        auto_wrap_policy="transformer_based_wrap", cpu_offload=parallelism.offload_params,
        state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False,
    )
    if precision in ("bf16", "fp16"):
        plugin.set_mixed_precision(precision)  # what AcceleratorState does with --mixed_precision
    return plugin


def prepare_fsdp2(model: torch.nn.Module, mesh: Any, parallelism: Parallelism, precision: str, *,
                  fake: bool = False) -> torch.nn.Module:
    """Shard `model` with accelerate's own `fsdp2_prepare_model` (per decoder layer, embedding, tail, root).

    `fake`: on fake tensors the offload policy does not pin host memory (aten._pin_memory has no fake kernel;
    pinning changes no size)."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = fsdp2_plugin(parallelism, precision)
    if fake and isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin),
        torch_device_mesh=mesh, parallelism_config=SimpleNamespace(fsdp_dim_names=("dp_shard",)),
        mixed_precision=precision if precision in ("bf16", "fp16") else "no", is_main_process=True,
        device=torch.device("cpu"),
    )
    return fsdp2_prepare_model(accelerator, model)


@contextlib.contextmanager
def fsdp2_sharding(mesh: Any, parallelism: Parallelism, precision: str) -> Iterator[None]:
    """Inside: every fake run (advisor/_sim/fake_step.run_fake_training) shards its model, once materialised as fake
    tensors and before `train()`, exactly as accelerate's `prepare` would; FSDP2's storage resizes reach the tracker."""
    from . import fake_step

    materialise = fake_step._materialise

    from torch.distributed.tensor import DTensor

    from . import tracker as tracker_module
    from .tracker import _key

    offload = parallelism.offload_params

    def sharded(model: torch.nn.Module) -> None:
        materialise(model)
        prepare_fsdp2(model, mesh, parallelism, precision, fake=True)
        tracker = _active_tracker()
        if tracker is not None:
            if offload:  # the sharded parameters live in host memory
                for p in model.parameters():
                    tracker._free(_key(getattr(p, "_local_tensor", p).untyped_storage()))
            _restart_stream(tracker)

    fake_step._materialise = sharded
    passing = tracker_module.PASS_THROUGH
    tracker_module.PASS_THROUGH = (DTensor,)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_tracked_storage_resizes())
            stack.enter_context(_untracked_sharding_propagation())
            stack.enter_context(_communication_categories(offload))
            if offload:
                stack.enter_context(_optimizer_on_host())
            yield
    finally:
        fake_step._materialise = materialise
        tracker_module.PASS_THROUGH = passing


def _restart_stream(tracker: Any) -> None:
    """The run's allocation stream starts with the sharded model: the full model materialised before sharding is
    the loading step (accelerate shards on the meta device when `cpu_ram_efficient_loading`), not the training
    step; what is live now is re-recorded as allocated at the start, in allocation order."""
    from .tracker import PeakSnapshot

    if tracker.events is None:
        return
    order = sorted(tracker._alloc_event.items(), key=lambda kv: kv[1])
    old_layers = tracker.event_layers
    tracker.events, tracker.event_layers, tracker._alloc_event, tracker.event_categories = [], [], {}, {}
    for key, index in order:
        live = tracker._live.get(key)
        if live is None:
            continue
        tracker._alloc_event[key] = len(tracker.events)
        tracker.events.append((key, live.nbytes))
        tracker.event_layers.append(old_layers[index])
    tracker.peak = PeakSnapshot(tracker.current, tracker.live_by_category())


@contextlib.contextmanager
def _optimizer_on_host() -> Iterator[None]:
    """With CPU offload the optimizer steps on the host: nothing it allocates (its state, its temporaries) is device
    memory, so the tracker records nothing while it runs."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def pre(optimizer: Any, *_: Any) -> None:
        tracker = _active_tracker()
        if tracker is not None:
            tracker._add = lambda storage, category: None

    def post(optimizer: Any, *_: Any) -> None:
        tracker = _active_tracker()
        if tracker is not None and "_add" in vars(tracker):
            del tracker._add

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _communication_categories(offload: bool = False) -> Iterator[None]:
    """What FSDP2 allocates to communicate (the all-gather's copy-in and flat output, the reduce-scatter's input and
    output) is labelled temporaries; the sharded gradients it assigns after the reduce-scatter (no gradient hook sees
    them: autograd accumulates into the unsharded parameters) gradients, or, offloaded, host memory: FSDP2 copies
    them to the host and the device's reduce-scatter output dies with the post-backward."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from .tracker import _key

    unshard, post_backward = FSDPParamGroup.unshard, FSDPParamGroup.post_backward

    def as_temporaries(method):
        def wrapped(self, *args: Any, **kwargs: Any):
            tracker = _active_tracker()
            if tracker is None:
                return method(self, *args, **kwargs)
            before = tracker.default_category
            tracker.default_category = Category.TEMPORARIES
            try:
                return method(self, *args, **kwargs)
            finally:
                tracker.default_category = before
                if method is post_backward:
                    grads = [p.sharded_param.grad for p in self.fsdp_params if p.sharded_param.grad is not None]
                    if offload:
                        for g in grads:
                            tracker._free(_key(getattr(g, "_local_tensor", g).untyped_storage()))
                    else:
                        tracker.set_category(grads, Category.GRADIENTS)
        return wrapped

    FSDPParamGroup.unshard = as_temporaries(unshard)
    FSDPParamGroup.post_backward = as_temporaries(post_backward)
    try:
        yield
    finally:
        FSDPParamGroup.unshard, FSDPParamGroup.post_backward = unshard, post_backward


@contextlib.contextmanager
def _untracked_sharding_propagation() -> Iterator[None]:
    """DTensor computes each op's global output shape by running it on fake tensors of the global shape
    (ShardingPropagator._propagate_tensor_meta_non_cached, in a fresh FakeTensorMode on a real run, so on no
    memory); inside our fake mode those tensors would reach the tracker, so it records nothing while they run."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, *args: Any, **kwargs: Any):
        tracker = _active_tracker()
        if tracker is None:
            return original(self, *args, **kwargs)
        on_op = tracker.on_op
        tracker._add, tracker.on_op = (lambda storage, category: None), None
        try:
            return original(self, *args, **kwargs)
        finally:
            del tracker._add  # the instance attribute: the class's method again
            tracker.on_op = on_op

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


def _active_tracker():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from .tracker import StorageTracker

    return next((m for m in reversed(_get_current_dispatch_mode_stack()) if isinstance(m, StorageTracker)), None)


@contextlib.contextmanager
def _tracked_storage_resizes() -> Iterator[None]:
    """FSDP2 allocates and frees its unsharded parameters (the all-gather outputs) by resizing their storages in
    place (`_fsdp_param.alloc_storage` / `free_storage`); a storage resize dispatches no op, so each one is reported
    to the running tracker as the allocation or free it is on the real allocator."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    from .tracker import _key

    def alloc_storage(tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.itemsize
        storage = tensor.untyped_storage()
        if storage.size() != size:
            tracker = _active_tracker()
            if tracker is not None:
                tracker._free(_key(storage))
            storage.resize_(size)
            if tracker is not None:
                tracker._add(storage, Category.PARAMETERS)

    def free_storage(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.size() != 0:
            tracker = _active_tracker()
            if tracker is not None:
                tracker._free(_key(storage))
            storage.resize_(0)

    saved = [(_fsdp_param, "alloc_storage", _fsdp_param.alloc_storage),
             (_fsdp_param, "free_storage", _fsdp_param.free_storage),
             (_fsdp_param_group, "alloc_storage", _fsdp_param_group.alloc_storage)]
    _fsdp_param.alloc_storage = alloc_storage
    _fsdp_param.free_storage = free_storage
    _fsdp_param_group.alloc_storage = alloc_storage
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


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
    """
    if stage not in (2, 3):
        raise ConfigError(f"zero stage {stage}: the closed form covers stages 2 and 3", context="zero_bytes")
    frozen = params - trainable
    # optimizer state: fp32 master weights (mixed precision only) + the moments, partitioned at every stage >= 1
    per = 4 * optimizer_moments + (4 if mixed else 0)
    optim = 0 if offload_optimizer else math.ceil(trainable * per / world)
    grads = math.ceil(trainable * param_bytes / world)  # stage 2 and 3: each rank keeps its gradient partition
    grad_bucket = min(bucket_elems, trainable) * param_bytes  # the reduce bucket being filled (stage 2)
    if stage == 2:
        parameters = params * param_bytes
        buffers = grad_bucket
    else:
        parameters = 0 if offload_params else math.ceil(params * param_bytes / world)
        # gathered parameters: the layer being computed and the prefetched bucket, capped by max_live_parameters
        live = min(max_live_elems, max(largest_layer, 0) + prefetch_elems, params)
        buffers = live * param_bytes + min(bucket_elems, trainable) * param_bytes
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


# ---- one rank's Measurement ----------------------------------------------------------------------------------------

def simulate_per_rank(workload: Any, candidate: Any, num_gpus: int | None = None,
                      parallelism: Parallelism | None = None, *, num_machines: int | None = None, gpu: Any = None,
                      layers: tuple[int, int] | None = (2, 3), steps: int = 2) -> Any:
    """One rank's Measurement of `candidate` trained on `num_gpus` GPUs (of `num_machines` machines; both default to
    the workload's).

    FSDP2 is simulated on fake tensors (the fake process group, accelerate's sharding, TRL's train()); DDP is the
    single-GPU simulation plus DDP's gradient buckets; ZeRO-2/3 replace the single-GPU run's model states with their
    closed form (`zero_bytes`). The CUDA allocator replay, the context and the workspace are the single-GPU path's
    (advisor/simulate.py). Throughput is global: every rank's trained tokens over the step time including the
    collectives' exposed time (`comm_time_s`)."""
    import dataclasses

    from ..measurement import Status
    from ..simulator import simulate
    from ..workload import check_world
    from .modelled import resolve_target as _resolve_target

    parallelism = parallelism or Parallelism()
    num_gpus = workload.num_gpus if num_gpus is None else num_gpus
    num_machines = workload.num_machines if num_machines is None else num_machines
    check_world(num_gpus, num_machines)
    parallelism.check(num_gpus)
    target = _resolve_target(gpu, workload)
    notes: list[str] = []
    if num_gpus == 1:
        return simulate(workload, candidate, target, layers=layers, steps=steps)
    if parallelism.strategy is Strategy.FSDP2:
        # at full depth: FSDP2's prefetch pairs each layer's gathered parameters with the next layer's work, which
        # the layer-by-layer extrapolation (advisor/_sim/layers.py) does not split (NotSeparable)
        with fake_process_group(num_gpus) as mesh, fsdp2_sharding(mesh, parallelism, candidate.precision.value):
            m = simulate(workload, candidate, target, layers=None, steps=steps)
        notes.append(
            f"FSDP2 on {num_gpus} ranks run on fake tensors: the fake process group and accelerate's "
            f"fsdp2_prepare_model (reshard_after_forward={parallelism.reshard_after_forward}, cpu offload="
            f"{parallelism.offload_params}) at full depth; all-gather and reduce-scatter buffers counted (as "
            "temporaries, the gathered parameters as parameters); NCCL's internal buffers are not"
        )
        notes.append("checked against real 2-process gloo runs on the CPU (tests/test_multigpu.py, "
                     "tests/test_multiprobe.py): the same peak within 0.15%; some rank-runs read higher by an FSDP "
                     "unit's bytes, frees made on gloo's worker threads that the CPU profiler does not see (with it "
                     "off the heap does not grow by them: advisor/probing/meters.memory_profiler), not memory a run "
                     "holds")
        if target.is_cuda:
            notes.append("FSDP2 all-gathers and reduce-scatters on its own CUDA streams, whose blocks the caching "
                         "allocator keeps in per-stream pools; the replay keeps one pool, so reserved bytes may be "
                         "somewhat higher on the GPU")
        if parallelism.offload_params:
            notes.append("CPU offload: the sharded parameters, gradients, optimizer state and the optimizer step live "
                         "in host memory and are not counted; the host-to-device copies of one unit's shards before "
                         "its all-gather (a no-op on fake CPU tensors) are not counted either")
    else:
        m = simulate(workload, candidate, target, layers=layers, steps=steps)
        m, more = _modelled_rank(m, workload, candidate, parallelism, num_gpus)
        notes.extend(more)
    comm = _comm(workload, candidate, parallelism, target, num_gpus, num_machines, m)
    host = offload_time_s(workload, candidate, parallelism, num_gpus) if target.is_cuda else 0.0
    if host:
        notes.append(f"CPU offload: {host:.3g} s a step added (the host optimizer step and the gradients' copies, "
                     "advisor/_sim/distributed.offload_time_s)")
    step = (m.step_time_s or 0.0) + comm.exposed_s + host
    trained = (m.trained_tokens_per_step or 0) * num_gpus
    notes.append(
        f"communication: all-gather {comm.all_gather_s:.3g} s, reduce {comm.reduce_s:.3g} s a step over the "
        f"{comm.link} link, {comm.exposed_s:.3g} s not hidden by compute; throughput counts all {num_gpus} ranks"
    )
    device = m.device_bytes or m.peak_bytes
    status = m.status if m.status is not Status.OK else (
        Status.OK if device <= workload.budget_bytes else Status.OOM)
    times = dict(m.time_breakdown)
    times["communication_exposed"] = comm.exposed_s
    return dataclasses.replace(
        m, status=status, step_time_s=step if step > 0 else None,
        tokens_per_second=trained / step if step > 0 else None, trained_tokens_per_step=trained,
        time_breakdown=times, notes=tuple(m.notes) + tuple(notes),
        message="" if status is Status.OK else f"device peak {device} B over budget {workload.budget_bytes} B per rank",
    )


def _model_counts(workload: Any, candidate: Any) -> tuple[int, int]:
    """(parameters, trainable parameters) of the model as the candidate trains it (advisor/estimate.py's shapes)."""
    from ..estimator import architecture, lora_parameters

    arch = architecture(workload.model)
    if candidate.use_lora:
        adapters = lora_parameters(arch, candidate)
        return arch.total + adapters, adapters
    return arch.total, arch.total


def _weight_bytes(candidate: Any) -> int:
    return 4 if candidate.weights_dtype.value == "float32" else 2


def _modelled_rank(m: Any, workload: Any, candidate: Any, parallelism: Parallelism, num_gpus: int):
    """DDP and ZeRO from the single-GPU simulation: the model states at its peak replaced by theirs."""
    import dataclasses

    br = dict(m.breakdown)
    grads = br.get(Category.GRADIENTS.value, 0)
    notes: list[str] = []
    if parallelism.strategy is Strategy.DDP:
        delta = _trainable_bytes(workload, candidate)
        br[Category.GRADIENTS.value] = grads + delta
        notes.append("DDP: modelled as the single-GPU run plus the reducer's gradient buckets (one more copy of the "
                     "trainable gradients: accelerate's default gradient_as_bucket_view=False)")
    else:
        stage = 2 if parallelism.strategy is Strategy.ZERO2 else 3
        params, trainable = _model_counts(workload, candidate)
        # DeepSpeed casts the module to bf16/fp16 when mixed precision is on (fp32 master weights in the optimizer)
        mixed = candidate.precision.value in ("bf16", "fp16")
        terms = zero_bytes(stage, params, trainable, num_gpus, param_bytes=2 if mixed else 4, mixed=mixed,
                           offload_params=parallelism.offload_params, offload_optimizer=parallelism.offload_optimizer)
        old = sum(br.get(c.value, 0) for c in (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER))
        br[Category.PARAMETERS.value] = terms.parameters + terms.buffers
        br[Category.GRADIENTS.value] = terms.gradients
        br[Category.OPTIMIZER.value] = terms.optimizer_state
        delta = terms.total - old
        notes.append(f"DeepSpeed ZeRO-{stage}: modelled in closed form (advisor/_sim/distributed.zero_bytes: the ZeRO "
                     "paper's model-state terms, DeepSpeed's default bucket sizes); activations from the simulation")
    return dataclasses.replace(
        m, peak_bytes=m.peak_bytes + delta, reserved_bytes=m.reserved_bytes + delta,
        device_bytes=(m.device_bytes + delta) if m.device_bytes else None, breakdown=br,
    ), notes


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
    import yaml

    from ..profiles import PROFILES_DIR, _gpu_index, normalize_gpu_name

    keys, _ = _gpu_index(PROFILES_DIR)
    path = keys.get(normalize_gpu_name(name))
    data = yaml.safe_load(path.read_text()) if path is not None else {}
    ic = (data or {}).get("interconnect")
    if not ic:
        raise ConfigError(f"--gpu {name}: its profile has no `interconnect` bandwidths, so the communication "
                          "time of several GPUs cannot be predicted; add them to its profiles/gpus/*.yaml",
                          context="simulate")
    return Interconnect(intra_gbs=float(ic["intra_gbs"]), pcie_gbs=float(ic["pcie_gbs"]),
                        inter_gbs=float(ic["inter_gbs"]) if ic.get("inter_gbs") else None,
                        intra_kind=str(ic.get("intra_kind", "nvlink")))


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
    from ..estimator import architecture
    from ..measurement import Category

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
        return out, [f"FSDP2 on {n} ranks (estimate, closed form: advisor/_sim/distributed.estimate_rank_moments): "
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
    from types import SimpleNamespace as NS

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
    from ..profiles import resolve_gpu

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
