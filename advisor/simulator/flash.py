"""FlashAttention on fake tensors: transformers' own flash path, with the kernel's allocations and FLOPs.

A real run with `attn_implementation` = `kernels-community/flash-attn2` (or `flash_attention_2`, FA3, ...) calls
transformers' `flash_attention_forward` -> `modeling_flash_attention_utils._flash_attention_forward`, which
- gets no 4D mask: masking_utils' flash mask is None, or the 2D padding mask when a row is padded;
- padded rows: unpads q/k/v with that mask (`_upad_input`: nonzero indices, int32 `cu_seqlens`, max length, a copy
  of q/k/v gathered to (tokens, heads, dim)), runs the varlen kernel, and pads the output back (zeros + scatter);
- padding-free / packed rows: takes TRL's `cu_seq_lens_q/k`, `max_length_q/k` from the batch (or derives them from
  `position_ids`) and runs the varlen kernel on the flattened row: no mask, no K/V repeated to every head;
- otherwise runs the dense kernel on (batch, seq, heads, dim).

Here that code runs unchanged. Only the kernel functions `lazy_import_flash_attention` hands it (the Hub kernel
cannot be downloaded, nor run on the CPU) are replaced by stand-ins that do what flash-attn's Python wrapper does
(`FlashAttnFunc` / `FlashAttnVarlenFunc`: pad the head dim to a multiple of 8, save q, k, v, out, lse, cu_seqlens
and the RNG state for backward) around torch custom ops. The ops' fake kernels take their outputs from aten's
`_flash_attention_forward` / `_flash_attention_backward` meta kernels (the output (T, H, D), the fp32 logsumexp
(H, T); dq, dk, dv) and add the workspace that FlashAttention 2's CUDA backward allocates beside them
(csrc/flash_attn/flash_api.cpp, `mha_bwd` / `mha_varlen_bwd`: `softmax_d`, the fp32 `dq_accum`, and dK/dV expanded
to every query head under GQA before they are summed). The ops live in a namespace whose name contains
"flash_attn", as the real kernel's ops do, so TRL's selective checkpointing saves them as it saves the real kernel.

The values transformers' flash path reads from the data (`.item()` of the longest sequence, the size of `nonzero` on
the padding mask or on `position_ids`) are answered from the real batch, and the kernels get the batch's real
`cu_seqlens`, so FLOPs are counted per sequence (see `attention_flops`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ..errors import ConfigError

__all__ = ["fake_flash_attention", "flash_attention_names", "attention_flops"]

_ONLY_FAKE = "advisor's FlashAttention stand-in runs on fake tensors only (the simulator); a real run loads the kernel"


# ---- the kernels: torch custom ops with aten's meta kernels and flash-attn's workspace -----------------------
def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _head_rounded(d: int) -> int:
    return _round(d, 32) if d <= 192 else 256  # flash_api.cpp: head_size_rounded


@torch.library.custom_op("advisor::_flash_attn_varlen_forward", mutates_args=())
def _varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_left: int, window_right: int,
) -> tuple[Tensor, Tensor, Tensor]:
    raise RuntimeError(_ONLY_FAKE)


@_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
      window_left, window_right):
    out, lse, _seed, _offset, _debug = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal, False,
        scale=softmax_scale, window_size_left=window_left, window_size_right=window_right,
    )
    return out, lse, q.new_empty((2,), dtype=torch.int64)  # rng_state: flash-attn returns it on the device


@torch.library.custom_op("advisor::_flash_attn_varlen_backward", mutates_args=())
def _varlen_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float,
    causal: bool, window_left: int, window_right: int, rng_state: Tensor,
) -> list[Tensor]:
    raise RuntimeError(_ONLY_FAKE)


@_varlen_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
      causal, window_left, window_right, rng_state):
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal,
        rng_state, rng_state, scale=softmax_scale, window_size_left=window_left, window_size_right=window_right,
    )
    total_q, heads, d = q.shape
    batch = cu_seqlens_q.numel() - 1
    f32 = dict(dtype=torch.float32, device=q.device)
    workspace = [
        torch.empty((heads, total_q + 128 * batch), **f32),  # softmax_d
        torch.empty((total_q + 128 * batch, heads, _head_rounded(d)), **f32),  # dq_accum (non-deterministic)
    ]
    if k.shape[1] != heads:  # GQA: dK, dV for every query head, then summed over the group
        workspace += [k.new_empty((k.shape[0], heads, d)), v.new_empty((v.shape[0], heads, v.shape[-1]))]
    return [dq, dk, dv, *workspace]


@torch.library.custom_op("advisor::_flash_attn_forward", mutates_args=())
def _dense_forward(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float, causal: bool, window_left: int,
    window_right: int,
) -> tuple[Tensor, Tensor, Tensor]:
    raise RuntimeError(_ONLY_FAKE)


@_dense_forward.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal, window_left, window_right):
    out, lse, _seed, _offset, _debug = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, causal, False,
        scale=softmax_scale, window_size_left=window_left, window_size_right=window_right,
    )
    return out, lse, q.new_empty((2,), dtype=torch.int64)


@torch.library.custom_op("advisor::_flash_attn_backward", mutates_args=())
def _dense_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dropout_p: float, softmax_scale: float,
    causal: bool, window_left: int, window_right: int, rng_state: Tensor,
) -> list[Tensor]:
    raise RuntimeError(_ONLY_FAKE)


@_dense_backward.register_fake
def _(dout, q, k, v, out, lse, dropout_p, softmax_scale, causal, window_left, window_right, rng_state):
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], dropout_p, causal, rng_state, rng_state,
        scale=softmax_scale, window_size_left=window_left, window_size_right=window_right,
    )
    b, s_q, heads, d = q.shape
    f32 = dict(dtype=torch.float32, device=q.device)
    workspace = [
        torch.empty((b, heads, _round(s_q, 128)), **f32),  # softmax_d
        torch.empty((b, _round(s_q, 128), heads, _head_rounded(d)), **f32),  # dq_accum
    ]
    if k.shape[2] != heads:
        workspace += [k.new_empty((b, k.shape[1], heads, d)), v.new_empty((b, v.shape[1], heads, v.shape[-1]))]
    return [dq, dk, dv, *workspace]


# ---- FLOPs: torch.utils.flop_counter's formula, per sequence, over the causal pairs ---------------------------
def attention_flops(
    lengths: Sequence[int], heads: int, kv_heads: int, head_dim: int, v_head_dim: int, *, causal: bool,
    backward: bool, window_left: int = -1, window_right: int = -1,
) -> int:
    """FLOPs of FlashAttention over sequences of `lengths` (queries and keys alike).

    Per sequence of length s this is `torch.utils.flop_counter.sdpa_flop_count` (forward: QK^T and PV, 4·H·s²·D) or
    `sdpa_backward_flop_count` (backward: 5 matmuls, 10·H·s²·D when D_v = D), the formulas flop_counter applies per
    sequence to aten's varlen `_flash_attention_forward/_backward`. flop_counter counts the full s² square ("we
    aren't accounting for causal attention here"); the kernel computes only the query-key pairs its mask keeps, so
    each term is scaled by pairs / s²: s(s+1)/2 when causal, fewer under a sliding window (flash-attn's window_size,
    which transformers sets to (sliding_window - 1, ...); causal forces the right window to 0).
    """
    total = 0
    for s in lengths:
        if s <= 0:
            continue
        q, kk, vv = (1, heads, s, head_dim), (1, kv_heads, s, head_dim), (1, kv_heads, s, v_head_dim)
        f = sdpa_backward_flop_count((1, heads, s, v_head_dim), q, kk, vv) if backward else sdpa_flop_count(q, kk, vv)
        total += f // (s * s) * _pairs(s, causal, window_left, window_right)
    return total


def _pairs(s: int, causal: bool, left: int, right: int) -> int:
    """Query-key pairs a flash kernel computes in a sequence of s: key j for query i when i - left <= j <= i + right
    (a negative bound is unbounded; causal means right = 0)."""
    if causal:
        right = 0
    if left < 0 and right < 0:
        return s * s
    if right == 0 and left < 0:
        return s * (s + 1) // 2
    if right == 0:  # causal sliding window: min(i, left) + 1 keys for query i
        w = min(left, s - 1)
        return w * (w + 1) // 2 + (s - w) * (w + 1)
    lo, hi = (left if left >= 0 else s), (right if right >= 0 else s)
    return sum(min(i, lo) + min(s - 1 - i, hi) + 1 for i in range(s))


def _lengths(cu: Tensor) -> list[int]:
    with _disable_current_modes():
        bounds = [int(x) for x in cu.tolist()]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


def _varlen_fwd_flop(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, left, right, *a, out_val=None,
                     **kw) -> int:
    return attention_flops(_lengths(cu_q), q.shape[1], k.shape[1], q.shape[2], v.shape[2], causal=causal,
                           backward=False, window_left=left, window_right=right)


def _varlen_bwd_flop(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, left, right, *a,
                     out_val=None, **kw) -> int:
    return attention_flops(_lengths(cu_q), q.shape[1], k.shape[1], q.shape[2], v.shape[2], causal=causal,
                           backward=True, window_left=left, window_right=right)


def _dense_fwd_flop(q, k, v, dropout_p, scale, causal, left, right, *a, out_val=None, **kw) -> int:
    # (B, S, H, D): every row is one sequence of S (aten's dense formula would read S as heads)
    return attention_flops([q.shape[1]] * q.shape[0], q.shape[2], k.shape[2], q.shape[3], v.shape[3],
                           causal=causal, backward=False, window_left=left, window_right=right)


def _dense_bwd_flop(dout, q, k, v, out, lse, dropout_p, scale, causal, left, right, *a, out_val=None, **kw) -> int:
    return attention_flops([q.shape[1]] * q.shape[0], q.shape[2], k.shape[2], q.shape[3], v.shape[3],
                           causal=causal, backward=True, window_left=left, window_right=right)


for _op, _formula in (
    (torch.ops.advisor._flash_attn_varlen_forward, _varlen_fwd_flop),
    (torch.ops.advisor._flash_attn_varlen_backward, _varlen_bwd_flop),
    (torch.ops.advisor._flash_attn_forward, _dense_fwd_flop),
    (torch.ops.advisor._flash_attn_backward, _dense_bwd_flop),
):
    flop_registry.setdefault(_op, _formula)


# ---- flash-attn's Python wrapper --------------------------------------------------------------------------
def _contiguous(x: Tensor) -> Tensor:
    return x.contiguous() if x.stride(-1) != 1 else x  # flash_attn_interface.maybe_contiguous


def _pad8(x: Tensor) -> Tensor:
    d = x.shape[-1]
    return torch.nn.functional.pad(x, [0, 8 - d % 8]) if d % 8 else x


class _VarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window):
        d = q.shape[-1]
        q, k, v = (_contiguous(_pad8(x)) for x in (q, k, v))
        out, lse, rng = torch.ops.advisor._flash_attn_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window[0], window[1])
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng)
        ctx.args = (max_q, max_k, dropout_p, scale, causal, window)
        return out[..., :d]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k, rng = ctx.saved_tensors
        max_q, max_k, dropout_p, scale, causal, window = ctx.args
        d = dout.shape[-1]
        dq, dk, dv, *_workspace = torch.ops.advisor._flash_attn_varlen_backward(
            _contiguous(_pad8(dout)), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal,
            window[0], window[1], rng)
        del _workspace
        return dq[..., :d], dk[..., :d], dv[..., :d], *([None] * 8)


class _DenseFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, scale, causal, window):
        d = q.shape[-1]
        q, k, v = (_contiguous(_pad8(x)) for x in (q, k, v))
        out, lse, rng = torch.ops.advisor._flash_attn_forward(q, k, v, dropout_p, scale, causal, window[0], window[1])
        ctx.save_for_backward(q, k, v, out, lse, rng)
        ctx.args = (dropout_p, scale, causal, window)
        return out[..., :d]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rng = ctx.saved_tensors
        dropout_p, scale, causal, window = ctx.args
        d = dout.shape[-1]
        dq, dk, dv, *_workspace = torch.ops.advisor._flash_attn_backward(
            _contiguous(_pad8(dout)), q, k, v, out, lse, dropout_p, scale, causal, window[0], window[1], rng)
        del _workspace
        return dq[..., :d], dk[..., :d], dv[..., :d], *([None] * 4)


def _check_dtype(q: Tensor) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ConfigError(
            f"attn_implementation=FlashAttention with {str(q.dtype).removeprefix('torch.')} attention inputs: the "
            "kernel raises \"FlashAttention only support fp16 and bf16 data type\"; use precision bf16 or fp16 "
            "(mixed precision), 16-bit weights, or attn_implementation=sdpa"
        )


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's `flash_attn_varlen_func` signature (transformers reads it to pick the kwargs it passes)."""
    _check_dtype(q)
    run = _active()
    cu = run.cu_seqlens(cu_seqlens_q, q.shape[0])
    if cu_seqlens_k.shape != cu_seqlens_q.shape or k.shape[0] != q.shape[0]:
        raise RuntimeError("FlashAttention stand-in: keys packed unlike queries (cross-attention) are not simulated")
    longest = max(run.lengths) if run.lengths else 0
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _VarlenFunc.apply(q, k, v, cu, cu, longest, longest, dropout_p, scale, causal, tuple(window_size))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's `flash_attn_func`: (batch, seq, heads, dim), one sequence per row."""
    _check_dtype(q)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _DenseFunc.apply(q, k, v, dropout_p, scale, causal, tuple(window_size))


