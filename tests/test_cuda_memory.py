"""What a CUDA training process holds that the fake run on the CPU must put back: the fused LM head's CUDA path, the
cuBLAS workspaces, the memory outside the allocator.

Measured on an H200 (issue 29, torch 2.11 CUDA 13, scripts/gpu_validate.py, Qwen2.5-0.5B, 4 x 1024): LoRA on bf16
weights, checkpointed, peaked at 1,762,590,208 B while the simulation read 1.2837 of it. Two causes:

- TRL's `_addmm_fp32` (the fused LM head's backward accumulation) tests `acc.device.type == "cuda"`: on a CUDA tensor
  one `addmm(..., out_dtype=float32, out=acc)`, on a CPU tensor an fp32 copy of the logits tile and of the weight
  chunk. The fake run's tensors are CPU tensors, so it held 536 MB + 117 MB a GPU never holds. Reproduced here: TRL's
  own head on fake CUDA tensors (its CUDA branch) against the simulator's fake CPU run for a CUDA target.
- one cuBLAS workspace per thread issuing GEMMs (the forward's, autograd's device thread): 2 x 32 MiB on Hopper,
  where the simulation counted one. Not reproducible on the CPU (no cuBLAS; the CPU's backward runs on the caller's
  thread): the gpu-marked test measures it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import weakref

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Allocations(TorchDispatchMode):
    """The ops run, every storage they create in order ((op, dtype, shape)), and the most bytes live at once."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.made: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        given = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, n = storage._cdata, storage.nbytes()
                if n and key not in self._seen and key not in given:  # a new storage, not a view or an out=
                    self._seen.add(key)
                    self.made.append((func.__name__, t.dtype, tuple(t.shape)))
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, n)
        return out

    def _free(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n


class _Ctx:
    """What torch.autograd.Function gives forward and backward, so both run without the autograd engine (which
    cannot run a backward on fake CUDA tensors without a GPU)."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad

    def set_materialize_grads(self, value: bool) -> None:
        pass

    def mark_non_differentiable(self, *args) -> None:
        pass

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


def _head_backward(device: str, weight_dtype: torch.dtype, trainable: bool) -> _Allocations:
    """TRL's chunked log-prob head, forward and backward, on fake `device` tensors: 300 labelled tokens, hidden 64,
    a 2,500-token vocabulary in chunks of 1,024 (a ragged last chunk), bf16 hidden states."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    with FakeTensorMode(allow_non_fake_inputs=True):
        hidden = torch.empty(300, 64, dtype=torch.bfloat16, device=device)
        weight = torch.empty(2500, 64, dtype=weight_dtype, device=device)
        targets = torch.zeros(300, dtype=torch.long, device=device)
        ctx = _Ctx((True, trainable, False, False, False, False, False, False, False))
        with _Allocations() as seen:
            logprobs, entropy, *_ = ChunkedLogProbFunction.forward(
                ctx, hidden, weight, None, targets, 1.0, 1024, None, 1.0, ("entropy", "is_top1"))
            grads = ChunkedLogProbFunction.backward(ctx, torch.ones_like(logprobs), torch.ones_like(entropy))
            del grads
    return seen


HEADS = pytest.mark.parametrize("weight_dtype, trainable", [(torch.bfloat16, False), (torch.float32, True)],
                                ids=["frozen-bf16-head", "trained-fp32-head"])


@HEADS
def test_fused_head_backward_holds_no_fp32_tile(weight_dtype, trainable):
    """The simulator's fake run for a CUDA target accumulates the head's gradients as CUDA does: one
    addmm(out_dtype=float32) per tile, no fp32 copy of a [300 x 1024] logits tile or a [1024 x 64] weight chunk
    (the CPU branch's `acc.addmm_(a.float(), b.float())`), and so peaks at the CUDA path's bytes."""
    from advisor.simulator import real_path_patches

    with real_path_patches(cuda=True):
        simulated = _head_backward("cpu", weight_dtype, trainable)
    with real_path_patches(cuda=False):
        cpu = _head_backward("cpu", weight_dtype, trainable)
    fp32_tiles = {(torch.float32, (300, 1024)), (torch.float32, (1024, 64)), (torch.float32, (1024, 300))}
    assert not [m for m in simulated.made if m[1:] in fp32_tiles]
    assert "aten.addmm.dtype_out" in simulated.ops  # the CUDA branch, into the fp32 accumulator
    assert [m for m in cpu.made if m[1:] in fp32_tiles]  # the CPU's own run does upcast (its probe is exact)
    assert simulated.peak < cpu.peak


@HEADS
@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="fake CUDA tensors need a CUDA build of torch")
def test_fused_head_allocates_as_on_cuda(monkeypatch, weight_dtype, trainable):
    """Against TRL's own code on fake CUDA tensors (its `_addmm_fp32` takes its CUDA branch): the simulator's fake
    CPU run for a CUDA target allocates the same tensors in the same order, and peaks at the same bytes. Both fold
    the tiles with the simulator's stand-in for TRL's Triton kernels (which allocate nothing)."""
    import trl.kernels.chunked_logprob as ck

    from advisor.simulator import fake_out_dtype_matmuls, real_path_patches

    with real_path_patches(cuda=True):  # the Triton folds' stand-ins, as the simulator runs them
        fold_forward, fold_backward = ck._forward_tile, ck._backward_tile
    monkeypatch.setattr(ck, "_use_triton", lambda device: False)  # the tile path, with the folds' stand-ins
    monkeypatch.setattr(ck, "_forward_tile", fold_forward)
    monkeypatch.setattr(ck, "_backward_tile", fold_backward)
    with fake_out_dtype_matmuls():  # torch 2.11's fake addmm(out_dtype=) fails (advisor/simulator/out_dtype.py)
        on_cuda = _head_backward("cuda", weight_dtype, trainable)  # TRL's code as a GPU runs it
    monkeypatch.undo()
    with real_path_patches(cuda=True):
        simulated = _head_backward("cpu", weight_dtype, trainable)

    assert "aten.addmm.dtype_out" in on_cuda.ops  # TRL's CUDA branch: addmm(out_dtype=float32, out=acc)
    assert simulated.ops == on_cuda.ops
    assert simulated.made == on_cuda.made
    assert simulated.peak == on_cuda.peak


