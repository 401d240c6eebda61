"""The emitted file runs as written on its target (issue 25): a CPU suggestion over a local jsonl and a local model
directory, written with `to_yaml()`, is given to the real `trl sft|dpo|reward|kto --config FILE` (a subprocess, offline)
with nothing but `--max_steps` added; it trains, and its peak, measured as the cpu backend measures its probe (the
CPU allocator's events through torch.profiler: tests/trl_meter/sitecustomize.py), is the suggestion's prediction
within 1%. The snippet (`to_python()`) loads the same data on the same target."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY_QWEN2, save_tiny_qwen2

ROOT = Path(__file__).resolve().parent.parent
METER = Path(__file__).resolve().parent / "trl_meter"
TEXT = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)
STEPS = 3  # the optimizer state exists from the second step on: the peak is reached by then


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 with seeded random weights and a byte-level BPE tokenizer trained on the spot, saved as
    Qwen2Tokenizer: what AutoTokenizer (TRL's loader) and the advisor's loader both read the same way (a generic
    fast tokenizer saved beside a qwen2 config.json is not: see the report of issue 25)."""
    from transformers import AutoTokenizer

    from advisor.data import load_tokenizer
    from advisor.profiles import resolve_model

    corpus = [f"hello world number {i} {TEXT}" for i in range(200)]
    path = tmp_path_factory.mktemp("tiny-qwen2")
    save_tiny_qwen2(path, corpus)
    ids = AutoTokenizer.from_pretrained(path)(corpus[3])["input_ids"]
    assert load_tokenizer(None, resolve_model(str(path)))(corpus[3])["input_ids"] == ids
    assert max(ids) < TINY_QWEN2["vocab_size"]
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Rows of one length, so every micro-batch of every step is the worst one the prediction is for."""
    d = tmp_path_factory.mktemp("data")
    rows = [{"text": f"hello world number {i} {TEXT}"} for i in range(10, 42)]
    (d / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = [{"prompt": f"hello world number {i}", "chosen": f" {TEXT}", "rejected": f" {TEXT}"} for i in range(10, 42)]
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    examples = [{"prompt": f"hello world number {i}", "completion": f" {TEXT}", "label": i % 2 == 0}
                for i in range(10, 42)]
    (d / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in examples))
    return d


def _trl_as_written(command: str, config: Path, cwd: Path) -> dict:
    """`trl <command> --config FILE --max_steps N` in a fresh process, its peak measured by the cpu backend's meter."""
    trl = shutil.which("trl", path=str(Path(sys.executable).parent)) or shutil.which("trl")
    assert trl, "the trl command is not installed beside this Python"
    return _measured([trl, command, "--config", str(config), "--max_steps", str(STEPS)], cwd)


def _measured(argv: list[str], cwd: Path) -> dict:
    out = cwd / "peak.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "ADVISOR_TRL_PEAK": str(out),
           "PYTHONPATH": os.pathsep.join([str(METER), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("trainer, data", [("sft", "sft.jsonl"), ("dpo", "pairs.jsonl"), ("reward", "pairs.jsonl"),
                                           ("kto", "kto.jsonl")])
def test_the_file_runs_as_written_and_peaks_as_predicted(trainer, data, model_dir, data_dir, tmp_path, monkeypatch,
                                                         capsys):
    import advisor
    from advisor.emit import load_run_config

    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path / "cache"))
    dataset = data_dir / data
    s = advisor.suggest(model=str(model_dir), gpu="cpu", dataset=str(dataset), backend="simulate", trials=2,
                        cache=False, trainer=trainer)
    text = s.to_yaml()
    run = tmp_path / "run.yaml"
    run.write_text(text)
    written = yaml.safe_load(text)
    # the target's key, the model and the data that were measured, the trainer's own command
    assert written["use_cpu"] is True and written["model_name_or_path"] == str(model_dir)
    assert written["datasets"] == [{"path": "json", "data_files": str(dataset), "split": "train"}]
    assert "dataset_name" not in written and f"# run: trl {s.trainer.command} --config THIS_FILE\n" in text
    # read back: the same candidate, the same data and model
    back = load_run_config(run, trainer=trainer)
    assert back.candidate == s.candidate and back.dataset == str(dataset) and back.use_cpu is True
    if trainer == "sft":  # the data of `advisor simulate --config FILE` is the file's: the same prediction
        from advisor.cli import main

        assert main(["simulate", "--model", str(model_dir), "--config", str(run), "--gpu", "cpu", "--json"]) == 0
        shown = capsys.readouterr().out
        assert json.loads(shown[shown.index("{"):])["peak_bytes"] == s.measurement.peak_bytes
    code = s.to_python()
    assert f"load_dataset('json', data_files={str(dataset)!r}, split=\"train\")" in code and "use_cpu=True" in code
    if trainer == "sft":  # the snippet as written, too: TRL's 3 epochs of the 32 rows (12 steps)
        (tmp_path / "snippet").mkdir()
        (tmp_path / "snippet" / "train.py").write_text(code)
        snippet = _measured([sys.executable, "train.py"], tmp_path / "snippet")
        assert snippet["steps"] == 12
        assert snippet["peak_bytes"] == pytest.approx(s.measurement.peak_bytes, rel=0.01), snippet

    real = _trl_as_written(s.trainer.command, run, tmp_path)
    assert real["steps"] == STEPS and real["trainer"] == s.trainer.trainer_class().__name__
    predicted = s.measurement.peak_bytes
    with capsys.disabled():  # the numbers, with -s
        print(f"{trainer}: trl {s.trainer.command} peak {real['peak_bytes']} bytes, predicted {predicted} "
              f"({real['peak_bytes'] / predicted:.5f})")
    assert real["peak_bytes"] == pytest.approx(predicted, rel=0.01), (trainer, real, predicted, s.candidate)


