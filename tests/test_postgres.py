"""`--storage postgresql://...` against a real PostgreSQL server that the tests start (Debian's postgresql).

A throwaway cluster: initdb into a temporary directory, pg_ctl start on a unix socket only (no TCP port), as
the `postgres` user when the tests run as root (the server refuses root). Without the binaries or the driver
the tests skip, saying what to install; `.ci/run` installs both and sets ADVISOR_REQUIRE_POSTGRES=1, which turns
the skip into a failure there.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import itertools
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import TINY_QWEN2
from test_storage_concurrency import (  # the same checks as on SQLite
    SMALL,
    assert_agree,
    check_study,
    cli_env,
    finish,
    killed_then_rerun,
    start,
    study_trials,
    together,
)

from advisor import search
from advisor.measurement import Measurement
from advisor.workload import Goals

NARROW = {"optim": "adamw_torch", "group_by_length": "false", "packing": "false", "padding_free": "false",
          "checkpoint_selective": "false", "checkpoint_every_n_layers": "1"}
_DBS = itertools.count()


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):  # Debian keeps them off PATH
        if os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    return None


def _unavailable(reason: str) -> None:
    if os.environ.get("ADVISOR_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"ADVISOR_REQUIRE_POSTGRES=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def pg_server():
    """A PostgreSQL cluster for this module: {"host": socket directory, "port": number}."""
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    if not (initdb and pg_ctl):
        _unavailable("PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql")
    if importlib.util.find_spec("psycopg") is None:
        _unavailable("the PostgreSQL driver is not installed: pip install 'advisor[postgres]'")
    base = Path(tempfile.mkdtemp(prefix="advisor-pg-"))  # short: a unix socket path has ~100 characters
    as_user: list[str] = []
    if os.geteuid() == 0:
        import pwd

        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            _unavailable("running as root and there is no `postgres` user to run the server as")
        if shutil.which("runuser") is None:
            _unavailable("running as root without runuser (util-linux) to start the server as `postgres`")
        os.chown(base, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, log, port = base / "data", base / "server.log", 50000 + os.getpid() % 10000
    subprocess.run([*as_user, initdb, "-D", str(data), "-U", "advisor", "--auth=trust", "-E", "UTF8",
                    "--no-sync"], check=True, capture_output=True)
    options = f"-k {base} -p {port} -c listen_addresses='' -c fsync=off -c max_connections=200"
    started = subprocess.run([*as_user, pg_ctl, "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "120",
                              "start"], capture_output=True, text=True)
    if started.returncode != 0:
        text = log.read_text() if log.exists() else ""
        shutil.rmtree(base, ignore_errors=True)
        pytest.fail(f"pg_ctl start failed: {started.stderr}\n{text[-2000:]}")
    try:
        yield {"host": str(base), "port": port}
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server):
    """A fresh, empty database on the server, as the URL a user passes to --storage."""
    import psycopg

    name = f"advisor_{os.getpid()}_{next(_DBS)}"
    with psycopg.connect(host=pg_server["host"], port=pg_server["port"], user="advisor", dbname="postgres",
                         autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"postgresql://advisor@/{name}?host={pg_server['host']}&port={pg_server['port']}"


@pytest.fixture
def config_json(tmp_path):
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_QWEN2))
    return path


@pytest.fixture
def budget_workload(tiny_workload):
    return dataclasses.replace(tiny_workload, goals=Goals(tokens_per_step=2048, memory_budget_bytes=10**9))


def fake_measure(w, c):
    """Memory grows with micro-batch x length, falls with checkpointing; big micro-batches are fast."""
    length = c.max_length or 256
    act = c.per_device_train_batch_size * length * 4e5 * (0.3 if c.activation_checkpointing else 1.0)
    dev = int(2e8 + act)
    tps = 1000 * c.per_device_train_batch_size ** 0.5 * (0.75 if c.activation_checkpointing else 1.0)
    if dev > 1.2e9:
        return Measurement("oom", "probe-cpu", message="fake OOM")
    return Measurement("ok", "probe-cpu", peak_bytes=dev, reserved_bytes=dev, device_bytes=dev, tokens_per_second=tps)


def _slow_fake(w, c):
    import time

    time.sleep(0.2)  # long enough that the workers take their share of the queue
    return fake_measure(w, c)


def _worker(url, workload, out, die_at=None):
    """`advisor worker` (run_worker) in a forked process; with `die_at`, it dies hard (no handler runs) while
    measuring its die_at-th candidate."""
    calls = []

    def backend(w, c):
        if die_at is not None and len(calls) + 1 == die_at:
            os._exit(3)
        calls.append(1)
        return _slow_fake(w, c)

    search.register_backend("fake", backend)
    out.put(search.run_worker(url, "shared", workload=workload, idle_s=6.0))


def _lead(url, workload, backend=_slow_fake):
    search.register_backend("fake", backend)
    try:
        return search.suggest(workload, backend="fake", exhaustive=True, storage=url, study_name="shared",
                              fix=NARROW, method="full")
    finally:
        search.unregister_backend("fake")


def _grid_best(workload):
    search.register_backend("fake", fake_measure)
    try:
        return search.suggest(workload, backend="fake", exhaustive=True, cache=False, fix=NARROW, method="full")
    finally:
        search.unregister_backend("fake")


def _measured_keys(url):
    from optuna.trial import TrialState

    return [t.user_attrs["key"] for t in study_trials(url) if t.state is TrialState.COMPLETE
            and t.user_attrs.get("measured") and not t.user_attrs.get("cached")]


def test_a_leader_and_two_workers_never_measure_a_candidate_twice(pg_url, budget_workload):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(pg_url, budget_workload, out)) for _ in range(2)]
    for p in workers:
        p.start()
    s = _lead(pg_url, budget_workload)
    for p in workers:
        p.join(120)
    counts = [out.get(timeout=10) for _ in workers]
    assert [p.exitcode for p in workers] == [0, 0]
    measured = _measured_keys(pg_url)
    assert len(measured) == len(set(measured)) == s.evaluations
    assert all(n > 0 for n in counts), f"both workers took part: {counts}"
    assert sum(counts) < s.evaluations, "the leader measured too"
    check_study(pg_url)
    assert s.candidate == _grid_best(budget_workload).candidate


def test_a_killed_workers_candidate_is_measured_again(pg_url, budget_workload):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    dying = ctx.Process(target=_worker, args=(pg_url, budget_workload, out, 1))
    steady = ctx.Process(target=_worker, args=(pg_url, budget_workload, out))
    dying.start()
    steady.start()
    s = _lead(pg_url, budget_workload)
    dying.join(120)
    steady.join(120)
    assert dying.exitcode == 3, "the dying worker took a candidate and died measuring it"
    from optuna.trial import TrialState

    trials = study_trials(pg_url)
    (killed,) = [t for t in trials if t.user_attrs.get("stale")]
    assert killed.state is TrialState.FAIL
    measured = _measured_keys(pg_url)
    assert killed.user_attrs["key"] in measured, "its candidate was measured again"
    assert len(measured) == len(set(measured)) == s.evaluations
    check_study(pg_url)
    assert s.candidate == _grid_best(budget_workload).candidate


def _dying_leader(url, workload):
    calls = []

    def dying(w, c):
        if len(calls) == 2:
            os._exit(3)
        calls.append(1)
        return fake_measure(w, c)

    _lead(url, workload, dying)


def test_a_second_leader_resumes(pg_url, budget_workload):
    from optuna.trial import TrialState

    first = mp.get_context("fork").Process(target=_dying_leader, args=(pg_url, budget_workload))
    first.start()
    first.join(120)
    assert first.exitcode == 3
    (left,) = [t for t in study_trials(pg_url) if t.state is TrialState.RUNNING]
    seen = []

    def counting(w, c):
        from advisor.search import candidate_key

        seen.append(candidate_key(c))
        return fake_measure(w, c)

    s = _lead(pg_url, budget_workload, counting)
    assert left.user_attrs["key"] in seen, "the killed trial's candidate is measured again"
    # a deterministic backend's measurement is its own confirmation: nothing is measured twice
    assert len(seen) == s.evaluations, "the two finished before the kill are not repeated"
    assert sum(t.cached and t.measurement.ok for t in s.trials) == 2
    check_study(pg_url)
    assert s.candidate == _grid_best(budget_workload).candidate


@pytest.mark.parametrize("backend", ["estimate", pytest.param("simulate", marks=pytest.mark.slow)])
def test_two_suggest_runs_on_postgres_agree(config_json, pg_url, backend):
    args = ["suggest", "--model", str(config_json), "--backend", backend, "--storage", pg_url, *SMALL]
    pick = assert_agree(together(args, cli_env(None)))
    check_study(pg_url)
    assert pick["evaluations"] >= 1


@pytest.mark.slow
def test_a_killed_run_on_postgres_leaves_no_trial_running(config_json, pg_url):
    args = ["suggest", "--model", str(config_json), "--backend", "simulate", "--storage", pg_url, *SMALL]
    killed_then_rerun(args, cli_env(None), pg_url)


@pytest.mark.slow
def test_advisor_worker_processes_join_a_postgres_study(config_json, pg_url):
    """The real `advisor worker` command: two of them and a leader on a small grid, simulated."""
    small = {**NARROW, "max_length": "none", "activation_checkpointing": "false", "activation_offloading": "false"}
    fixes = [a for k, v in small.items() for a in ("--fix", f"{k}={v}")]  # 8 candidates
    workers = [start(["worker", "--storage", pg_url, "--study", "shared", "--idle", "20", "--json"], cli_env(None))
               for _ in range(2)]
    leader = start(["suggest", "--model", str(config_json), "--backend", "simulate", "--storage", pg_url,
                    "--study", "shared", "--exhaustive", "--gpu", "L4", "--method", "full", "--format", "json",
                    *fixes], cli_env(None))
    rc, out, err = finish(leader)
    assert rc == 0, err[-3000:]
    results = [finish(w) for w in workers]
    assert all(r[0] == 0 for r in results), [r[2][-2000:] for r in results]
    measured = _measured_keys(pg_url)
    counted = json.loads(out)["evaluations"]
    assert len(measured) == len(set(measured)) == counted
    assert sum(json.loads(r[1])["measured"] for r in results) <= counted
    check_study(pg_url)
