"""FlashAttention on the fake run: transformers' flash path with aten's flash meta kernels (advisor/simulator/flash.py).

What the real kernel path does is read from transformers 5 (integrations/flash_attention.py,
modeling_flash_attention_utils.py) and flash-attn 2 (flash_attn_interface.py, csrc/flash_attn/flash_api.cpp); these
tests check that the fake run follows it: which tensors exist, the FLOPs per sequence, and the peak against runs
whose answer is known.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from advisor.space import Candidate
from advisor.workload import Goals, ModelSpec, Workload

FLASH = "kernels-community/flash-attn2"
LENGTHS = (240, 180, 130, 90, 60, 40)  # distinct, so every sequence is identifiable in cu_seqlens
BASE = dict(per_device_train_batch_size=4, precision="bf16", optim="adamw_torch", activation_checkpointing=False)


def _data(lengths=LENGTHS, seed=0):
    from advisor.data import TokenizedDataset

    rng = np.random.default_rng(seed)
    rows = tuple({"input_ids": rng.integers(10, 1024, size=n).tolist()} for n in lengths)
    return TokenizedDataset(name="fixed-lengths", source="local", rows=rows, completion_only_loss=False)


@pytest.fixture
def workload(tiny_model, h100_target):
    return Workload(model=tiny_model, gpu=h100_target, dataset=_data(), goals=Goals())


class _Recorder:
    """Every op of the fake run (the tracker's on_op hook, through the step-time model): outputs, args, FLOPs."""

    def __init__(self):
        self.ops: list[tuple[str, list[tuple[int, ...]], tuple]] = []
        self.flops: collections.Counter[str] = collections.Counter()


@pytest.fixture
def recorder(monkeypatch):
    import torch
    from torch import Tensor
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import flop_registry

    import advisor.simulator as timing

    def tensors_in(tree):  # the op's output tensors in pytree order
        return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]

    rec = _Recorder()
    original = timing.TimingHook.__call__

    def spy(self, func, args, kwargs, out):
        name = str(func)
        rec.ops.append((name, [tuple(t.shape) for t in tensors_in(out)], args))
        if func._overloadpacket in flop_registry:
            # torch's formulas take no out_dtype (addmm.dtype_out: the fused LM head's fp32 accumulation on CUDA)
            shapes = [a for a in args if not isinstance(a, torch.dtype)]
            given = {k: v for k, v in kwargs.items() if k != "out"}
            rec.flops[name] += flop_registry[func._overloadpacket](*shapes, **given, out_val=out)
        return original(self, func, args, kwargs, out)

    monkeypatch.setattr(timing.TimingHook, "__call__", spy)
    return rec


def _simulate(workload, target, **knobs):
    from advisor.simulator import simulate

    return simulate(workload, Candidate(**{**BASE, **knobs}), target)


def _cu_lengths(rec, op="advisor._flash_attn_varlen_forward.default"):
    out = []
    for name, _, args in rec.ops:
        if name == op:
            bounds = [int(x) for x in args[3].tolist()]  # the real cu_seqlens_q the kernel got
            out.append(tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False)))
    return out


def _square_tensors(rec, t):
    """Outputs with two dimensions of the flattened row's length T: a (.., T, T) mask or score matrix."""
    return [(name, s) for name, shapes, _ in rec.ops for s in shapes if list(s).count(t) >= 2]


@pytest.mark.parametrize("knobs", [
    dict(padding_free=True, max_length=None),
    dict(packing=True, max_length=256),
], ids=["padding_free", "packing_bfd"])
def test_padding_free_flash_has_no_row_squared_tensor(workload, h100_target, recorder, knobs):
    m = _simulate(workload, h100_target, attn_implementation=FLASH, **knobs)
    assert m.status.value == "ok" and any("FlashAttention" in n for n in m.notes)
    lengths = _cu_lengths(recorder)
    layers, steps = workload.model.num_layers, 2
    assert len(lengths) == layers * steps, "every attention call took the varlen kernel"
    t = sum(lengths[0])
    assert len(lengths[0]) > 1 and all(n in LENGTHS for n in lengths[0]), "one flattened row of whole sequences"
    assert not _square_tensors(recorder, t)
    assert not [n for n, _, _ in recorder.ops if "scaled_dot_product" in n]
    # the same batch with sdpa does build the T x T block-diagonal mask: the check above can fail
    recorder.ops.clear()
    _simulate(workload, h100_target, attn_implementation="sdpa", **knobs)
    assert _square_tensors(recorder, t)


