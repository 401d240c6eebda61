"""The package list, discovered, so a new package can never be left out of the wheel (issue 25).

pyproject.toml holds everything else; what it cannot say is that `profiles/` (GPU specs, model configs,
calibration) ships inside the wheel as `advisor._profiles`, so a non-editable install works offline too (a
checkout reads the same files in place). Every directory under profiles/ whose path is importable (`gpus`,
`models/Qwen`) is listed as a namespace package of that name with its files as data, which is what setuptools
asks of a data directory Python could import; a directory whose name is not an identifier (`Qwen2.5-0.5B`) is
data of the nearest package above it. tests/test_wheel.py builds the wheel and compares it with the tree.
"""

from __future__ import annotations

import glob
from pathlib import Path

from setuptools import find_packages, setup

PROFILES = Path(__file__).resolve().parent / "profiles"
PROFILES_PACKAGE = "advisor._profiles"


def profile_data() -> dict[str, list[str]]:
    """{package: [file pattern relative to its directory]} for every file under profiles/."""
    data: dict[str, list[str]] = {PROFILES_PACKAGE: []}
    for path in sorted(PROFILES.rglob("*")):
        rel = path.relative_to(PROFILES)
        if not path.is_file() or any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
            continue
        dirs = rel.parts[:-1]
        n = 0
        while n < len(dirs) and dirs[n].isidentifier():
            n += 1
        package = ".".join((PROFILES_PACKAGE, *dirs[:n]))
        data.setdefault(package, []).append(glob.escape(Path(*rel.parts[n:]).as_posix()))
    return data


DATA = profile_data()
setup(
    packages=find_packages(include=["advisor", "advisor.*"]) + sorted(DATA),
    package_dir={PROFILES_PACKAGE: "profiles"},
    package_data=DATA,
)
