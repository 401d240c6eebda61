"""Counts every storage a fake run creates, when it dies, and what was live at the peak.

PyTorch's `MemTracker` fails on frozen parameters (LoRA), so this is a plain `TorchDispatchMode` that sees each
op's outputs, records their untyped storages once, and subtracts them when the storage object is freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..measurement import Category


@dataclass
class _Live:
    nbytes: int
    category: Category


@dataclass
class PeakSnapshot:
    """Bytes live at the peak, by category, and the allocation sizes live then (for the CUDA allocator rules)."""

    peak_bytes: int = 0
    by_category: dict[Category, int] = field(default_factory=dict)
    sizes: tuple[int, ...] = ()


def _key(storage: torch.UntypedStorage) -> int:
    return storage._cdata


class StorageTracker(TorchDispatchMode):
    """Enter it inside a FakeTensorMode. `classify` maps a storage key to a Category (default: activations)."""

    def __init__(self, answer_scalar: Callable[[torch.Tensor], object] | None = None) -> None:
        super().__init__()
        self._live: dict[int, _Live] = {}
        self.current = 0
        self.peak = PeakSnapshot()
        self.category_of: dict[int, Category] = {}
        self.default_category = Category.ACTIVATIONS
        self.answer_scalar = answer_scalar
        self.allocations = 0
        self.on_op: Callable[[object, tuple, dict, object], None] | None = None
        # (+bytes | -bytes) in time order, for replaying the CUDA caching allocator; None when not recording
        self.events: list[tuple[int, int]] | None = None

    # ---- bookkeeping -------------------------------------------------------------------------------------
    def track(self, tensors: Iterable[object], category: Category | None = None) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage(), category)

    def _add(self, storage: torch.UntypedStorage, category: Category | None) -> None:
        key = _key(storage)
        if key in self._live:
            if category is not None:
                self._live[key].category = category
            return
        nbytes = storage.nbytes()
        cat = category or self.category_of.get(key) or self.default_category
        self._live[key] = _Live(nbytes, cat)
        self.allocations += 1
        self.current += nbytes
        if self.events is not None:
            self.events.append((key, nbytes))
        weakref.finalize(storage, self._free, key)
        if self.current > self.peak.peak_bytes:
            self._snapshot()

    def _free(self, key: int) -> None:
        live = self._live.pop(key, None)
        if live is not None:
            self.current -= live.nbytes
            if self.events is not None:
                self.events.append((key, -live.nbytes))

    def _snapshot(self) -> None:
        by_cat: dict[Category, int] = {}
        for live in self._live.values():
            by_cat[live.category] = by_cat.get(live.category, 0) + live.nbytes
        self.peak = PeakSnapshot(self.current, by_cat, tuple(v.nbytes for v in self._live.values()))

    def set_category(self, tensors: Iterable[torch.Tensor], category: Category) -> None:
        """Label storages that are (or will be) live, e.g. parameters, gradients, optimizer state."""
        for t in tensors:
            if t is None:
                continue
            key = _key(t.untyped_storage())
            if key in self._live:
                self._live[key].category = category
            else:
                self.category_of[key] = category

    def live_by_category(self) -> dict[Category, int]:
        out: dict[Category, int] = {}
        for live in self._live.values():
            out[live.category] = out.get(live.category, 0) + live.nbytes
        return out

    # ---- dispatch ----------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and self.answer_scalar is not None:
            return self.answer_scalar(args[0])
        out = func(*args, **kwargs)
        if self.on_op is not None:
            self.on_op(func, args, kwargs, out)
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage(), None)
        return out
