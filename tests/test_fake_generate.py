"""`model.generate` on fake tensors (advisor.simulator.simulate_generate, the piece online RL's simulated `train()`
runs): every sequence runs to `max_new_tokens`, and the tracked peak is the real CPU generate's, measured from the
allocator's own events (torch.profiler replayed by advisor.probing.meters.cpu_peak, as scripts/grpo_cpu_peak.py).

The real run forces the same length with `min_new_tokens == max_new_tokens` (transformers suppresses EOS until
then), so both decode exactly N tokens. Its model is the same tiny Qwen2 with random weights: the peak does not depend
on the weights' values. Peaks are the bytes generate held above what was live before it (the weights, the prompts).
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import TINY_QWEN2

N = 8  # new tokens: min_new_tokens = max_new_tokens


def _model(device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**TINY_QWEN2)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _prompts(batch: int, length: int, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(10, TINY_QWEN2["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:  # left padding, as TRL pads prompts: rows of different lengths
        for row in range(1, batch, 2):
            mask[row, : length // 3 + row] = 0
        ids[mask == 0] = TINY_QWEN2["pad_token_id"]
    return ids, mask


def _real_peak(ids: torch.Tensor, mask: torch.Tensor, new: int, **kwargs) -> tuple[tuple[int, ...], int]:
    from advisor.probing.meters import cpu_peak, memory_profiler

    torch.manual_seed(0)
    model = _model("cpu")
    gc.collect()
    prof = memory_profiler()
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **kwargs)
    finally:
        prof.__exit__(None, None, None)
    return tuple(out.shape), cpu_peak(prof).peak_bytes


# (batch, prompt tokens, left-padded, sampling): the peak is asserted exact
CASES = {
    # Four left-padded prompts, greedy: the prefill binds the peak (its activations outweigh the KV cache at 8 new
    # tokens).
    "prefill-bound-greedy-padded": (4, 24, True, False),
    # Two 4-token prompts, sampling (as GRPO generates): the decode binds (the real peak grows with the new tokens:
    # asserted below).
    "decode-bound-sampling": (2, 4, False, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fake_generate_runs_to_full_length_at_the_real_peak(case):
    from advisor.simulator import simulate_generate

    batch, length, padded, sample = CASES[case]
    ids, mask = _prompts(batch, length, padded)
    run = simulate_generate(_model("meta"), ids, mask, max_new_tokens=N, min_new_tokens=N, do_sample=sample)

    assert run.shape == (batch, length + N)
    # the ids TRL reads after generate: the real prompts, then N known tokens none of which ends a completion
    assert torch.equal(run.ids[:, :length], ids)
    assert not torch.isin(run.ids[:, length:], torch.tensor([TINY_QWEN2["eos_token_id"],
                                                             TINY_QWEN2["pad_token_id"]])).any()

    real_shape, real_peak = _real_peak(ids, mask, N, do_sample=sample)
    assert real_shape == run.shape
    assert run.peak_bytes == real_peak
    if case.startswith("decode"):
        _, prefill_peak = _real_peak(ids, mask, 1, do_sample=sample)
        assert real_peak > prefill_peak  # the decode steps, not the prefill, set this peak


def test_generate_is_restored_and_ids_must_be_known():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from advisor.simulator import DataShadow, IncompleteGeneration, filler_token, full_length_generate

    model = _model("meta")
    assert filler_token(model) == 3  # 0 pad, 1 BOS, 2 EOS are special
    shadow = DataShadow()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    unknown = mode.from_tensor(torch.ones(1, 4, dtype=torch.long))  # a fake prompt the shadow was never told
    with full_length_generate(model, shadow):
        assert "generate" in vars(model)
        with pytest.raises(IncompleteGeneration, match="known tensor"):
            model.generate(input_ids=unknown, max_new_tokens=2)
    assert "generate" not in vars(model)


def test_data_shadow_knows_data_never_weights_and_forgets_stale_values():
    """What DataShadow carries: real CPU tensors and value-defined factories (and floats computed from them only);
    never `empty*`, seeded random factories or meta-made tensors; a known tensor written with unknown values is
    forgotten, so a later `.item()` is not answered from stale values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from advisor.simulator import DataShadow

    shadow = DataShadow()
    with FakeTensorMode(allow_non_fake_inputs=True), shadow:
        rewards = torch.zeros(4, 2)
        rewards[:, 0] = torch.tensor([1.0, float("nan"), 2.0, 0.0])  # a real CPU tensor lifted into the mode
        assert bool(torch.isnan(rewards).all(dim=1).any()) is False  # computed on the values, not guessed
        assert bool(torch.isnan(rewards).any()) is True
        assert shadow.real(torch.arange(5).sum()).item() == 10
        assert shadow.real(torch.empty(3)) is None
        assert shadow.real(torch.randn(3)) is None
        weight = torch.empty_like(torch.empty(4, 4, device="meta"), device="cpu")  # how _materialise makes weights
        assert shadow.real(weight) is None and shadow.real(weight @ torch.ones(4)) is None
        counts = torch.zeros(4)
        assert shadow.real(counts) is not None
        counts.add_(weight[0])  # unknown values written into a known tensor
        assert shadow.real(counts) is None
