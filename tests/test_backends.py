"""The one backend layer: a backend registered at runtime is searched with, baselined and checked through the same
registry, its measurements carry its own Source, and an unknown name is a UsageError naming --backend."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from conftest import TINY_QWEN2

import advisor
from advisor.backends import get_backend, register_backend, unregister_backend
from advisor.cli import main
from advisor.emit import to_yaml
from advisor.errors import UsageError
from advisor.measurement import Measurement, Source, Status
from advisor.regress import Verdict, check, measure, record_baseline

NAME = "test-external"


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN2))
    return tmp_path


@pytest.fixture
def external():
    """A backend that is not one of the built-ins: the estimate's numbers scaled by `scale`, under its own name
    and Source; with `crash_first`, the first candidate it is asked to measure raises (a crash on it)."""
    from advisor.estimator import estimate

    calls = []
    state = {"scale": 1.0, "crash_first": False}

    def measure_fn(workload, candidate):
        calls.append(candidate)
        if state["crash_first"] and len(calls) == 1:
            raise RuntimeError("this backend crashed on its first candidate")
        m = estimate(workload, candidate)
        scale = state["scale"]
        return dataclasses.replace(
            m, source=Source.EXTERNAL, peak_bytes=int(m.peak_bytes * scale),
            reserved_bytes=int(m.reserved_bytes * scale), device_bytes=int(m.device_bytes * scale),
            breakdown={k: int(v * scale) for k, v in m.breakdown.items()})

    register_backend(NAME, measure_fn, cost=1)
    yield calls, state
    unregister_backend(NAME)


def test_registered_backend_declares_its_own_source(external):
    be = get_backend(NAME)
    assert be.source is Source.EXTERNAL and not be.needs_gpu and be.deterministic
    assert get_backend("simulate").source is Source.SIMULATE and get_backend("cuda").needs_gpu
    assert get_backend("estimate").source is Source.ESTIMATE and get_backend("cpu").source is Source.PROBE_CPU
    assert not Source.SIMULATE.is_run and not Source.ESTIMATE.is_run
    assert Source.PROBE_CUDA.is_run and Source.EXTERNAL.is_run


def test_suggest_labels_every_trial_with_the_backends_source(model_dir, external):
    calls, state = external
    state["crash_first"] = True
    s = advisor.suggest(str(model_dir), gpu="cpu", backend=NAME, method="full", trials=12, cache=False)
    assert calls, "the registered backend was never called"
    assert s.measurement.source is Source.EXTERNAL and s.candidate != calls[0]
    errors = [t for t in s.trials if t.measurement.status is Status.ERROR]
    assert [t.candidate for t in errors] == [calls[0]], "the crash on the first candidate is its trial's outcome"
    # the search makes the error outcome itself: its label comes from the registry, never `estimate`
    assert {t.measurement.source for t in s.trials if t.measurement.status is not Status.PRUNED} == {Source.EXTERNAL}


def test_a_runtime_backend_is_baselined_and_checked(model_dir, external, tmp_path):
    _, state = external
    from advisor.inputs import build_workload
    from advisor.space import Candidate

    workload = build_workload(str(model_dir), gpu="cpu")
    candidate = Candidate(max_length=512, per_device_train_batch_size=4)
    b = record_baseline(workload, candidate, backend=NAME)
    assert b.backend == NAME and b.source == "external"
    assert b.peak_bytes == measure(workload, candidate, NAME).peak_bytes
    path = b.save(tmp_path / "b.json")
    loaded = advisor.load_baseline(path)
    assert loaded.backend == NAME
    same = check(loaded, workload=workload)
    assert same.outcome is Verdict.WITHIN and same.measurement.source is Source.EXTERNAL
    state["scale"] = 1.25  # the backend now reports 25% more: the check, through the same name, sees it
    grown = check(loaded, workload=workload)
    assert grown.outcome is Verdict.REGRESSED and "peak_bytes" in grown.grown
    # a runtime backend runs the step, so a build label of torch counts as a version change
    from advisor.regress import version_changes

    assert [v.package for v in version_changes({"torch": "2.13.0+cpu"}, {"torch": "2.13.0"}, NAME)] == ["torch"]


def test_cli_baseline_and_check_with_a_runtime_backend(model_dir, external, tmp_path, capsys):
    from advisor.space import Candidate

    run = tmp_path / "RUN.yaml"
    run.write_text(to_yaml(Candidate(max_length=512, per_device_train_batch_size=4), model_name_or_path=None))
    out = tmp_path / "baseline.json"
    args = ["baseline", "--model", str(model_dir), "--gpu", "cpu", "--config", str(run), "--backend", NAME]
    assert main([*args, "--out", str(out)]) == 0
    assert f"{NAME} backend" in capsys.readouterr().out
    assert json.loads(out.read_text())["backend"] == NAME
    assert main(["check", "--baseline", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["backend"] == NAME and result["source"] == "external" and result["outcome"] == "within_tolerance"
    external[1]["scale"] = 1.25
    assert main(["check", "--baseline", str(out)]) == 1
    assert "REGRESSION" in capsys.readouterr().out


def test_unknown_backend_is_a_usage_error_naming_backend(model_dir, tmp_path, capsys):
    from advisor.inputs import build_workload
    from advisor.space import Candidate

    workload = build_workload(str(model_dir), gpu="cpu")
    cand = Candidate(max_length=256, per_device_train_batch_size=2)
    for call in (lambda: record_baseline(workload, cand, backend="no-such"),
                 lambda: measure(workload, cand, "no-such"),
                 lambda: advisor.suggest(str(model_dir), gpu="cpu", backend="no-such", cache=False)):
        with pytest.raises(UsageError, match=r"--backend 'no-such': unknown; choose one of estimate, simulate"):
            call()
    run = tmp_path / "RUN.yaml"
    run.write_text(to_yaml(cand, model_name_or_path=None))
    rc = main(["baseline", "--model", str(model_dir), "--gpu", "cpu", "--config", str(run), "--backend", "no-such",
               "--out", str(tmp_path / "b.json")])
    assert rc == 2 and "--backend 'no-such'" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_a_baseline_of_an_unregistered_backend_is_refused_on_load(tmp_path):
    data = json.loads((_root() / "profiles/baselines/qwen2.5-0.5b-h100-trl-defaults.json").read_text())
    data["backend"] = "gone"
    path = tmp_path / "b.json"
    path.write_text(json.dumps(data))
    with pytest.raises(advisor.BaselineError, match=r"backend='gone': not one of estimate, simulate, cpu, cuda"):
        advisor.load_baseline(path)


def test_a_nondeterministic_backend_cannot_be_baselined(model_dir):
    from advisor.inputs import build_workload
    from advisor.space import Candidate

    register_backend("noisy", lambda w, c: Measurement(Status.OK, Source.EXTERNAL, peak_bytes=1), deterministic=False)
    try:
        with pytest.raises(UsageError, match="--backend noisy: its results are not deterministic"):
            record_baseline(build_workload(str(model_dir), gpu="cpu"), Candidate(), backend="noisy")
    finally:
        unregister_backend("noisy")


def test_budget_bytes_and_fits_are_the_measurements_own():
    m = Measurement(Status.OK, Source.SIMULATE, peak_bytes=100, reserved_bytes=120, device_bytes=150,
                    tokens_per_second=10.0)
    assert m.budget_bytes == 150 and m.fits(150) and not m.fits(149) and m.feasible(150)
    assert Measurement(Status.OK, Source.SIMULATE, peak_bytes=100, reserved_bytes=120).budget_bytes == 120
    assert Measurement(Status.OK, Source.SIMULATE, peak_bytes=100).budget_bytes == 100
    assert Measurement(Status.OK, Source.SIMULATE).budget_bytes is None
    assert not Measurement(Status.OK, Source.SIMULATE).fits(10**12)
    assert not Measurement(Status.OOM, Source.PROBE_CPU, peak_bytes=1).fits(10**12)
    assert not dataclasses.replace(m, tokens_per_second=None).feasible(150)  # fits, but no speed to rank it by


def test_workload_ref_round_trips_through_a_baseline_and_a_study_spec():
    from advisor.inputs import WorkloadRef
    from advisor.workload import Goals, Method

    ref = WorkloadRef(model="m", gpu=None, dataset="d.jsonl", sample=10, fingerprint="f",
                      goals=Goals(tokens_per_step=512, method=Method.LORA, headroom=0.1))
    spec = ref.to_spec()
    assert spec["workload_fingerprint"] == "f" and spec["goals"]["method"] == "lora"
    assert WorkloadRef.from_spec(spec) == ref
    assert WorkloadRef.from_dict({**ref.to_dict(), "gpu": "cpu"}) == dataclasses.replace(ref, gpu="cpu")


def test_value_types_import_no_resolver():
    """workload.py (the value types) loads without the resolvers (profiles, data, inputs): no import circle."""
    code = ("import sys, advisor.workload, advisor.space, advisor.measurement; "
            "print(sorted(m for m in ('advisor.profiles', 'advisor.data', 'advisor.inputs') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _root():
    from pathlib import Path

    return Path(__file__).resolve().parent.parent


def test_no_module_shares_a_name_with_a_public_function():
    """A submodule import binds the module on the package; a module named like a public function would shadow
    it (the reason advisor/__init__.py once swapped its own module class)."""
    import importlib
    import pkgutil
    import types

    modules = {m.name for m in pkgutil.iter_modules(advisor.__path__)}
    assert not modules & set(advisor.__all__), modules & set(advisor.__all__)
    assert type(advisor) is types.ModuleType
    for name in ("advisor.estimator", "advisor.simulator", "advisor.probing", "advisor.regress"):
        importlib.import_module(name)
    for name in ("estimate", "simulate", "probe", "suggest", "check", "record_baseline"):
        assert isinstance(getattr(advisor, name), types.FunctionType), name
