"""bitsandbytes' storage sizes live in advisor/_bnb.py; the estimate and the simulator both take them from there."""

from __future__ import annotations

import pytest

from advisor._bnb import bits_per_weight, weight_bytes
from advisor.estimator import architecture, memory_parts
from advisor.space import Candidate, RunBase


def test_storage_formulas():
    # nf4: 4-bit codes + a float32 absmax per 64 weights; nested: uint8 absmax + a float32 per 256 blocks
    assert bits_per_weight(4096, 4096, "4bit") == 4.5
    assert bits_per_weight(4096, 4096, "4bit", double_quant=True) == pytest.approx(4 + 8 / 64 + 32 / (64 * 256))
    # int8: int8 codes + a float32 scale per output row
    assert weight_bytes(14336, 4096, "8bit") == 14336 * 4096 + 4096 * 4
    with pytest.raises(ValueError, match="quantization='none'"):
        weight_bytes(8, 8, "none")


def test_estimate_and_simulate_share_the_nested_quantization(tiny_workload, h100_target):
    import dataclasses

    from advisor.simulator import simulate

    wl = dataclasses.replace(tiny_workload, gpu=h100_target)
    qlora = Candidate(max_length=128, per_device_train_batch_size=2, use_lora=True, quantization="4bit",
                      weights_dtype="bfloat16", lora_target_modules=("q_proj", "v_proj"))
    nested = qlora.replace(base=RunBase.of({"use_bnb_nested_quant": True}))
    arch = architecture(wl.model)
    saved = arch.layers * sum(weight_bytes(i, o, "4bit") - weight_bytes(i, o, "4bit", double_quant=True)
                              for _, i, o in arch.linears)
    assert saved > 0
    assert memory_parts(wl, qlora).parameters - memory_parts(wl, nested).parameters == pytest.approx(saved, abs=2)
    plain, double = simulate(wl, qlora), simulate(wl, nested)
    assert plain.breakdown["parameters"] - double.breakdown["parameters"] == pytest.approx(saved, abs=2)