# ---- what transformers' flash path reads from the data -------------------------------------------------------
class _Run:
    """The fake run's batch as the flash path sees it: `facts()` returns an object with `seq_lengths` (the lengths
    the varlen kernel gets: per sequence of a padding-free row, per row of a padded batch) and `packed`."""

    def __init__(self, facts: Callable[[], Any]) -> None:
        self._facts = facts
        self._cu: dict[tuple[int, ...], Tensor] = {}

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self._facts().seq_lengths)

    @property
    def packed(self) -> bool:
        return bool(self._facts().packed)

    def cu_seqlens(self, fake: Tensor, total: int) -> Tensor:
        """The batch's real int32 cu_seqlens, in place of the fake one transformers computed or the batch carried."""
        lengths = self.lengths
        if fake.numel() != len(lengths) + 1 or sum(lengths) != total:
            raise RuntimeError(
                f"FlashAttention stand-in: cu_seqlens of {fake.numel()} entries over {total} tokens does not match "
                f"the batch's {len(lengths)} sequences of {sum(lengths)} tokens"
            )
        if lengths not in self._cu:
            with _disable_current_modes():
                bounds = [0]
                for n in lengths:
                    bounds.append(bounds[-1] + n)
                self._cu[lengths] = torch.tensor(bounds, dtype=torch.int32)
        return self._cu[lengths]


