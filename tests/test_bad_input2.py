"""Bad input, round two (issue 25): what a new user hit after issue 13. Every case here failed on main before it:
a silent wrong answer, a traceback, a lost Ctrl-C, a message that blamed the wrong thing, or the library's own
TypeError from the Python API. The estimate backend and the tiny model keep them fast."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from advisor.cli import main
from advisor.errors import ConfigError, UsageError
from tests.conftest import TINY_QWEN2


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(path))
    return path


@pytest.fixture
def model_json(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_QWEN2))
    return str(path)


def _suggest(model: str, *more: str) -> list[str]:
    return ["suggest", "--model", model, "--gpu", "cpu", "--backend", "estimate", "--trials", "2", *more]


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err and "Exception ignored" not in err


def _yaml(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- silent wrong answers: a --config's values read as `trl sft --config` reads them ----------------------------
def _trl_reads(path: Path, command: str = "sft") -> dict:
    """What TRL's own parser (the TrlParser `trl <command>` builds) makes of the file: every dataclass's fields."""
    import dataclasses
    import importlib

    parser = importlib.import_module(f"trl.scripts.{command}").make_parser()
    # use_cpu / bf16 only so that TrainingArguments' own check passes on this CPU machine
    parsed = parser.parse_args_and_config(["--config", str(path), "--use_cpu", "true", "--bf16", "false",
                                           "--output_dir", str(path.parent / "out")])
    out = {}
    for obj in parsed:
        out.update({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    return out


QUOTED = """\
model_name_or_path: Qwen/Qwen2.5-0.5B
gradient_checkpointing: "false"
packing: "False"
use_peft: "no"
load_in_4bit: "false"
per_device_train_batch_size: "4"
gradient_accumulation_steps: "2"
max_length: "none"
learning_rate: "1e-4"
"""


def test_quoted_values_are_read_as_trl_reads_them(tmp_path):
    from advisor.emit import load_run_config
    from advisor.space import Quantization

    path = _yaml(tmp_path, QUOTED)
    trl = _trl_reads(path)  # the independent reading: TRL's parser itself
    assert trl["gradient_checkpointing"] is False and trl["packing"] is False and trl["use_peft"] is False
    assert trl["per_device_train_batch_size"] == 4 and trl["max_length"] is None
    cand = load_run_config(path).candidate
    assert cand.activation_checkpointing is trl["gradient_checkpointing"]  # main: True ("false" is truthy)
    assert cand.packing is trl["packing"]  # main: True
    assert cand.quantization is Quantization.NONE  # main: QLoRA nf4 from load_in_4bit: "false"
    assert cand.per_device_train_batch_size == trl["per_device_train_batch_size"]  # main: refused ("4")
    assert cand.gradient_accumulation_steps == trl["gradient_accumulation_steps"]
    assert cand.max_length is None
    assert cand.base.get("learning_rate") == trl["learning_rate"] == 1e-4  # a float, emitted as one


def test_a_value_trl_refuses_is_refused_by_key(tmp_path):
    from advisor.emit import load_run_config

    path = _yaml(tmp_path, "gradient_checkpointing: sometimes\nper_device_train_batch_size: '4.0'\n")
    with pytest.raises(SystemExit):  # trl sft refuses both
        _trl_reads(path)
    with pytest.raises(ConfigError) as info:  # main: accepted as true, then "4.0" refused alone
        load_run_config(path)
    assert len(info.value.problems) == 2
    text = str(info.value)
    assert "gradient_checkpointing='sometimes'" in text and "write true or false" in text
    assert "per_device_train_batch_size='4.0'" in text and "whole number" in text


def test_quoted_booleans_of_a_dpo_config_are_read_as_trl_dpo_reads_them(tmp_path):
    from advisor.emit import load_run_config

    path = _yaml(tmp_path, "precompute_ref_log_probs: 'true'\ngradient_checkpointing: 'false'\n")
    trl = _trl_reads(path, "dpo")
    cand = load_run_config(path, trainer="dpo").candidate
    assert cand.activation_checkpointing is trl["gradient_checkpointing"] is False
    assert cand.base.get("precompute_ref_log_probs") is trl["precompute_ref_log_probs"] is True


def test_baseline_of_quoted_falses_records_what_trl_trains(tmp_path, cache, model_json, capsys):
    path = _yaml(tmp_path, 'gradient_checkpointing: "false"\nuse_peft: "false"\nload_in_4bit: "false"\n'
                           'max_length: 64\n')
    out = tmp_path / "baseline.json"
    assert main(["baseline", "--model", model_json, "--gpu", "cpu", "--config", str(path), "--backend", "estimate",
                 "--out", str(out)]) == 0
    cand = json.loads(out.read_text())["candidate"]
    assert cand["activation_checkpointing"] is False  # main: true
    assert cand["quantization"] == "none" and cand["use_lora"] is False  # main: a QLoRA 4-bit baseline


# ---- --fix ------------------------------------------------------------------------------------------------------
def test_conflicting_fix_of_one_knob_is_refused(model_json, cache, capsys):
    assert main(_suggest(model_json, "--fix", "packing=true", "--fix", "packing=false")) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "--fix packing=true and --fix packing=false contradict each other" in err


def test_fix_wrapped_without_allow_wrapped_names_the_flag(model_json, cache, capsys):
    assert main(_suggest(model_json, "--fix", "packing_strategy=wrapped")) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "--fix packing_strategy=wrapped" in err and "--allow-wrapped" in err
    assert main(_suggest(model_json, "--fix", "packing_strategy=wrapped", "--allow-wrapped")) == 0


# ---- a storage that fails mid-run, an output that cannot be written -------------------------------------------
@pytest.fixture
def full_disk(monkeypatch):
    """SQLite as on a full disk: every connection may not grow the file beyond what it holds (SQLITE_FULL,
    "database or disk is full", the error a full file system gives)."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    state = {"on": False}

    def limit(dbapi_connection, _record):
        if state["on"]:
            cur = dbapi_connection.cursor()
            pages = cur.execute("PRAGMA page_count").fetchone()[0]
            cur.execute(f"PRAGMA max_page_count = {pages}")
            cur.close()

    event.listen(Engine, "connect", limit)
    yield state
    event.remove(Engine, "connect", limit)


