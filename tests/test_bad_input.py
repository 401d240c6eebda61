"""What a new user hits (issue 13): every bad input exits with a code and a message naming the value and the fix,
never a traceback; a silent wrong answer is refused; the front door says what to do next."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from advisor.cli import main
from tests.conftest import TINY_QWEN2

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(path))
    return path


def _config(tmp_path: Path, name: str = "config.json", **changes) -> str:
    path = tmp_path / name
    path.write_text(json.dumps({**TINY_QWEN2, **changes}))
    return str(path)


def _suggest(model: str, *more: str) -> list[str]:
    return ["suggest", "--model", model, "--gpu", "cpu", "--backend", "estimate", "--trials", "4", *more]


def _tokenized(path: Path, lengths: list[int], vocab: int = 1024) -> str:
    import random

    rng = random.Random(0)
    with path.open("w") as fh:
        for n in lengths:
            fh.write(json.dumps({"input_ids": [rng.randrange(10, vocab) for _ in range(n)]}) + "\n")
    return str(path)


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err


# ---- silent wrong answers -------------------------------------------------------------------------------------
def test_memory_budget_above_the_card_is_refused(tmp_path, cache, capsys):
    cfg = _config(tmp_path)
    assert main(["suggest", "--model", cfg, "--gpu", "L4", "--backend", "estimate", "--memory-budget", "1TB"]) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "--memory-budget 1000GB" in err and "L4" in err and "22.49 GiB" in err
    assert "omit --memory-budget" in err and "larger --gpu" in err
    # at the card's capacity it is accepted: the check is "above", not "at"
    assert main(["suggest", "--model", cfg, "--gpu", "L4", "--backend", "estimate", "--trials", "2",
                 "--memory-budget", "22GiB", "--no-cache"]) == 0


def test_memory_budget_above_the_card_is_refused_by_the_library(tiny_workload):
    import dataclasses

    from advisor.errors import ConfigError
    from advisor.workload import Goals

    with pytest.raises(ConfigError, match="--memory-budget .* more than"):
        dataclasses.replace(tiny_workload, goals=Goals(memory_budget_bytes=tiny_workload.gpu.memory_bytes + 1))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_suggest_cuda_without_a_gpu_fails_before_any_work(tmp_path, cache, capsys):
    assert main(["suggest", "--model", _config(tmp_path), "--gpu", "L4", "--backend", "cuda"]) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "--backend cuda: no CUDA device is visible" in err and "--backend simulate" in err
    assert not cache.exists()  # no study was opened, nothing was measured
    import advisor

    with pytest.raises(advisor.UsageError, match="--backend cuda"):
        advisor.suggest(_config(tmp_path), gpu="L4", backend="cuda", cache=False)


@pytest.fixture
def broken_backend():
    from advisor.measurement import Measurement, Source, Status
    from advisor.search import register_backend, unregister_backend

    calls = []

    def measure(workload, candidate):
        calls.append(candidate)
        return Measurement(Status.ERROR, Source.SIMULATE, message="RuntimeError: the backend is broken here")

    register_backend("broken", measure, cost=1)
    yield calls
    unregister_backend("broken")


def test_an_error_on_every_candidate_is_an_error_of_the_run(tmp_path, cache, capsys, broken_backend):
    cfg = _config(tmp_path)
    args = ["suggest", "--model", cfg, "--gpu", "cpu", "--backend", "broken", "--trials", "3", "--no-cache"]
    assert main(args) == 3
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "every one of the 3 candidates measured failed with an error" in err
    assert "the backend is broken here" in err and "nothing fits" not in err
    assert len(broken_backend) == 3  # it stopped with the first method: no escalation to lora / qlora
    assert main([*args, "--json"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "backend_error" and out["errors"] == 3 and out["backend"] == "broken"
    import advisor

    with pytest.raises(advisor.BackendError) as info:
        advisor.suggest(cfg, gpu="cpu", backend="broken", trials=2, cache=False)
    assert info.value.exit_code == 3


def test_a_fixed_backend_is_measured_again_not_answered_with_stored_errors(tmp_path, cache, capsys,
                                                                           broken_backend):
    from advisor.measurement import Measurement, Source, Status
    from advisor.search import register_backend

    cfg = _config(tmp_path)
    args = ["suggest", "--model", cfg, "--gpu", "cpu", "--backend", "broken", "--trials", "3", "--json"]
    assert main(args) == 3
    capsys.readouterr()

    def works(workload, candidate):  # the cause was fixed: the same backend now measures
        return Measurement(Status.OK, Source.SIMULATE, peak_bytes=2**28, reserved_bytes=2**28, device_bytes=2**28,
                           tokens_per_second=1000.0 * candidate.per_device_train_batch_size)

    register_backend("broken", works, cost=1)
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["evaluations"] == 3 and any("held only error outcomes" in n for n in out["notes"])


def _bert(tmp_path: Path) -> str:
    from transformers import BertConfig

    data = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      vocab_size=1024).to_dict()
    data["architectures"] = ["BertForMaskedLM"]
    (tmp_path / "bert.json").write_text(json.dumps(data))
    return str(tmp_path / "bert.json")


def _t5(tmp_path: Path) -> str:
    from transformers import T5Config

    data = T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, vocab_size=1024).to_dict()
    data["architectures"] = ["T5ForConditionalGeneration"]
    (tmp_path / "t5.json").write_text(json.dumps(data))
    return str(tmp_path / "t5.json")


def test_a_model_that_is_not_a_causal_lm_is_refused_by_name(tmp_path, cache, capsys):
    assert main(_suggest(_bert(tmp_path))) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "'bert'" in err and "BertForMaskedLM" in err and "causal LM" in err and "Qwen/Qwen2.5-0.5B" in err
    assert main(_suggest(_t5(tmp_path))) == 2
    err = capsys.readouterr().err
    assert "'t5'" in err and "encoder-decoder" in err
    assert "num_hidden_layers" not in err  # refused by what it is, not as missing fields


def test_causal_lm_check_reads_transformers_mapping():
    from advisor.profiles import causal_lm_problem

    assert causal_lm_problem(TINY_QWEN2) is None
    assert causal_lm_problem({**TINY_QWEN2, "architectures": ["Qwen2ForSequenceClassification"]})
    assert "no causal-LM class" in causal_lm_problem({"model_type": "vit"})
    assert causal_lm_problem({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}) is None


def test_max_length_beyond_the_models_context_is_refused(tmp_path, cache, capsys):
    cfg = _config(tmp_path)  # max_position_embeddings 4096
    assert main(_suggest(cfg, "--fix", "max_length=8192", "--no-cache")) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "max_length=8192" in err and "max_position_embeddings 4096" in err and "--fix max_length=4096" in err
    # a --config file with it is refused the same way
    from advisor.emit import to_yaml
    from advisor.space import Candidate

    run = tmp_path / "run.yaml"
    run.write_text(to_yaml(Candidate(max_length=8192), model_name_or_path=cfg))
    assert main(["simulate", "--model", cfg, "--config", str(run), "--gpu", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "max_position_embeddings 4096" in err and f"max_length: 4096 in --config {run}" in err
    assert "--fix" not in err  # simulate has no --fix: the fix is said as the file's key


def test_rows_longer_than_the_context_are_noted_and_truncated_to_it(tmp_path, cache, capsys):
    cfg = _config(tmp_path)
    data = _tokenized(tmp_path / "long.jsonl", [5000] * 8 + [300] * 8)
    assert main(_suggest(cfg, "--dataset", data, "--json", "--no-cache", "--tokens-per-step", "8192")) == 0
    captured = capsys.readouterr()
    assert "8 of 16 rows are longer than" in captured.err and "max_position_embeddings 4096" in captured.err
    out = json.loads(captured.out)
    assert out["config"]["max_length"] is not None and out["config"]["max_length"] <= 4096
    assert any("longer than" in n for n in out["notes"])


# ---- tracebacks instead of messages ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,content,what", [
    ("bin.jsonl", bytes(range(256)) * 4, "binary"),
    ("bin.json", bytes(range(256)) * 4, "binary"),
    ("gz.jsonl", b"\x1f\x8b\x08\x00" + bytes(range(128, 256)), "gzip-compressed"),
])
def test_a_binary_dataset_exits_2_naming_the_file(tmp_path, cache, capsys, name, content, what):
    path = tmp_path / name
    path.write_bytes(content)
    assert main(_suggest(_config(tmp_path), "--dataset", str(path))) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert f"--dataset {path}: not UTF-8 text" in err and what in err and "decompress" in err


def test_a_save_to_disk_dataset_is_accepted(tmp_path, cache, capsys):
    import datasets

    from advisor.data import load_dataset
    from advisor.profiles import resolve_model

    cfg = _config(tmp_path)
    rows = {"input_ids": [list(range(10, 10 + n)) for n in (40, 80, 120, 160)]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "saved_dict"))
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "no_train"))
    for d in ("saved", "saved_dict"):
        data = load_dataset(str(tmp_path / d), resolve_model(cfg))
        assert sorted(data.lengths.tolist()) == [40, 80, 120, 160]
    assert main(_suggest(cfg, "--dataset", str(tmp_path / "saved"), "--no-cache")) == 0
    capsys.readouterr()
    assert main(_suggest(cfg, "--dataset", str(tmp_path / "no_train"), "--no-cache")) == 2
    err = capsys.readouterr().err
    assert "without a 'train' split" in err and "test" in err


# ---- messages that mislead ------------------------------------------------------------------------------------
def test_long_rows_name_the_derived_batch_and_a_fix_that_works(tmp_path, cache, capsys):
    cfg = _config(tmp_path, max_position_embeddings=65536)
    data = _tokenized(tmp_path / "long.jsonl", [12000] * 8)
    assert main(_suggest(cfg, "--dataset", data, "--no-cache")) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "you did not set --tokens-per-step" in err and "TRL's default 8 rows x 1,024" in err
    fix = re.search(r"set --tokens-per-step (\d+)", err)
    assert fix, err
    assert main(_suggest(cfg, "--dataset", data, "--no-cache", "--tokens-per-step", fix.group(1))) == 0
    capsys.readouterr()
    assert main(_suggest(cfg, "--dataset", data, "--no-cache", "--tokens-per-step", "4000")) == 2
    assert "--tokens-per-step 4000 (yours)" in capsys.readouterr().err


def test_offline_is_decided_once_for_the_whole_run(tmp_path, cache, capsys, monkeypatch):
    from advisor import profiles

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: the connection is refused at once
    profiles._hub_reachable.cache_clear()
    try:
        assert main(["suggest", "--model", "Qwen/Qwen2.5-0.5B", "--gpu", "L4", "--dataset", "trl-lib/Capybara",
                     "--backend", "estimate", "--no-cache"]) == 2
    finally:
        profiles._hub_reachable.cache_clear()
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "is not reachable: working offline for this run (HF_HUB_OFFLINE=1)" in err
    assert "--dataset trl-lib/Capybara" in err
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    import huggingface_hub.constants

    assert huggingface_hub.constants.HF_HUB_OFFLINE is True


def test_a_local_run_does_not_test_the_hub(tmp_path, monkeypatch):
    from advisor import profiles

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(profiles, "_hub_reachable", lambda: pytest.fail("the hub was tested for local files"))
    assert profiles.decide_offline(_config(tmp_path), None, None) is None


def test_confirmation_note_says_what_was_compared():
    from advisor.measurement import Measurement, Source, Status
    from advisor.search import confirmation_note

    a = Measurement(Status.OK, Source.SIMULATE, tokens_per_second=1000.0)
    b = Measurement(Status.OK, Source.SIMULATE, tokens_per_second=768.0)
    note = confirmation_note(a, b, "simulate")
    assert "a second simulate measurement of the chosen configuration" in note
    assert "768" in note and "1,000" in note and "-23.2%" in note and "ties" in note
    assert confirmation_note(a, Measurement(Status.OK, Source.SIMULATE, tokens_per_second=1020.0), "cuda") == ""


# ---- what a TRL user expects ----------------------------------------------------------------------------------
def test_table_ends_with_the_next_step_that_works(tmp_path, cache, capsys, monkeypatch):
    import yaml

    from advisor.emit import load_run_config

    cfg = _config(tmp_path)
    assert main(_suggest(cfg, "--report")) == 0
    out = capsys.readouterr().out
    assert "device peak (GiB, predicted)" in out and "tokens/s (trained, predicted)" in out
    assert "a prediction for cpu, not a run on it" in out and "device GiB (predicted)" in out
    tail = out.rstrip().splitlines()[-4:]
    assert tail[0] == "Next:"
    assert "--format yaml -o run.yaml" in tail[1] and "--report" not in tail[1]
    assert tail[2].strip().startswith("trl sft --config run.yaml --dataset_name")
    # the printed command works as written, answered from the stored study
    monkeypatch.chdir(tmp_path)
    command = shlex.split(tail[1].split("#")[0])
    assert command[:2] == ["advisor", "suggest"]
    assert main(command[1:]) == 0
    text = (tmp_path / "run.yaml").read_text()
    assert text.startswith("# advisor ") and "on cpu" in text and "predicted device peak" in text
    assert "the estimate backend" in text and "\n# dataset_name: " in text
    assert yaml.safe_load(text)["model_name_or_path"] == cfg
    assert load_run_config(tmp_path / "run.yaml").candidate.per_device_train_batch_size >= 1
    from advisor.search import stored_studies

    assert [st.trials for st in stored_studies()] == [4]  # the same study answered: nothing measured again


def test_plot_says_where_it_wrote_and_json_has_the_trials(tmp_path, cache, capsys):
    pytest.importorskip("matplotlib")
    cfg = _config(tmp_path)
    png = tmp_path / "front.png"
    assert main(_suggest(cfg, "--plot", str(png), "--no-cache")) == 0
    assert f"wrote the plot (device peak against tokens/s) to {png}" in capsys.readouterr().out
    assert png.stat().st_size > 1000
    assert main(_suggest(cfg, "--json", "--no-cache", "--plot", str(png))) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)  # the plot's line went to stderr, the JSON stays one object
    assert f"wrote the plot to {png}" in captured.err
    assert len(out["trials"]) >= out["evaluations"] == 4
    chosen = [t for t in out["trials"] if t["why"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["config"]["per_device_train_batch_size"] == \
        out["config"]["per_device_train_batch_size"]
    assert {"number", "config", "measurement", "why", "cached"} <= set(out["trials"][0])


def test_version_and_gpus(capsys):
    import advisor

    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"advisor {advisor.__version__} (") and "trl " in out
    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    assert "L4" in out and "H100-80GB-SXM" in out and "cpu" in out and "aliases" in out
    assert main(["gpus", "--json"]) == 0
    names = [g["name"] for g in json.loads(capsys.readouterr().out)["gpus"]]
    from advisor.profiles import list_gpus

    assert names == list_gpus()


def test_studies_and_report_show_a_stored_search_without_measuring(tmp_path, cache, capsys):
    cfg = _config(tmp_path)
    assert main(["studies"]) == 0
    assert "no stored search" in capsys.readouterr().out
    assert main(_suggest(cfg, "--json")) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(["studies", "--json"]) == 0
    studies = json.loads(capsys.readouterr().out)["studies"]
    assert len(studies) == 1 and studies[0]["model"] == str(Path(cfg).resolve())
    assert studies[0]["trials"] == 4 and studies[0]["answered"] and studies[0]["backend"] == "estimate"
    name = studies[0]["name"]
    assert any(f"advisor report --study {name}" in n for n in first["notes"])
    assert main(["report", "--study", name, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["config"] == first["config"] and again["device_bytes"] == first["device_bytes"]
    assert again["evaluations"] == 0 and all(t["cached"] for t in again["trials"])
    assert main(["report", "--study", name]) == 0
    out = capsys.readouterr().out
    assert "shown from the stored study" in out and "chosen" in out
    assert main(["report", "--study", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--study 'nope': no such study" in err and name in err


@pytest.mark.skipif(__import__("torch").accelerator.is_available(), reason="needs a machine without a GPU")
def test_sft_config_builds_where_it_runs(tiny_workload, tmp_path):
    from advisor.measurement import Measurement, Source, Status
    from advisor.space import Candidate, Precision
    from advisor.suggestion import Suggestion

    s = Suggestion(workload=tiny_workload, candidate=Candidate(precision=Precision.BF16),
                   measurement=Measurement(Status.OK, Source.ESTIMATE))
    with pytest.warns(UserWarning, match="sets use_cpu=True"):
        config = s.sft_config(output_dir=str(tmp_path / "out"))
    assert config.use_cpu and config.bf16
    with pytest.raises(ValueError, match="bf16"):  # what the user would otherwise hit: use_cpu=False is theirs
        s.sft_config(output_dir=str(tmp_path / "out"), use_cpu=False)


def test_readme_python_snippet_runs_as_written(tmp_path):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1, "the README has one Python snippet"
    (tmp_path / "snippet.py").write_text(blocks[0])
    env = {**os.environ, "ADVISOR_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(tmp_path / "snippet.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model_name_or_path: Qwen/Qwen2.5-0.5B" in done.stdout and "micro-batch x accumulation" in done.stdout