_ACTIVE: list[_Run] = []


def _active() -> _Run:
    if not _ACTIVE:
        raise RuntimeError(_ONLY_FAKE)
    return _ACTIVE[-1]


def _flash_utils_caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == "transformers.modeling_flash_attention_utils":
            return frame.f_code.co_name
        frame = frame.f_back
    return ""


class _DataAnswers(TorchDispatchMode):
    """Inside the flash path: `nonzero` and `.item()` answered from the real batch."""

    def __init__(self, run: _Run) -> None:
        super().__init__()
        self.run = run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            if t.dtype is torch.bool:  # _is_packed_sequence: several sequences in one flattened row
                return self.run.packed
            if not t.dtype.is_floating_point:  # the longest sequence (max_seqlen of _get_unpad_data / kwargs)
                return max(self.run.lengths)
        if func is torch.ops.aten.nonzero.default:
            caller = _flash_utils_caller()
            if caller in ("_get_unpad_data", "_unpad_input"):
                count = sum(self.run.lengths)  # the real tokens of the padding mask
            elif caller == "prepare_fa_kwargs_from_position_ids":
                count = len(self.run.lengths)  # the sequence starts
            else:
                raise RuntimeError(f"FlashAttention stand-in: unanswered data-dependent nonzero in {caller or '?'}")
            return torch.empty((count, args[0].dim()), dtype=torch.long, device=args[0].device)
        return func(*args, **kwargs)


