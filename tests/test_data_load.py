"""load_dataset: TRL's own preparation, bad rows reported with line and field, sampling, tokenizer lookup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from advisor.data import DataFormat, load_dataset
from advisor.errors import DatasetError

ASSETS = Path(__file__).parent / "assets" / "data"


def test_messages_tokenized_with_chat_template(tiny_model, tiny_tokenizer):
    from transformers import AutoTokenizer

    data = load_dataset(str(ASSETS / "chat.jsonl"), tiny_model, tokenizer=str(tiny_tokenizer))
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    first = json.loads((ASSETS / "chat.jsonl").read_text().splitlines()[0])
    assert data.format is DataFormat.MESSAGES
    assert len(data.rows) == 40 and not data.bad_rows and not data.synthetic
    assert list(data.rows[0]["input_ids"]) == tok.apply_chat_template(first["messages"], tokenize=True)["input_ids"]
    # language modeling on messages: every token is trained (TRL's default completion_only_loss)
    assert not data.completion_only_loss
    assert (data.trained == data.lengths).all()


def test_prompt_completion_masks_the_prompt(tiny_model, tiny_tokenizer):
    data = load_dataset(str(ASSETS / "prompt_completion.jsonl"), tiny_model, tokenizer=str(tiny_tokenizer))
    assert data.format is DataFormat.PROMPT_COMPLETION
    assert data.completion_only_loss
    assert (data.trained < data.lengths).all() and (data.trained > 0).all()


def test_plain_text_gets_eos(tiny_model, tiny_tokenizer, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "hello world"}\n{"text": "the quick brown fox"}\n')
    data = load_dataset(str(path), tiny_model, tokenizer=str(tiny_tokenizer))
    assert data.lengths.tolist() == [3, 5]
    assert all(r["input_ids"][-1] == 2 for r in data.rows)  # "</s>" is id 2 in the fixture


def test_invalid_json_line_names_the_line():
    with pytest.raises(DatasetError, match=r"line 2: invalid JSON"):
        load_dataset(str(ASSETS / "malformed.jsonl"), None)  # fails before the model is needed


def test_bad_rows_are_counted_with_line_and_field(tiny_model, tiny_tokenizer):
    data = load_dataset(str(ASSETS / "missing_field.jsonl"), tiny_model, tokenizer=str(tiny_tokenizer))
    assert len(data.rows) == 2
    described = [b.describe() for b in data.bad_rows]
    assert described == [
        "line 2: field 'text': missing",
        "line 3: field 'text': empty",
        "line 4: field 'text': wrong type: expected a string, got int",
    ]
    assert [b.index for b in data.bad_rows] == [1, 2, 3]
    assert any("3 bad row(s)" in n for n in data.notes)


def test_all_rows_bad_is_an_error(tiny_model):
    with pytest.raises(DatasetError, match=r"line 1: field 'text': empty; line 2: field 'text': missing"):
        load_dataset(str(ASSETS / "all_bad.jsonl"), tiny_model)


def test_pretokenized_needs_no_tokenizer(tiny_model, tmp_path):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [1, 5000]}]))
    data = load_dataset(str(path), tiny_model)
    assert data.format is DataFormat.TOKENIZED
    assert data.lengths.tolist() == [3, 2]
    assert data.bad_rows[0].index == 2 and "vocabulary" in data.bad_rows[0].reason


def test_parquet_and_csv(tiny_model, tiny_tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    table = pa.table({"id": [0, 1, 2], "text": ["hello world", "the lazy dog", None]})
    pq.write_table(table, tmp_path / "d.parquet")
    pcsv.write_csv(table, tmp_path / "d.csv")
    for name, reason in (("d.parquet", "missing"), ("d.csv", "empty")):  # CSV has no null string
        data = load_dataset(str(tmp_path / name), tiny_model, tokenizer=str(tiny_tokenizer))
        assert data.lengths.tolist() == [3, 4]
        assert [b.describe() for b in data.bad_rows] == [f"row 2: field 'text': {reason}"]


def test_sample_is_seeded(tiny_model, tiny_tokenizer):
    spec = str(ASSETS / "chat.jsonl")
    a = load_dataset(spec, tiny_model, tokenizer=str(tiny_tokenizer), sample=10, seed=3)
    b = load_dataset(spec, tiny_model, tokenizer=str(tiny_tokenizer), sample=10, seed=3)
    c = load_dataset(spec, tiny_model, tokenizer=str(tiny_tokenizer), sample=10, seed=4)
    assert len(a.rows) == 10 and a.population == 40 and a.sampled
    assert a.lengths.tolist() == b.lengths.tolist()
    assert a.fingerprint == b.fingerprint != c.fingerprint


def test_no_tokenizer_reachable_says_how_to_provide_one(tiny_model):
    with pytest.raises(DatasetError, match=r"--tokenizer PATH.*omit --dataset"):
        load_dataset(str(ASSETS / "chat.jsonl"), tiny_model)


def test_none_is_synthetic(tiny_model):
    data = load_dataset(None, tiny_model)
    assert data.synthetic and data.completion_only_loss and len(data.rows) > 0


def test_missing_file_and_bad_sample(tiny_model):
    with pytest.raises(DatasetError, match="no such file"):
        load_dataset("nope/does-not-exist.jsonl", tiny_model)
    with pytest.raises(DatasetError, match="--sample 0"):
        load_dataset(str(ASSETS / "chat.jsonl"), tiny_model, sample=0)
