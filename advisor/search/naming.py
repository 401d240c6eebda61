"""Study names, what a stored study was made for (its spec) and how a new run's spec differs, and opening the
store and the study (a cache that cannot be used falls back, and says so as an event)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..events import Event, Progress, StorageNote
from ..measurement import Status
from ..workload import Method, Workload, fingerprint
from .params import StudySpace
from .storage import library_versions, open_cache, open_given, open_storage, prepare_study

if TYPE_CHECKING:
    import optuna

SPEC_KEY = "advisor"  # the study user attr that holds what the study was made for
# What a stored study must agree on with a new run that reuses its name (pins are part of the space).
SPEC_FIELDS = ("backend", "method", "space", "tokens_per_step", "workload_fingerprint", "goals")
METHOD_SUFFIXES = tuple(f"-{m.value}" for m in (Method.FULL, Method.LORA, Method.QLORA))


def study_name(workload: Workload, backend: str, method: Method, space: StudySpace) -> str:
    fp = fingerprint({
        "workload": workload.fingerprint(), "backend": backend, "method": method.value, "space": space.to_json(),
        "tokens_per_step": space.tokens_per_step, "limit": workload.limit_bytes, "versions": library_versions(),
    })
    short = workload.model.name.rstrip("/").split("/")[-1]
    gpus = workload.gpu.name if workload.num_gpus == 1 else (
        f"{workload.num_gpus}x{workload.gpu.name}" + (f"-{workload.num_machines}nodes" if workload.num_machines > 1
                                                      else ""))
    return f"advisor-{short}-{gpus}-{backend}-{method.value}-{fp}"


def spec(workload: Workload, backend: str, method: Method, space: StudySpace,
         origin: dict[str, Any]) -> dict[str, Any]:
    return {"backend": backend, "method": method.value, "space": space.to_json(),
            "tokens_per_step": space.tokens_per_step, "workload_fingerprint": workload.fingerprint(),
            "goals": {k: (v.value if isinstance(v, Enum) else v) for k, v in workload.goals.__dict__.items()},
            "trainer": workload.trainer,
            # several GPUs: the world the study was made for (left out on one GPU: older specs stay)
            **({"num_gpus": workload.num_gpus, "num_machines": workload.num_machines}
               if (workload.num_gpus, workload.num_machines) != (1, 1) else {}),
            **origin}


def spec_differences(stored: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    out = []
    for k in SPEC_FIELDS:
        a, b = stored.get(k), new.get(k)
        if k == "goals":  # the requested method (auto or not) is not the study's: "method" above is
            a = {g: v for g, v in (a or {}).items() if g != "method"}
            b = {g: v for g, v in (b or {}).items() if g != "method"}
            changed = sorted(g for g in set(a) | set(b) if a.get(g) != b.get(g))
            if changed:
                out.append(f"goals ({', '.join(changed)})")
        elif k == "space" and a != b:
            keys = sorted(g for g in set(a or {}) | set(b or {}) if (a or {}).get(g) != (b or {}).get(g))
            out.append(f"space ({', '.join(keys)}: --fix, --method or --max-truncation)")
        elif a != b:
            out.append(k if k != "workload_fingerprint" else "workload (model, GPU, dataset or budget)")
    return out


def open_store(storage: str | None, cache: bool, events: list[Event],
               progress: Callable[[Progress], None] | None) -> tuple[optuna.storages.BaseStorage, bool]:
    """--storage as given (errors name it), else the default cache, which never fails: an unusable one is
    replaced by memory, a read-only one is read; either says so in one line (the report, and the CLI's stderr).
    The flag says whether what this run measures is kept (False: in memory, or a read-only copy)."""
    if not storage and not cache:
        return open_storage(None), False
    opened = open_given(storage) if storage else open_cache()
    if opened.note:
        events.append(StorageNote(opened.note))
        if progress is not None:
            progress(Progress(0, 0, None, 0.0, note=opened.note))
    return opened.storage, not opened.note


def create_study(storage: optuna.storages.BaseStorage, name: str, new: dict[str, Any],
                 given_name: str | None = None) -> optuna.Study:
    import optuna  # lazy: loads optuna

    from .proposers import make_sampler  # lazy: circle via proposers

    prepare_study(storage, name)
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize", sampler=make_sampler(),
                                load_if_exists=True)
    stored = study.user_attrs.get(SPEC_KEY)
    if stored is None:
        study.set_user_attr(SPEC_KEY, new)
    elif differences := spec_differences(stored, new):
        shown = given_name or name
        raise UsageError(f"--study {shown!r}: the stored study {name!r} was made with a different "
                         f"{'; '.join(differences)}; pass the original flags to resume it, or name a new --study")
    return study


def study_names(store: optuna.storages.BaseStorage) -> list[str]:
    import optuna  # lazy: loads optuna

    return [su.study_name for su in optuna.get_all_study_summaries(store, include_best_trial=False)]


def worker_names(names: list[str], name: str) -> list[str]:
    """The study itself, or the per-method studies `suggest --method auto --study NAME` makes (NAME-full, ...)."""
    if name in names:
        return [name]
    return [name + sfx for sfx in METHOD_SUFFIXES if name + sfx in names]


def drop_failed_study(store: optuna.storages.BaseStorage, name: str) -> bool:
    """Delete a cached study whose every measurement is an error (the run raised BackendError): it says nothing
    about memory, and keeping it would answer the rerun, after the cause is fixed, with the same errors."""
    import optuna  # lazy: loads optuna
    from optuna.trial import TrialState  # lazy: loads optuna

    if name not in study_names(store):
        return False
    study = optuna.load_study(study_name=name, storage=store)
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    statuses = [t.user_attrs["measurement"].get("status") for t in done
                if t.user_attrs.get("measured") and "measurement" in t.user_attrs]
    if not statuses or any(st != Status.ERROR.value for st in statuses):
        return False
    with contextlib.suppress(KeyError):  # another run deleted it first
        optuna.delete_study(study_name=name, storage=store)
    return True
