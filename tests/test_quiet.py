"""Quiet by default: what TRL and friends say per trainer is collected and named once in the report; stderr carries
the assumption lines and one progress bar, nothing else (all of it with --verbose)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import warnings

import pytest
from conftest import TINY_QWEN2
from test_storage_concurrency import cli_env

from advisor._messages import capture, summarize

# TRL warns "[RANK 0] You are using a per_device_train_batch_size of 1 with padding-free training..." once per
# trainer built: the simulator builds one per simulated depth, so three per candidate.
NOISY = ["--fix", "per_device_train_batch_size=1", "--fix", "padding_free=true", "--fix", "packing=false",
         "--fix", "max_length=none", "--tokens-per-step", "256", "--trials", "2"]
TRL_SAYS = "per_device_train_batch_size of 1 with padding-free training"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture
def config_json(tmp_path):
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_QWEN2))
    return path


def test_capture_collects_warnings_logs_and_prints_and_hands_them_outward():
    root = logging.getLogger()
    before = root.handlers[:]
    with capture() as outer:
        with capture() as inner:
            warnings.warn("a library warning", UserWarning, stacklevel=1)
            warnings.warn("a library warning", UserWarning, stacklevel=1)
            logging.getLogger("trl.trainer.sft_trainer").warning("[RANK 0] per trainer")
            logging.getLogger("transformers.trainer").warning("from transformers")
            logging.getLogger("trl").info("below WARNING: not collected")
            print("a print\r100%")
        assert inner[("UserWarning", "a library warning")] == 2
    assert root.handlers == before, "the caller's handlers are back"
    said = {str(m) for m in summarize(outer)}
    assert said == {"[UserWarning] a library warning (x2)", "[trl.trainer.sft_trainer] [RANK 0] per trainer",
                    "[transformers.trainer] from transformers", "[stdout] 100%"}


def _on_a_terminal(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal (so it draws its bar), stdout on a pipe."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen([sys.executable, "-m", "advisor", *args], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    out = proc.stdout.read().decode()
    proc.wait(timeout=600)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_the_front_doors_stderr_is_the_assumption_lines_and_the_progress_bar(config_json, tmp_path):
    rc, out, err = _on_a_terminal(["suggest", "--model", str(config_json), *NOISY], cli_env(tmp_path / "cache"))
    assert rc == 0, err[-3000:]
    pieces = [p.strip() for p in re.split(r"[\r\n]+", _ANSI.sub("", err)) if p.strip()]
    other = [p for p in pieces if not p.startswith("advisor: ") and not re.search(r"\d+(/\d+)? ?\[.*cand", p)
             and not re.fullmatch(r"\d+%\|.*\|.*", p) and not re.fullmatch(r"\d+cand.*", p)]
    assert not other, f"stderr carries more than assumption lines and the bar: {other}"
    assert any(p.startswith("advisor: ") for p in pieces), "the assumption lines are there"
    assert any("best" in p and "tok/s" in p for p in pieces), f"the bar shows the best so far: {pieces}"
    assert TRL_SAYS not in err
    assert out.count(TRL_SAYS) == 1, "the report names TRL's message once"


@pytest.mark.slow
def test_verbose_lists_every_distinct_message_on_stderr(config_json, capsys, monkeypatch, tmp_path):
    from advisor.cli import main

    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["suggest", "--model", str(config_json), *NOISY, "--format", "json", "--verbose"]) == 0
    out, err = capsys.readouterr()
    listed = [line for line in err.splitlines() if line.startswith("advisor: while measuring: ")]
    assert len(listed) == len(set(listed)) >= 1 and sum(TRL_SAYS in line for line in listed) == 1, err
    assert re.search(r"\(x\d+\)$", next(line for line in listed if TRL_SAYS in line)), "with how often"
    notes = json.loads(out)["notes"]
    assert sum(TRL_SAYS in n for n in notes) == 1
