"""Counts every storage a fake run creates, when it dies, and what was live at the peak.

PyTorch's `MemTracker` fails on frozen parameters (LoRA), so this is a plain `TorchDispatchMode` that sees each
op's outputs, records their untyped storages once, and subtracts them when the storage object is freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import _DISPATCH_META_HANDLERS, FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..measurement import Category

_SCALAR = torch.ops.aten._local_scalar_dense.default


@dataclass
class _Live:
    nbytes: int
    category: Category


@dataclass
class PeakSnapshot:
    """Bytes live at the peak, by category."""

    peak_bytes: int = 0
    by_category: dict[Category, int] = field(default_factory=dict)


def _key(storage: torch.UntypedStorage) -> int:
    return storage._cdata


# Tensor subclasses whose ops the tracker lets through to their own __torch_dispatch__ (returning NotImplemented),
# so it sees the ops on their local tensors instead: DTensor while a rank is simulated
# (advisor/simulator/distributed.py).
PASS_THROUGH: tuple[type, ...] = ()


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage that holds `t`'s bytes (a DTensor's: its local shard's)."""
    return getattr(t, "_local_tensor", t).untyped_storage()


class StorageTracker(TorchDispatchMode):
    """Enter it inside a FakeTensorMode. `classify` maps a storage key to a Category (default: activations)."""

    def __init__(self, answer_scalar: Callable[[torch.Tensor], object] | None = None) -> None:
        super().__init__()
        self._live: dict[int, _Live] = {}
        self.current = 0
        self._by_category: dict[Category, int] = {}  # running totals of _live, so a new peak costs O(categories)
        self.peak = PeakSnapshot()
        self.category_of: dict[int, Category] = {}
        self.default_category = Category.ACTIVATIONS
        self.answer_scalar = answer_scalar
        self.allocations = 0
        self.on_op: Callable[[object, tuple, dict, object], None] | None = None
        # told of every op the host waits at (advisor/simulator/fake_step.SyncWatch, above every other mode)
        self.on_sync: Callable[[object], None] | None = None
        # (+bytes | -bytes) in time order, for replaying the CUDA caching allocator; None when not recording
        self.events: list[tuple[int, int]] | None = None
        # per event: the decoder layer it belongs to (None: unknown), and per allocation its last category; kept
        # while recording so a deeper run's stream can be built layer by layer (advisor/simulator/layers.py)
        self.event_layers: list[int | None] = []
        self.event_categories: dict[int, Category] = {}
        self.layer: int | None = None  # the decoder layer running now (set by layer hooks), None outside one
        self._op_layer: int | None = None  # outside a layer: the layer of the running op's first tagged input
        self._alloc_event: dict[int, int] = {}  # live storage key -> index of its allocation event

    # ---- bookkeeping -------------------------------------------------------------------------------------
    def track(self, tensors: Iterable[object], category: Category | None = None) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(_storage(t), category)

    def _add(self, storage: torch.UntypedStorage, category: Category | None) -> None:
        key = _key(storage)
        if key in self._live:
            if category is not None:
                self._relabel(self._live[key], category)
            return
        nbytes = storage.nbytes()
        if nbytes == 0:  # nothing allocated (FSDP2's freed unsharded storages; empty tensors): no event
            return
        cat = category or self.category_of.get(key) or self.default_category
        self._live[key] = _Live(nbytes, cat)
        self._by_category[cat] = self._by_category.get(cat, 0) + nbytes
        self.allocations += 1
        self.current += nbytes
        if self.events is not None:
            self._alloc_event[key] = len(self.events)
            self.events.append((key, nbytes))
            self.event_layers.append(self.layer if self.layer is not None else self._op_layer)
        weakref.finalize(storage, self._free, key)
        if self.current > self.peak.peak_bytes:
            self._snapshot()

    def _free(self, key: int) -> None:
        live = self._live.pop(key, None)
        if live is not None:
            self.current -= live.nbytes
            self._by_category[live.category] -= live.nbytes
            if self.events is not None:
                index = self._alloc_event.pop(key, None)
                if index is not None:
                    self.event_categories[index] = live.category
                    self.events.append((key, -live.nbytes))
                    self.event_layers.append(self.layer)

    def _snapshot(self) -> None:
        self.peak = PeakSnapshot(self.current, {c: n for c, n in self._by_category.items() if n})

    def _relabel(self, live: _Live, category: Category) -> None:
        self._by_category[live.category] -= live.nbytes
        self._by_category[category] = self._by_category.get(category, 0) + live.nbytes
        live.category = category

    def set_category(self, tensors: Iterable[torch.Tensor], category: Category) -> None:
        """Label storages that are (or will be) live, e.g. parameters, gradients, optimizer state."""
        for t in tensors:
            if t is None:
                continue
            key = _key(_storage(t))
            if key in self._live:
                self._relabel(self._live[key], category)
            else:
                self.category_of[key] = category

    def set_layer(self, tensors: Iterable[torch.Tensor], layer: int) -> None:
        """Mark live storages (a decoder layer's parameters) as allocated by `layer`."""
        if self.events is None:
            return
        for t in tensors:
            index = self._alloc_event.get(_key(_storage(t)))
            if index is not None:
                self.event_layers[index] = layer

    def finish_events(self) -> list[tuple[int, int]] | None:
        """Stop recording: the events so far (later frees, e.g. when the trainer is collected, are not part of it);
        the category of each allocation still live is its category now."""
        events = self.events
        if events is not None:
            for key, index in self._alloc_event.items():
                self.event_categories[index] = self._live[key].category
            self._alloc_event = {}
        self.events = None
        return events

    def _input_layer(self, args: object) -> int | None:
        for t in tensors_in(args):
            index = self._alloc_event.get(_key(t.untyped_storage())) if type(t) is FakeTensor else None
            if index is not None and self.event_layers[index] is not None:
                return self.event_layers[index]
        return None

    def live_by_category(self) -> dict[Category, int]:
        return {c: n for c, n in self._by_category.items() if n}

    # ---- dispatch ----------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Metadata queries (prim.device above all: half of all calls, from autograd) allocate nothing and are no
        # op of the step; answer them as FakeTensorMode would, without its dispatch or the hooks.
        handler = _DISPATCH_META_HANDLERS.get(func)
        if handler is not None and len(args) == 1 and type(args[0]) is FakeTensor:
            return handler(args)
        if PASS_THROUGH and any(issubclass(t, PASS_THROUGH) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if func is _SCALAR and self.answer_scalar is not None:
            return self.answer_scalar(args[0])
        out = func(*args, **kwargs)
        if self.on_op is not None:
            self.on_op(func, args, kwargs, out)
        per_tensor = self.events is not None and self.layer is None and _foreach_lists(func, args, out)
        if per_tensor:
            # a foreach op (the GPU's optimizer step): output i is computed from element i of the first list, so
            # it belongs to that element's layer, not to the first element's
            for src, t in zip(args[0], out, strict=True):
                self._op_layer = self._input_layer(src)
                if (t.fake_device if type(t) is FakeTensor else t.device).type != "meta":
                    self._add(t.untyped_storage(), None)
            self._op_layer = None
            return out
        if self.events is not None and self.layer is None:
            self._op_layer = self._input_layer((args, kwargs))
        for t in tensors_in(out):
            if (t.fake_device if type(t) is FakeTensor else t.device).type != "meta":
                self._add(t.untyped_storage(), None)
        self._op_layer = None
        return out


def _foreach_lists(func, args: tuple, out: object) -> bool:
    """A `_foreach_*` op returning one tensor per element of its first tensor list."""
    return (
        func._overloadpacket.__name__.startswith("_foreach_")
        and isinstance(out, (list, tuple)) and len(out) > 0
        and bool(args) and isinstance(args[0], (list, tuple)) and len(args[0]) == len(out)
        and all(isinstance(t, torch.Tensor) for t in out)
    )


def tensors_in(tree: object) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs, in pytree order, without tree_flatten's generality."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    out: list[torch.Tensor] = []
    _collect(tree, out)
    return out


def _collect(tree: object, out: list[torch.Tensor]) -> None:
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            _collect(x, out)
    elif isinstance(tree, dict):
        for x in tree.values():
            _collect(x, out)
