"""Stored searches shown again without measuring (`stored_studies`, `stored_suggestion`) and a worker's side of a
shared study (`run_worker`); advisor.search re-exports them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import NoFitError, UsageError
from ..events import ConfirmationFailed, Event, NoConfirmationStored, Progress, ShownFromStored, render
from ..inputs import WorkloadRef
from ..measurement import Measurement, Source, Status
from ..suggestion import Suggestion
from ..workload import Goals, Method, Workload, fingerprint
from .answer import build_suggestion
from .backends import FunctionBackend, get_backend
from .evaluator import failure_reason
from .ledger import candidate_key, device_bytes, feasible
from .loop import StudyRun
from .naming import SPEC_KEY, study_names
from .params import StudySpace, space_from_json
from .space import RowTokens
from .storage import open_for_reading, open_storage
from .worker import work

_GiB = 2**30


@dataclass(frozen=True)
class StoredStudy:
    """One stored study (one method of one search): what it was for, and how far it got."""

    name: str
    model: str | None
    gpu: str | None
    dataset: str | None
    backend: str
    method: str
    trials: int  # distinct candidates measured
    answered: bool  # a confirmation is stored: `suggest` returned an answer from it
    started: str | None  # ISO date of its first trial


def stored_studies(storage: str | None = None) -> list[StoredStudy]:
    """The advisor studies in `storage` (default: the study cache that `suggest` uses), oldest first."""
    import optuna  # lazy: loads optuna
    from optuna.trial import TrialState  # lazy: loads optuna

    store = open_for_reading(storage)  # never creates a database
    out = []
    for su in optuna.get_all_study_summaries(store, include_best_trial=False):
        spec = su.user_attrs.get(SPEC_KEY)
        if not spec:
            continue
        study = optuna.load_study(study_name=su.study_name, storage=store)
        measured = {t.user_attrs.get("key") for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    if t.user_attrs.get("measured")}
        out.append(StoredStudy(
            name=su.study_name, model=spec.get("model"), gpu=spec.get("gpu"), dataset=spec.get("dataset"),
            backend=spec["backend"], method=spec["method"], trials=len(measured),
            answered=any(k.startswith("confirm:") for k in study.user_attrs),
            started=su.datetime_start.isoformat(timespec="seconds") if su.datetime_start else None,
        ))
    return sorted(out, key=lambda s: (s.started or "", s.name))


def stored_suggestion(study_name: str, storage: str | None = None, *, workload: Workload | None = None) -> Suggestion:
    """The answer of a stored study, rebuilt from its trials and stored confirmation; nothing is measured.

    The workload is rebuilt from the names the study keeps (model, GPU, dataset), unless given.
    """
    import optuna  # lazy: loads optuna

    label = storage or "the study cache"
    store = open_for_reading(storage)  # never creates a database
    names = study_names(store)
    if study_name not in names:
        ours = [n for n in names if n.startswith("advisor-") or study_name in n]
        listed = f"stored: {', '.join(ours)}" if ours else "none is stored there yet"
        raise UsageError(f"--study {study_name!r}: no such study in {label} ({listed}); `advisor studies` lists "
                         "them")
    study = optuna.load_study(study_name=study_name, storage=store)
    spec = study.user_attrs.get(SPEC_KEY)
    if spec is None:
        raise UsageError(f"--study {study_name!r}: not an advisor study (no spec attribute)")
    if workload is None:
        if not spec.get("model"):
            raise UsageError(f"--study {study_name!r}: made from a Workload object; call "
                             "advisor.search.stored_suggestion(name, workload=...)")
        workload = WorkloadRef.from_spec(spec).build()
    workload = dataclasses.replace(workload, goals=Goals(**spec["goals"]))
    if workload.fingerprint() != spec["workload_fingerprint"]:
        raise UsageError(f"--study {study_name!r}: the model, GPU profile or dataset it names has changed since "
                         "the search; rerun `advisor suggest` with the same flags")
    try:
        be = get_backend(spec["backend"])
    except UsageError:  # a backend registered by the process that made the study: never called here
        be = FunctionBackend(spec["backend"], lambda w, c: Measurement(Status.ERROR, Source.EXTERNAL))
    space = StudySpace(workload, space_from_json(spec["space"]), int(spec["tokens_per_step"]),
                   RowTokens(workload.dataset))
    run = StudyRun(workload, Method(spec["method"]), space, be, study)
    events: list[Event] = [ShownFromStored(study_name, len(run.ledger.measured))]
    ok = sorted((e for e in run.ledger.measured if feasible(e.measurement, run.limit)),
                key=lambda e: (-(e.measurement.tokens_per_second or 0.0), len(e.candidate.requirements()),
                               device_bytes(e.measurement) or 0))
    for entry in ok:
        stored = study.user_attrs.get("confirm:" + fingerprint(candidate_key(entry.candidate)))
        if stored is None:
            events.append(NoConfirmationStored())
            return build_suggestion(workload, [run], entry, entry.measurement, events, spec["backend"])
        confirmed = Measurement.from_dict(stored)
        if feasible(confirmed, run.limit):
            return build_suggestion(workload, [run], entry, confirmed, events, spec["backend"])
        events.append(ConfirmationFailed(entry.candidate, failure_reason(confirmed, run.limit)))
    raise NoFitError(f"--study {study_name!r}: no measured candidate fits the limit "
                     f"{workload.limit_bytes / _GiB:.2f} GiB ({len(run.ledger.measured)} measured); "
                     "rerun `advisor suggest` to search further",
                     details={"limit_bytes": workload.limit_bytes, "notes": [render(e) for e in events],
                              "events": [e.to_dict() for e in events]})


def run_worker(storage: str, study_name: str, *, workload: Workload | None = None, backend: str | None = None,
               idle_s: float = 5.0, progress: Callable[[Progress], None] | None = None,
               jobs: int | None = None) -> int:
    """Measure queued candidates of a shared study until no queue has had work for `idle_s`; return how many.

    `study_name` is the name given to `suggest --study`: with `--method auto` the worker follows the per-method
    studies NAME-full, NAME-lora, NAME-qlora as the leader escalates. Optuna hands each queued trial to one
    worker only, so no two workers measure the same candidate. `jobs`: candidates measured at once.
    """
    store = open_storage(storage)
    runs: dict[str, StudyRun] = {}
    pools: dict[str, Any] = {}
    try:
        work(store, study_name, storage, workload, backend, idle_s, progress, jobs, runs, pools)
    finally:
        for pool in pools.values():
            pool.close()
    if not runs:
        known = study_names(store)
        listed = f"studies there: {', '.join(known)}" if known else "it holds no study yet"
        raise UsageError(f"--study {study_name!r}: no such study in {storage} ({listed}); pass the --study name "
                         "given to `advisor suggest`")
    return sum(run.new_measurements for run in runs.values())