def test_padding_free_cu_seqlens_and_flops_per_sequence(workload, h100_target, recorder):
    """Attention FLOPs are the per-sequence causal terms of the batch's cu_seqlens.

    Checked formula, per layer and step, for a sequence of s tokens, H query heads, head dim D:
      forward  2·H·D·s(s+1)   = torch.utils.flop_counter.sdpa_flop_count (4·H·s²·D: QK^T and PV) x (s+1)/(2s)
      backward 5·H·D·s(s+1)   = sdpa_backward_flop_count (10·H·s²·D: five matmuls) x (s+1)/(2s)
    flop_counter applies those formulas per sequence to aten's varlen flash ops and counts the full square; a causal
    kernel computes the s(s+1)/2 pairs at or below the diagonal.
    """
    _simulate(workload, h100_target, attn_implementation=FLASH, padding_free=True, max_length=None)
    lengths = _cu_lengths(recorder)
    # the 4 longest rows, longest first (worst batch), one flattened row: TRL's cu_seq_lens_q
    assert set(lengths) == {(240, 180, 130, 90)}
    cfg = workload.model.config
    h, d = cfg["num_attention_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    calls = workload.model.num_layers * 2
    expected_fwd = calls * sum(2 * h * d * s * (s + 1) for s in (240, 180, 130, 90))
    expected_bwd = calls * sum(5 * h * d * s * (s + 1) for s in (240, 180, 130, 90))
    assert recorder.flops["advisor._flash_attn_varlen_forward.default"] == expected_fwd
    assert recorder.flops["advisor._flash_attn_varlen_backward.default"] == expected_bwd
    whole_row = calls * 2 * h * d * 640 * 641  # what one causal sequence of the whole row would cost
    assert expected_fwd < 0.4 * whole_row


def test_selective_checkpointing_saves_the_flash_kernel_as_trl_saves_the_real_one(workload, h100_target, recorder):
    """TRL's SAC policy keeps ops whose name contains "flash_attn" (the real kernel's custom ops): their forward is not
    recomputed, where full checkpointing recomputes it."""
    calls = {}
    for selective in (False, True):
        recorder.ops.clear()
        _simulate(workload, h100_target, attn_implementation=FLASH, padding_free=True, max_length=None,
                  activation_checkpointing=True, checkpoint_selective=selective)
        calls[selective] = [n for n, _, _ in recorder.ops].count("advisor._flash_attn_varlen_forward.default")
    forward_passes = workload.model.num_layers * 2
    assert calls == {False: 2 * forward_passes, True: forward_passes}


@pytest.mark.parametrize("causal, left, right", [(True, -1, -1), (True, 5, -1), (False, -1, -1), (False, 3, 2)])
def test_attention_flops_count_the_pairs_the_mask_keeps(causal, left, right):
    from torch.utils.flop_counter import sdpa_flop_count

    from advisor.simulator import attention_flops

    def kept(s):  # brute force: key j for query i within the window (causal: right window 0)
        r = 0 if causal else right
        return sum(1 for i in range(s) for j in range(s) if (left < 0 or j >= i - left) and (r < 0 or j <= i + r))

    lengths = (1, 7, 30)
    got = attention_flops(lengths, 4, 2, 16, 16, causal=causal, backward=False, window_left=left, window_right=right)
    assert got == sum(sdpa_flop_count((1, 4, s, 16), (1, 2, s, 16), (1, 2, s, 16)) * kept(s) // (s * s)
                      for s in lengths)
    assert got == sum(4 * 4 * 16 * kept(s) for s in lengths)


def _varlen_allowance(cfg, n, t):
    """What a varlen run of n sequences over t tokens may add to the same rows run dense, unpadded: cu_seqlens_q/k,
    seq_idx int32 (1, t) and position_ids int64 (1, t) in the batch (its attention_mask goes), and the backward
    workspace's 128 rows of slack per sequence (flash_api.cpp mha_varlen_bwd: softmax_d (H, T + 128 n) and dq_accum
    (T + 128 n, H, round32(D)) in fp32, where mha_bwd has (B, H, round128(S)) and (B, round128(S), H, round32(D)))."""
    h, d = cfg["num_attention_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    block = 512  # the CUDA allocator's smallest block
    workspace = 128 * n * h * 4 + 128 * n * h * (-(-d // 32) * 32) * 4
    return workspace + 2 * block + 4 * t + 8 * t


def test_padding_free_peak_at_most_the_rows_unpadded_plus_varlen_buffers(tiny_model, h100_target):
    """Four sequences of 512: padding-free (1 x 2048, varlen) against the same four as a 4 x 512 batch without
    padding (dense kernel): no higher than that plus the varlen buffers. sdpa on the same two batches is the control
    that the comparison can fail: its padding-free row gets a (1, 1, 2048, 2048) block-diagonal mask."""
    wl = Workload(model=tiny_model, gpu=h100_target, dataset=_data((512,) * 4), goals=Goals())
    allowance = _varlen_allowance(tiny_model.config, 4, 2048)
    peaks = {}
    for attn in (FLASH, "sdpa"):
        rows = _simulate(wl, h100_target, attn_implementation=attn, max_length=512)
        free = _simulate(wl, h100_target, attn_implementation=attn, padding_free=True, max_length=None)
        assert rows.peak_batch.startswith("4 x 512") and free.peak_batch.startswith("1 x 2048")
        peaks[attn] = rows.peak_bytes, free.peak_bytes
    rows, free = peaks[FLASH]
    assert rows * 0.95 <= free <= rows + allowance  # the same tokens through the same model
    sdpa_rows, sdpa_free = peaks["sdpa"]
    assert sdpa_free > sdpa_rows + allowance


def test_padded_flash_runs_between_padding_free_and_sdpa(workload, h100_target, recorder):
    """Padded rows (4 x 240, 640 real tokens): flash unpads q/k/v to the 640 tokens, runs varlen, pads back.

    Compared: its peak is at least the padding-free run of the same four sequences (1 x 640: the padded batch carries
    960 positions through every layer, plus the unpad copies) and at most sdpa on the same padded batch (which
    adds the (B, 1, S, S) mask and its CPU-path kernel's saved tensors)."""
    padded = _simulate(workload, h100_target, attn_implementation=FLASH, max_length=256)
    assert padded.peak_batch.startswith("4 x 240 (padded")
    assert set(_cu_lengths(recorder)) == {(240, 180, 130, 90)}, "unpadded by the attention mask's row sums"
    unpad_copies = [s for name, shapes, _ in recorder.ops if name == "aten.index.Tensor" for s in shapes]
    assert (640, 4, 16) in unpad_copies and (640, 2, 16) in unpad_copies  # q, then k and v (GQA: 2 KV heads)
    free = _simulate(workload, h100_target, attn_implementation=FLASH, padding_free=True, max_length=None)
    sdpa = _simulate(workload, h100_target, attn_implementation="sdpa", max_length=256)
    assert free.peak_bytes <= padded.peak_bytes <= sdpa.peak_bytes


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_gqa_backward_expands_dk_dv_only_with_fewer_kv_heads(tiny_model, h100_target, recorder, kv_heads):
    spec = ModelSpec(name=f"tiny-kv{kv_heads}", config={**tiny_model.config, "num_key_value_heads": kv_heads},
                     source="local")
    wl = Workload(model=spec, gpu=h100_target, dataset=_data(), goals=Goals())
    m = _simulate(wl, h100_target, attn_implementation=FLASH, padding_free=True, max_length=None)
    assert m.status.value == "ok"
    fwd = [(args[0].shape, args[1].shape) for name, _, args in recorder.ops
           if name == "advisor._flash_attn_varlen_forward.default"]
    assert fwd and all(q == (640, 4, 16) and k == (640, kv_heads, 16) for q, k in fwd), "K/V not repeated"
    bwd = [shapes for name, shapes, _ in recorder.ops if name == "advisor._flash_attn_varlen_backward.default"]
    expanded = [(640, 4, 16), (640, 4, 16)] if kv_heads < 4 else []
    # dq, dk, dv, softmax_d (H, T + 128 n), dq_accum (T + 128 n, H, 32) and, under GQA, dK/dV for every query head
    assert all(s == [(640, 4, 16), (640, kv_heads, 16), (640, kv_heads, 16), (4, 640 + 512), (640 + 512, 4, 32),
                     *expanded] for s in bwd)


def test_every_flash_name_routes_to_the_stand_in_and_is_restored():
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from advisor.simulator import fake_flash_attention, flash_attention_names

    names = flash_attention_names()
    for name in (FLASH, "flash_attention_2", "flash_attention_3", "kernels-community/flash-attn3",
                 "kernels-community/vllm-flash-attn3"):
        assert name in names
    assert "sdpa" not in names and "eager" not in names
    with fake_flash_attention(lambda: None):
        # one stand-in, the simulator's own (advisor/simulator/flash.py), for every name
        stand_in = ALL_ATTENTION_FUNCTIONS.get_interface(names[0], None)
        assert stand_in is not flash_attention_forward and stand_in.__module__ == "advisor.simulator.flash"
        for name in names:
            assert ALL_ATTENTION_FUNCTIONS.get_interface(name, None) is stand_in
            assert name in ALL_MASK_ATTENTION_FUNCTIONS
        assert ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None) is not stand_in
    assert ALL_ATTENTION_FUNCTIONS["flash_attention_2"] is flash_attention_forward
    assert FLASH not in ALL_ATTENTION_FUNCTIONS and FLASH not in ALL_MASK_ATTENTION_FUNCTIONS


@pytest.mark.parametrize("name", ["flash_attention_2", "flash_attention_3", "kernels-community/vllm-flash-attn3"])
def test_other_flash_names_run_the_same_path(tiny_model, name):
    """A model named with any FlashAttention implementation runs forward and backward on fake tensors, offline."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from advisor.modeling import build_model
    from advisor.simulator import batch_facts, fake_flash_attention
    from advisor.simulator import materialise as _materialise

    model = build_model(tiny_model, Candidate(weights_dtype="bfloat16"), device="meta")
    model.config._attn_implementation = name
    batch = {"input_ids": torch.arange(10, 110)[None], "labels": torch.arange(10, 110)[None],
             "position_ids": torch.cat([torch.arange(60), torch.arange(40)])[None]}
    facts = batch_facts(batch)
    assert facts.seq_lengths == (60, 40) and facts.packed
    seen = []
    with fake_flash_attention(lambda: facts), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        _materialise(model)
        fake = {k: mode.from_tensor(v) for k, v in batch.items()}
        with _Seen(seen):
            model(**fake).loss.backward()
    assert seen.count("advisor._flash_attn_varlen_forward.default") == tiny_model.config["num_hidden_layers"]
    assert seen.count("advisor._flash_attn_varlen_backward.default") == tiny_model.config["num_hidden_layers"]


def _Seen(seen):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    return Seen()


def test_fp32_attention_inputs_are_refused_by_name(tiny_model, h100_target):
    from advisor.errors import ConfigError

    wl = Workload(model=tiny_model, gpu=h100_target, dataset=_data(), goals=Goals())
    with pytest.raises(ConfigError, match="FlashAttention only support fp16 and bf16"):
        _simulate(wl, h100_target, attn_implementation=FLASH, precision="fp32", padding_free=True, max_length=None)


# ---- the front door: padding-free batches take FlashAttention where the GPU has it ----------------------------
_NARROW = {"optim": "adamw_torch", "activation_checkpointing": "false", "activation_offloading": "false",
           "group_by_length": "false", "weights_dtype": "float32"}


def _favour_padding_free_sdpa(w, c):
    """A fake backend under which a padding-free batch with sdpa would win every time it is admitted."""
    from advisor.measurement import Measurement
    from advisor.space import Attention

    tps = 1000.0 * c.per_device_train_batch_size ** 0.5
    if c.effective_padding_free and c.attn_implementation is not Attention.FLASH_ATTENTION_2:
        tps *= 10
    return Measurement("ok", "probe-cpu", peak_bytes=10**8, reserved_bytes=10**8, device_bytes=10**8,
                       tokens_per_second=tps)


@pytest.mark.parametrize("gpu, fix, sdpa_padding_free", [
    ("H100-80GB", {}, False),
    ("H100-80GB", {"attn_implementation": "sdpa"}, True),
    ("T4", {}, True),
], ids=["fa_gpu", "fa_gpu_pinned_sdpa", "gpu_without_fa"])
def test_front_door_never_pairs_padding_free_with_sdpa_on_fa_gpus(tiny_model, monkeypatch, tmp_path, gpu, fix,
                                                                  sdpa_padding_free):
    from advisor import search
    from advisor.profiles import resolve_gpu
    from advisor.search import RowTokens
    from advisor.space import Attention

    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path / "cache"))
    target = resolve_gpu(gpu)
    wl = Workload(model=tiny_model, gpu=target, dataset=_data(), goals=Goals(tokens_per_step=2048))
    space = search.StudySpace(wl, search.build_space(wl, fix={**_NARROW, **fix}), 2048, RowTokens(wl.dataset))
    cands = list(space.candidates())
    pf = [c for c in cands if c.effective_padding_free]
    assert pf and cands
    assert any(c.attn_implementation is not Attention.FLASH_ATTENTION_2 for c in pf) is sdpa_padding_free
    assert any(c.attn_implementation is not Attention.FLASH_ATTENTION_2 for c in cands if not c.effective_padding_free)
    if sdpa_padding_free:
        return
    search.register_backend("favour-pf-sdpa", _favour_padding_free_sdpa)
    try:
        s = search.suggest(wl, backend="favour-pf-sdpa", cache=False, trials=30, fix=_NARROW)
    finally:
        search.unregister_backend("favour-pf-sdpa")
    seen = [s.candidate, *(t.candidate for t in s.trials)]
    assert any(c.effective_padding_free for c in seen)
    flash = Attention.FLASH_ATTENTION_2
    assert not [c for c in seen if c.effective_padding_free and c.attn_implementation is not flash]
