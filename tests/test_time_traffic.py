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
    from advisor.profiles import resolve_gpu
    from advisor.simulator import BatchLayout, TimingHook

    hook = TimingHook(resolve_gpu(gpu), BatchLayout(2, 64, (64, 64), 126, False), "sdpa")
    hook.begin_micro(True)
    return hook


def test_a_collective_adds_no_memory_bound_time():
    """c10d's all-gather and reduce-scatter (here the fake backend's ops, called as FSDP2 calls them) are priced by
    the communication model only; the same bytes through a device copy are memory-bound time (the check can fail)."""
    import torch

    from advisor.physics import _TERMS, Term

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

    from advisor.parallelism import Parallelism
    from advisor.profiles import resolve_gpu
    from advisor.simulator import TimingHook, simulate_per_rank

    sys.path.insert(0, HERE)
    from multigpu_worker import workload

    hooks: list = []
    init = TimingHook.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        hooks.append(self)

    monkeypatch.setattr(TimingHook, "__init__", recording_init)
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


@pytest.fixture(scope="module")
def regather_runs():
    with pytest.MonkeyPatch.context() as m:
        resharded, groups = _regather_run(True, m)
    with pytest.MonkeyPatch.context() as m:
        kept, _ = _regather_run(False, m)
    return resharded, kept, groups


def test_fsdp2_regather_costs_its_copies_not_its_buffers_nor_the_collective(regather_runs):
    """Resharding after forward gathers every non-root unit again in the backward: the memory-bound bytes grow by
    exactly that re-gather's copies: the copy-in (the float32 shard cast to bf16 into the flat input, then copied into
    its slice of the all-gather buffer) and the copy-out (the all-gather buffer read, the unsharded parameters
    written). Not by the all-gather buffer the copy-in is handed (allocated, not written), not by the collective."""
    resharded, kept, groups = regather_runs
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


@pytest.mark.parametrize("reshard", [True, False])
def test_closed_form_of_fsdp2_copies_equals_the_fake_run(regather_runs, reshard):
    """The closed form both backends share for a layout's copies (ranks_closed.layout_traffic: every gather's copy-in
    and copy-out, the reduce-scatter's copy-in) equals what the fake run's FSDP2 copies move, byte for byte."""
    from advisor.parallelism import Parallelism
    from advisor.physics import layout_traffic

    sys.path.insert(0, HERE)
    from multigpu_worker import workload

    resharded, kept, _ = regather_runs
    run = resharded if reshard else kept
    copies = {k: v for k, v in run.items() if k.startswith("fsdp::") or k == "aten::_foreach_copy_"}
    cand = Candidate(max_length=128, per_device_train_batch_size=2, precision="bf16", optim="adamw_torch",
                     activation_checkpointing=False)
    closed = layout_traffic(workload(), cand, Parallelism(reshard_after_forward=reshard), 2)
    assert closed.per_micro_bytes == pytest.approx(sum(copies.values()), rel=1e-9), (closed, copies)
    assert closed.optimizer_fraction == 0.5


@pytest.mark.slow  # two single-GPU simulations of Qwen2.5-0.5B: about 60 s on an idle 2-core host
def test_zero3_regather_priced_alike_by_both_backends(monkeypatch):
    """ZeRO-3 gathers every parameter in the forward and again in the backward; ZeRO-2 keeps them: the memory-bound
    term of ZeRO-3 minus ZeRO-2's is the closed form's gathers (copy-in of the partition, copy-out of the buffer) over
    the bandwidth, in the simulation and in the estimate alike (both add ranks_closed.layout_traffic), and the device
    optimizer steps this rank's half in both."""
    import advisor.parallelism as par
    from advisor.estimator import estimate
    from advisor.inputs import build_workload
    from advisor.physics import layout_traffic, time_constants
    from advisor.simulator import simulate_per_rank

    monkeypatch.setattr(par, "deepspeed_available", lambda: True)
    wl = build_workload("Qwen/Qwen2.5-0.5B", gpu="H100-80GB", num_gpus=2)
    bw = time_constants(wl.gpu).mem_bw
    knobs = dict(max_length=256, per_device_train_batch_size=2, precision="bf16", optim="adamw_torch_fused")
    by = {}
    for layout in ("zero2", "zero3"):
        cand = Candidate(**knobs, parallelism=layout)
        lt = layout_traffic(wl, cand)
        sim = simulate_per_rank(wl, cand, parallelism=cand.parallelism.parallelism)
        est = estimate(wl, cand)
        by[layout] = (lt, sim.time_breakdown, est.time_breakdown)
    (l2, s2, e2), (l3, s3, e3) = by["zero2"], by["zero3"]
    expected = (l3.per_micro_bytes + l3.per_step_bytes - l2.per_micro_bytes - l2.per_step_bytes) / bw
    assert expected > 0
    detail = f"zero2 sim {s2} est {e2}; zero3 sim {s3} est {e3}; closed-form difference {expected:.6f} s"
    assert s3["memory_bound"] - s2["memory_bound"] == pytest.approx(expected, rel=1e-6), detail
    assert e3["memory_bound"] - e2["memory_bound"] == pytest.approx(expected, rel=1e-6), detail
    assert l3.optimizer_fraction == l2.optimizer_fraction == 0.5