def test_a_cache_that_fills_up_mid_run_costs_one_line(model_json, cache, full_disk, capsys):
    assert main(_suggest(model_json)) == 0  # the cache exists and holds a study
    assert (cache / "studies.sqlite3").is_file()
    capsys.readouterr()
    full_disk["on"] = True
    assert main(_suggest(model_json, "--max-truncation", "0.05", "--format", "yaml")) == 0  # a new study
    cap = capsys.readouterr()
    _no_traceback(cap.err)
    lines = [x for x in cap.err.splitlines() if "cannot store" in x]
    assert len(lines) == 1 and "database or disk is full" in lines[0] and "--no-cache" in lines[0]
    assert "per_device_train_batch_size:" in cap.out  # the answer is still printed


def test_an_output_that_cannot_be_written_is_an_error_and_the_answer_is_kept(model_json, cache, capsys):
    target = "/proc/advisor-run.yaml"  # passes the check before the search (/proc is a writable-looking folder)
    assert main(_suggest(model_json, "--format", "yaml", "-o", target)) == 2
    cap = capsys.readouterr()
    _no_traceback(cap.err)
    assert f"--output {target}: cannot be written" in cap.err
    assert "per_device_train_batch_size:" in cap.out  # printed instead, not lost


def test_output_is_written_atomically(tmp_path, monkeypatch):
    """No space left while writing: the previous file stays whole, and no empty or temporary file is left."""
    from advisor._files import write_atomic

    target = tmp_path / "run.yaml"
    target.write_text("old: 1\n")
    real_fsync = os.fsync

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError):
        write_atomic(target, "new: 2\n" * 1000)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert target.read_text() == "old: 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]
    write_atomic(tmp_path / "fresh.yaml", "a: 1\n")
    assert (tmp_path / "fresh.yaml").read_text() == "a: 1\n"
    assert oct((tmp_path / "fresh.yaml").stat().st_mode & 0o777) != oct(0o600)  # as open() would make it


def test_suggest_output_failing_after_the_search_leaves_no_empty_file(model_json, cache, capsys, monkeypatch,
                                                                     tmp_path):
    import advisor._files as files

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", no_space)
    out = tmp_path / "run.yaml"
    assert main(_suggest(model_json, "--format", "yaml", "-o", str(out))) == 2
    cap = capsys.readouterr()
    _no_traceback(cap.err)
    assert "No space left on device" in cap.err and not out.exists()
    assert list(tmp_path.glob(".run.yaml.*")) == []


