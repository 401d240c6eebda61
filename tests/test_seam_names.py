"""Trainer names and hooks stay inside advisor/trainers/: outside it, no code probes a member of the `Trainer` protocol
by name (`getattr(kind, "derive", None)`, `hasattr(kind, "search_values")`: the protocol declares every member and a
base gives the defaults, so a backend calls it), and no string equal to a registered trainer's name appears save the
ones KNOWN lists with why (the default from one constant). Read with `ast`; docstrings are prose and left out."""

from __future__ import annotations

import ast
from pathlib import Path

from advisor.trainers import names

ROOT = Path(__file__).resolve().parent.parent
ADVISOR = ROOT / "advisor"

# (file, the probe as written) -> why it is not a probe of a trainer
NOT_TRAINERS: dict[tuple[str, str], str] = {
    ("advisor/simulator/fake_step.py", "hasattr(inner, 'peft_config')"):
        "the trained torch model unwrapped as TRL does (PEFT's wrapper has peft_config), not a Trainer",
    ("advisor/simulator/fake_step.py", "getattr(inner, 'lm_head', None)"):
        "the torch model's head module, not the Trainer's lm_head flag",
}
# (file, literal) -> (how many, why)
KNOWN: dict[tuple[str, str], tuple[int, str]] = {
    ("advisor/workload.py", "sft"): (1, "DEFAULT_TRAINER: --trainer's default, the one constant every default reads"),
    ("advisor/physics/__init__.py", "distillation"): (2, "the module physics/distillation.py named in the lazy "
                                                         "exports table, not the trainer"),
}


def _protocol_members() -> set[str]:
    tree = ast.parse((ADVISOR / "trainers" / "protocol.py").read_text())
    out: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, kinds) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def scan(files: dict[str, str], members: set[str], trainer_names: set[str]) -> tuple[list[tuple[str, str]], dict]:
    """The probes of protocol members by name and the trainer-name literals in `files` (path -> source)."""
    probes: list[tuple[str, str]] = []
    literals: dict[tuple[str, str], int] = {}
    for rel, source in files.items():
        tree = ast.parse(source)
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in members):
                probes.append((rel, ast.unparse(node)))
            elif isinstance(node, ast.Constant) and node.value in trainer_names and id(node) not in docs:
                literals[(rel, node.value)] = literals.get((rel, node.value), 0) + 1
    return probes, literals


def _outside_trainers() -> dict[str, str]:
    return {f.relative_to(ROOT).as_posix(): f.read_text() for f in sorted(ADVISOR.rglob("*.py"))
            if "trainers" not in f.relative_to(ADVISOR).parts}


def test_no_trainer_hook_is_probed_by_name_outside_trainers():
    probes, _ = scan(_outside_trainers(), _protocol_members(), set(names()))
    new = [p for p in probes if p not in NOT_TRAINERS]
    assert not new, "a Trainer member probed by name outside advisor/trainers/ (declare it on the protocol, give " \
                    "the default on the base, call it):\n" + "\n".join(f"{f}: {e}" for f, e in new)
    gone = [k for k in NOT_TRAINERS if k not in probes]
    assert not gone, f"NOT_TRAINERS lists what is no longer there (remove it): {gone}"


def test_trainer_names_stay_inside_trainers():
    _, literals = scan(_outside_trainers(), _protocol_members(), set(names()))
    known = {k: n for k, (n, _) in KNOWN.items()}
    assert literals == known, (
        "trainer-name literals outside advisor/trainers/ (ask the trainer, or read trainers.DEFAULT): "
        f"found {literals}, known {known}")
    real = sum(n for (f, name), n in literals.items() if not (f.endswith("physics/__init__.py")))
    assert real <= 3


def test_the_scan_sees_a_probe_and_a_literal():
    """The scan itself: a probe of a protocol member and a trainer's name are found, a docstring and another
    attribute are not."""
    source = ('"""dpo in prose."""\n'
              'def f(kind, m):\n'
              '    """sft in a docstring."""\n'
              '    if kind.name == "dpo":\n'
              '        return getattr(kind, "derive", None), getattr(m, "weight", None)\n')
    probes, literals = scan({"x.py": source}, {"derive"}, {"sft", "dpo"})
    assert probes == [("x.py", "getattr(kind, 'derive', None)")]
    assert literals == {("x.py", "dpo"): 1}
