"""Prompt-only data for GRPO/RLOO: read as GRPOTrainer/RLOOTrainer read it, the synthetic prompt set, and the
errors for data they cannot take."""

from __future__ import annotations

import json

import numpy as np
import pytest

from advisor.data import SYNTHETIC_MEDIAN, synthetic_lengths
from advisor.errors import ConfigError, DatasetError
from advisor.trainers.prompts import (
    PROMPT_COLUMN,
    check_prompt_rows,
    load_prompts,
    synthetic_prompts,
    tokenize_prompts,
)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_synthetic_prompts_are_the_chat_sets_prompts():
    data = synthetic_prompts(vocab_size=1024, rows=256, seed=3)
    lengths, share = synthetic_lengths(np.random.default_rng(3), 256)
    assert data.lengths.tolist() == [max(1, int(n * s)) for n, s in zip(lengths, share, strict=True)]
    assert all(10 <= t < 1024 for row in data.rows for t in row)
    assert data.synthetic and data.notes
    assert 0.25 * SYNTHETIC_MEDIAN < np.median(data.lengths) < 0.6 * SYNTHETIC_MEDIAN
    again = synthetic_prompts(vocab_size=1024, rows=256, seed=3)
    assert again.rows == data.rows and again.fingerprint == data.fingerprint
    assert synthetic_prompts(vocab_size=1024, rows=256, seed=4).fingerprint != data.fingerprint


def test_longest_and_full_length_sequences():
    data = synthetic_prompts(vocab_size=1024, rows=64, seed=0)
    top = data.longest(8)
    assert len(top) == 8 and data.lengths[top[0]] == data.lengths.max()
    assert (np.diff(data.lengths[top]) <= 0).all()
    assert (data.sequence_lengths(128) == data.lengths + 128).all()


def test_to_hf_round_trips_through_the_placeholder_tokenizer(tiny_model):
    from advisor.modeling import placeholder_tokenizer

    data = synthetic_prompts(vocab_size=1024, rows=16, seed=0)
    hf = data.to_hf([3, 1])
    assert hf.column_names == [PROMPT_COLUMN]
    tok = placeholder_tokenizer(tiny_model)
    assert tok(text=list(hf[PROMPT_COLUMN]))["input_ids"] == [list(data.rows[3]), list(data.rows[1])]


def test_plain_prompts_tokenized_as_grpo_does(tmp_path, tiny_model, tiny_tokenizer):
    from transformers import AutoTokenizer

    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "number 7"]
    spec = _jsonl(tmp_path / "p.jsonl", [{"prompt": t, "answer": "x"} for t in texts])
    data = load_prompts(spec, tiny_model, tokenizer=str(tiny_tokenizer))
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    assert [list(r) for r in data.rows] == tok(text=texts)["input_ids"]
    assert data.lengths.tolist() == [2, 9, 2]
    assert data.conversational is False and data.source == "local"


def test_conversational_prompts_get_the_chat_template_and_generation_prompt(tmp_path, tiny_model, tiny_tokenizer):
    from transformers import AutoTokenizer

    convs = [[{"role": "user", "content": "hello world"}],
             [{"role": "system", "content": "the lazy dog"}, {"role": "user", "content": "number 3"}]]
    spec = _jsonl(tmp_path / "c.jsonl", [{"prompt": c} for c in convs])
    data = load_prompts(spec, tiny_model, tokenizer=str(tiny_tokenizer), trainer="rloo")
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    expected = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
                for c in convs]
    assert [list(r) for r in data.rows] == expected
    # "<|user|> hello world <|assistant|>": the role tokens and the generation prompt are counted (4); "<|system|>" is
    # no token of this vocabulary: the whitespace pre-tokenizer splits it into "<|", "system", "|>" (3 + 3 + 1 + 2 + 1)
    assert data.lengths.tolist() == [4, 10]
    assert data.conversational is True


def test_a_dataset_without_prompt_names_the_column_and_the_fix(tmp_path, tiny_model, tiny_tokenizer):
    spec = _jsonl(tmp_path / "sft.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "yo"}]}])
    with pytest.raises(ConfigError) as err:
        load_prompts(spec, tiny_model, tokenizer=str(tiny_tokenizer))
    text = str(err.value)
    assert "'prompt'" in text and "it has ['messages']" in text and "rename_column" in text
    assert "without its last assistant turn" in text and "trainer=grpo" in text
    with pytest.raises(ConfigError, match="RLOOTrainer takes the 'prompt' column"):
        check_prompt_rows([{"question": "2+2?"}], "q.jsonl", trainer="rloo")


def test_rows_trl_cannot_take_are_each_named():
    rows = [{"prompt": "a"}, {"prompt": None}, {"prompt": "  "}, {"prompt": 3},
            {"prompt": [{"role": "user", "content": "x"}]}]
    with pytest.raises(DatasetError) as err:
        check_prompt_rows(rows, "bad.jsonl")
    text = str(err.value)
    assert "4 row(s)" in text
    for needle in ("row 1: 'prompt' is missing", "row 2: 'prompt' is empty", "row 3: 'prompt' is a int",
                   "row 4: 'prompt' is a list of messages where row 0's is text"):
        assert needle in text


def test_conversational_prompts_need_a_chat_template(tiny_model):
    from advisor.modeling import placeholder_tokenizer

    with pytest.raises(DatasetError, match="no chat template; pass --tokenizer"):
        tokenize_prompts([[{"role": "user", "content": "<t5>"}]], placeholder_tokenizer(tiny_model), label="c.jsonl")
    with pytest.raises(ConfigError, match="trainer='sft' does not read prompt-only data"):
        tokenize_prompts(["x"], placeholder_tokenizer(tiny_model), trainer="sft")


def test_no_dataset_is_the_synthetic_set(tiny_model):
    data = load_prompts(None, tiny_model)
    assert data.synthetic and len(data.rows) == 2048
    assert data.rows == synthetic_prompts(tiny_model.vocab_size).rows
