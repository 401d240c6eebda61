"""Several `advisor suggest` processes on one SQLite cache, a killed run, and caches that cannot be written.

Real processes of the real CLI (python -m advisor), on a tiny model's config.json: what a user runs.
tests/test_postgres.py runs the same checks on a PostgreSQL server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_QWEN2

ROOT = Path(__file__).resolve().parents[1]
# A small run: one method, one optimizer, three candidates (a simulation of the tiny model takes ~1 s).
SMALL = ["--gpu", "L4", "--method", "full", "--fix", "optim=adamw_torch", "--trials", "3", "--format", "json"]


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_QWEN2))
    return path


def cli_env(cache: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ADVISOR_CACHE_DIR", "XDG_CACHE_HOME")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if cache is not None:
        env["ADVISOR_CACHE_DIR"] = str(cache)
    env.update(extra)
    return env


def start(args: list[str], env: dict[str, str], prefix: list[str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([*(prefix or []), sys.executable, "-m", "advisor", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def run_cli(args: list[str], env: dict[str, str], prefix: list[str] | None = None) -> tuple[int, str, str]:
    return finish(start(args, env, prefix))


def together(args: list[str], env: dict[str, str], n: int = 2) -> list[tuple[int, str, str]]:
    """`n` identical runs started at the same moment."""
    procs = [start(args, env) for _ in range(n)]
    return [finish(p) for p in procs]


def study_trials(url: str) -> list:
    """Every trial of every study in the storage at `url`."""
    import optuna

    from advisor.search import open_storage

    store = open_storage(url)
    out = []
    for summary in optuna.get_all_study_summaries(store, include_best_trial=False):
        out += optuna.load_study(study_name=summary.study_name, storage=store).get_trials(deepcopy=False)
    return out


def check_study(url: str) -> None:
    """No trial left RUNNING, and no candidate measured twice."""
    from optuna.trial import TrialState

    trials = study_trials(url)
    assert trials, "the runs stored their trials"
    running = [t.number for t in trials if t.state is TrialState.RUNNING]
    assert not running, f"trials left RUNNING: {running}"
    measured = [t.user_attrs["key"] for t in trials if t.state is TrialState.COMPLETE
                and t.user_attrs.get("measured") and not t.user_attrs.get("cached")]
    assert measured and len(measured) == len(set(measured)), "a candidate was measured twice"
    for t in trials:  # what optuna-dashboard shows: plain JSON, no NaN
        json.dumps(t.user_attrs, allow_nan=False)


def assert_agree(results: list[tuple[int, str, str]]) -> dict:
    for rc, _out, err in results:
        assert rc == 0, err[-3000:]
        assert "database is locked" not in err and "Traceback" not in err, err[-3000:]
    picks = [json.loads(out) for _, out, _ in results]
    assert all(p["config"] == picks[0]["config"] for p in picks), [p["config"] for p in picks]
    assert all(p["tokens_per_second"] == picks[0]["tokens_per_second"] for p in picks)
    return picks[0]


@pytest.mark.parametrize("backend", ["estimate", pytest.param("simulate", marks=pytest.mark.slow)])
def test_two_suggest_runs_on_an_empty_sqlite_cache_agree(tiny_config, tmp_path, backend):
    """Both create the schema and the study at once (once: `UNIQUE constraint failed: alembic_version`) and pop
    queued trials at once (once: both ran one trial, the second tell crashed with UpdateFinishedTrialError)."""
    cache = tmp_path / "cache"
    args = ["suggest", "--model", str(tiny_config), "--backend", backend, *SMALL]
    if backend == "estimate":
        args = [a for a in args if a not in ("--trials", "3")] + ["--trials", "20"]
    pick = assert_agree(together(args, cli_env(cache)))
    check_study(f"sqlite:///{cache / 'studies.sqlite3'}")
    rc, out, err = run_cli(args, cli_env(cache))  # and a third run answers from what they stored
    assert rc == 0 and json.loads(out)["config"] == pick["config"] and json.loads(out)["evaluations"] == 0, err


def wait_for_measuring(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    """Until a trial of `proc` is RUNNING and claimed for measuring (the moment to kill it)."""
    from optuna.trial import TrialState

    db = url.removeprefix("sqlite:///")
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if not url.startswith("sqlite") or Path(db).exists():
            try:
                if any(t.state is TrialState.RUNNING and t.user_attrs.get("measuring") for t in study_trials(url)):
                    return
            except Exception:  # the schema is being made right now
                pass
        time.sleep(0.2)
    raise AssertionError(f"no trial was measured within {timeout_s} s")


def killed_then_rerun(args: list[str], env: dict[str, str], url: str) -> dict:
    """kill -9 a run while it measures, run it again: it answers, and no trial is left RUNNING."""
    from optuna.trial import TrialState

    victim = start(args, env)
    wait_for_measuring(url, victim)
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=60)
    # one RUNNING trial per candidate in flight (the pool measures up to --jobs at once)
    running = [t for t in study_trials(url) if t.state is TrialState.RUNNING]
    assert running, "the victim was killed while measuring"
    assert all(t.user_attrs.get("owner") for t in running), "a trial names the process that measures it"
    rc, out, err = run_cli(args, env)
    assert rc == 0, err[-3000:]
    trials = {t.number: t for t in study_trials(url)}
    for left in running:
        if "key" not in left.user_attrs:  # killed while its candidate was being asked for: none was claimed
            assert trials[left.number].state is TrialState.FAIL and trials[left.number].user_attrs.get("stale")
            continue
        after = {t.number: t for t in trials.values() if t.user_attrs.get("key") == left.user_attrs["key"]}
        assert after[left.number].state is TrialState.FAIL and after[left.number].user_attrs.get("stale")
        assert any(t.state is TrialState.COMPLETE and t.user_attrs.get("measured") for t in after.values()), (
            "the killed trial's candidate is measured again")
    check_study(url)
    return json.loads(out)


@pytest.mark.slow
def test_a_killed_run_leaves_no_trial_running_after_the_next_run(tiny_config, tmp_path):
    cache = tmp_path / "cache"
    args = ["suggest", "--model", str(tiny_config), "--backend", "simulate", *SMALL]
    resumed = killed_then_rerun(args, cli_env(cache), f"sqlite:///{cache / 'studies.sqlite3'}")
    assert resumed["config"], "the resumed run answers"


def test_a_resumed_run_answers_as_a_fresh_run(tiny_config, tmp_path):
    """The killed trial's candidate is measured first on resume (liveness.ask pops "retry" trials before the
    seeds still waiting), so with --trials 3 the resumed run measures the same 3 candidates as a fresh run."""
    cache = tmp_path / "cache"
    args = ["suggest", "--model", str(tiny_config), "--backend", "simulate", *SMALL]
    resumed = killed_then_rerun(args, cli_env(cache), f"sqlite:///{cache / 'studies.sqlite3'}")
    rc, out, err = run_cli(args, cli_env(tmp_path / "fresh"))
    assert rc == 0 and json.loads(out)["config"] == resumed["config"], "the resumed run gives the same answer"


# ---- caches that cannot be written -----------------------------------------------------------------------------
def unprivileged() -> list[str]:
    """A command prefix under which file permissions apply (root ignores them): root without DAC override."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv (util-linux): cannot make a directory read-only for root")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]