# ---- the keys themselves (fast) ----------------------------------------------------------------------------------
def _parse_like_trl(path: Path, command: str = "sft"):
    import importlib

    return importlib.import_module(f"trl.scripts.{command}").make_parser().parse_args_and_config(
        ["--config", str(path)], return_remaining_strings=True, separate_remaining_strings=True)


def test_a_cpu_file_builds_its_trl_config_with_nothing_added(tiny_workload, tmp_path):
    """Before issue 25 the CPU file said bf16: true without use_cpu, and TrainingArguments refused it here."""
    import torch

    from advisor.emit import load_run_config, to_yaml
    from advisor.space import Candidate, Precision

    cand = Candidate(precision=Precision.BF16)
    path = tmp_path / "run.yaml"
    path.write_text(to_yaml(cand, model_name_or_path="m", workload=tiny_workload))
    _script, training, *_, config_left, args_left = _parse_like_trl(path)
    assert config_left == [] and args_left == []
    assert training.use_cpu is True and training.bf16 is True
    if not torch.cuda.is_available():
        assert training.device.type == "cpu"
    # the synthetic set has no file to name: the placeholder says where trl takes the data from
    assert "# dataset_name: trl-lib/Capybara" in path.read_text() and "datasets:" not in path.read_text()
    back = load_run_config(path)
    # the synthetic set is pre-tokenized prompt/completion, which TRL cannot tell apart: the file says so explicitly,
    # and the candidate read back carries it as the user's key
    assert "completion_only_loss: true" in path.read_text()
    assert back.candidate == cand.replace(base={"completion_only_loss": True})
    assert back.use_cpu is True and back.dataset is None


def test_a_gpu_file_says_use_cpu_false(tiny_workload, h100_target):
    import dataclasses

    from advisor.emit import run_config_dict
    from advisor.space import Candidate

    wl = dataclasses.replace(tiny_workload, gpu=h100_target)
    assert run_config_dict(Candidate(), model_name_or_path="m", workload=wl)["use_cpu"] is False


def test_local_data_is_an_entry_trl_reads_and_reads_back(tmp_path):
    """A .jsonl file, a save_to_disk Dataset and DatasetDict: TRL's get_dataset loads the entry the writer emits to
    the rows the advisor read, and the reader turns it back into what --dataset took."""
    import datasets
    from trl import DatasetMixtureConfig, get_dataset

    from advisor.runconfig import dataset_entry, dataset_of

    rows = [{"text": f"row {i}"} for i in range(5)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(tmp_path / "saved")
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(tmp_path / "saved_dict")
    for name in ("d.jsonl", "saved", "saved_dict"):
        entry = dataset_entry(str(tmp_path / name))
        assert get_dataset(DatasetMixtureConfig(datasets=[entry]))["train"]["text"] == [r["text"] for r in rows]
        assert dataset_of([entry]) == str(tmp_path / name)
    assert dataset_entry("trl-lib/Capybara") is None


def test_a_users_own_mixture_stays_in_the_base(tmp_path):
    from advisor.emit import candidate_from_run_dict, run_config_dict

    mixture = [{"path": "trl-lib/Capybara"}, {"path": "json", "data_files": "x.jsonl", "columns": ["messages"]}]
    cand = candidate_from_run_dict({"datasets": mixture, "use_cpu": True})
    assert cand.base.get("datasets") == mixture and cand.base.get("use_cpu") is None
    assert run_config_dict(cand, model_name_or_path="m")["datasets"] == mixture
