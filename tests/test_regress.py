"""Baseline files, tolerance parsing and the comparison logic of advisor.regress (no measuring here)."""

from __future__ import annotations

import json

import pytest

from advisor.baseline import SCHEMA_VERSION, Baseline, load_baseline
from advisor.cli import main
from advisor.errors import BaselineError, UsageError
from advisor.inputs import WorkloadRef
from advisor.measurement import Measurement, Source, Status
from advisor.regress import CheckResult, Verdict, compare_rows, parse_tolerance
from advisor.render import check_markdown, check_table, check_verdict, format_bytes
from advisor.space import Candidate
from advisor.workload import Goals, Method

MiB = 2**20


def _baseline(**changes) -> Baseline:
    fields = dict(
        peak_bytes=100 * MiB, reserved_bytes=110 * MiB, device_bytes=120 * MiB,
        breakdown={"parameters": 40 * MiB, "activations": 50 * MiB, "optimizer_state": 10 * MiB},
        backend="estimate", source="estimate",
        workload=WorkloadRef(model="some/model", gpu="cpu", goals=Goals(tokens_per_step=2048, method=Method.LORA),
                             fingerprint="abc"),
        candidate=Candidate(max_length=256, per_device_train_batch_size=2),
        versions={"torch": "2.13.0", "transformers": "5.24.0", "trl": "1.16.0", "peft": "0.21.2"},
        created="2026-01-01T00:00:00+00:00", config_path="RUN.yaml",
    )
    fields.update(changes)
    return Baseline(**fields)


def _now(activations: int, status: Status = Status.OK) -> Measurement:
    breakdown = {"parameters": 40 * MiB, "activations": activations, "optimizer_state": 10 * MiB}
    peak = sum(breakdown.values())
    return Measurement(status=status, source=Source.ESTIMATE, peak_bytes=peak, reserved_bytes=peak + 10 * MiB,
                       device_bytes=peak + 20 * MiB, breakdown=breakdown)


def _result(base: Baseline, now: Measurement, tolerance: float = 0.01) -> CheckResult:
    return CheckResult(baseline=base, measurement=now, candidate=base.candidate, tolerance=tolerance,
                       rows=compare_rows(base.totals(), base.breakdown, now))


@pytest.mark.parametrize(("text", "value"), [("1%", 0.01), ("0.01", 0.01), (" 2.5% ", 0.025), ("0", 0.0)])
def test_parse_tolerance_accepts_percent_and_fraction(text, value):
    assert parse_tolerance(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["abc", "5", "150%", "-1%"])
def test_parse_tolerance_rejects_with_the_flag_named(text):
    with pytest.raises(UsageError, match="--tolerance"):
        parse_tolerance(text)


def test_baseline_round_trips_through_its_file(tmp_path):
    base = _baseline()
    path = base.save(tmp_path / "sub" / "b.json")
    loaded = load_baseline(path)
    assert loaded == base
    assert loaded.workload.goals.method is Method.LORA
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert set(data["versions"]) == {"torch", "transformers", "trl", "peft"}


