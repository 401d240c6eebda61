"""SIGTERM to `advisor suggest` (a scheduler's kill, `timeout`): the simulator's worker processes and their server
stop with it, the run exits 143, and what it had measured is kept for the rerun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from test_pool import _alive
from test_pool import _descendants as _children


def test_sigterm_stops_the_workers_and_exits_143(tiny_config, tmp_path):
    env = dict(os.environ, ADVISOR_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "advisor", "suggest", "--model", tiny_config, "--gpu", "cpu",
                             "--backend", "simulate", "--jobs", "2", "--format", "json"], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        seen: set[int] = set()
        while time.monotonic() < deadline and proc.poll() is None:
            seen |= _children(proc.pid)
            if len(seen) >= 2:  # the workers' server and at least one worker (or the resource tracker)
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the search ended before its workers started: nothing to terminate"
        assert seen, "no worker process started"
        time.sleep(1.0)
        seen |= _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err.decode()[-2000:]
    assert b"terminated; finished trials are kept" in err
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in seen if _alive(p)], "a worker process or its server outlived the terminated run"
