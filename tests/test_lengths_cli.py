"""`advisor lengths`: JSON equal to SFTTrainer's own prepared and packed data; malformed files exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from advisor.cli import main

ASSETS = Path(__file__).parent / "assets" / "data"


@pytest.fixture
def model_dir(tmp_path, tiny_model):
    path = tmp_path / "tiny-model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(tiny_model.config)))
    return path


def _json(capsys, *argv):
    code = main(["lengths", *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.slow
def test_json_equals_sfttrainer(capsys, model_dir, tiny_model, tiny_tokenizer):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    path = ASSETS / "chat.jsonl"
    report = _json(capsys, "--model", str(model_dir), "--dataset", str(path), "--tokenizer", str(tiny_tokenizer),
                   "--max-length", "96")

    def prepared(**config):
        args = SFTConfig(output_dir=str(model_dir / "out"), use_cpu=True, report_to="none", **config)
        return SFTTrainer(model=AutoModelForCausalLM.from_config(tiny_model.hf_config()), args=args,
                          train_dataset=datasets.load_dataset("json", data_files=str(path), split="train"),
                          processing_class=AutoTokenizer.from_pretrained(tiny_tokenizer)).train_dataset

    lengths = np.array([len(x) for x in prepared(max_length=None)["input_ids"]])
    assert report["count"] == len(lengths) == 40
    assert report["percentiles"] == {
        **{f"p{q}": int(np.percentile(lengths, q, method="inverted_cdf")) for q in (50, 90, 95, 99)},
        "max": int(lengths.max()),
    }
    assert report["synthetic"] is False and report["bad_rows"] == []
    packed = prepared(max_length=96, packing=True)  # bfd, TRL's default strategy
    fill = sum(len(x) for x in packed["input_ids"]) / (len(packed) * 96)
    assert report["max_lengths"][0]["packing"]["bfd"]["fill_rate"] == pytest.approx(fill, abs=1e-12)
    assert report["max_lengths"][0]["packing"]["bfd"]["rows"] == len(packed)


def test_tokenizer_from_the_model_directory(capsys, model_dir, tiny_tokenizer):
    """Without --tokenizer the model directory's tokenizer is read as `trl sft` reads it (AutoProcessor): the
    word-level tokenizer saved as the generic class beside a qwen2 config.json becomes a Qwen2Tokenizer that
    keeps only the special tokens, so TRL's rows are the two role markers with the completion's tokens gone
    (SFTTrainer then drops every row as fully masked); the report counts that, and its note says why."""
    from transformers import AutoProcessor

    for f in Path(tiny_tokenizer).iterdir():
        shutil.copy(f, model_dir / f.name)
    path = ASSETS / "prompt_completion.jsonl"
    report = _json(capsys, "--model", str(model_dir), "--dataset", str(path), "--max-length", "64",
                   "--micro-batch", "2")
    assert report["count"] == 30
    trl_tok = AutoProcessor.from_pretrained(model_dir)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    full = [trl_tok.apply_chat_template(r["prompt"] + r["completion"], tokenize=True, return_dict=True)["input_ids"]
            for r in rows]
    assert report["total_tokens"] == sum(len(x) for x in full)
    assert report["trained_tokens"] == 0  # what TRL trains on with the class it loads
    assert any("saved as TokenizersBackend" in n and "Qwen2Tokenizer" in n for n in report["notes"])
    assert set(report["max_lengths"][0]["padding"]) == {"2"}
    assert set(report["max_lengths"][0]["packing"]) == {"bfd", "bfd_split", "wrapped"}


def test_synthetic_default_and_text_output(capsys, model_dir):
    report = _json(capsys, "--model", str(model_dir), "--max-length", "512")
    assert report["synthetic"] is True and report["count"] > 0
    assert main(["lengths", "--model", str(model_dir), "--max-length", "512"]) == 0
    out = capsys.readouterr().out
    assert "synthetic data" in out and "<- max_length 512" in out


def test_invalid_json_exits_2_naming_the_line(capsys, model_dir):
    assert main(["lengths", "--model", str(model_dir), "--dataset", str(ASSETS / "malformed.jsonl")]) == 2
    assert "line 2: invalid JSON" in capsys.readouterr().err


def test_missing_field_is_reported_with_line_and_field(capsys, model_dir, tiny_tokenizer):
    report = _json(capsys, "--model", str(model_dir), "--dataset", str(ASSETS / "missing_field.jsonl"),
                   "--tokenizer", str(tiny_tokenizer), "--max-length", "64")
    assert report["count"] == 2
    assert report["bad_rows"][0] == {"index": 1, "line": 2, "field": "text", "reason": "missing"}
    assert main(["lengths", "--model", str(model_dir), "--dataset", str(ASSETS / "all_bad.jsonl")]) == 2
    assert "line 2: field 'text': missing" in capsys.readouterr().err


def test_no_tokenizer_exits_2_with_the_fix(capsys, model_dir):
    assert main(["lengths", "--model", str(model_dir), "--dataset", str(ASSETS / "chat.jsonl")]) == 2
    assert "--tokenizer PATH" in capsys.readouterr().err


def test_plot_writes_a_png(capsys, model_dir, tmp_path):
    pytest.importorskip("matplotlib")
    report = _json(capsys, "--model", str(model_dir), "--max-length", "512", "--plot", str(tmp_path / "h.png"))
    assert Path(report["plot"]).read_bytes()[:4] == b"\x89PNG"
