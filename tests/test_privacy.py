"""Private packages are private: nothing outside a package of advisor's layers (`physics`, `simulator`, `estimator`,
`data`, `search`, `runconfig`, `values`: LAYERS) or a private package (`advisor/_<name>/`) imports its modules.

Such a package is used from outside only through the names its `__init__` declares in `__all__` (`from
advisor.simulator import X`, `from .simulator import X`). Every module under advisor/, tests/ and scripts/ is read with
`ast` (nothing is imported) and every import is resolved, relative ones too; an import of a module inside such a
package from outside it, or of a name its `__all__` does not declare, is an offender.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADVISOR = ROOT / "advisor"

# The reaches that remain, each with why; the test fails when one goes away too, so that this list only shrinks.
KNOWN: dict[tuple[str, str], str] = {
    ("tests/test_simulate_accuracy.py", "advisor.simulator.fake_step"):
        "test_unpadded_batch_takes_the_real_path switches the fake step's real-path patches off to show they matter",
}


# Packages whose insides are private though their name has no leading underscore: a layer of its own, named for it.
LAYERS = ("physics", "simulator", "estimator", "data", "search", "runconfig", "values")


def _private_packages() -> dict[str, Path]:
    return {f"advisor.{d.name}": d for d in sorted(ADVISOR.iterdir())
            if d.is_dir() and (d.name in LAYERS or d.name.startswith("_") and not d.name.startswith("__"))
            and (d / "__init__.py").exists()}


def _declared(init: Path) -> set[str] | None:
    """The package's `__all__` as its `__init__` writes it (a list/tuple of strings or `sorted(<dict>)`); None
    where it declares none."""
    tree = ast.parse(init.read_text())
    values: dict[str, ast.expr] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and node.value is not None:
            values[target.id] = node.value
    value = values.get("__all__")
    if value is None:
        return None
    return _names(value, values)


def _names(value: ast.expr, values: dict[str, ast.expr]) -> set[str]:
    """The names a literal `__all__` (or one starred part of it) spells: a list or tuple of strings, `sorted(<dict>)`
    (its keys), and `[..., *sorted(<dict>)]`."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "sorted" \
            and len(value.args) == 1 and isinstance(value.args[0], ast.Name):
        value = values[value.args[0].id]
    if isinstance(value, ast.List | ast.Tuple) and any(isinstance(e, ast.Starred) for e in value.elts):
        out: set[str] = set()
        for e in value.elts:
            out |= _names(e.value, values) if isinstance(e, ast.Starred) else {ast.literal_eval(e)}
        return out
    return set(ast.literal_eval(_keys_only(value)))


def _keys_only(node: ast.expr) -> ast.expr:
    """A dict literal's keys (with `**{n: ... for n in (...)}` spread in); any other literal as it is."""
    if not isinstance(node, ast.Dict):
        return node
    keys: list[ast.expr] = []
    for key, value in zip(node.keys, node.values, strict=True):
        if key is not None:
            keys.append(key)
        elif isinstance(value, ast.DictComp) and isinstance(value.generators[0].iter, ast.Tuple | ast.List):
            keys.extend(value.generators[0].iter.elts)
        else:
            raise AssertionError(f"cannot read __all__'s names statically: {ast.unparse(value)}")
    return ast.List(elts=keys, ctx=ast.Load())


def _module_name(path: Path) -> tuple[str, bool]:
    """The dotted name of the module at `path` and whether it is a package's `__init__`."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _imports(source: str, name: str, is_package: bool):
    """(line, imported module, names or None) for every import in the source of module `name`, relative ones
    resolved."""
    here = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module, [a.name for a in node.names]


def _offences(extra: dict[str, str] | None = None) -> list[tuple[str, int, str, str]]:
    """(file, line, what it reaches, why) for every offending import; `extra`: more sources by their path."""
    packages = _private_packages()
    surfaces = {pkg: _declared(d / "__init__.py") for pkg, d in packages.items()}
    files = sorted([*ADVISOR.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")])
    sources = {str(f.relative_to(ROOT)): f.read_text() for f in files} | (extra or {})
    found = []
    for rel, source in sources.items():
        name, is_package = _module_name(ROOT / rel)
        for line, module, names in _imports(source, name, is_package):
            for pkg, directory in packages.items():
                if name == pkg or name.startswith(pkg + "."):
                    continue  # inside the package: its insides are its own
                if module.startswith(pkg + "."):
                    found.append((rel, line, module, f"imports the module {module}"))
                elif module == pkg and names:
                    for n in names:
                        if (directory / f"{n}.py").exists() or (directory / n / "__init__.py").exists():
                            found.append((rel, line, f"{pkg}.{n}", f"imports the module {pkg}.{n}"))
                        elif surfaces[pkg] is not None and n not in surfaces[pkg]:
                            found.append((rel, line, f"{pkg}.{n}", f"imports {n}, not in {pkg}.__all__"))
    return found


def test_nothing_outside_a_private_package_imports_its_insides():
    found = _offences()
    new = [f for f in found if (f[0], f[2]) not in KNOWN]
    assert not new, "imports of a private package's insides (import the name from the package's __all__, or " \
                     "from a public module):\n" + "\n".join(f"  {p}:{n}: {why}" for p, n, _, why in new)
    gone = set(KNOWN) - {(f[0], f[2]) for f in found}
    assert not gone, f"no longer reached, remove from KNOWN: {sorted(gone)}"


def test_the_private_packages_declare_their_surface():
    """Each private package says what the rest may use, and every declared name resolves to a module inside it."""
    packages = _private_packages()
    assert {"advisor.simulator", "advisor.search", "advisor.physics"} <= set(packages)
    for pkg in ("advisor.simulator", "advisor.search", "advisor.physics"):
        declared = _declared(packages[pkg] / "__init__.py")
        assert declared, f"{pkg}/__init__.py declares no __all__"
        module = __import__(pkg, fromlist=["__all__"])
        assert set(module.__all__) == declared
        for n in sorted(declared):
            assert getattr(module, n) is not None, f"{pkg}.{n}"
            assert not (packages[pkg] / f"{n}.py").exists(), f"{pkg}.{n} is the name of a module inside it"


def test_the_check_sees_every_kind_of_reach():
    """The walk resolves absolute, relative and package-level imports (a check that cannot fail proves nothing)."""
    probe = ("from .physics.timing import Term\nfrom .search import naming\nfrom .simulator import not_declared\n"
             "import advisor.search.pool\nfrom .physics import replay\nfrom . import physics\n"
             "from .physics import ranks_closed\n")
    deeper = "from ..simulator.layers import LayerStream\nfrom ..search import candidate_key\n"
    inside = "from .timing import Term\nfrom ..ledger import candidate_key\n"
    found = _offences({"advisor/_probe.py": probe, "advisor/cli/_probe.py": deeper,
                       "advisor/search/x/_probe.py": inside})
    assert {(f[0], f[2]) for f in found if f[0].endswith("_probe.py")} == {
        *(("advisor/_probe.py", m) for m in ("advisor.physics.timing", "advisor.search.naming",
                                             "advisor.simulator.not_declared", "advisor.search.pool",
                                             "advisor.physics.ranks_closed")),
        ("advisor/cli/_probe.py", "advisor.simulator.layers"),
    }
