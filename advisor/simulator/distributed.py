"""One rank of a multi-GPU run on fake tensors: the fake process group and FSDP2's sharding, which
advisor/simulator.simulate_per_rank runs TRL's train() under (ZeRO, the collectives' time and the estimate's rank are
closed forms: advisor/physics/ranks_closed.py).

FSDP2 runs for real on fake tensors: `torch.distributed` with the `fake` backend (FakeStore, world size N) and
accelerate's own `fsdp2_prepare_model` (each decoder layer, then the embedding and the tail [final norm, LM head]
as units, then the root; `reshard_after_forward`, the mixed-precision policy and the CPU offload policy from
accelerate's `FullyShardedDataParallelPlugin`), then TRL's `SFTTrainer.train()` as the single-GPU simulation runs it
(advisor/simulator/fake_step.py). accelerate's own FSDP path (`Accelerator(fsdp_plugin=...)`) refuses a CPU process
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
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ..errors import ConfigError
from ..measurement import Category
from ..parallelism import Parallelism
from . import fake_step
from . import tracker as tracker_module
from .tracker import PeakSnapshot, StorageTracker, _key

__all__ = ["fake_process_group", "fsdp2_sharding", "prepare_fsdp2"]


# ---- the fake process group -------------------------------------------------------------------------------------

@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Any]:
    """The default process group as the `fake` backend with `world_size` ranks (this process is rank 0), and its
    1-D device mesh (built outside any fake mode: the mesh computes its coordinates with real tensors)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # lazy: loads torch.testing

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
    from accelerate.utils import FullyShardedDataParallelPlugin  # lazy: loads accelerate

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
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model  # lazy: loads accelerate
    from torch.distributed.fsdp import CPUOffloadPolicy  # lazy: loads torch.distributed.fsdp

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
    """Inside: every fake run (advisor/simulator/fake_step.run_fake_training) shards its model, once materialised as
    fake tensors and before `train()`, exactly as accelerate's `prepare` would; FSDP2's storage resizes reach the
    tracker."""
    materialise = fake_step._materialise

    from torch.distributed.tensor import DTensor  # lazy: loads torch.distributed.tensor


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
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup  # lazy: loads torch FSDP


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
    from torch.distributed.tensor._sharding_prop import ShardingPropagator  # lazy: loads torch.distributed.tensor

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
    return next((m for m in reversed(_get_current_dispatch_mode_stack()) if isinstance(m, StorageTracker)), None)


@contextlib.contextmanager
def _tracked_storage_resizes() -> Iterator[None]:
    """FSDP2 allocates and frees its unsharded parameters (the all-gather outputs) by resizing their storages in
    place (`_fsdp_param.alloc_storage` / `free_storage`); a storage resize dispatches no op, so each one is reported
    to the running tracker as the allocation or free it is on the real allocator."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group  # lazy: loads torch.distributed.fsdp


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
