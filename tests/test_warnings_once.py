"""A library warning said many times while the advisor tokenizes a dataset reaches the user once, with its count
(issue 25: "a library warning is printed 11 times instead of collected once").

TRL's "The tokenized prompt is not a prefix of the tokenized prompt+completion ... This warning is shown once" is
`warning_once` of a text that quotes each row's own prompt tail, so prompts that end inside a word each print it:
`advisor suggest` over 11 such rows wrote it 11 times to stderr. Now what the libraries say while the data is
tokenized is collected, each distinct message once (the variants that differ only in the quoted text merged) with
its count, as one note of the dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_QWEN2, save_bpe_qwen2_tokenizer

from advisor.cli import main

WORDS = "the quick brown fox jumps over lazy dog hello world number".split()  # 11 distinct words
TEXT = " ".join(WORDS)
WARNING = "The tokenized prompt is not a prefix of the tokenized prompt+completion"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 config.json and a byte-level BPE tokenizer trained on the spot on the words above, saved as
    Qwen2Tokenizer (the class TRL loads; no note of a rebuilt class)."""
    path = tmp_path_factory.mktemp("split-words-qwen2")
    save_bpe_qwen2_tokenizer(path, [f"{TEXT} {i}" for i in range(200)], vocab_size=300)
    (path / "config.json").write_text(json.dumps(TINY_QWEN2))
    return path


def _split_rows(prefix: str) -> list[dict]:
    """Each prompt ends inside another word (`... qu` + `ick ...`), so each row's prompt tail differs."""
    return [{"prompt": f"{prefix} {i} {w[:2]}", "completion": f"{w[2:]} {TEXT}"} for i, w in enumerate(WORDS)]


def _diverging_tails(model_dir: Path, rows: list[dict], chosen: str = "completion") -> set[str]:
    """The prompt tails TRL quotes: where the tokenized prompt and prompt+completion part (independently of the
    advisor: the tokenizer TRL loads, TRL's own prefix rule)."""
    from transformers import AutoProcessor
    from trl.data_utils import common_prefix_length

    tok = AutoProcessor.from_pretrained(model_dir)
    tails = set()
    for r in rows:
        prompt = tok(r["prompt"])["input_ids"]
        full = tok(r["prompt"] + r[chosen])["input_ids"]
        n = common_prefix_length(prompt, full)
        if n < len(prompt):
            tails.add(tok.decode(prompt[n:]))
    return tails


@pytest.fixture
def fresh_once_cache():
    """TRL's `warning_once` remembers a text for the process (accelerate's lru_cache): forget it, so this test sees
    what a fresh `advisor` process says."""
    from accelerate.logging import MultiProcessAdapter

    MultiProcessAdapter.warning_once.cache_clear()
    yield
    MultiProcessAdapter.warning_once.cache_clear()


def _once_with_count(text: str, n: int) -> None:
    assert text.count(WARNING) == 1, text
    assert f"(x{n}, {n} variants of the quoted text)" in text


def test_suggest_says_the_tokenizing_warning_once_with_its_count(model_dir, tmp_path, monkeypatch, capsys, caplog,
                                                                 fresh_once_cache):
    rows = _split_rows("sft prompt")
    data = tmp_path / "split.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tails = _diverging_tails(model_dir, rows)
    assert len(tails) >= 5  # the case of the issue: one warning per row
    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["suggest", "--model", str(model_dir), "--dataset", str(data), "--gpu", "cpu", "--backend",
                 "estimate", "--no-cache"]) == 0
    out, err = capsys.readouterr()
    _once_with_count(err, len(tails))  # one stderr line as the data is read
    _once_with_count(out, len(tails))  # one note in the report
    assert not [r for r in caplog.records if WARNING in r.getMessage()]  # none left to the logging system


def test_dpo_lengths_says_it_once_with_its_count(model_dir, tmp_path, capsys, caplog, fresh_once_cache):
    rows = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"][:8]}
            for r in _split_rows("dpo prompt")]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tails = _diverging_tails(model_dir, rows, "chosen") | _diverging_tails(model_dir, rows, "rejected")
    assert len(tails) >= 5
    assert main(["lengths", "--model", str(model_dir), "--dataset", str(data), "--trainer", "dpo", "--json"]) == 0
    out, err = capsys.readouterr()
    notes = [n for n in json.loads(out)["notes"] if WARNING in n]
    assert len(notes) == 1
    _once_with_count(notes[0], len(tails))
    assert WARNING not in err
    assert not [r for r in caplog.records if WARNING in r.getMessage()]


def test_a_fresh_process_writes_it_once_to_stderr(model_dir, tmp_path):
    """The real stderr of a real `advisor suggest` (pytest's logging capture not in the way)."""
    rows = _split_rows("process prompt")
    data = tmp_path / "split.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    n = len(_diverging_tails(model_dir, rows))
    env = {**os.environ, "ADVISOR_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from advisor.cli import main; sys.exit(main(sys.argv[1:]))",
         "suggest", "--model", str(model_dir), "--dataset", str(data), "--gpu", "cpu", "--backend", "estimate",
         "--no-cache"], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    _once_with_count(proc.stderr, n)
