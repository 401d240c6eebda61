"""An import inside a function only where start-up needs it, saying so: every import in a function body of advisor
carries a trailing `# lazy: why` comment (on its first or its last line), e.g. `# lazy: loads torch` (the module's
own import does not load torch), `# lazy: keeps start-up light`, `# lazy: circle via proposers`; the standard
library is imported at the top of the module, except in the files STDLIB_LOCAL names with why. Read with `ast`,
nothing is imported."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADVISOR = ROOT / "advisor"

# Files whose function-local standard-library imports stay, with why (this list only shrinks).
STDLIB_LOCAL: dict[str, str] = {
    "advisor/search/pool_child.py": "the pool's worker and forkserver start-up runs in its own order",
    "advisor/search/forkserver.py": "multiprocessing's forkserver and resource tracker load only when a pool starts",
}

_LAZY = re.compile(r"#\s*lazy:\s*\S")
_STDLIB = frozenset(sys.stdlib_module_names)


def local_imports(source: str) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement inside a function (or lambda) body of `source`, with the first module it names."""
    out: list[tuple[ast.Import | ast.ImportFrom, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import):
                out.append((child, child.names[0].name))
            elif in_function and isinstance(child, ast.ImportFrom):
                out.append((child, "." * child.level + (child.module or "")))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return out


def problems(rel: str, source: str) -> list[str]:
    """What is wrong with the function-local imports of the file `rel` (relative to the repository)."""
    lines = source.splitlines()
    out = []
    for node, module in local_imports(source):
        where = f"{rel}:{node.lineno}: {lines[node.lineno - 1].strip()}"
        if not (_LAZY.search(lines[node.lineno - 1]) or _LAZY.search(lines[node.end_lineno - 1])):
            out.append(f"{where}\n    an import inside a function without `# lazy: why` (move it to the top of the "
                       "module, or say why it must stay: `# lazy: loads torch`, `# lazy: circle via X`, ...)")
        if not module.startswith(".") and module.split(".")[0] in _STDLIB and rel not in STDLIB_LOCAL:
            out.append(f"{where}\n    the standard library inside a function: import it at the top of the module")
    return out


def _files() -> dict[str, str]:
    return {str(f.relative_to(ROOT)): f.read_text() for f in sorted(ADVISOR.rglob("*.py"))}


def test_every_function_local_import_says_why():
    found = [p for rel, source in _files().items() for p in problems(rel, source)]
    assert not found, f"{len(found)} function-local imports:\n" + "\n".join(found)


def test_stdlib_exceptions_still_hold_one():
    files = _files()
    for rel in STDLIB_LOCAL:
        assert any(not m.startswith(".") and m.split(".")[0] in _STDLIB for _, m in local_imports(files[rel])), \
            f"{rel} imports no standard-library module inside a function any more: remove it from STDLIB_LOCAL"


def test_the_check_sees_what_it_should():
    """Each kind of import is told apart (a check that cannot fail proves nothing)."""
    source = '''
import json
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    import torch

class A:
    import re

    def method(self):
        import torch
        from .space import Candidate  # lazy: circle via space
        from transformers import (  # lazy: loads transformers
            AutoConfig,
        )
        from trl import (
            SFTConfig,
        )  # lazy: loads trl
        import os  # lazy: the standard library needs no reason

def outer():
    def inner():
        import yaml
    f = lambda: __import__("x")
    return inner, f
'''
    found = problems("advisor/probe.py", source)
    lines = [p.split("\n")[0] for p in found]
    assert lines == [
        "advisor/probe.py:11: import torch",
        "advisor/probe.py:19: import os  # lazy: the standard library needs no reason",
        "advisor/probe.py:23: import yaml",
    ], found
    assert "the standard library" in found[1]
    # the allowed files keep their standard library inside a function, with a reason
    assert problems("advisor/search/forkserver.py", "def f():\n    import os  # lazy: x\n") == []
    assert problems("advisor/search/forkserver.py", "def f():\n    import os\n") != []
