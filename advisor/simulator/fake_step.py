"""Runs a TRL trainer's own `train()` for a few optimizer steps on fake tensors, with every storage tracked.

What differs between trainers comes from their `advisor.trainers.Trainer`: the class, the
methods the fake class replaces, the models besides the policy (DPO's reference), the passes before training
(DPO's precomputed reference log-probs) and the labels of a batch.

The trainer is built outside the fake mode on a `meta` model (its `__init__` cannot swap fake parameters);
inside the mode the model is materialised with `to_empty`, the worst-case batches are lifted with
`from_tensor`, and `train()` runs its real loop (clipping, optimizer, scheduler, zero_grad) on them.
Where transformers or TRL branch on "is this a fake tensor", the branch is patched to the real run's answer.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import types
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..measurement import Category
from ..modeling import BatchFeed
from .flash import fake_flash_attention
from .layers import install_layer_hooks
from .out_dtype import fake_out_dtype_matmuls
from .shadow import IntegerShadow
from .timing_hook import is_sync
from .tracker import PeakSnapshot, StorageTracker, _key, _storage


@dataclass(frozen=True)
class BatchFacts:
    """What data-dependent branches of the real run would see on this batch."""

    unpadded: bool  # attention_mask all ones (or a padding-free batch holding a single sequence per row)
    labelled: int  # positions whose next-token label is not -100 (the fused LM head's compact rows)
    tokens: int  # input positions in the batch
    shape: tuple[int, int]
    # The sequence lengths FlashAttention's varlen kernel gets: per sequence of a padding-free row (TRL's
    # cu_seq_lens_q, else where position_ids restart), per row of a padded batch (the attention mask's row sums).
    seq_lengths: tuple[int, ...] = ()
    packed: bool = False  # a padding-free row holding more than one sequence (transformers' _is_packed_sequence)


@dataclass
class FakeRunResult:
    peak: PeakSnapshot
    facts: BatchFacts
    allocations: int
    events: list[tuple[int, int]] | None
    # per event, the decoder layer it belongs to (advisor/simulator/layers)
    event_layers: list[int | None] | None = None
    event_categories: dict[int, Category] | None = None  # per allocation event, its last category
    saved_bytes: int = 0  # count_saved: the most bytes one micro-batch's autograd saved, as TRL's offloader takes them


def batch_facts(batch: dict[str, torch.Tensor], labels: torch.Tensor | None = None) -> BatchFacts:
    """`labels`: per position, -100 where not trained (the batch's own `labels` when not given)."""
    ids = batch["input_ids"]
    if "attention_mask" in batch and batch["attention_mask"] is not None:
        unpadded = bool(batch["attention_mask"].all())
    else:
        pos = batch["position_ids"]
        first = pos[:, :1] - 1
        seq = (torch.diff(pos, prepend=first, dim=-1) != 1).cumsum(-1)
        unpadded = bool((seq[:, -1] == 0).all())
    labels = (batch["labels"] if labels is None else labels)[:, 1:]
    lengths = _seq_lengths(batch)
    return BatchFacts(
        unpadded=unpadded,
        labelled=int((labels != -100).sum()),
        tokens=int(ids.numel()),
        shape=(int(ids.shape[0]), int(ids.shape[1])),
        seq_lengths=lengths,
        packed=batch.get("attention_mask") is None and len(lengths) > 1,
    )


def _seq_lengths(batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """What transformers' flash path derives: `_get_unpad_data` (mask row sums), TRL's cu_seq_lens_q, or
    `prepare_fa_kwargs_from_position_ids` (a new sequence wherever position_ids equal their minimum)."""
    if batch.get("attention_mask") is not None:
        return tuple(int(n) for n in batch["attention_mask"].sum(-1))
    cu = batch.get("cu_seq_lens_q")
    if cu is None:
        pos = batch["position_ids"].reshape(-1)
        starts = (pos == pos.min()).nonzero().view(-1)
        cu = torch.cat([starts, torch.tensor([pos.numel()])])
    return tuple(int(n) for n in cu.diff())


def worst_batch(trainer: Any, batch_size: int, spec: Any = None) -> dict[str, torch.Tensor]:
    """The batch that needs the most memory, as the trainer's collator builds it (`spec`: its
    advisor.trainers.Trainer; the default trainer when not given)."""
    from ..trainers import DEFAULT, get_trainer  # lazy: loads yaml

    return get_trainer(spec or DEFAULT).worst_batch(trainer, batch_size)


def _in_module(prefix: str) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(prefix):
            return True
        frame = frame.f_back
    return False


class ScalarOracle:
    """Answers `.item()` on fake tensors: the real batch's answer inside transformers' masking code, else 1."""

    def __init__(self, facts: BatchFacts) -> None:
        self.facts = facts

    def __call__(self, t: torch.Tensor) -> object:
        if t.dtype is torch.bool:
            if _in_module("transformers.masking_utils"):
                return self.facts.unpadded
            return True
        return 1.0 if t.dtype.is_floating_point else 1


@contextlib.contextmanager
def real_path_patches(cuda: bool) -> Iterator[None]:
    """Make the fake run take the real run's branches.

    - transformers' `is_tracing(t)` is True for any FakeTensor, so an unpadded batch would build an attention mask
      (and packed single sequences a packed mask) that the real run skips: masking_utils sees "not tracing" and
      the `.item()` it then asks is answered from the real batch (ScalarOracle).
    - TRL's fused LM head: on CUDA it scores only labelled rows and folds tiles in a Triton kernel that allocates
      nothing; on the CPU it scores every position with torch ops. `cuda` selects the CUDA path, including the
      backward's fp32 accumulation (`_addmm_fp32`): on a CUDA tensor one `addmm(..., out_dtype=float32, out=acc)`
      that allocates nothing; on a CPU tensor `acc.addmm_(a.float(), b.float())`, an fp32 copy of the logits tile
      and of the weight chunk (at 4 x 1024 tokens and Qwen2.5's vocabulary 536 MB + 117 MB that a GPU never holds).
    - TRL's chunked divergence (distillation, trl/kernels/chunked_divergence.py) alike: on CUDA it projects only the
      completion tokens, each tile by `torch.mm(..., out_dtype=torch.float32, out=tile)` straight from 16-bit inputs
      and accumulates the gradients by the same `_addmm_fp32` (no float32 copies of the hidden states or of the
      head's slice), and folds the tiles in Triton kernels that allocate nothing. Those `out_dtype` matmuls run on
      fake tensors under every torch the project declares (advisor/simulator/out_dtype.py: torch 2.11's fake kernel
      fails them).
    """
    import transformers.masking_utils as mu  # lazy: loads transformers
    from transformers.utils.import_utils import is_torchdynamo_compiling  # lazy: loads transformers

    saved: list[tuple[Any, str, Any]] = [(mu, "is_tracing", mu.is_tracing)]
    mu.is_tracing = lambda tensor=None: is_torchdynamo_compiling()
    if cuda:
        import trl.kernels.chunked_logprob as ck  # lazy: loads trl
        import trl.trainer.utils as tu  # lazy: loads trl

        saved.append((tu, "_use_triton", tu._use_triton))
        tu._use_triton = lambda device: True
        saved.append((ck, "_addmm_fp32", ck._addmm_fp32))
        ck._addmm_fp32 = _cuda_addmm_fp32(ck._addmm_fp32, ck._MM_OUT_DTYPE)
        for name in ("_forward_tile", "_backward_tile"):
            if hasattr(ck, name):
                saved.append((ck, name, getattr(ck, name)))
                setattr(ck, name, _no_alloc_fold)
        saved.extend(_divergence_cuda_path())
    with contextlib.ExitStack() as stack:
        if cuda:
            stack.enter_context(fake_out_dtype_matmuls())
        try:
            yield
        finally:
            for obj, name, value in reversed(saved):
                if value is _ABSENT:
                    delattr(obj, name)
                else:
                    setattr(obj, name, value)


def _cuda_addmm_fp32(original: Callable[..., None], out_dtype_mm: bool) -> Callable[..., None]:
    """TRL's `_addmm_fp32(acc, a, b)` (trl/kernels/chunked_logprob.py) as it runs on CUDA tensors: with 16-bit inputs
    (and torch >= 2.8, TRL's `_MM_OUT_DTYPE`) one `torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`; its
    test is `acc.device.type == "cuda"`, which a fake CPU tensor fails, so the fake run would take the CPU's upcast."""

    def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        if out_dtype_mm and a.dtype in (torch.float16, torch.bfloat16):
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        else:
            original(acc, a, b)

    return addmm_fp32


def _no_alloc_fold(*args: Any, **kwargs: Any) -> None:
    """Stands in for TRL's Triton fold kernels: they work in registers and allocate nothing."""
    return None


class _NoAllocKernel:
    """Stands in for a Triton kernel launched as `kernel[grid](...)`: it allocates nothing."""

    def __getitem__(self, grid: Any) -> Any:
        return _no_alloc_fold


def _divergence_cuda_path() -> list[tuple[Any, str, Any]]:
    """Install the CUDA path of trl/kernels/chunked_divergence.py (see `real_path_patches`); returns what to restore.
    `_project` and `_addmm_fp32` take their `device.type == "cuda"` branch (torch >= 2.8's out_dtype matmuls, which
    fake tensors run); the Triton kernels allocate nothing; `triton.cdiv` sizes their grid."""
    import trl.kernels.chunked_divergence as cd  # lazy: loads trl
    import trl.trainer.distillation_trainer as dt  # lazy: loads trl

    def project(tile, hidden_chunk, weight, bias, start, end, dtype):
        w = weight[start:end].to(dtype).t()
        if cd._MM_OUT_DTYPE and dtype in (torch.float16, torch.bfloat16):
            torch.mm(hidden_chunk, w, out_dtype=torch.float32, out=tile)
        else:
            torch.mm(hidden_chunk.float(), w.float(), out=tile)
        if bias is not None:
            tile.add_(bias[start:end].float())

    saved: list[tuple[Any, str, Any]] = []
    for obj, name, value in (
            (cd, "_use_triton", lambda device: True), (dt, "_use_triton", lambda device: True),
            (cd, "_project", project), (cd, "_addmm_fp32", _cuda_addmm_fp32(cd._addmm_fp32, cd._MM_OUT_DTYPE)),
            (cd, "_stats_kernel", _NoAllocKernel()), (cd, "_jsd_kernel", _NoAllocKernel()),
            (cd, "_backward_kernel", _NoAllocKernel()),
            (cd, "triton", types.SimpleNamespace(cdiv=lambda a, b: -(-a // b), math=math))):
        saved.append((obj, name, getattr(obj, name, _ABSENT)))
        setattr(obj, name, value)
    return saved


_ABSENT = object()  # a module attribute the patch added (`triton` where Triton is not installed): deleted after


class CompactIndexing(torch.utils._python_dispatch.TorchDispatchMode):
    """Boolean indexing has a data-dependent size; on fake tensors answer it with the real batch's count."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.nonzero.default:
            src = args[0]
            return torch.empty((self.count, src.dim()), dtype=torch.long, device=src.device)
        if func is torch.ops.aten.index.Tensor and _bool_index(args[1]):
            src, mask = args[0], args[1][0]
            return src.new_empty((self.count, *src.shape[mask.dim():]))
        if func in (torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default) and _bool_index(
            args[1]
        ):
            return args[0]
        if func is torch.ops.aten.index_put.default and _bool_index(args[1]):
            return torch.empty_like(args[0])
        return func(*args, **kwargs)


class SyncWatch(torch.utils._python_dispatch.TorchDispatchMode):
    """Entered above every other mode of the fake run: tells `tracker.on_sync` of each op the host waits at
    (advisor/simulator/timing_hook.is_sync), after the op ran. Above the shadows, which answer `.item()` on known values
    without handing it down, it sees every one."""

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.tracker.on_sync is not None and is_sync(func, args, kwargs):
            self.tracker.on_sync(func)
        return out


def _bool_index(indices: Any) -> bool:
    return (
        isinstance(indices, (list, tuple))
        and len(indices) == 1
        and isinstance(indices[0], torch.Tensor)
        and indices[0].dtype is torch.bool
    )


def make_trainer_class(spec: Any = None):
    """The trainer class of `spec` (an advisor.trainers.Trainer or its name; the default trainer when not given)
    that leaves placement alone, trains on batches handed to it, and takes the trainer's own fake-run overrides."""
    from ..trainers import DEFAULT, get_trainer  # lazy: loads yaml

    spec = get_trainer(spec or DEFAULT)
    base = spec.trainer_class()

    def _move_model_to_device(self, model, device):
        return None

    def get_train_dataloader(self):
        return BatchFeed(self._fake_batches)

    namespace = {
        "__doc__": f"{base.__name__} that leaves placement alone and trains on batches handed to it.",
        "_fake_batches": deque(),
        "_move_model_to_device": _move_model_to_device,
        "get_train_dataloader": get_train_dataloader,
        **spec.real_overrides(),
        **spec.fake_overrides(),
    }
    return type(f"Fake{base.__name__}", (base,), namespace)


def run_fake_training(
    trainer: Any,
    batch: dict[str, torch.Tensor],
    *,
    steps: int,
    cuda: bool,
    on_op: Callable[[Any, tuple, dict, Any], None] | None = None,
    on_sync: Callable[[Any], None] | None = None,
    on_tracker: Callable[[StorageTracker], None] | None = None,
    record_events: bool = False,
    num_layers: int = 0,
    spec: Any = None,
    count_saved: bool = False,
) -> FakeRunResult:
    """Materialise `trainer.model` (and the trainer's other models) as fake tensors, run the trainer's passes before
    training, then `trainer.train()` for `steps` optimizer steps. `spec`: the advisor.trainers.Trainer (the default
    trainer when not given). `on_op` sees every op of train(), `on_sync` every op the host waits at (SyncWatch),
    `on_tracker` the tracker (whose `layer` tags the ops with their decoder layer)."""
    from ..trainers import DEFAULT, get_trainer  # lazy: loads yaml

    spec = get_trainer(spec or DEFAULT)
    facts = batch_facts(batch, spec.labels(batch))
    ga = trainer.args.gradient_accumulation_steps
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracker = StorageTracker(answer_scalar=ScalarOracle(facts))
    tracker.events = []  # always: the stream is what deeper runs are built from (advisor/simulator/layers.py)
    shadow = IntegerShadow() if spec.shadows_integers() else None
    model = trainer.model
    models = [model, *spec.extra_models(trainer)]
    passes = spec.before_train(trainer)  # their real batches built here, outside the fake mode

    def lift(real: dict) -> dict:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in real.items()}
        tracker.track(fake.values(), Category.OTHER)
        if shadow is not None:
            for k, v in fake.items():
                if isinstance(v, torch.Tensor):
                    shadow.know(v, real[k])
        return fake

    with _frozen_heap(), real_path_patches(cuda), fake_flash_attention(lambda: tracker.answer_scalar.facts), mode, \
            tracker:
        hooks = _materialised(models, tracker, num_layers)
        _outside_layers_after(trainer, "training_step", tracker)
        trainer.accelerator.device_placement = False  # model.to() cannot swap fake parameters; it is a no-op anyway
        with contextlib.ExitStack() as stack:
            if cuda:
                stack.enter_context(CompactIndexing(facts.labelled))
            if shadow is not None:
                stack.enter_context(shadow)
            for real, run in passes:
                run(lift(real))
            batches = deque(lift(batch) for _ in range(steps * ga))
            tracker.on_op = on_op
            if on_tracker is not None:
                on_tracker(tracker)
            if on_sync is not None:
                tracker.on_sync = on_sync
                stack.enter_context(SyncWatch(tracker))
            trainer._fake_batches = batches
            trainer.train_dataset = _Sized(steps * ga)
            _label_training_state(trainer, tracker, cuda=cuda)
            saved = _SavedCounter(trainer, models) if count_saved else None
            if saved is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack))
            trainer.train()
        events = tracker.finish_events()
        for handle in hooks:
            handle.remove()
    return FakeRunResult(peak=tracker.peak, facts=facts, allocations=tracker.allocations, events=events,
                         event_layers=tracker.event_layers, event_categories=tracker.event_categories,
                         saved_bytes=saved.most if saved is not None else 0)


def _materialised(models: list, tracker: StorageTracker, num_layers: int) -> list:
    """Each model's parameters and buffers as fake tensors, counted as parameters, with the hooks that tag its ops
    with their decoder layer (returned, to remove after the run)."""
    hooks = []
    for m in models:
        _materialise(m)
        tracker.set_category([p for p in m.parameters()], Category.PARAMETERS)
        tracker.set_category([b for b in m.buffers()], Category.PARAMETERS)
        hooks += install_layer_hooks(m, tracker, num_layers)
    return hooks


class _SavedCounter:
    """What activation offloading would move: the tensors autograd saves in a micro-batch's forward, through the
    same saved-tensor hooks TRL's offloader installs (trl/models/activation_offloading.py), with its rules: one
    copy per storage, nothing under `min_offload_size` (1024 bytes), no parameter or buffer, nothing the output head
    saves (get_act_offloading_ctx_manager's NoOpManager around `output` / `lm_head`). Inside a checkpointed layer
    torch's own hooks take precedence, so only the checkpoint's inputs are seen, as the offloader sees them. Fake
    tensors cannot run the offloader itself (its CUDA streams and pinned host memory)."""

    MIN_BYTES = 1024  # TRL's OffloadActivations(min_offload_size=1024)

    def __init__(self, trainer: Any, models: list) -> None:
        self.params = {_key(_storage(t)) for m in models for t in (*m.parameters(), *m.buffers())}
        self.seen: set[int] = set()
        self.bytes = self.most = 0
        self.paused = 0
        for m in models[:1]:  # the trained model, unwrapped as TRL does (accelerate's .module, PEFT's base_model)
            inner = getattr(m, "module", m)
            if hasattr(inner, "base_model") and hasattr(inner, "peft_config"):
                inner = inner.base_model
            head = getattr(inner, "output", None) if hasattr(inner, "output") else getattr(inner, "lm_head", None)
            head = getattr(head, "linear", head)
            if isinstance(head, torch.nn.Module):
                head.register_forward_pre_hook(lambda *a: self._pause(1))
                head.register_forward_hook(lambda *a: self._pause(-1), always_call=True)
        original = trainer.training_step

        def training_step(*args: Any, **kwargs: Any):
            self.seen, self.bytes = set(), 0
            try:
                return original(*args, **kwargs)
            finally:
                self.most = max(self.most, self.bytes)

        trainer.training_step = training_step

    def _pause(self, by: int) -> None:
        self.paused += by

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self.paused and isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            storage = _storage(t)
            key = _key(storage)
            n = storage.nbytes()
            if key not in self.params and key not in self.seen and n >= self.MIN_BYTES:
                self.seen.add(key)
                self.bytes += n
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        return t


def _outside_layers_after(trainer: Any, name: str, tracker: StorageTracker) -> None:
    """After a micro-batch's forward and backward, no decoder layer runs (clipping, the optimizer, zero_grad)."""
    original = getattr(trainer, name)

    def wrapped(*args: Any, **kwargs: Any):
        try:
            return original(*args, **kwargs)
        finally:
            tracker.layer = None

    setattr(trainer, name, wrapped)


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """`train()` calls `gc.collect()` (accelerate's free_memory); with transformers and TRL imported a full collection
    walks millions of objects (~0.3 s). Frozen before the first tracked storage exists, so the collection can still free
    everything of the fake run it could free before; it just stops walking the older heap."""
    if gc.get_freeze_count():  # the host process manages freezing itself: leave it alone
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _materialise(model: torch.nn.Module) -> None:
    """`to_empty` on fake tensors unties shared weights; this keeps one fake tensor per distinct parameter."""
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, value in table.items():
                if value is None:
                    continue
                if id(value) not in memo:
                    empty = torch.empty_like(value, device="cpu")
                    if isinstance(value, torch.nn.Parameter):
                        empty = torch.nn.Parameter(empty, requires_grad=value.requires_grad)
                    memo[id(value)] = empty
                table[name] = memo[id(value)]


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _label_training_state(trainer: Any, tracker: StorageTracker, *, cuda: bool = False) -> None:
    """Gradients and optimizer state are labelled when created: wrap the optimizer's step and backward hooks.

    On a CUDA target the optimizer takes the implementation it takes on the GPU: torch picks `foreach` for
    `foreach=None` when every parameter is a CUDA tensor (torch/optim/optimizer.py `_default_to_fused_or_foreach`),
    and the foreach step allocates whole-group temporaries (e.g. AdamW's `_foreach_sqrt` of every exp_avg_sq) that
    the CPU's per-tensor loop never holds at once. The fake tensors are CPU tensors, so that choice is made here."""
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def _grad_hook(p: torch.Tensor) -> None:
        if p.grad is not None:
            tracker.set_category([p.grad], Category.GRADIENTS)

    for p in params:
        p.register_post_accumulate_grad_hook(_grad_hook)

    original = trainer.create_optimizer

    def create_optimizer(*args: Any, **kwargs: Any):
        opt = original(*args, **kwargs)
        inner = getattr(opt, "optimizer", opt)
        if cuda:
            for group in inner.param_groups:
                if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                    group["foreach"] = True

        def _before_step(optimizer, *_a, **_k):
            tracker.default_category = Category.TEMPORARIES

        def _after_step(optimizer, *_a, **_k):
            tracker.default_category = Category.ACTIVATIONS
            for state in optimizer.state.values():
                tracker.set_category(
                    [v for v in state.values() if isinstance(v, torch.Tensor)], Category.OPTIMIZER
                )

        inner.register_step_pre_hook(_before_step)
        inner.register_step_post_hook(_after_step)
        return opt

    trainer.create_optimizer = create_optimizer
