"""`advisor suggest` and `advisor worker` through the CLI: formats, exit codes, messages."""

from __future__ import annotations

import json

import pytest

from advisor.cli import main
from tests.conftest import TINY_QWEN2


@pytest.fixture
def tiny_config(tmp_path, monkeypatch):
    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_QWEN2))
    return str(path)


def _args(cfg, *more):
    return ["suggest", "--model", cfg, "--gpu", "cpu", "--backend", "estimate", "--trials", "6", *more]


def test_json_has_the_design_keys(tiny_config, capsys):
    assert main(_args(tiny_config, "--json", "--no-cache")) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("config", "peak_bytes", "reserved_bytes", "device_bytes", "tokens_per_second", "evaluations",
                "backend", "source", "notes"):
        assert key in out
    assert out["backend"] == "estimate" and out["evaluations"] == 6
    assert out["config"]["per_device_train_batch_size"] >= 1


def test_table_yaml_output_and_plot(tiny_config, tmp_path, capsys):
    yaml_path, png = tmp_path / "run.yaml", tmp_path / "front.png"
    assert main(_args(tiny_config, "--output", str(yaml_path), "--plot", str(png), "--report")) == 0
    text = capsys.readouterr().out
    assert "micro-batch x accumulation" in text and "chosen" in text
    import yaml

    assert yaml.safe_load(yaml_path.read_text())["model_name_or_path"]
    assert png.stat().st_size > 1000


def test_bad_fix_exits_2_naming_the_field(tiny_config, capsys):
    assert main(_args(tiny_config, "--fix", "optim=sgd", "--no-cache")) == 2
    err = capsys.readouterr().err
    assert "optim=sgd" in err and "adamw_torch" in err
    assert main(_args(tiny_config, "--fix", "optim")) == 2


def test_nothing_fits_exits_1(tiny_config, capsys):
    assert main(_args(tiny_config, "--memory-budget", "1MB", "--method", "full", "--no-cache")) == 1
    err = capsys.readouterr().err
    assert "nothing fits" in err and "--method lora" in err


def test_worker_needs_an_existing_study(tmp_path, capsys):
    assert main(["worker", "--storage", str(tmp_path / "j.log"), "--study", "nope", "--idle", "0.5"]) == 2
    assert "nope" in capsys.readouterr().err


def test_nothing_fits_with_json_still_prints_one_object(tiny_config, capsys):
    assert main(_args(tiny_config, "--memory-budget", "1MB", "--method", "full", "--json", "--no-cache")) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "no_fit" and out["limit_bytes"] == int(1e6 * 0.95)
    assert out["smallest_device_bytes"] > out["limit_bytes"] and out["next_knob"].startswith("--method lora")


@pytest.mark.parametrize(
    ("more", "text"),
    [
        (["--time-budget", "0"], "--time-budget 0: must be a positive number of seconds"),
        (["--output", "/nonexistent-dir/run.yaml"], "--output /nonexistent-dir/run.yaml: the folder"),
        (["--plot", "/nonexistent-dir/p.png"], "--plot /nonexistent-dir/p.png: the folder"),
    ],
)
def test_bad_flags_exit_2_before_any_work(tiny_config, capsys, more, text):
    assert main(_args(tiny_config, *more)) == 2
    assert text in capsys.readouterr().err


def test_summary_says_the_data_was_synthetic(tiny_config, capsys):
    assert main(_args(tiny_config, "--no-cache")) == 0
    assert "synthetic data: no dataset was given" in capsys.readouterr().out


def test_front_door_yaml_goes_through_trl_sft_parser(tmp_path, monkeypatch, capsys):
    """Issue 2's must-show: `advisor suggest --model Qwen/Qwen2.5-0.5B --gpu H100-80GB --format yaml`, offline,
    parsed by the parser `trl sft` itself uses, with nothing left over."""
    from trl.scripts.sft import make_parser

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run.yaml"
    assert main(["suggest", "--model", "Qwen/Qwen2.5-0.5B", "--gpu", "H100-80GB", "--backend", "estimate",
                 "--format", "yaml", "--output", str(out)]) == 0
    assert capsys.readouterr().out.strip() == out.read_text().strip()
    *parsed, config_left, args_left = make_parser().parse_args_and_config(
        ["--config", str(out), "--use_cpu", "True"], return_remaining_strings=True, separate_remaining_strings=True)
    assert config_left == [] and args_left == []
    script, training, model, _ = parsed
    assert model.model_name_or_path == "Qwen/Qwen2.5-0.5B"
    assert training.per_device_train_batch_size >= 1 and training.completion_only_loss is True
