"""Backends behind one `measure(workload, candidate) -> Measurement`, looked up by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..errors import UsageError

if TYPE_CHECKING:
    from ..measurement import Measurement
    from ..space import Candidate
    from ..workload import Workload

Measure = Callable[["Workload", "Candidate"], "Measurement"]


class Backend(Protocol):
    name: str

    def measure(self, workload: Workload, candidate: Candidate) -> Measurement: ...


@dataclass(frozen=True)
class FunctionBackend:
    """A backend made of one function; `cost` orders backends (a cheaper one may prune for a costlier one)."""

    name: str
    fn: Measure
    cost: int = 1

    def measure(self, workload: Workload, candidate: Candidate) -> Measurement:
        return self.fn(workload, candidate)


def _estimate(workload: Workload, candidate: Candidate) -> Measurement:
    from ..estimate import estimate

    return estimate(workload, candidate)


def _simulate(workload: Workload, candidate: Candidate) -> Measurement:
    from ..simulate import simulate

    return simulate(workload, candidate)


def _probe(kind: str) -> Measure:
    def run(workload: Workload, candidate: Candidate) -> Measurement:
        from ..probe import probe

        # A real probe enforces the limit as a hard cap, so an over-budget candidate really OOMs.
        return probe(workload, candidate, backend=kind, memory_budget_bytes=workload.limit_bytes)

    return run


_REGISTRY: dict[str, FunctionBackend] = {
    "estimate": FunctionBackend("estimate", _estimate, cost=0),
    "simulate": FunctionBackend("simulate", _simulate, cost=1),
    "cpu": FunctionBackend("cpu", _probe("cpu"), cost=2),
    "cuda": FunctionBackend("cuda", _probe("cuda"), cost=3),
}


def register_backend(name: str, fn: Measure, cost: int = 1) -> FunctionBackend:
    """Plug in a backend (tests register fakes); replaces one of the same name."""
    backend = FunctionBackend(name, fn, cost)
    _REGISTRY[name] = backend
    return backend


def unregister_backend(name: str) -> None:
    _REGISTRY.pop(name, None)


def backend_names() -> list[str]:
    return list(_REGISTRY)


def get_backend(name: str) -> FunctionBackend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UsageError(f"--backend {name!r}: unknown; choose one of {', '.join(_REGISTRY)}") from None


def default_backend_name() -> str:
    """cuda when a GPU is present, else simulate."""
    import torch

    return "cuda" if torch.cuda.is_available() else "simulate"