def assert_one_note(err: str, *, names: str | None, says: str, storage: bool = False) -> str:
    """stderr has exactly one line about the cache; it names `names` (what the user set) and --storage only
    when the user passed it."""
    lines = [line for line in err.splitlines() if "answering" in line]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err and ("--storage" in err) == storage, err[-3000:]
    assert says in lines[0], lines[0]
    if names is not None:
        assert names in lines[0], lines[0]
    else:
        assert "$ADVISOR_CACHE_DIR=" not in lines[0], lines[0]
    return lines[0]


def run_here(args: list[str], capsys, monkeypatch, **env: str) -> tuple[int, str, str]:
    """The CLI in this process (no second torch import), with `env` as its environment's cache settings."""
    from advisor.cli import main

    for k in ("ADVISOR_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_a_cache_dir_that_is_a_file_answers_without_storing(tiny_config, tmp_path, where, capsys, monkeypatch):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    cache = blocker if where == "file" else blocker / "advisor"
    args = ["suggest", "--model", str(tiny_config), "--backend", "estimate", *SMALL]
    rc, out, err = run_here(args, capsys, monkeypatch, ADVISOR_CACHE_DIR=str(cache))
    assert rc == 0, err
    line = assert_one_note(err, names=f"$ADVISOR_CACHE_DIR={cache}", says="answering without storing")
    assert ("is a file" if where == "file" else "lies under a file") in line
    assert any("answering without storing" in n for n in json.loads(out)["notes"]), "the report says it too"
    assert blocker.read_text() == "not a directory"


def test_the_default_cache_unusable_does_not_blame_a_variable_the_user_never_set(tiny_config, tmp_path, capsys,
                                                                                  monkeypatch):
    home = tmp_path / "home"
    home.write_text("HOME is a file")
    args = ["suggest", "--model", str(tiny_config), "--backend", "estimate", *SMALL]
    rc, out, err = run_here(args, capsys, monkeypatch, HOME=str(home))
    assert rc == 0, err
    assert_one_note(err, names=f"the cache {home / '.cache' / 'advisor'}", says="answering without storing")


@pytest.fixture
def writable_again(tmp_path):
    """Give back write permission under tmp_path after a test that took it away (so it can be cleaned up)."""
    yield
    for p in [tmp_path, *tmp_path.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode | 0o200)


def test_an_empty_read_only_cache_answers_without_storing(tiny_config, tmp_path, writable_again):
    prefix = unprivileged()
    cache = tmp_path / "ro"
    cache.mkdir()
    cache.chmod(0o555)
    args = ["suggest", "--model", str(tiny_config), "--backend", "estimate", *SMALL]
    rc, out, err = run_cli(args, cli_env(cache), prefix)
    assert rc == 0, err
    assert_one_note(err, names=f"$ADVISOR_CACHE_DIR={cache}", says="read-only")
    assert not any(cache.iterdir())


@pytest.mark.parametrize("given", ["cache", "--storage"])
def test_a_read_only_cache_that_holds_the_answer_still_answers(tiny_config, tmp_path, writable_again, given):
    prefix = unprivileged()
    cache = tmp_path / "ro"
    db = cache / "studies.sqlite3"
    args = ["suggest", "--model", str(tiny_config), "--backend", "estimate", *SMALL]
    if given == "--storage":
        cache.mkdir()
        args += ["--storage", f"sqlite:///{db}"]
    rc, out, err = run_cli(args, cli_env(cache))
    assert rc == 0, err
    stored = json.loads(out)
    before = db.read_bytes()
    db.chmod(0o444)
    cache.chmod(0o555)
    rc, out, err = run_cli(args, cli_env(cache), prefix)
    assert rc == 0, err
    names = f"$ADVISOR_CACHE_DIR={cache}" if given == "cache" else f"--storage sqlite:///{db}"
    assert_one_note(err, names=names, says="answering from the studies stored there", storage=given == "--storage")
    again = json.loads(out)
    assert again["config"] == stored["config"] and again["evaluations"] == 0, "read, not measured again"
    assert db.read_bytes() == before