def test_missing_baseline_names_the_file_and_the_fix(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(BaselineError, match="no such file") as exc:
        load_baseline(path)
    assert str(path) in str(exc.value) and "advisor baseline" in str(exc.value)
    assert exc.value.exit_code == 2


def test_truncated_baseline_is_reported(tmp_path):
    path = _baseline().save(tmp_path / "b.json")
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(BaselineError, match="truncated") as exc:
        load_baseline(path)
    assert str(path) in str(exc.value)


@pytest.mark.parametrize("version", [None, 0, 99, "1"])
def test_unknown_schema_version_is_reported(tmp_path, version):
    path = tmp_path / "b.json"
    data = _baseline().to_dict()
    data["schema_version"] = version
    path.write_text(json.dumps(data))
    with pytest.raises(BaselineError, match="schema_version"):
        load_baseline(path)


def test_every_problem_of_a_malformed_baseline_at_once(tmp_path):
    path = tmp_path / "b.json"
    data = _baseline().to_dict()
    del data["created"]
    data["backend"] = "magic"
    data["peak_bytes"] = -3
    data["candidate"]["no_such_knob"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(BaselineError) as exc:
        load_baseline(path)
    msg = str(exc.value)
    for part in ("'created'", "magic", "peak_bytes=-3", "no_such_knob"):
        assert part in msg


def test_same_numbers_are_within_tolerance():
    base = _baseline()
    result = _result(base, _now(50 * MiB))
    assert not result.regressed and result.grown == ()
    assert result.outcome is Verdict.WITHIN and "within tolerance" in check_verdict(result)


def test_growth_of_activations_regresses_and_the_table_names_it():
    result = _result(_baseline(), _now(80 * MiB))
    assert result.regressed
    assert "activations" in result.grown and "peak_bytes" in result.grown
    assert "parameters" not in result.grown
    assert result.outcome is Verdict.REGRESSED
    table = check_table(result)
    act = next(line for line in table.splitlines() if line.startswith("activations"))
    assert "+30.00 MiB" in act and "+60.00%" in act and "grew" in act
    md = check_markdown(result)
    assert "regression" in md and "| activations" in md


def test_growth_within_tolerance_passes():
    # +0.5 MiB on a 100 MiB peak is 0.5%, inside 1%
    assert not _result(_baseline(), _now(50 * MiB + MiB // 2)).regressed
    assert _result(_baseline(), _now(50 * MiB + MiB // 2), tolerance=0.001).regressed


def test_shrinking_passes_and_suggests_a_new_baseline():
    result = _result(_baseline(), _now(20 * MiB))
    assert not result.regressed and result.improved
    assert result.outcome is Verdict.IMPROVED and "record a new baseline" in check_verdict(result)


def test_a_run_that_now_fails_is_a_regression():
    now = Measurement(status=Status.OOM, source=Source.ESTIMATE, message="over budget")
    result = _result(_baseline(), now)
    assert result.regressed
    assert result.outcome is Verdict.FAILED and "oom" in check_verdict(result)


def test_format_bytes():
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(-5 * MiB, signed=True) == "-5.00 MiB"
    assert format_bytes(0, signed=True) == "0 B"
    assert format_bytes(None) == "-"


def test_cli_check_missing_or_bad_baseline_exits_2(tmp_path, capsys):
    assert main(["check", "--baseline", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "peak_')
    assert main(["check", "--baseline", str(bad)]) == 2
    assert "truncated" in capsys.readouterr().err
    assert main(["check", "--baseline", str(bad), "--tolerance", "lots"]) == 2
    assert "--tolerance" in capsys.readouterr().err


def test_version_changes_ignore_build_labels_only_where_no_device_is_touched():
    from advisor.regress import version_changes

    was = {"torch": "2.13.0+cpu", "trl": "1.16.0"}
    now = {"torch": "2.13.0", "trl": "1.17.0"}
    assert [str(v) for v in version_changes(was, now, "simulate")] == ["trl 1.16.0 -> 1.17.0"]
    assert [v.package for v in version_changes(was, now, "cuda")] == ["torch", "trl"]


def test_a_category_absent_at_the_new_peak_counts_as_zero():
    now = _now(50 * MiB)
    now = Measurement(status=Status.OK, source=Source.ESTIMATE, peak_bytes=now.peak_bytes,
                      breakdown={k: v for k, v in now.breakdown.items() if k != "optimizer_state"})
    rows = {r.metric: r for r in compare_rows(_baseline().totals(), _baseline().breakdown, now)}
    assert rows["optimizer_state"].now == 0 and rows["optimizer_state"].difference == -10 * MiB
    assert rows["reserved_bytes"].now is None  # a total the backend did not report stays unknown


def test_shipped_baselines_match_their_run_yaml():
    """profiles/baselines/: each JSON loads, was simulated, and its candidate is what its RUN.yaml says."""
    from pathlib import Path

    from advisor.emit import load_run_config

    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "profiles" / "baselines").glob("*.json"))
    assert {f.stem for f in files} >= {"qwen2.5-0.5b-h100-trl-defaults", "qwen2.5-0.5b-h100-advisor-pick"}
    for f in files:
        b = load_baseline(f)
        assert b.backend == "simulate" and b.workload.model == "Qwen/Qwen2.5-0.5B"
        assert load_run_config(root / b.config_path, trainer=b.workload.trainer).candidate == b.candidate, f
    defaults = load_baseline(root / "profiles/baselines/qwen2.5-0.5b-h100-trl-defaults.json")
    # nothing set: the attention is what transformers picks (sdpa for Qwen2), not written in the file
    assert defaults.candidate == Candidate.trl_defaults().replace(attn_implementation=None)
