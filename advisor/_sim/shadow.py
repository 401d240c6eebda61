"""The real values of the batch's integer tensors, carried beside their fake tensors.

DPO's and Reward's steps index by masks built from the batch (`chosen_mean_logits[chosen_mask.bool()]`, the fused
LM head's `hidden_states[labels != -100]` on CUDA): a data-dependent size that fake tensors cannot know. The batch
is real before it is lifted, so every integer or boolean tensor computed from the batch's integer tensors alone
(slices, chunks, comparisons, `masked_fill`, `cumsum`, ...) is computed again on the real values here, and a
boolean index, `nonzero` or `.item()` of such a tensor gets the real run's answer. Floating tensors are never
shadowed (they come from the model's fake weights).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from .tracker import tensors_in

_aten = torch.ops.aten
_SCALAR = _aten._local_scalar_dense.default
_LIMIT = 1 << 22  # elements: a shadow is a mask or an index, never a tensor of the model's size


def _shadowable(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not t.dtype.is_floating_point and not t.dtype.is_complex \
        and t.numel() <= _LIMIT


class IntegerShadow(TorchDispatchMode):
    """Enter it above the tracker (it sees each op first). `know(fake, real)` seeds it with the batch."""

    def __init__(self) -> None:
        super().__init__()
        self._real: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def know(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        if _shadowable(real):
            self._real[fake] = real

    def real(self, t: torch.Tensor) -> torch.Tensor | None:
        return self._real.get(t)

    def _swap(self, tree: object) -> object:
        if isinstance(tree, torch.Tensor):
            return self._real[tree]
        if isinstance(tree, (list, tuple)):
            return type(tree)(self._swap(x) for x in tree)
        if isinstance(tree, dict):
            return {k: self._swap(v) for k, v in tree.items()}
        return tree

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tensors_in((args, kwargs))
        known = bool(inputs) and all(t in self._real for t in inputs)
        if not known:
            answered = self._data_dependent(func, args, kwargs)
            if answered is not None:
                return answered
            return func(*args, **kwargs)
        with _disable_current_modes():
            real_out = func(*self._swap(args), **self._swap(kwargs))
        if func is _SCALAR:
            return real_out
        if func in (_aten.nonzero.default, _aten.masked_select.default) or (
                func is _aten.index.Tensor and _bool_index(args[1])):
            out = _empty_like_real(args[0], real_out)
        else:
            out = func(*args, **kwargs)
        for fake, real in zip(tensors_in(out), tensors_in(real_out), strict=False):
            if _shadowable(real) and tuple(fake.shape) == tuple(real.shape):
                self._real[fake] = real
        return out

    def _data_dependent(self, func, args, kwargs):
        """A float tensor indexed by a known mask: an empty tensor of the real count (the tracker counts it)."""
        if func is _aten.index.Tensor and _bool_index(args[1]) and args[1][0] in self._real:
            mask = self._real[args[1][0]]
            src = args[0]
            with _disable_current_modes():
                count = int(mask.sum())
            return src.new_empty((count, *src.shape[mask.dim():]))
        if func is _aten.masked_select.default and args[1] in self._real:
            mask = self._real[args[1]]
            with _disable_current_modes():
                count = int(torch.broadcast_to(mask, args[0].shape).sum())
            return args[0].new_empty((count,))
        if func in (_aten.index_put_.default, _aten._index_put_impl_.default) and _bool_index(args[1]) \
                and args[1][0] in self._real:
            return args[0]
        return None


def _empty_like_real(src: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    return src.new_empty(tuple(real.shape), dtype=real.dtype)


def _bool_index(indices: object) -> bool:
    return (
        isinstance(indices, (list, tuple))
        and len(indices) == 1
        and isinstance(indices[0], torch.Tensor)
        and indices[0].dtype is torch.bool
    )