def test_outside_allocator_per_cuda_major_and_gpu():
    """The memory outside the caching allocator is looked up per CUDA major and compute capability; the H200's
    measurement (CUDA 13, sm90) carries its source, other combinations take the unverified default."""
    from advisor.physics import context_bytes, cuda_constants, local_cuda_major

    ctx = cuda_constants()["cuda_context_bytes"]
    measured = ctx["measured"]["cuda13"]["sm90"]
    assert measured["bytes"] == 794_820_608 and "H200" in measured["gpu"] and measured["source"]
    assert context_bytes("9.0", cuda_major=13) == 794_820_608
    assert context_bytes("9.0", cuda_major=12) == ctx["default"]  # not measured on CUDA 12
    assert context_bytes("8.0", cuda_major=13) == ctx["default"]  # nor on an A100
    assert context_bytes(None) == ctx["default"]
    # the local build's CUDA major decides; a build without CUDA takes the newest CUDA major measured for the GPU
    expected = int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None
    assert local_cuda_major() == expected
    assert context_bytes("9.0") == context_bytes("9.0", cuda_major=13 if expected is None else expected)


def test_two_cublas_workspaces_on_hopper():
    """A training step issues GEMMs from two threads (the forward's, autograd's), each with its own cuBLAS handle
    and workspace: 2 x 32 MiB on Hopper (sm90), 2 x 8,519,680 B before."""
    from advisor.physics import cublas_workspace_bytes

    assert cublas_workspace_bytes("9.0") == 2 * 32 * 2**20
    assert cublas_workspace_bytes("9.0", threads=1) == 32 * 2**20
    assert cublas_workspace_bytes("8.0") == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)


