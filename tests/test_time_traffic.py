"""The timing hook prices device traffic only (issue 24): a collective moves nothing through the memory-bound term,
a buffer an op only allocates is no traffic, a copy costs its real bytes. The FSDP2 re-gather of a tiny model, on
the fake process group, against the sizes of what it copies (the FSDP2 parameter groups' own shard sizes)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from advisor.space import Candidate

HERE = os.path.dirname(os.path.abspath(__file__))


def _hook(gpu: str = "H100-80GB"):
    from advisor._sim.timing import BatchLayout, TimingHook
    from advisor.profiles import resolve_gpu

    hook = TimingHook(resolve_gpu(gpu), BatchLayout(2, 64, (64, 64), 126, False), "sdpa")
    hook.begin_micro(True)
    return hook


def test_a_collective_adds_no_memory_bound_time():
    """c10d's all-gather and reduce-scatter (here the fake backend's ops, called as FSDP2 calls them) are priced by
    the communication model only; the same bytes through a device copy are memory-bound time (the check can fail)."""
    import torch

    from advisor._sim.timing import _TERMS, Term

    mem = _TERMS.index(Term.MEMORY)
    out, inp = torch.empty(1 << 20, dtype=torch.bfloat16), torch.empty(1 << 19, dtype=torch.bfloat16)
    for op, args, result in (
        (torch.ops.c10d._allgather_base_.default, (out, inp, None, False, -1), (out, None)),
        (torch.ops.c10d._reduce_scatter_base_.default, (inp, out, None, None, False, -1), (inp, None)),
    ):
        hook = _hook()
        hook(op, args, {}, result)
        assert hook.device.sum() == 0.0 and not hook.memory_bytes, (op, hook.device, hook.memory_bytes)
        assert hook.launches == 1  # its launch is host time
    hook = _hook()
    hook(torch.ops.aten.copy_.default, (out[: inp.numel()], inp), {}, out[: inp.numel()])
    assert hook.device[mem].sum() > 0
    # a copy reads its source and writes its destination (not read): 2 x 1 MiB
    assert hook.memory_bytes == {"aten::copy_": 2.0 * inp.numel() * 2}


def _regather_run(reshard: bool, monkeypatch):
    """One rank of 2 (FSDP2, bf16 mixed precision) on the fake process group: the recording hook's bytes by op, per
    micro-step, and the FSDP2 parameter groups that reshard after forward (gathered again in the backward)."""
    import dataclasses

    from advisor._sim.timing import hook as hook_module
    from advisor.parallelism import Parallelism, simulate_per_rank
    from advisor.profiles import resolve_gpu

    sys.path.insert(0, HERE)
    from multigpu_worker import workload

    hooks: list = []
    init = hook_module.TimingHook.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        hooks.append(self)

    monkeypatch.setattr(hook_module.TimingHook, "__init__", recording_init)
    groups: list = []
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    unshard = FSDPParamGroup.unshard

    def remembering_unshard(self, *args, **kwargs):
        if self not in groups:
            groups.append(self)
        return unshard(self, *args, **kwargs)

    monkeypatch.setattr(FSDPParamGroup, "unshard", remembering_unshard)
    wl = dataclasses.replace(workload(), gpu=resolve_gpu("H100-80GB"))
    cand = Candidate(max_length=128, per_device_train_batch_size=2, precision="bf16", optim="adamw_torch",
                     activation_checkpointing=False)
    simulate_per_rank(wl, cand, 2, Parallelism(reshard_after_forward=reshard), gpu="H100-80GB")
    hook = next(h for h in hooks if h.micro_steps)
    return {k: v / hook.micro_steps for k, v in hook.memory_bytes.items()}, groups


def test_fsdp2_regather_costs_its_copies_not_its_buffers_nor_the_collective(monkeypatch):
    """Resharding after forward gathers every non-root unit again in the backward: the memory-bound bytes grow by
    exactly that re-gather's copies: the copy-in (the float32 shard cast to bf16 into the flat input, then copied into
    its slice of the all-gather buffer) and the copy-out (the all-gather buffer read, the unsharded parameters
    written). Not by the all-gather buffer the copy-in is handed (allocated, not written), not by the collective."""
    with monkeypatch.context() as m:
        resharded, groups = _regather_run(True, m)
    with monkeypatch.context() as m:
        kept, _ = _regather_run(False, m)
    regathered = [g for g in groups if g.post_forward_mesh_info is not None]
    assert regathered, "no FSDP2 unit resharded after forward"
    world = 2
    copy_in = copy_out = 0
    for g in regathered:
        shard = sum(p.sharded_size.numel() for p in g.fsdp_params)
        padded = sum(p.padded_sharded_param_size.numel() for p in g.fsdp_params)
        full = sum(int(np.prod(p._orig_size)) for p in g.fsdp_params)
        low = 2  # bf16 compute dtype (MixedPrecisionPolicy); the sharded parameters are float32
        copy_in += shard * (4 + low)  # _foreach_copy_: fp32 shard read, bf16 flat input written
        copy_in += 2 * padded * low  # all_gather_copy_in: the flat input read, its slice of the buffer written
        copy_out += world * padded * low + full * low  # split_with_sizes_copy: buffer read, parameters written
    diff = {k: resharded.get(k, 0.0) - kept.get(k, 0.0) for k in set(resharded) | set(kept)}
    diff = {k: v for k, v in diff.items() if v}
    total = sum(diff.values())
    detail = (f"memory-bound bytes a micro-step, resharded - kept, by op: {diff}; expected copy-in {copy_in} B + "
              f"copy-out {copy_out} B over {len(regathered)} re-gathered units")
    assert total == pytest.approx(copy_in + copy_out, rel=1e-9), detail
    assert not any(k.startswith("c10d::") for k in resharded), resharded
    assert diff.get("fsdp::split_with_sizes_copy") == pytest.approx(copy_out, rel=1e-9), detail
