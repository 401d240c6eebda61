"""scripts/gpu_validate.py on the CPU: the plan (what runs, in which order, within which budget), the rows written as
each step ends and kept when the run is killed, a step stopped at its cap, the dry run; and (slow) the real code path
on a tiny model with the CPU probe. What the GPU run takes is not measured here."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SCRIPT = SCRIPTS / "gpu_validate.py"


@pytest.fixture(scope="module")
def gv():
    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_validate"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _default(gv):
    steps, left_out = gv.select(None, [], [], vllm=False, calibrate=True)
    kept, dropped = gv.fit_budget(steps, gv.BUDGET_S)
    return steps, kept, dropped, left_out


def test_default_plan_is_the_issue_within_five_minutes(gv):
    every, steps, dropped, left_out = _default(gv)
    assert [s.name for s in steps] == ["prepare", "lora-ckpt", "full-ckpt", "grpo-generate", "calibrate",
                                       "front-door", "pytest-gpu"]
    assert [n for n, _ in dropped] == ["packing-bfd", "full-no-ckpt"]  # --budget 340 keeps them
    assert [s.name for s in gv.fit_budget(every, 340)[0]] == [s.name for s in every]
    assert sum(s.planned_s for s in steps) <= 300
    assert {n for n, _ in left_out} == {"grpo-vllm-colocate", "grpo-vllm-colocate-sleep"}
    without, _ = gv.select(None, [], [], vllm=False, calibrate=False)  # a checkout without gpu_calibrate.py
    assert "calibrate" not in [s.name for s in without]
    pytest_step = steps[-1]
    assert pytest_step.kind is gv.Kind.PYTEST and pytest_step.reserved and pytest_step.cap_s <= 120
    from advisor.profiles import resolve_gpu, resolve_model

    target = gv.Target(resolve_model("Qwen/Qwen2.5-0.5B"), resolve_gpu("H200"), "cuda", 1024, 64, 4)
    cands = {s.name: target.candidate(s.kind, s.knobs) for s in every if s.kind in gv.PROBED}
    sft = [c for n, c in cands.items() if n != "grpo-generate"]
    assert all(c.per_device_train_batch_size == 4 and c.max_length == 1024 for c in sft)
    assert cands["lora-ckpt"].use_lora and cands["lora-ckpt"].weights_dtype.value == "bfloat16"
    assert cands["lora-ckpt"].activation_checkpointing and cands["full-ckpt"].activation_checkpointing
    assert not cands["full-no-ckpt"].activation_checkpointing and not cands["full-ckpt"].use_lora
    assert cands["packing-bfd"].packing and cands["packing-bfd"].effective_padding_free
    assert not cands["grpo-generate"].base.get("use_vllm")
    assert gv.check_candidates(target, every) == []  # every candidate is one TRL accepts on the H200


def test_budget_drops_the_least_valuable_and_keeps_the_reserved(gv):
    steps, _ = gv.select(None, [], [2], vllm=True, calibrate=True)
    names = [s.name for s in steps]
    assert names.index("fsdp2-2gpu") < names.index("pytest-gpu") == len(names) - 1
    kept, dropped = gv.fit_budget(steps, 300)
    assert sum(s.planned_s for s in kept) <= 300 and kept[-1].name == "pytest-gpu"
    assert [n for n, _ in dropped] == names[len(kept) - 1:-1][::-1]  # from the least valuable up
    only, _ = gv.select(["front-door"], [], [], vllm=False, calibrate=False)
    assert [s.name for s in only] == ["front-door"]  # no case: nothing to prepare
    only, _ = gv.select(["lora-ckpt"], [], [], vllm=False, calibrate=False)
    assert [s.name for s in only] == ["prepare", "lora-ckpt"]


def test_a_step_gets_its_cap_or_the_budget_less_the_reserved_time(gv):
    Step, K = gv.Step, gv.Kind
    steps = [Step("a", K.SFT, 20, 60), Step("b", K.SFT, 20, 60), Step("t", K.PYTEST, 80, 120, reserved=True)]
    assert gv.step_timeout(steps, 0, 300) == 60
    assert gv.step_timeout(steps, 1, 100) == 20  # 100 s left, 80 held for the tests
    assert gv.step_timeout(steps, 2, 100) == 100  # the reserved step takes what is left, up to its cap
    assert gv.step_timeout(steps, 2, 300) == 120


def _ctx(tmp_path):
    return SimpleNamespace(sims=SimpleNamespace(poll=lambda: None), started=time.monotonic(), env={"date": "d"},
                           work=tmp_path)


def _report(gv, tmp_path, steps):
    return gv.Report(tmp_path / "out.json", {"backend": "cpu"}, steps, [])


def test_rows_are_written_as_each_step_ends(gv, tmp_path, monkeypatch):
    Step, K = gv.Step, gv.Kind
    steps = [Step("a", K.SFT, 1, 5), Step("g", K.ONLINE, 1, 5), Step("f", K.FRONT_DOOR, 1, 5),
             Step("t", K.PYTEST, 1, 5, reserved=True)]
    seen = []

    def fake(ctx, step, timeout_s):
        doc = json.loads((tmp_path / "out.json").read_text())  # what a kill now would leave
        seen.append([p["status"] for p in doc["plan"]])
        return {"case": step.name, "name": step.name, "status": "ok", "probe": {"peak_bytes": 1}}

    for kind in K:
        monkeypatch.setitem(gv.RUNNERS, kind, fake)
    report = _report(gv, tmp_path, steps)
    assert gv.run_plan(_ctx(tmp_path), steps, report, 60) is True
    assert seen == [["pending"] * 4, ["ok"] + ["pending"] * 3, ["ok"] * 2 + ["pending"] * 2,
                    ["ok"] * 3 + ["pending"]]
    doc = json.loads((tmp_path / "out.json").read_text())
    assert [r["case"] for r in doc["rows"]] == ["a"] and [r["case"] for r in doc["online_rows"]] == ["g"]
    assert [r["name"] for r in doc["checks"]] == ["f", "t"]
    assert all(r["environment"] == {"date": "d"} and r["wall_s"] >= 0 for r in doc["checks"])


def test_a_step_past_its_cap_is_stopped_and_the_next_still_runs(gv, tmp_path, monkeypatch):
    Step, K = gv.Step, gv.Kind
    steps = [Step("slow", K.SFT, 1, 1), Step("next", K.SFT, 1, 5), Step("late", K.SFT, 10, 20),
             Step("t", K.PYTEST, 3, 5, reserved=True)]

    def fake(ctx, step, timeout_s):
        if step.name == "slow":
            time.sleep(60)
        return {"case": step.name, "status": "ok"}

    monkeypatch.setitem(gv.RUNNERS, K.SFT, fake)
    monkeypatch.setitem(gv.RUNNERS, K.PYTEST, fake)
    report = _report(gv, tmp_path, steps)
    start = time.monotonic()
    assert gv.run_plan(_ctx(tmp_path), steps, report, 6) is False
    assert time.monotonic() - start < 10
    doc = json.loads((tmp_path / "out.json").read_text())
    status = {p["name"]: p["status"] for p in doc["plan"]}
    assert status == {"slow": "timeout", "next": "ok", "late": "skipped", "t": "ok"}
    late = next(p for p in doc["plan"] if p["name"] == "late")
    assert "under half its planned 10 s" in late["reason"]  # 6 s budget: 3 held for the tests


def test_a_command_past_its_cap_is_stopped_with_its_group(gv, tmp_path, monkeypatch):
    steps_mod = sys.modules["gpu_validate_steps"]
    monkeypatch.setattr(steps_mod, "GRACE_S", 1.0)
    # ignores SIGTERM (the stop signal), starts a child in its group: both are killed after the grace
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    code = (f"import subprocess, sys, time; exec({stubborn!r}.split('; time')[0]); "
            f"p = subprocess.Popen([sys.executable, '-c', {stubborn!r}]); print(p.pid, flush=True); time.sleep(60)")
    start = time.monotonic()
    row = steps_mod.run_command("hang", [sys.executable, "-c", code], 3.0, tmp_path, stop=signal.SIGTERM)
    assert time.monotonic() - start < 10
    assert row["status"] == "timeout" and row["returncode"] == -signal.SIGKILL
    child = Path(f"/proc/{int(row['stdout'].split()[0])}/stat")
    time.sleep(0.2)
    assert not child.exists() or child.read_text().split(") ")[1].startswith("Z")  # gone, or a zombie
    ok = steps_mod.run_command("ok", [sys.executable, "-c", "print('fine')"], 30.0, tmp_path, stop=signal.SIGTERM)
    assert ok["status"] == "ok" and ok["returncode"] == 0 and ok["stdout"].strip() == "fine"


WRAPPER = """
import importlib.util, json, sys, time
spec = importlib.util.spec_from_file_location("gpu_validate", {script!r})
gv = importlib.util.module_from_spec(spec)
sys.modules["gpu_validate"] = gv
spec.loader.exec_module(gv)

