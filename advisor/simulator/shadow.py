"""The real values of the batch's integer tensors, carried beside their fake tensors.

DPO's and Reward's steps index by masks built from the batch (`chosen_mean_logits[chosen_mask.bool()]`, the fused
LM head's `hidden_states[labels != -100]` on CUDA): a data-dependent size that fake tensors cannot know. The batch
is real before it is lifted, so every integer or boolean tensor computed from the batch's integer tensors alone
(slices, chunks, comparisons, `masked_fill`, `cumsum`, ...) is computed again on the real values here, and a
boolean index, `nonzero` or `.item()` of such a tensor gets the real run's answer. Floating tensors are never
shadowed (they come from the model's fake weights).

`DataShadow` widens it for a run that generates (online RL: `model.generate` inside `train()`,
advisor/simulator/generation.py):
real CPU tensors handed to an op are known as themselves (the tokenized prompts), factory ops other than `empty*` and
the seeded random ones are computed for real (`torch.full`, `arange`, `zeros`: the decode loop's
`unfinished_sequences`, TRL's reward table), floating tensors derived only from such data are carried too (the
rewards and advantages TRL checks for NaN), and while a generation runs the token a sampling op picks from the fake
logits is a filler id that is not a special token, so the decode loop's own stop decision (`unfinished_sequences.max()
== 0`) is computed on known values and every sequence runs to its maximum length. The model's weights never become
known: they are made by `empty_like` from meta tensors, and neither is known.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
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
        if self._keeps(real):
            self._real[fake] = real

    def real(self, t: torch.Tensor) -> torch.Tensor | None:
        return self._value(t) if self._known(t) else None

    # what is known and what is carried: DataShadow widens these
    def _known(self, t: torch.Tensor) -> bool:
        return t in self._real

    def _value(self, t: torch.Tensor) -> torch.Tensor:
        return self._real[t]

    def _keeps(self, real: torch.Tensor) -> bool:
        return _shadowable(real)

    def _swap(self, tree: object) -> object:
        if isinstance(tree, torch.Tensor):
            return self._value(tree)
        if isinstance(tree, (list, tuple)):
            return type(tree)(self._swap(x) for x in tree)
        if isinstance(tree, dict):
            return {k: self._swap(v) for k, v in tree.items()}
        return tree

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tensors_in((args, kwargs))
        known = bool(inputs) and all(self._known(t) for t in inputs)
        if not known:
            answered = self._data_dependent(func, args, kwargs)
            if answered is not None:
                return answered
            return func(*args, **kwargs)
        with _disable_current_modes():
            real_out = func(*self._swap(args), **self._real_kwargs(self._swap(kwargs)))
        if func is _SCALAR:
            return real_out
        if func in (_aten.nonzero.default, _aten.masked_select.default) or (
                func is _aten.index.Tensor and _bool_index(args[1])):
            out = _empty_like_real(args[0], real_out)
        else:
            out = func(*args, **kwargs)
        self._carry(out, real_out)
        return out

    def _real_kwargs(self, kwargs: dict) -> dict:
        return kwargs

    def _carry(self, out: object, real_out: object) -> None:
        for fake, real in zip(tensors_in(out), tensors_in(real_out), strict=False):
            if self._keeps(real) and tuple(fake.shape) == tuple(real.shape):
                self._real[fake] = real

    def _data_dependent(self, func, args, kwargs):
        """A float tensor indexed by a known mask: an empty tensor of the real count (the tracker counts it)."""
        if func is _aten.index.Tensor and _bool_index(args[1]) and self._known(args[1][0]):
            mask = self._value(args[1][0])
            src = args[0]
            with _disable_current_modes():
                count = int(mask.sum())
            return src.new_empty((count, *src.shape[mask.dim():]))
        if func is _aten.masked_select.default and self._known(args[1]):
            mask = self._value(args[1])
            with _disable_current_modes():
                count = int(torch.broadcast_to(mask, args[0].shape).sum())
            return args[0].new_empty((count,))
        if func in (_aten.index_put_.default, _aten._index_put_impl_.default) and _bool_index(args[1]) \
                and self._known(args[1][0]):
            return args[0]
        return None


# Factories whose output has no defined value: never known, whatever DataShadow computes.
_UNINITIALISED = frozenset({_aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default,
                            _aten.new_empty.default, _aten.new_empty_strided.default, _aten.empty_permuted.default})
# What picks a decode step's token from the logits (transformers' _sample: multinomial when sampling, argmax greedy).
_SAMPLING = frozenset({_aten.multinomial.default, _aten.argmax.default})


class DataShadow(IntegerShadow):
    """IntegerShadow for a run that generates: real CPU tensors are known as themselves, value-defined factories are
    computed for real, floating tensors derived only from known data are carried, and inside `filling(token)` the
    tokens sampled from the fake logits are `token` (see the module's docstring). Every other rule is
    IntegerShadow's: an op is computed for real only when every tensor it reads is known."""

    def __init__(self) -> None:
        super().__init__()
        self._filler: int | None = None

    @contextlib.contextmanager
    def filling(self, token: int) -> Iterator[None]:
        """While inside, a sampling op on unknown logits yields `token` in every row (a known value)."""
        saved, self._filler = self._filler, int(token)
        try:
            yield
        finally:
            self._filler = saved

    def _known(self, t: torch.Tensor) -> bool:
        return t in self._real or _real_cpu(t)

    def _value(self, t: torch.Tensor) -> torch.Tensor:
        real = self._real.get(t)
        return t if real is None else real

    def _keeps(self, real: torch.Tensor) -> bool:
        return isinstance(real, torch.Tensor) and not real.dtype.is_complex and real.numel() <= _LIMIT

    def _real_kwargs(self, kwargs: dict) -> dict:
        """The real values live on the CPU whatever device the fake run targets."""
        out = {k: (torch.device("cpu") if isinstance(v, torch.device) else v) for k, v in kwargs.items()}
        if out.get("pin_memory"):
            out["pin_memory"] = False
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tensors_in((args, kwargs))
        if func in _UNINITIALISED or (not inputs and torch.Tag.nondeterministic_seeded in func.tags):
            return func(*args, **kwargs)
        if not inputs:  # a factory: its value is defined by its arguments
            out = func(*args, **kwargs)
            if all(isinstance(t, torch.Tensor) and t.numel() <= _LIMIT for t in tensors_in(out)):
                with _disable_current_modes():
                    real_out = func(*args, **self._real_kwargs(kwargs))
                self._carry(out, real_out)
            return out
        if all(self._known(t) for t in inputs):
            return super().__torch_dispatch__(func, types, args, kwargs)
        if self._filler is not None and func in _SAMPLING:
            out = func(*args, **kwargs)
            with _disable_current_modes():
                self._real[out] = torch.full(tuple(out.shape), self._filler, dtype=out.dtype)
            return out
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._forget_written(func, args, kwargs)
        return out

    def _forget_written(self, func, args, kwargs) -> None:
        """An op that writes unknown values into a known tensor leaves its carried value stale: forget it."""
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in tensors_in(value):
                self._real.pop(t, None)


def _real_cpu(t: torch.Tensor) -> bool:
    """A real (not fake, not meta) CPU tensor of a shadow's size: its own value."""
    return not isinstance(t, FakeTensor) and t.device.type == "cpu" and not t.dtype.is_complex \
        and t.numel() <= _LIMIT


def _empty_like_real(src: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    return src.new_empty(tuple(real.shape), dtype=real.dtype)


def _bool_index(indices: object) -> bool:
    return (
        isinstance(indices, (list, tuple))
        and len(indices) == 1
        and isinstance(indices[0], torch.Tensor)
        and indices[0].dtype is torch.bool
    )
