"""length_report and max_length_candidates against TRL's own preparation, packing and transformers' sampler."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from advisor.data import TokenizedDataset, load_dataset, synthetic
from advisor.errors import UsageError
from advisor.lengths import histogram_text, length_report, max_length_candidates, plot_lengths

ASSETS = Path(__file__).parent / "assets" / "data"


def _rows(lengths, prompt=0):
    return TokenizedDataset(
        name="t", source="local", completion_only_loss=prompt > 0,
        rows=tuple({"input_ids": [5] * n, "completion_mask": [0] * min(prompt, n) + [1] * max(0, n - prompt)}
                   for n in lengths),
    )


def _trainer(spec, data_path, tokenizer_dir, **config):
    """A real SFTTrainer on the raw file, loaded by `datasets` as `trl sft` would."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_config(spec.hf_config())
    args = SFTConfig(output_dir="/tmp/advisor-test-sft", use_cpu=True, report_to="none", **config)
    train = datasets.load_dataset("json", data_files=str(data_path), split="train")
    return SFTTrainer(model=model, args=args, train_dataset=train,
                      processing_class=AutoTokenizer.from_pretrained(tokenizer_dir))


@pytest.mark.slow
def test_matches_sfttrainer_prepared_and_packed_dataset(tiny_model, tiny_tokenizer):
    path = ASSETS / "chat.jsonl"
    report = length_report(load_dataset(str(path), tiny_model, tokenizer=str(tiny_tokenizer)), max_lengths=[128])
    trainer = _trainer(tiny_model, path, tiny_tokenizer, max_length=None)
    lengths = np.array([len(x) for x in trainer.train_dataset["input_ids"]])
    trained = sum(int((np.array(x) != -100).sum()) for x in trainer.train_dataset["labels"])
    assert report.count == len(lengths)
    expected = {f"p{q}": int(np.percentile(lengths, q, method="inverted_cdf")) for q in (50, 90, 95, 99)}
    assert report.to_dict()["percentiles"] == {**expected, "max": int(lengths.max())}
    assert report.trained_tokens == trained
    (stats,) = report.max_lengths
    for strategy in ("bfd", "bfd_split", "wrapped"):
        config = {"max_length": 128, "packing": True, "packing_strategy": strategy}
        packed = _trainer(tiny_model, path, tiny_tokenizer, **config).train_dataset
        tokens = sum(len(x) for x in packed["input_ids"])
        got = stats.to_dict()["packing"][strategy]
        assert got["rows"] == len(packed)
        assert got["fill_rate"] == pytest.approx(tokens / (len(packed) * 128), abs=1e-12)


def test_truncation_counts_trained_tokens_and_dropped_rows():
    # rows of 10, 20, 40 tokens; the first 8 tokens are prompt (not trained)
    data = _rows([10, 20, 40], prompt=8)
    (stats,) = length_report(data, max_lengths=[8], micro_batches=(1,)).max_lengths
    assert stats.tokens_lost == data.total_trained == 2 + 12 + 32
    assert stats.rows_dropped == 3 and stats.rows_truncated == 3
    (stats,) = length_report(data, max_lengths=[16], micro_batches=(1,)).max_lengths
    assert stats.tokens_lost == (12 - 8) + (32 - 8) and stats.rows_dropped == 0
    assert stats.tokens_lost_fraction == pytest.approx(28 / 46)


def test_random_padding_is_the_exact_expectation():
    import itertools

    lengths = [3, 5, 8, 13]
    data = _rows(lengths)
    (stats,) = length_report(data, max_lengths=[100], micro_batches=(1, 2, 4)).max_lengths
    by_batch = {p.micro_batch: p for p in stats.padding}
    pairs = list(itertools.combinations(lengths, 2))
    expected_max = sum(max(p) for p in pairs) / len(pairs)
    assert by_batch[2].random == pytest.approx(1 - sum(lengths) / (4 * expected_max))
    assert by_batch[4].random == pytest.approx(1 - sum(lengths) / (4 * 13))
    assert by_batch[1].random == 0.0 and by_batch[1].group_by_length == 0.0


def test_grouped_padding_follows_transformers_sampler():
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    data = synthetic(vocab_size=1024, rows=64, seed=1, median=64, max_len=256)
    (stats,) = length_report(data, max_lengths=[512], micro_batches=(4,)).max_lengths
    sampler = LengthGroupedSampler(4, lengths=data.lengths.tolist(), generator=torch.Generator().manual_seed(42))
    order = data.lengths[list(sampler)]
    padded = sum(4 * int(order[i:i + 4].max()) for i in range(0, 64, 4))
    assert stats.padding[0].group_by_length == pytest.approx(1 - order.sum() / padded)
    assert stats.padding[0].group_by_length < stats.padding[0].random


def test_max_length_candidates_keep_the_allowed_share():
    data = synthetic(vocab_size=1024, rows=200, seed=0, median=100, max_len=1000)
    for share in (0.0, 0.01, 0.1):
        cands = max_length_candidates(data, share, multiple=64)
        assert cands == sorted(cands) and all(c % 64 == 0 for c in cands)
        assert data.truncated_fraction(cands[0]) <= share
        assert cands[0] == 64 or data.truncated_fraction(cands[0] - 64) > share
        assert cands[-1] >= int(data.lengths.max())
    assert max_length_candidates(data, 0.0)[0] == -(-int(data.lengths.max()) // 64) * 64
    with pytest.raises(UsageError, match="--max-truncation 2"):
        max_length_candidates(data, 2)


def test_sampled_report_has_a_sampling_error(tiny_model, tiny_tokenizer):
    data = load_dataset(str(ASSETS / "chat.jsonl"), tiny_model, tokenizer=str(tiny_tokenizer), sample=20, seed=1)
    report = length_report(data, max_lengths=[64], micro_batches=(2,))
    err = report.to_dict()["sampling_error"]
    assert err["rows"] == 20 and err["population"] == 40
    p50 = err["percentiles"]["p50"]
    assert p50["low"] <= report.percentiles.p50 <= p50["high"]
    assert length_report(synthetic(1024, rows=32), max_lengths=[64]).sampling is None


def test_histogram_and_plot(tmp_path):
    report = length_report(_rows([10, 20, 40, 41, 90]), max_lengths=[64], micro_batches=(1,))
    text = histogram_text(report, max_length=64)
    counts = [int(re.search(r"\| #* *(\d+)", line).group(1)) for line in text.splitlines()]
    assert sum(counts) == 5 and counts == list(report.histogram_counts)
    assert text.count("<- max_length 64") == 1
    pytest.importorskip("matplotlib")
    out = plot_lengths(report, tmp_path / "h.png", max_length=64)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