_WORKSPACES = r"""
import json, torch
torch.cuda.init()
x = torch.randn(512, 512, device="cuda", requires_grad=True)
w = torch.randn(512, 512, device="cuda", requires_grad=True)
torch.cuda.synchronize()
before = torch.cuda.memory_allocated()
y = x @ w  # a GEMM on this (the Python) thread
loss = y.sum()
loss.backward()  # GEMMs on autograd's device thread
del loss
torch.cuda.synchronize()
held = torch.cuda.memory_allocated() - before - sum(t.nbytes for t in (y, x.grad, w.grad))
cc = torch.cuda.get_device_capability()
print(json.dumps({"held": held, "cc": f"{cc[0]}.{cc[1]}"}))
"""


@pytest.mark.gpu
def test_cublas_workspaces_measured():
    """On a GPU, in a fresh process: after one GEMM forward and its backward the allocator holds, besides the tensors,
    exactly the workspaces `cublas_workspace_bytes` counts (one per thread that ran a GEMM)."""
    from advisor.physics import cublas_workspace_bytes

    out = subprocess.run([sys.executable, "-c", _WORKSPACES], capture_output=True, text=True, check=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["held"] == cublas_workspace_bytes(got["cc"])


@pytest.mark.slow
def test_lora_and_full_rows_of_the_h200_run():
    """The simulation of scripts/gpu_validate.py's rows against the H200's measured peaks (issue 29: torch 2.11
    CUDA 13, Qwen2.5-0.5B, batch 4 x 1024, bf16 autocast, sdpa, AdamW): LoRA on bf16 weights within 3% (it read
    1.2837 before the fused head's CUDA path), full fine-tuning checkpointed within 1%."""
    from advisor.data import synthetic
    from advisor.profiles import resolve_gpu, resolve_model
    from advisor.simulator import simulate
    from advisor.space import Candidate
    from advisor.workload import Goals, Workload

    gpu, spec = resolve_gpu("H200"), resolve_model("Qwen/Qwen2.5-0.5B")
    data = synthetic(vocab_size=spec.vocab_size, rows=64, seed=0, median=512, max_len=1024)
    wl = Workload(model=spec, gpu=gpu, dataset=data, goals=Goals())
    base = {"max_length": 1024, "per_device_train_batch_size": 4, "precision": "bf16", "optim": "adamw_torch",
            "attn_implementation": "sdpa"}
    lora = simulate(wl, Candidate(**base, use_lora=True, weights_dtype="bfloat16"), gpu)
    full = simulate(wl, Candidate(**base), gpu)
    assert lora.peak_bytes == pytest.approx(1_762_590_208, rel=0.03)
    assert full.peak_bytes == pytest.approx(9_949_676_544, rel=0.01)


@pytest.mark.parametrize("forced", [False, True], ids=["this-torch", "workaround-forced"])
def test_fake_addmm_out_dtype_on_every_declared_torch(forced):
    """TRL's CUDA accumulation `addmm(acc, a, b, out_dtype=float32, out=acc)` runs on fake tensors under
    `fake_out_dtype_matmuls`: on torch 2.11 its own fake kernel binds out_dtype to beta and fails (every CUDA
    candidate of the front door failed with the CUDA build of 2.11); the stand-in answers as torch 2.13+ does.
    `forced` runs the stand-in on this torch too (the CPU wheel answers the op itself)."""
    from advisor.simulator import fake_out_dtype_matmuls

    with fake_out_dtype_matmuls(stand_in=True if forced else None), FakeTensorMode(), _Allocations() as seen:
        acc = torch.empty(300, 64)
        a, b = torch.empty(300, 1024, dtype=torch.bfloat16), torch.empty(1024, 64, dtype=torch.bfloat16)
        before = len(seen.made)
        into = torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        assert into is acc and len(seen.made) == before  # in place: nothing allocated
        new = torch.addmm(acc, a, b, out_dtype=torch.float32)
        assert new.shape == (300, 64) and new.dtype == torch.float32 and new is not acc
        assert seen.made[-1] == ("addmm.dtype", torch.float32, (300, 64))
    assert "aten.addmm.dtype_out" in seen.ops and "aten.addmm.dtype" in seen.ops  # dispatched by name, as always
    from torch._decomp import decomposition_table

    assert torch.ops.aten.addmm.dtype_out in decomposition_table  # restored on exit
