"""`advisor worker`'s side of a shared study: rebuild the workload and space from the study's spec, then measure
queued candidates until every queue has been idle for a while."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..events import Progress
from ..inputs import WorkloadRef
from ..workload import Goals, Method, Workload
from . import naming
from .backends import get_backend
from .evaluator import _open_pool
from .loop import StudyRun
from .params import StudySpace, space_from_json
from .space import RowTokens

if TYPE_CHECKING:
    import optuna


def _worker_run(store: optuna.storages.BaseStorage, name: str, storage: str, workload: Workload | None,
                backend: str | None, progress: Callable[[Progress], None] | None, pools: dict[str, Any],
                jobs: int | None) -> StudyRun:
    import optuna  # lazy: loads optuna

    study = optuna.load_study(study_name=name, storage=store)
    spec = study.user_attrs.get(naming.SPEC_KEY)
    end = time.monotonic() + 30.0
    while spec is None and time.monotonic() < end:  # a leader creates the study, then stores its spec
        time.sleep(0.2)
        spec = study.user_attrs.get(naming.SPEC_KEY)
    if spec is None:
        raise UsageError(f"--study {name!r}: not an advisor study in {storage} (no spec attribute); name a study "
                         "made by `advisor suggest --storage URL --study NAME`")
    if backend is not None and backend != spec["backend"]:
        raise UsageError(f"--backend {backend}: the study {name!r} measures with {spec['backend']}; a worker must "
                         f"use the study's backend: drop --backend or pass --backend {spec['backend']}")
    if workload is None:
        if not spec.get("model"):
            raise UsageError(f"--study {name!r}: started from a Workload object; run workers through "
                             "advisor.search.run_worker(workload=...)")
        # the one reference type: model, GPU, data, trainer and world (num_gpus) as the leader's spec names them
        workload = WorkloadRef.from_spec(spec).build(goals=Goals(**spec["goals"]))
    workload = dataclasses.replace(workload, goals=Goals(**spec["goals"]))
    if workload.fingerprint() != spec["workload_fingerprint"]:
        raise UsageError(f"--study {name!r}: the workload differs from the one the study was made for")
    be = get_backend(spec["backend"])
    space = StudySpace(workload, space_from_json(spec["space"]), int(spec["tokens_per_step"]),
                   RowTokens(workload.dataset))
    if spec["backend"] not in pools:
        pools[spec["backend"]] = _open_pool(spec["backend"], jobs)
    pool = pools[spec["backend"]]
    return StudyRun(workload, Method(spec["method"]), space, be, study, progress, pool=pool, jobs=pool.jobs)


def work(store: optuna.storages.BaseStorage, study_name: str, storage: str, workload: Workload | None,
          backend: str | None, idle_s: float, progress: Callable[[Progress], None] | None, jobs: int | None,
          runs: dict[str, StudyRun], pools: dict[str, Any]) -> None:
    idle_since = time.perf_counter()
    while True:  # a worker may start before the leader has made the study, or before it escalates
        for name in naming.worker_names(naming.study_names(store), study_name):
            if name not in runs:
                runs[name] = _worker_run(store, name, storage, workload, backend, progress, pools, jobs)
                idle_since = time.perf_counter()  # `idle_s` of an empty queue counts from the study's making
        worked = 0
        for run in runs.values():
            before = run.new_measurements
            run.run(trials=0, time_budget_s=None, exhaustive=False, queue_only=True, idle_s=0.0)
            worked += run.new_measurements - before
        if worked:
            idle_since = time.perf_counter()
        elif time.perf_counter() - idle_since > idle_s:
            break
        else:
            time.sleep(0.2)
