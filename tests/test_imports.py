"""advisor's import graph: every module imports, no import circle among its top-level modules and packages, and the
two predicting backends share their physics through advisor/physics/ without reaching each other.

The graph is read with `ast` (nothing is imported to build it): one node per top-level module or package of advisor
(`space`, `estimator`, `simulator`, `trainers`, ...; the package root `advisor/__init__.py`, the public API above
everything, is not a node), an edge where any file of one imports anything of another: at the top of a file or
inside a function (a function-local import runs the first time the function does, so it closes the circle all the
same), `importlib.import_module` with a literal name included; imports under `if TYPE_CHECKING:` are left out
(they never run). Two checks read it: with every import counted, a circle must be one KNOWN explains (that list
only shrinks); with only the imports that run at import time (module and class bodies), there is no circle at all.
"""

from __future__ import annotations

import ast
import importlib
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ADVISOR = ROOT / "advisor"

# The estimate and the simulator: each side may import the physics package and what lies below it, never the other
# side, directly or through any module in between.
ESTIMATE = frozenset({"estimator"})
SIMULATOR = frozenset({"simulator"})
PHYSICS = "physics"

# The edges that still close a circle, each with why; the test fails on a circle they do not explain and when one
# of them goes away (remove it here), so that this list only shrinks.
KNOWN: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(source: str, name: str, is_package: bool, import_time: bool = False) -> list[tuple[int, str]]:
    """(line, module reached) for every import in the source of module `name` that runs (top level, in a function,
    or `import_module` of a literal), relative ones resolved; `from X import y` reaches X.y too (y may be a module)."""
    here = name.split(".") if is_package else name.split(".")[:-1]

    def resolve(level: int, module: str | None) -> str:
        if not level:
            return module or ""
        base = here[: len(here) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if import_time and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return  # runs when called, not when the module is imported
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = resolve(node.level, node.module)
            out.extend((node.lineno, f"{module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Call) and (getattr(node.func, "attr", None) == "import_module"
                                             or getattr(node.func, "id", None) == "import_module") \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            target = node.args[0].value
            dots = len(target) - len(target.lstrip("."))
            out.append((node.lineno, resolve(dots, target[dots:] or None)))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return out


def _top(module: str) -> str | None:
    """The top-level module or package of advisor that `module` lies in (None outside advisor or for its root)."""
    parts = module.split(".")
    if parts[0] != "advisor" or len(parts) < 2:
        return None
    name = parts[1]
    return name if (ADVISOR / f"{name}.py").exists() or (ADVISOR / name / "__init__.py").exists() else None


def import_graph(sources: dict[str, str] | None = None, import_time: bool = False
                 ) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> ["path:line", ...] between advisor's top-level modules and packages. `sources`:
    more (or replaced) sources by their path relative to the repository."""
    files = {str(f.relative_to(ROOT)): f.read_text() for f in sorted(ADVISOR.rglob("*.py"))} | (sources or {})
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for rel, source in files.items():
        name, is_package = _module_name(ROOT / rel)
        a = _top(name)
        if a is None:
            continue
        for line, module in _imports(source, name, is_package, import_time):
            b = _top(module)
            where = f"{rel}:{line}"
            if b is not None and b != a and where not in edges[(a, b)]:
                edges[(a, b)].append(where)
    return dict(edges)


def _successors(edges) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        out[a].add(b)
    return out


def find_cycle(edges) -> list[str] | None:
    """One circle of the graph as [a, b, ..., a], or None."""
    succ = _successors(edges)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(succ.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := walk(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(succ):
        if v not in state and (found := walk(v)):
            return found
    return None


def reach(edges, start: str, avoid: frozenset[str] = frozenset()) -> dict[str, str]:
    """Every node `start` reaches (not through `avoid`), each with the node it was first reached from."""
    succ = _successors(edges)
    seen = {start: ""}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in sorted(succ.get(v, ())):
            if w not in seen and w not in avoid:
                seen[w] = v
                todo.append(w)
    return seen


def _path(seen: dict[str, str], end: str) -> list[str]:
    out = [end]
    while seen[out[-1]]:
        out.append(seen[out[-1]])
    return out[::-1]


def _describe(chain: list[str], edges) -> str:
    return "\n".join(f"  {a} -> {b}: {', '.join(edges[(a, b)][:3])}" for a, b in zip(chain, chain[1:], strict=False))


def circle_problems(edges) -> list[str]:
    rest = {e: w for e, w in edges.items() if e not in KNOWN}
    cycle = find_cycle(rest)
    return [] if cycle is None else [
        "an import circle among advisor's top-level modules/packages, " + " -> ".join(cycle) + "\n"
        + _describe(cycle, rest)]


def backend_problems(edges) -> list[str]:
    """The estimate and the simulator reaching each other (other than both importing physics), or physics
    reaching either."""
    out = []
    for sides, other in ((ESTIMATE, SIMULATOR), (SIMULATOR, ESTIMATE), ({PHYSICS}, ESTIMATE | SIMULATOR)):
        for start in sorted(sides):
            seen = reach(edges, start)
            for end in sorted(other & set(seen)):
                chain = _path(seen, end)
                out.append(f"{start} reaches {end}: " + " -> ".join(chain) + "\n" + _describe(chain, edges))
    return out


def _modules() -> list[str]:
    out = []
    for f in sorted(ADVISOR.rglob("*.py")):
        name, _ = _module_name(f)
        if name.rsplit(".", 1)[-1] != "__main__":
            out.append(name)
    return out


@pytest.mark.parametrize("module", _modules())
def test_every_module_imports(module):
    importlib.import_module(module)


def test_no_import_circle():
    problems = circle_problems(import_graph())
    assert not problems, "\n".join(problems)


def test_no_import_time_circle():
    """No circle at all among the imports that run when a module is imported (module and class bodies, not function
    bodies): KNOWN does not apply here, so importing any module of advisor never depends on the order of others."""
    edges = import_graph(import_time=True)
    cycle = find_cycle(edges)
    assert cycle is None, "an import-time circle among advisor's top-level modules/packages, " + \
        " -> ".join(cycle) + "\n" + _describe(cycle, edges)


def test_the_import_time_check_sees_a_module_level_circle():
    """A module-level import closing a circle is found, the same import inside a function is not."""
    errors = (ADVISOR / "errors.py").read_text()
    at_top = {"advisor/errors.py": errors + "\nfrom . import space as _space\n"}
    in_function = {"advisor/errors.py": errors + "\ndef _g():\n    from . import space\n"}
    assert find_cycle(import_graph(at_top, import_time=True)) is not None
    assert find_cycle(import_graph(in_function, import_time=True)) is None


def test_known_circle_edges_still_exist():
    gone = sorted(set(KNOWN) - set(import_graph()))
    assert not gone, f"no longer imported, remove from KNOWN: {gone}"


def test_estimate_and_simulator_meet_only_in_physics():
    edges = import_graph()
    assert not backend_problems(edges), "\n".join(backend_problems(edges))
    # both really stand on the physics package (the check above is not vacuous)
    for side in ("estimator", "simulator"):
        assert PHYSICS in reach(edges, side), side


def test_the_checks_see_every_kind_of_import():
    """A function-local import, a relative `from . import`, an `import_module` literal and a TYPE_CHECKING block
    (which is left out) each change the graph as they should (a check that cannot fail proves nothing)."""
    base = import_graph()
    probe = {
        # the simulator's fake run asking the estimate for a number inside a function: a backend reaching the other
        "advisor/simulator/_probe.py": "def f():\n    from ..estimator import architecture\n",
        # the estimate importing the simulator's package by `import_module`
        "advisor/estimator/_probe.py": "from importlib import import_module\n"
                                       "import_module('..simulator', __package__)\n",
        # errors.py (imported by almost everything) importing the physics package back: a circle
        "advisor/errors.py": (ADVISOR / "errors.py").read_text() + "\ndef _g():\n    from . import physics\n",
        # ignored: only for the type checker
        "advisor/physics/_probe.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..simulator "
                                      "import simulate\n",
    }
    edges = import_graph(probe)
    assert ("simulator", "estimator") in edges and ("simulator", "estimator") not in base
    assert ("estimator", "simulator") in edges and ("estimator", "simulator") not in base
    assert ("physics", "simulator") not in edges
    found = backend_problems(edges)
    assert any(p.startswith("simulator reaches estimator") for p in found), found
    assert any(p.startswith("estimator reaches simulator") for p in found), found
    cycle = find_cycle({e: w for e, w in edges.items() if e not in KNOWN})
    assert cycle is not None and "errors" in cycle and PHYSICS in cycle, cycle
    assert circle_problems(edges)