def test_a_sqlite_file_given_as_a_journal_is_named(model_json, cache, capsys, tmp_path):
    db = tmp_path / "studies.sqlite3"
    assert main(_suggest(model_json, "--storage", f"sqlite:///{db}")) == 0
    capsys.readouterr()
    for argv in (_suggest(model_json, "--storage", str(db)), ["studies", "--storage", str(db)],
                 ["worker", "--storage", str(db), "--study", "x"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        _no_traceback(err)
        assert f"is a SQLite database, not a journal file; write --storage sqlite:///{db}" in err, argv
    text = tmp_path / "notes.txt"
    text.write_text("these are my notes\n")
    assert main(["studies", "--storage", str(text)]) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "is not an Optuna journal file" in err and text.read_text() == "these are my notes\n"


def test_read_only_commands_never_create_a_database(cache, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv in (["studies", "--storage", "sqlite:///typo.db"], ["report", "--study", "x", "--storage",
                                                                 "sqlite:///typo.db"],
                 ["studies", "--storage", "typo.log"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        _no_traceback(err)
        assert "typo" in err and "no such" in err
    assert main(["studies"]) == 0  # no cache yet: nothing stored, and none made
    assert "no stored search" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == [] and not cache.exists()


def test_studies_of_a_corrupt_cache_says_so(cache, capsys):
    cache.mkdir()
    (cache / "studies.sqlite3").write_bytes(b"not a database at all\n" * 100)
    assert main(["studies"]) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "studies.sqlite3: cannot be read" in err and "not a database" in err


@pytest.mark.parametrize("flag", ["--model", "--dataset", "--tokenizer", "--config"])
def test_a_path_longer_than_the_file_system_allows_names_the_flag(model_json, cache, capsys, flag):
    long = "x" * 300 + ".jsonl"
    argv = ["suggest", "--gpu", "cpu", "--backend", "estimate", "--model", model_json]
    argv = [*argv[:-2], flag, long] if flag == "--model" else [*argv, flag, long]
    assert main(argv) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert f"{flag} xxxx" in err and "longer than the file system allows" in err


def test_a_long_path_through_the_python_api_names_the_parameter(model_json):
    import advisor

    with pytest.raises(UsageError, match="--dataset .* longer than the file system allows"):
        advisor.suggest(model_json, gpu="cpu", dataset="d" * 400, backend="estimate", cache=False)


# ---- Ctrl-C ---------------------------------------------------------------------------------------------------
@pytest.fixture
def swallowed_interrupt():
    """A backend that measures with the estimate, and on its second call receives Ctrl-C inside a weakref callback
    (where SQLAlchemy's pool has many): Python prints "Exception ignored in ..." and drops the KeyboardInterrupt."""
    import signal
    import weakref

    from advisor.estimator import estimate
    from advisor.search import register_backend, unregister_backend

    calls = []

    def measure(workload, candidate):
        calls.append(candidate)
        if len(calls) == 2:
            class Held:
                pass

            held = Held()
            ref = weakref.ref(held, lambda _ref: signal.raise_signal(signal.SIGINT))
            del held
            assert ref() is None
        return estimate(workload, candidate)

    register_backend("swallowed", measure, cost=2)
    yield calls
    unregister_backend("swallowed")


@pytest.fixture
def interactive():
    """SIGINT as an interactive shell leaves it (Python's default handler): a test run started in the background
    (`pytest ... &` without job control) inherits it ignored, which the CLI keeps (the next test but one)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_swallowed_in_a_weakref_callback_still_ends_the_run(model_json, cache, capsys, swallowed_interrupt,
                                                                   interactive):
    argv = ["suggest", "--model", model_json, "--gpu", "cpu", "--backend", "swallowed", "--trials", "8",
            "--jobs", "1"]
    assert main(argv) == 130  # main: the search went on to 8 trials and exited 0
    err = capsys.readouterr().err
    assert "interrupted; finished trials are kept" in err and "Exception ignored" not in err
    assert len(swallowed_interrupt) == 2  # ended at the next safe point
    assert main(["studies", "--json"]) == 0
    studies = json.loads(capsys.readouterr().out)["studies"]
    assert [s["trials"] for s in studies if s["backend"] == "swallowed"] == [2]  # what was measured stays


def test_ctrl_c_ignored_by_the_caller_stays_ignored(model_json, cache, capsys, swallowed_interrupt):
    """Started with SIGINT ignored (nohup, `&` in a script): the CLI keeps it ignored, so the same signal ends
    nothing and the search runs to its answer; the caller's disposition is left as it was."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert main(["suggest", "--model", model_json, "--gpu", "cpu", "--backend", "swallowed", "--trials", "8",
                     "--jobs", "1"]) == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(swallowed_interrupt) > 2 and "interrupted" not in capsys.readouterr().err


# ---- messages that blamed the wrong thing -----------------------------------------------------------------------
@pytest.fixture
def baseline_file(tmp_path, cache, model_json, capsys):
    config = _yaml(tmp_path, "max_length: 64\n")
    out = tmp_path / "baseline.json"
    assert main(["baseline", "--model", model_json, "--gpu", "cpu", "--config", str(config), "--backend", "estimate",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    return out, config


@pytest.mark.parametrize("key,value,says", [
    ("gpu", "H1OO", "no such GPU profile"),
    ("dataset", "nosuch.jsonl", "no such file"),
])
def test_check_of_a_hand_edited_baseline_names_the_file_and_its_key(baseline_file, capsys, key, value, says):
    path, config = baseline_file
    data = json.loads(path.read_text())
    data["workload"][key] = value
    path.write_text(json.dumps(data))
    assert main(["check", "--baseline", str(path), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert f"--baseline {path}: workload.{key} " in err and says in err
    assert f"--{key}" not in err  # check has no such flag


def test_a_bad_model_in_a_config_names_the_config_key(tmp_path, cache, capsys):
    config = _yaml(tmp_path, f"model_name_or_path: {tmp_path / 'no-such-model'}/\n")
    assert main(["suggest", "--config", str(config), "--gpu", "cpu", "--backend", "estimate"]) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert f"--config {config}: model_name_or_path " in err and "--model" not in err


def test_a_bad_dataset_in_a_config_names_the_config_key(tmp_path, cache, model_json, capsys):
    config = _yaml(tmp_path, f"model_name_or_path: {model_json}\ndataset_name: ./nothere.jsonl\n")
    assert main(["suggest", "--config", str(config), "--gpu", "cpu", "--backend", "estimate"]) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert f"--config {config}: dataset_name ./nothere.jsonl: no such file" in err and "--dataset" not in err


def test_preference_rows_lacking_rejected_are_named_not_the_chat_template(tmp_path, cache, model_json, capsys,
                                                                         tiny_tokenizer):
    rows = [{"prompt": "hello world", "chosen": "the quick brown fox", "rejected": "the lazy dog"} for _ in range(8)]
    del rows[5]["rejected"]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["suggest", "--model", model_json, "--tokenizer", str(tiny_tokenizer), "--trainer", "dpo",
                 "--dataset", str(data), "--gpu", "cpu", "--backend", "estimate", "--trials", "2"]) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "row 5 lacks the column(s) 'rejected'" in err and "chat template" not in err


def test_a_latin1_file_is_called_latin1_not_binary(tmp_path, cache, model_json, capsys):
    data = tmp_path / "latin.jsonl"
    data.write_bytes("".join(json.dumps({"text": "café crème"}, ensure_ascii=False) + "\n"
                             for _ in range(4)).encode("latin-1"))
    assert main(["suggest", "--model", model_json, "--dataset", str(data), "--gpu", "cpu", "--backend",
                 "estimate"]) == 2
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "another encoding than UTF-8" in err and "binary" not in err and "iconv -f latin1 -t utf-8" in err


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_utf8_file_with_a_bom_is_read_as_datasets_reads_it(tmp_path, suffix):
    import datasets

    from advisor.data import read_raw

    rows = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10]}]
    text = ("".join(json.dumps(r) + "\n" for r in rows) if suffix == ".jsonl" else json.dumps(rows))
    data = tmp_path / f"bom{suffix}"
    data.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    theirs = datasets.load_dataset("json", data_files=str(data), split="train")  # the independent reading
    raw = read_raw(str(data))
    assert [raw.rows[i] for i in range(len(raw.rows))] == [dict(r) for r in theirs]


# ---- the Python API with a value of the wrong type ---------------------------------------------------------------
@pytest.mark.parametrize("kwargs,says", [
    ({"model": 123}, "model=123: expected a hub id or a local directory"),
    ({"gpu": 80}, "gpu=80: expected a GPU profile name"),
    ({"trials": "4"}, "trials='4': expected a whole number of trials"),
    ({"fix": ["optim=sgd"]}, "fix=['optim=sgd']: expected a mapping of field to value, e.g. fix={'optim': "
                             "'adamw_torch'}, got list; write fix={'optim': 'sgd'}"),
    ({"dataset": 5}, "dataset=5: expected a hub id or a local"),
    ({"memory_budget": "4XB"}, "memory_budget '4XB': not a size"),
    ({"headroom": [0.1]}, "headroom=[0.1]: expected a number such as 0.05 or '5%'"),
    ({"allow_wrapped": "yes"}, "allow_wrapped='yes': expected True or False"),
])
def test_a_parameter_of_the_wrong_type_is_named(model_json, kwargs, says):
    import advisor

    args = {"model": model_json, "gpu": "cpu", **kwargs}
    with pytest.raises(advisor.AdvisorError) as info:  # main: the library's own TypeError / AttributeError
        advisor.suggest(args.pop("model"), backend="estimate", cache=False, **args)
    assert isinstance(info.value, ConfigError)
    assert says in str(info.value)


def test_memory_budget_takes_the_clis_syntax(model_json):
    import advisor

    s = advisor.suggest(Path(model_json), gpu="cpu", memory_budget="4GB", headroom="10%", backend="estimate",
                        trials=2, cache=False)
    assert s.workload.goals.memory_budget_bytes == 4 * 10**9 and s.workload.goals.headroom == pytest.approx(0.1)
