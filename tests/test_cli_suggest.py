"""`advisor suggest` and `advisor worker` through the CLI: formats, exit codes, messages."""

from __future__ import annotations

import json

import pytest

from advisor.cli import main


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
    assert main(_args(tiny_config, "--fix", "optim=lomo", "--no-cache")) == 2
    err = capsys.readouterr().err
    assert "optim=lomo" in err and "adamw_torch" in err
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


def _cli_fake(w, c):
    """Slow enough that a worker takes part; memory grows with micro-batch x length."""
    import time

    from advisor.measurement import Measurement

    time.sleep(0.4)  # the forked worker builds its workload from the stored names meanwhile
    dev = int(2e8 + c.per_device_train_batch_size * (c.max_length or 256) * 4e5)
    return Measurement("ok", "probe-cpu", peak_bytes=dev, reserved_bytes=dev, device_bytes=dev,
                       tokens_per_second=1000.0 * c.per_device_train_batch_size ** 0.5)


_CLI_NARROW = ["--fix", "optim=adamw_torch", "--fix", "group_by_length=false", "--fix", "packing=false",
               "--fix", "padding_free=false", "--fix", "gradient_checkpointing=false"]


def _cli_worker(storage, study, out):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        # --idle 10: on a loaded machine the leader may take more than 4 s to create the study the worker waits for
        rc = main(["worker", "--storage", storage, "--study", study, "--idle", "10", "--json"])
    out.put((rc, buf.getvalue()))


def test_worker_joins_a_cli_made_auto_study(tiny_config, tmp_path, capsys):
    """`advisor suggest --storage J --study S` (method auto: studies S-full, ...) and `advisor worker --storage J
    --study S` in another process share the queue; no candidate is measured twice."""
    import multiprocessing as mp

    import optuna

    from advisor import search
    from advisor.search import open_storage

    search.register_backend("fake", _cli_fake)
    try:
        storage = str(tmp_path / "journal.log")
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        worker = ctx.Process(target=_cli_worker, args=(storage, "S", out))
        worker.start()
        rc = main(["suggest", "--model", tiny_config, "--gpu", "cpu", "--backend", "fake", "--storage", storage,
                   "--study", "S", "--exhaustive", "--json", "--memory-budget", "1GB", *_CLI_NARROW])
        worker.join(60)
        worker_rc, worker_out = out.get(timeout=5)
        assert rc == 0 and worker_rc == 0
    finally:
        search.unregister_backend("fake")
    result = json.loads(capsys.readouterr().out)
    study = optuna.load_study(study_name="S-full", storage=open_storage(storage))
    spec = study.user_attrs["advisor"]
    assert spec["model"] == tiny_config and spec["gpu"] == "cpu"
    measured = [t.user_attrs["key"] for t in study.trials
                if t.user_attrs.get("measured") and not t.user_attrs.get("cached")]
    assert len(measured) == len(set(measured)) == result["evaluations"]
    assert json.loads(worker_out)["measured"] > 0, ("the worker took part", worker_out, result["evaluations"])


def test_fix_leaving_no_candidate_exits_2_naming_it(tiny_config, capsys):
    assert main(_args(tiny_config, "--fix", "per_device_train_batch_size=64", "--no-cache")) == 2
    err = capsys.readouterr().err
    assert "--fix per_device_train_batch_size=64" in err and "no admissible candidate" in err
    assert "within 25% of 1729 trained tokens per optimizer step" in err and "change the --fix" in err


@pytest.mark.parametrize("storage", ["/proc/x.log", "/nonexistent-dir/j.log"])
def test_unusable_storage_exits_2_naming_it(tiny_config, capsys, storage):
    assert main(_args(tiny_config, "--storage", storage, "--study", "s")) == 2
    err = capsys.readouterr().err
    assert f"--storage {storage!r}" in err and "choose a writable file path" in err and "Traceback" not in err


def test_worker_refuses_another_backend(tiny_config, tmp_path, capsys):
    storage = str(tmp_path / "j.log")
    assert main(_args(tiny_config, "--storage", storage, "--study", "S", "--method", "full", "--trials", "2")) == 0
    capsys.readouterr()
    assert main(["worker", "--storage", storage, "--study", "S", "--backend", "simulate", "--idle", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--backend simulate" in err and "measures with estimate" in err and "--backend estimate" in err
