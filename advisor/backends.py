"""The one backend layer: every way of measuring a candidate, declared once and looked up by name.

`suggest` (the search), `advisor baseline` / `advisor check` (regress) and the CLI's `--backend` flags all go
through this registry, so a backend registered here can be searched with and baselined alike. A backend
declares how it measures (`measure(workload, candidate) -> Measurement`), the `Source` its numbers carry (a
prediction is never labelled a measurement, nor the other way round), its cost (a cheaper backend may prune
for a costlier one), whether it needs a CUDA device, and whether its results are deterministic enough to
baseline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .errors import NotSimulated, UsageError
from .measurement import Source, Status
from .probing import PROBE_BACKENDS, PROBE_SOURCES, probe  # noqa: F401  (PROBE_BACKENDS: the CLI's)
from .simulator import simulate, simulate_per_rank

if TYPE_CHECKING:
    from .measurement import Measurement
    from .space import Candidate
    from .workload import Workload

Measure = Callable[["Workload", "Candidate"], "Measurement"]


class Backend(Protocol):
    """What the search and regress need of a backend."""

    name: str
    cost: int
    source: Source
    needs_gpu: bool
    deterministic: bool

    def measure(self, workload: Workload, candidate: Candidate) -> Measurement: ...


@dataclass(frozen=True)
class FunctionBackend:
    """A backend made of one function.

    `cost` orders backends (a cheaper one may prune for a costlier one); `source` is what its measurements are
    labelled with (a runtime backend that declares none is `Source.EXTERNAL`, never an estimate); `needs_gpu`:
    it runs only where a CUDA device is visible; `deterministic`: the same inputs give the same peak, so a
    baseline recorded with it can be checked later; `parallel`: a measurement takes seconds (it runs the training
    step), so the search measures several at once in warm worker processes (advisor/search/pool.py); a cheap
    backend runs in the caller, where a worker's start-up would cost more than it saves. `runs_here`: it runs the
    candidate's training on this machine (the real probes), so a candidate needing a package missing here is never
    given to it (advisor/packages.py).
    """

    name: str
    fn: Measure
    cost: int = 1
    source: Source = Source.EXTERNAL
    needs_gpu: bool = False
    deterministic: bool = True
    parallel: bool = False
    runs_here: bool = False

    def measure(self, workload: Workload, candidate: Candidate) -> Measurement:
        return self.fn(workload, candidate)


def _estimate(workload: Workload, candidate: Candidate) -> Measurement:
    from .estimator import estimate  # lazy: loads yaml

    return estimate(workload, candidate)


def _simulate(workload: Workload, candidate: Candidate) -> Measurement:
    if workload.num_gpus > 1:  # one rank of N, the candidate's parallelism

        try:
            return simulate_per_rank(workload, candidate, parallelism=candidate.parallelism.parallelism)
        except NotSimulated as why:  # what the fake run does not do yet: the estimate's closed form, saying so
            return _estimated_instead(workload, candidate, why.reason)

    return simulate(workload, candidate)


def _estimated_instead(workload: Workload, candidate: Candidate, reason: str) -> Measurement:
    """The estimate of `candidate` (its source `estimate`: modelled, not run), with the simulate backend's verdict
    against the per-rank budget and a note naming what was not simulated."""
    from .estimator import estimate  # lazy: loads yaml

    m = estimate(workload, candidate)
    device = m.device_bytes or m.peak_bytes
    fits = device <= workload.budget_bytes
    return dataclasses.replace(
        m, status=Status.OK if fits else Status.OOM,
        message="" if fits else f"device peak {device} B over budget {workload.budget_bytes} B per rank",
        notes=(*m.notes, f"not simulated, the estimate's closed form instead: {reason}"))


def _probe(kind: str) -> Measure:
    def run(workload: Workload, candidate: Candidate) -> Measurement:
        # A real probe enforces the limit as a hard cap, so an over-budget candidate really OOMs.
        return probe(workload, candidate, backend=kind, memory_budget_bytes=workload.limit_bytes)

    return run


BUILTIN: tuple[FunctionBackend, ...] = (
    FunctionBackend("estimate", _estimate, cost=0, source=Source.ESTIMATE),
    FunctionBackend("simulate", _simulate, cost=1, source=Source.SIMULATE, parallel=True),
    FunctionBackend("cpu", _probe("cpu"), cost=2, source=PROBE_SOURCES["cpu"], runs_here=True),
    FunctionBackend("cuda", _probe("cuda"), cost=3, source=PROBE_SOURCES["cuda"], needs_gpu=True, runs_here=True),
)
_REGISTRY: dict[str, FunctionBackend] = {b.name: b for b in BUILTIN}


def register_backend(name: str, fn: Measure, cost: int = 1, *, source: Source | str = Source.EXTERNAL,
                     needs_gpu: bool = False, deterministic: bool = True, parallel: bool = False,
                     runs_here: bool = False) -> FunctionBackend:
    """Plug in a backend (tests register fakes); replaces one of the same name. It is then usable by `suggest`,
    `advisor baseline` and `advisor check` alike."""
    if not name or not isinstance(name, str):
        raise UsageError(f"register_backend(name={name!r}): give a non-empty name")
    backend = FunctionBackend(name, fn, cost, Source(source), needs_gpu, deterministic, parallel, runs_here)
    _REGISTRY[name] = backend
    return backend


def unregister_backend(name: str) -> None:
    _REGISTRY.pop(name, None)


def backend_names() -> list[str]:
    return list(_REGISTRY)


def get_backend(name: str) -> FunctionBackend:
    """The registered backend; an unknown name is a UsageError naming --backend and the known names (exit 2)."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UsageError(f"--backend {name!r}: unknown; choose one of {', '.join(_REGISTRY)}") from None


def source_of(name: str) -> Source:
    """The Source a registered backend's measurements carry (also for the error outcome of a crashed run)."""
    return get_backend(name).source


def check_usable(name: str) -> FunctionBackend:
    """The backend, or a UsageError (exit 2) when the name is unknown or it cannot run here (no CUDA device)."""
    backend = get_backend(name)
    if backend.needs_gpu:
        import torch  # lazy: loads torch

        if not torch.cuda.is_available():
            build = " (this torch is a CPU build)" if torch.version.cuda is None else ""
            raise UsageError(f"--backend {name}: no CUDA device is visible here{build}; measure with --backend "
                             "simulate (the default without a GPU) or --backend cpu, or run on a GPU machine")
    return backend


def check_baselinable(name: str) -> FunctionBackend:
    """The backend, or a UsageError when its results vary from run to run (a baseline could not be checked)."""
    backend = get_backend(name)
    if not backend.deterministic:
        stable = ", ".join(n for n, b in _REGISTRY.items() if b.deterministic)
        raise UsageError(f"--backend {name}: its results are not deterministic, so a baseline recorded with it "
                         f"could not be checked; record with one of {stable} (simulate runs on any CPU)")
    return backend


def default_backend_name() -> str:
    """cuda when a GPU is present, else simulate."""
    import torch  # lazy: loads torch

    return "cuda" if torch.cuda.is_available() else "simulate"
