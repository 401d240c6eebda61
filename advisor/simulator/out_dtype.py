"""`torch.addmm(..., out_dtype=torch.float32)` on fake tensors, whatever the torch version.

TRL's fused heads accumulate their gradients on CUDA with `torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`
(trl/kernels/chunked_logprob.py and chunked_divergence.py, `_addmm_fp32`), and the simulator's fake run for a CUDA
target takes that branch (advisor/simulator/fake_step.py `real_path_patches`). In torch 2.11 the fake (and meta) kernel
of `aten.addmm.dtype` / `aten.addmm.dtype_out` is the Python decomposition of plain `addmm(self, mat1, mat2, beta=1,
alpha=1)`, which binds the positional `out_dtype` to `beta` and fails with "unsupported operand type(s) for *:
'torch.dtype' and 'FakeTensor'": with the CUDA build of torch 2.11 every candidate of the front door failed (CI,
2026-12-04); torch 2.13 and 2.14 answer it. On a torch that fails it, `fake_out_dtype_matmuls()` answers the two
overloads in the fake mode from their schema: `dtype_out` returns `out` (written in place, nothing allocated), `dtype` a
new [m, n] tensor of `out_dtype`. The op is still dispatched by name, so every mode above the fake mode (the tracker,
the timing hook) sees `aten.addmm.dtype_out` as on any other torch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch._decomp import decomposition_table
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensorMode


def _overloads() -> tuple[Any, ...]:
    found = (getattr(torch.ops.aten.addmm, name, None) for name in ("dtype", "dtype_out"))
    return tuple(op for op in found if op is not None)


@functools.cache
def fake_addmm_out_dtype_works() -> bool:
    """Whether this torch's fake mode runs `addmm(..., out_dtype=float32, out=acc)` (probed once, on tiny tensors)."""
    if not _overloads():
        return True  # no out_dtype overloads: nothing calls them
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)  # the fake mode logs the failure it then raises
    try:
        with FakeTensorMode():
            acc = torch.empty(2, 2)
            a = torch.empty(2, 3, dtype=torch.bfloat16)
            torch.addmm(acc, a, torch.empty(3, 2, dtype=torch.bfloat16), out_dtype=torch.float32, out=acc)
        return True
    except TypeError:
        return False
    finally:
        log.setLevel(level)


def _fake_addmm_out_dtype(fake_mode: Any, func: Any, self: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor,
                          out_dtype: torch.dtype, *, beta: Any = 1, alpha: Any = 1, out: torch.Tensor | None = None
                          ) -> Any:
    shape = (mat1.shape[0], mat2.shape[1])
    if mat1.shape[1] != mat2.shape[0]:
        raise RuntimeError(f"addmm: mat1 and mat2 shapes cannot be multiplied ({tuple(mat1.shape)} and "
                           f"{tuple(mat2.shape)})")
    if out is not None:
        if tuple(out.shape) != shape or out.dtype != out_dtype:
            return NotImplemented  # what no fused head does: left to torch's own kernel
        return out
    with fake_mode:
        return torch.empty(shape, dtype=out_dtype, device=mat1.device)


@contextlib.contextmanager
def fake_out_dtype_matmuls(stand_in: bool | None = None) -> Iterator[None]:
    """While open, fake tensors run `aten.addmm.dtype` / `.dtype_out` on a torch whose own fake kernel fails them
    (see the module); on any other torch it changes nothing. `stand_in`: None decides by the probe; True installs
    the stand-in on any torch (its test on a torch that answers the op itself)."""
    if not stand_in and fake_addmm_out_dtype_works():
        yield
        return

    ops = _overloads()
    dropped = {op: decomposition_table.pop(op) for op in ops if op in decomposition_table}
    check = (lambda func: func in ops, _fake_addmm_out_dtype)
    fake_impls.op_implementations_checks.insert(0, check)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(check)
        decomposition_table.update(dropped)
