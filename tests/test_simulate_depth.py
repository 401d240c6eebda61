"""The full depth built layer by layer from two shallow fake runs is the full-depth fake run.

`simulate()` runs 2 and 3 decoder layers (2 and 2 + p where the layers repeat with period p), builds the full
depth's allocation stream from theirs (advisor/simulator/layers.py) and takes the peaks on it. These tests compare that
stream, event for event, and its peaks with a fake run of every layer, on cases where a straight line through the
two shallow peaks is wrong.
"""

from __future__ import annotations

import importlib

import pytest

from advisor.space import Candidate
from advisor.workload import Goals, ModelSpec, Workload

sim = importlib.import_module("advisor.simulator")

BASE = dict(max_length=128, per_device_train_batch_size=2, precision="fp32", optim="adamw_torch")

# A Llama with a wide vocabulary against its width: the peak is a later step's backward (the logits) at a few
# layers and the first step's optimizer step (gradients + new Adam state, 16 bytes a parameter against 12) from 9.
WIDE_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 1024,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 32768, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 0,
}
SWITCH = dict(max_length=128, per_device_train_batch_size=1, precision="fp32", optim="adamw_torch")
SWITCH_DEPTH = 12


def _workload(config: dict, layers: int, target, data) -> Workload:
    spec = ModelSpec(name=f"{config['model_type']}-{layers}", config={**config, "num_hidden_layers": layers},
                     source="local")
    return Workload(model=spec, gpu=target, dataset=data, goals=Goals())


def _pairs(events) -> list[int]:
    """For each free, the index of its allocation (-1 for an allocation)."""
    live: dict[int, int] = {}
    out = [-1] * len(events)
    for i, (key, delta) in enumerate(events):
        if delta > 0:
            live[key] = i
        else:
            out[i] = live.pop(key)
    return out


def _stream(run) -> tuple[list[int], list[int]]:
    return [d for _, d in run.stream.events], _pairs(run.stream.events)


def _built(wl: Workload, cand: Candidate, target, depth: int):
    depths, _ = sim.plan_depths(wl.model, (2, 3), cand)
    lo, hi = (sim.simulate_depth(wl, cand, target, n) for n in depths)
    return sim.synthesize_checked(lo.stream, hi.stream, depth)


@pytest.fixture
def wide_data():
    from advisor.data import synthetic

    return synthetic(vocab_size=32768, rows=64, seed=0, median=64, max_len=256)


def test_peak_moment_switch_is_exact(cpu_target, wide_data):
    """Where the peak's moment switches between the shallow runs and the full depth, the built stream is exact.

    How the switch depth was found: fake runs of every layer at 2..16 layers (`simulate_depth`), against the line
    through 2 and 3: exact up to 8 layers, -0.08% at 9, -0.88% at 10, -2.34% at 12, -4.77% at 16. At 12 layers the
    line is more than 2% low; the built stream gives the 12-layer run's peak to the byte."""
    cand = Candidate(**SWITCH)
    wl = {n: _workload(WIDE_LLAMA, n, cpu_target, wide_data) for n in (2, 3, SWITCH_DEPTH)}
    runs = {n: sim.simulate_depth(wl[n], cand, cpu_target, n) for n in wl}
    line = runs[2].peak_bytes + (SWITCH_DEPTH - 2) * (runs[3].peak_bytes - runs[2].peak_bytes)
    assert line < 0.98 * runs[SWITCH_DEPTH].peak_bytes  # the switch is real at this depth
    fast = sim.simulate(wl[SWITCH_DEPTH], cand, cpu_target)
    assert any("layer by layer" in n for n in fast.notes)
    assert fast.peak_bytes == runs[SWITCH_DEPTH].peak_bytes
    events, _ = _built(wl[SWITCH_DEPTH], cand, cpu_target, SWITCH_DEPTH)
    assert [d for _, d in events] == _stream(runs[SWITCH_DEPTH])[0]
    assert _pairs(events) == _stream(runs[SWITCH_DEPTH])[1]


