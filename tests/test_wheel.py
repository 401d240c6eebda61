"""The wheel holds every package under advisor/ and every file under profiles/ (as `advisor._profiles`), and what
is installed from it imports and answers offline without the checkout (issue 25: a hand-kept package list left
the value types, data, run-config, estimate and simulator-timing packages and `trainers` out of it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("advisor", "profiles", "setup.py", "pyproject.toml", "README.md")


def _tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")
            and p.suffix not in (".pyc", ".pyo")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel .` of a copy of the checkout (the build leaves build/ and *.egg-info beside its sources)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    # setuptools warns when a data directory Python could import is not declared a package: none may be left
    assert "is absent from the `packages` configuration" not in done.stdout + done.stderr
    (whl,) = out.glob("advisor-*.whl")
    return whl


def test_the_wheel_holds_every_module_and_every_profile(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = {n for n in z.namelist() if not n.endswith("/")}
    dist_info = {n for n in names if n.split("/")[0].endswith(".dist-info")}
    expected = {f"advisor/{p}" for p in _tree(ROOT / "advisor")}
    expected |= {f"advisor/_profiles/{p}" for p in _tree(ROOT / "profiles")}
    assert names - dist_info == expected
    packages = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "advisor").rglob("__init__.py")}
    assert {"advisor/values", "advisor/runconfig", "advisor/estimator", "advisor/physics/timing",
            "advisor/simulator", "advisor/data", "advisor/trainers"} <= packages
    assert all(f"{p}/__init__.py" in names for p in packages)


def test_what_the_wheel_installs_imports_and_reads_its_profiles(wheel, tmp_path):
    """Unpacked alone (no checkout beside it, so profiles come from `advisor._profiles`): the public modules import
    and a GPU, a model profile and a calibration file resolve."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    code = (
        "import advisor, advisor.space, advisor.search, advisor.simulator, advisor.trainers, advisor.emit\n"
        "from advisor.profiles import PROFILES_DIR, resolve_gpu, resolve_model\n"
        "print(advisor.__file__); print(PROFILES_DIR)\n"
        "print(resolve_gpu('H100').name, resolve_model('Qwen/Qwen2.5-0.5B').source)\n"
        "import advisor.trainers as t; print(sorted(t.names()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ADVISOR_PROFILES_DIR")}
    env["PYTHONPATH"] = str(site)
    done = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r})\n" + code],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == str(site / "advisor" / "__init__.py")
    assert out[1] == str(site / "advisor" / "_profiles")
    assert out[2].startswith("H100") and out[2].endswith("profile")
    from advisor.trainers import get_trainer, names

    built_in = sorted(n for n in names() if type(get_trainer(n)).__module__.startswith("advisor.trainers."))
    assert out[3] == str(built_in)  # every built-in trainer module is in the wheel