def _fake_flash_attention_forward(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.flash_attention import flash_attention_forward  # lazy: loads transformers

    with _DataAnswers(_active()):
        return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _stand_in_imports(implementation=None, attention_wrapper=None, allow_all_kernels=False):
    """`lazy_import_flash_attention` for the fake run: the stand-in kernels, transformers' own pad/unpad."""
    import transformers.modeling_flash_attention_utils as mfa  # lazy: loads transformers

    global _PROCESS
    if _PROCESS is None:
        _PROCESS = mfa._lazy_define_process_function(flash_attn_varlen_func)
    return (flash_attn_func, flash_attn_varlen_func, None, mfa._pad_input, mfa._unpad_input), (_PROCESS, dict)


_PROCESS = None


def flash_attention_names() -> tuple[str, ...]:
    """Every FlashAttention `attn_implementation` transformers knows for CUDA: flash_attention_2/3/4 and the Hub
    kernels it maps them to or versions (kernels-community/flash-attn2, flash-attn3, vllm-flash-attn3, ...)."""
    from transformers.modeling_flash_attention_utils import (  # lazy: loads transformers
        FLASH_ATTN_KERNEL_DEVICES,
        FLASH_ATTN_KERNEL_FALLBACK,
    )
    from transformers.modeling_utils import AttentionInterface  # lazy: loads transformers
    from transformers.utils.generic import is_flash_attention_requested  # lazy: loads transformers

    names = {k for k in AttentionInterface._global_mapping if not k.startswith("paged|")}
    names |= set(FLASH_ATTN_KERNEL_FALLBACK.values())
    names |= {k for k, devices in FLASH_ATTN_KERNEL_DEVICES.items() if "cuda" in devices}
    names = {n for n in names if is_flash_attention_requested(requested_attention_implementation=n)}
    return tuple(sorted(n for n in names if FLASH_ATTN_KERNEL_DEVICES.get(n, ("cuda",)) != ("rocm",)))


@contextlib.contextmanager
def fake_flash_attention(facts: Callable[[], Any]) -> Iterator[None]:
    """Route every FlashAttention name to the stand-in for the duration of a fake run (restored afterwards).

    `facts()` gives the batch being run (BatchFacts: `seq_lengths`, `packed`); it is read at each call, so a run that
    feeds several batches only has to update what it returns.
    """
    import transformers.modeling_flash_attention_utils as mfa  # lazy: loads transformers
    from transformers.masking_utils import (  # lazy: loads transformers
        ALL_MASK_ATTENTION_FUNCTIONS,
        flash_attention_mask,
    )
    from transformers.modeling_utils import AttentionInterface  # lazy: loads transformers

    attn_map = AttentionInterface._global_mapping
    mask_map = type(ALL_MASK_ATTENTION_FUNCTIONS)._global_mapping
    names = flash_attention_names()
    saved_attn = {n: attn_map[n] for n in names if n in attn_map}
    saved_mask = {n: mask_map[n] for n in names if n in mask_map}
    saved_import = mfa.lazy_import_flash_attention
    for n in names:
        attn_map[n] = _fake_flash_attention_forward
        mask_map.setdefault(n, flash_attention_mask)  # what load_and_register_attn_kernel registers for a Hub kernel
    mfa.lazy_import_flash_attention = _stand_in_imports
    _ACTIVE.append(_Run(facts))
    try:
        yield
    finally:
        _ACTIVE.pop()
        mfa.lazy_import_flash_attention = saved_import
        for n in names:
            attn_map.pop(n, None)
            mask_map.pop(n, None)
        attn_map.update(saved_attn)
        mask_map.update(saved_mask)