def fake(ctx, step, timeout_s):
    if step.name == "pytest-gpu":
        time.sleep(3600)
    return {{"case": step.name, "name": step.name, "status": "ok", "probe": {{"peak_bytes": 1}}}}

for kind in gv.Kind:
    gv.RUNNERS[kind] = fake
sys.exit(gv.main(sys.argv[1:]))
"""


def test_a_killed_run_keeps_every_row_it_finished(tmp_path):
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER.format(script=str(SCRIPT)))
    out = tmp_path / "run.json"
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, str(wrapper), "--backend", "cpu", "--tiny", "--out", str(out),
                             "--work-dir", str(tmp_path / "work")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        done: list[str] = []
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists():
                done = [p["name"] for p in json.loads(out.read_text())["plan"] if p["status"] == "ok"]
                if "front-door" in done:
                    break
            time.sleep(0.1)
        assert "front-door" in done, proc.stdout.read().decode() if proc.poll() is not None else done
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)  # no cleanup, no last write
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and doc["schema_version"] == 2 and doc["backend"] == "cpu"
    status = {p["name"]: p["status"] for p in doc["plan"]}
    assert [n for n, s in status.items() if s == "ok"] == ["prepare", "lora-ckpt", "full-ckpt", "grpo-generate",
                                                          "calibrate", "front-door"]
    assert status["pytest-gpu"] == "pending"
    assert [r["case"] for r in doc["rows"]] == ["lora-ckpt", "full-ckpt"]
    assert [r["case"] for r in doc["online_rows"]] == ["grpo-generate"]
    assert not list(out.parent.glob(f".{out.name}.*"))  # no temporary file left beside it


def test_dry_run_prints_each_steps_planned_time_and_the_total(gv, capsys):
    assert gv.main(["--dry-run", "--gpu", "H200"]) == 0
    out = capsys.readouterr().out
    assert "Qwen/Qwen2.5-0.5B, gpu profile H200, backend cuda, batch 4 x 1024" in out
    for name in ("lora-ckpt", "full-ckpt", "full-no-ckpt", "packing-bfd", "grpo-generate", "front-door",
                 "pytest-gpu"):
        assert name in out
    assert "total planned 295 s of the 300 s budget" in out
    assert "calibrate" in out and "not run: full-no-ckpt: over the 300 s budget (planned 20 s)" in out


def test_plan_from_an_earlier_run(gv, tmp_path, capsys):
    earlier = tmp_path / "h200.json"
    earlier.write_text(json.dumps({"plan": [{"name": "front-door", "status": "ok", "wall_s": 212.4},
                                            {"name": "lora-ckpt", "status": "timeout", "wall_s": 60}]}))
    assert gv.main(["--dry-run", "--gpu", "H200", "--plan-from", str(earlier)]) == 0
    out = capsys.readouterr().out
    # the measured 212 s puts the plan over the budget: the least valuable steps go first, the front door with them
    assert "not run: front-door: over the 300 s budget (planned 212 s)" in out
    assert "not run: packing-bfd" in out and "not run: full-no-ckpt" in out and "grpo-generate" in out


def test_bad_flags_name_the_flag(gv, capsys):
    with pytest.raises(SystemExit):
        gv.main(["--dry-run", "--only", "lora"])
    assert "--only lora: not a step" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gv.main(["--dry-run", "--budget", "0"])
    assert "--budget 0: must be positive" in capsys.readouterr().err


def test_cuda_without_gpu_is_a_usage_error(gv, monkeypatch, capsys):
    import advisor.profiles

    monkeypatch.setattr(advisor.profiles, "detect_gpu", lambda: None)
    assert gv.main(["--backend", "cuda"]) == 2
    assert "--backend cuda: no CUDA GPU found" in capsys.readouterr().err


def test_front_door_summary_counts_each_trials_outcome(gv):
    d = {"config": {"optim": "adamw_torch_fused"}, "source": "probe-cuda", "evaluations": 3,
         "trials": [{"number": 0, "why": "chosen", "measurement": {"status": "ok", "peak_bytes": 5}},
                    {"number": 1, "measurement": {"status": "error", "message": "ImportError before training"}}]}
    s = sys.modules["gpu_validate_steps"].front_door_summary(json.dumps(d))
    assert s["trial_statuses"] == {"ok": 1, "error": 1} and s["pick"] == {"optim": "adamw_torch_fused"}
    assert s["trials"][1]["message"] == "ImportError before training"
    assert sys.modules["gpu_validate_steps"].front_door_summary("Traceback ...") == {"parsed": False}


@pytest.mark.slow
def test_tiny_cpu_run_writes_each_case_beside_its_simulation(gv, tmp_path):
    out = tmp_path / "cpu.json"
    rc = gv.main(["--backend", "cpu", "--tiny", "--only", "full-ckpt", "lora-ckpt", "--simulate", "ahead",
                  "--budget", "600", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["complete"] is True and data["versions"]["trl"] and data["date"]
    assert [r["case"] for r in data["rows"]] == ["lora-ckpt", "full-ckpt"]
    for row in data["rows"]:
        assert row["probe"]["status"] == "ok" and row["simulate"]["status"] == "ok"
        # on the CPU the simulator predicts the probe's allocator peak closely
        assert row["simulate_over_probe"]["peak_bytes"] == pytest.approx(1.0, abs=0.05)
        assert len(row["probe"]["step_times_s"]) == 2 and row["probe"]["setup_s"] > 0
        assert "loaded by path" in row["how"]["weights"] and "separate process" in row["how"]["simulate"]
        assert row["environment"]["torch"] and row["wall_s"] > 0