STREAMS = {
    "ckpt": {},
    "no-ckpt": dict(activation_checkpointing=False),
    "selective": dict(checkpoint_selective=True),
    "every-2": dict(checkpoint_every_n_layers=2),
    "lora-bf16": dict(use_lora=True, precision="bf16", weights_dtype="bfloat16"),
    "bf16-accum2": dict(precision="bf16", gradient_accumulation_steps=2),
    "packing": dict(packing=True, packing_strategy="bfd"),
}


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_built_stream_is_the_full_depth_stream(name, tiny_model, cpu_target, tiny_data):
    """Event for event: the same sizes in the same order, each free of the same allocation (7 layers)."""
    cand = Candidate(**{**BASE, **STREAMS[name]})
    wl = _workload(tiny_model.config, 7 if name != "every-2" else 8, cpu_target, tiny_data)
    depth = wl.model.num_layers
    events, _ = _built(wl, cand, cpu_target, depth)
    full = sim.simulate_depth(wl, cand, cpu_target, depth)
    sizes, pairs = _stream(full)
    assert [d for _, d in events] == sizes
    assert _pairs(events) == pairs


@pytest.mark.parametrize("expandable", [False, True])
def test_cuda_peaks_equal_full_depth(expandable, tiny_model, h100_target, tiny_data):
    """Allocated, reserved and device bytes on the CUDA rules: extrapolated == full depth, to the byte."""
    cand = Candidate(**{**BASE, "precision": "bf16", "expandable_segments": expandable})
    wl = _workload(tiny_model.config, 7, h100_target, tiny_data)
    fast = sim.simulate(wl, cand, h100_target)
    full = sim.simulate(wl, cand, h100_target, layers=None)
    assert any("layer by layer" in n for n in fast.notes)
    assert (fast.peak_bytes, fast.reserved_bytes, fast.device_bytes) == (
        full.peak_bytes, full.reserved_bytes, full.device_bytes)
    assert fast.breakdown == full.breakdown


def test_depths_follow_the_period(tiny_model):
    """2 and 2 + p layers, p the period of layer_types and of checkpointing every n layers; the shallow depth keeps
    the full depth's remainder so the block repeats a whole number of times."""
    deep = ModelSpec(name="t24", config={**tiny_model.config, "num_hidden_layers": 24}, source="local")
    assert sim.plan_depths(deep, (2, 3), Candidate())[0] == [2, 3]
    assert sim.plan_depths(deep, (2, 3), Candidate(checkpoint_every_n_layers=3))[0] == [3, 6]
    assert sim.plan_depths(deep, (2, 3), Candidate(checkpoint_every_n_layers=4))[0] == [4, 8]
    odd = ModelSpec(name="t25", config={**tiny_model.config, "num_hidden_layers": 25}, source="local")
    assert sim.plan_depths(odd, (2, 3), Candidate(checkpoint_every_n_layers=2))[0] == [3, 5]
    assert sim.plan_depths(deep, None, Candidate())[0] == [24]
    short = ModelSpec(name="t4", config={**tiny_model.config, "num_hidden_layers": 4}, source="local")
    assert sim.plan_depths(short, (2, 3), Candidate(checkpoint_every_n_layers=2))[0] == [4]


def test_a_stream_that_does_not_split_is_refused():
    """Block events not between layer 0 and the tail, or a rebuilt shallow stream that differs: NotSeparable, so
    simulate() runs every layer instead of guessing."""
    from advisor.simulator import LayerStream, NotSeparable, synthesize, synthesize_checked

    # layer 1's work after the tail's: not a pass over the layers
    deep = LayerStream(layers=3, events=((1, 8), (2, 8), (3, 8)), event_layers=(0, 2, 1), categories=(None,) * 3)
    with pytest.raises(NotSeparable):
        synthesize(deep, 1, 6)
    ok = LayerStream(layers=3, events=((1, 8), (2, 8), (3, 8)), event_layers=(0, 1, 2), categories=(None,) * 3)
    assert [d for _, d in synthesize(ok, 1, 5)[0]] == [8] * 5
    with pytest.raises(NotSeparable):  # the 2-layer run has one event less than the rebuilt one
        synthesize_checked(LayerStream(layers=2, events=((1, 8),), event_layers=(0,), categories=(None,)), ok, 5)
    # outside the block a size may grow by the same bytes a block (gradient clipping's stacked norms): 4 bytes at
    # 2 layers, 8 at 3, so 16 at 5
    shallow = LayerStream(layers=2, events=((1, 8), (2, 4)), event_layers=(0, 1), categories=(None,) * 2)
    assert [d for _, d in synthesize_checked(shallow, ok, 5)[0]] == [8, 8, 8, 8, 16]
    shrinking = LayerStream(layers=2, events=((1, 8), (2, 16)), event_layers=(0, 1), categories=(None,) * 2)
    with pytest.raises(NotSeparable):  # 16 at 2 layers, 8 at 3: no bytes left at 5
        synthesize_checked(shrinking, ok, 5)
