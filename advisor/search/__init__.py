"""The search: an Optuna study over the SearchSpace that finds the fastest candidate that fits, and confirms it.

Objective: trained tokens per second at a fixed effective batch (micro-batch x accumulation is a knob, the
trained tokens per optimizer step are not). Constraint (`Trial.set_constraint`): device bytes <= the limit.
Methods are tried in order (`--method auto`: full, then LoRA, then QLoRA), one study each, until one has a
confirmed pick. Within one study proposals come, in order, from the study's queue: stored results of a cheaper
backend, the estimate's seeds (one per plateau of ties), or every candidate with `exhaustive`; then, when the
estimate prunes for a costlier backend, the multi-fidelity frontier (the unmeasured candidate the corrected
estimate ranks fastest among those that can still win), the search ending with a `Converged` event when none is
left; without an estimate, or with the estimate as the backend, the neighbour walk over plateaus of ties and TPE
(the study's sampler). Each distinct candidate is measured once (our ledger; TPE repeats points), a measured
failure bounds its larger neighbours, and the estimate prunes candidates far over the limit before a costlier
backend sees them. Measurements run through a pool (`jobs` at a time: in-process, or warm worker processes);
`run_worker` joins a shared study from another process.

This `__init__` is the public API (`__all__`); the package's modules are private to it (tests/test_privacy.py): `loop`
(one method's ask / evaluate / tell), `proposers` (stored results, estimate seeds, the frontier, the neighbour walk,
TPE, the fit check), `evaluator` (dedup, bounds, pruning, the pool), `pool` / `pool_child` / `forkserver` (the warm
worker processes), `fidelity` (the estimate corrected by measured points), `ledger` (what was measured, the bounds of
failures), `liveness` (heartbeats, owners, stale trials), `worker` (a worker's side of a shared study), `naming` (study
names, specs, opening the store), `storage` (SQLite, RDB URLs, journal files), `space` (the default space, `--fix` pins,
the accumulation that keeps the effective batch), `params` (the space as Optuna sees it) and `answer` (the confirmed
pick, the Suggestion, the no-fit message). What the search says about its run are typed events (`advisor.events`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

from ..backends import (
    backend_names,
    check_usable,
    default_backend_name,
    get_backend,
    register_backend,
    unregister_backend,
)
from ..errors import ConfigError, NoFitError, UsageError
from ..events import (
    AnsweredFromStored,
    EffectiveBatch,
    EmptyStudy,
    ErrorsDiscarded,
    Event,
    FitCheck,
    NoAdmissible,
    NothingFits,
    Progress,
    StorageNote,
    StoredAs,
    TrialsIgnored,
    render,
)
from ..inputs import build_workload
from ..space import Candidate, PackingStrategy, SearchSpace
from ..suggestion import Suggestion
from ..trainers import DEFAULT, choices, get_trainer, model_inputs, trainer_of
from ..workload import Goals, Method, Workload, parse_fraction, parse_size
from .answer import (
    build_suggestion,
    confirmation_note,
    confirmed_best,
    empty_message,
    next_knob,
    no_fit_message,
    not_installed,
    raise_if_backend_failed,
    smallest,
)
from .answer import smallest as smallest_run
from .evaluator import PRUNE_FACTOR, SerialPool, failure_reason
from .evaluator import _open_pool as open_search_pool
from .fidelity import FLOOR as FIDELITY_FLOOR
from .fidelity import MIN_POINTS as FIDELITY_MIN_POINTS
from .fidelity import SHRINK as FIDELITY_SHRINK
from .fidelity import Correction, cannot_win
from .fidelity import fit as fit_correction
from .ledger import candidate_key, device_bytes, feasible, needs_at_least
from .liveness import HEARTBEAT_S, STALE_S
from .loop import StudyRun
from .naming import SPEC_KEY, create_study, drop_failed_study, open_store, study_name, study_names
from .naming import spec as study_spec
from .naming import study_name as name_study
from .params import NO_ACCUMULATION, StudySpace, space_from_json
from .pool import InProcessPool, ProcessPool, check_jobs, default_jobs, messages_of, open_pool, prestarted
from .proposers import fit_check, walk_parameters
from .space import (
    RowTokens,
    accumulation_for,
    apply_pins,
    default_space,
    default_tokens_per_step,
    installed_space,
    method_order,
    parse_fix,
    value_requirements,
    with_accumulation,
)
from .storage import (
    after_failure,
    cache_dir,
    is_storage_failure,
    open_cache,
    open_for_reading,
    open_given,
    open_storage,
)
from .stored import StoredStudy, run_worker, stored_studies, stored_suggestion
from .worker import work

__all__ = [
    "suggest", "run_worker", "build_space", "Progress", "check_backend", "stored_studies", "stored_suggestion",
    "StoredStudy", "register_backend", "unregister_backend", "backend_names",
    "default_backend_name", "prestarted", "walk_parameters", "cache_dir", "parse_fix", "DEFAULT_TRIALS",
    "confirmation_note",
    # the search's parts (this package's modules), public for tools, benchmarks and their tests:
    # the ledger's keys and the budget's bytes
    "candidate_key", "device_bytes", "feasible", "needs_at_least", "PRUNE_FACTOR",
    # the space and the effective batch
    "default_space", "RowTokens", "default_tokens_per_step", "accumulation_for", "with_accumulation", "StudySpace",
    "value_requirements",
    # measuring through a pool (--jobs)
    "open_pool", "open_search_pool", "SerialPool", "InProcessPool", "ProcessPool", "check_jobs", "default_jobs",
    "messages_of", "get_backend",
    # the estimate corrected by the measured points
    "Correction", "fit_correction", "cannot_win", "FIDELITY_SHRINK", "FIDELITY_FLOOR", "FIDELITY_MIN_POINTS",
    # studies: names, the stored spec, storages, heartbeats
    "name_study", "study_spec", "open_storage", "HEARTBEAT_S", "STALE_S",
    # the parts the rest of advisor uses (the CLI, the probes, the report), beside those above
    "NO_ACCUMULATION", "SPEC_KEY", "StudyRun", "after_failure", "apply_pins", "build_suggestion", "confirmed_best",
    "create_study", "drop_failed_study", "empty_message", "failure_reason", "fit_check", "installed_space",
    "is_storage_failure", "method_order", "next_knob", "no_fit_message", "not_installed", "open_cache",
    "open_for_reading", "open_given", "open_store", "raise_if_backend_failed", "smallest", "space_from_json",
    "study_name", "study_names", "work",
]

DEFAULT_TRIALS = 40
_GiB = 2**30


def build_space(workload: Workload, method: Method = Method.FULL, fix: Mapping[str, Any] | None = None) -> SearchSpace:
    """The default space of `workload` for one method, narrowed by `fix` (its trainer's config / ModelConfig names)."""
    return apply_pins(default_space(workload, method), parse_fix(fix, workload.trainer))


_GOALS = {g.param: g for g in Goals.declared()}


_PATHLIKE = (str, os.PathLike)
_KINDS: dict[str, tuple[tuple[type, ...], str]] = {  # suggest()'s parameter -> (accepted types, what to pass)
    "model": ((*_PATHLIKE, Workload), "a hub id or a local directory / config.json path (str), or a Workload"),
    "gpu": ((str,), "a GPU profile name such as 'H100-80GB', 'L4' or 'cpu' (`advisor gpus` lists them)"),
    "dataset": (_PATHLIKE, "a hub id or a local .jsonl/.json/.parquet/.csv file or directory (str)"),
    "backend": ((str,), "a backend name such as 'estimate' or 'simulate'"),
    "trials": ((int,), "a whole number of trials, e.g. trials=40"),
    "time_budget_s": ((int, float), "seconds, e.g. time_budget_s=600"),
    "fix": ((Mapping,), "a mapping of field to value, e.g. fix={'optim': 'adamw_torch'}"),
    "storage": (_PATHLIKE, "an Optuna RDB URL such as 'sqlite:///studies.db' or a journal file path"),
    "jobs": ((int,), "a whole number of parallel measurements, e.g. jobs=2"),
    "num_gpus": ((int,), "a whole number of GPUs, e.g. num_gpus=8"),
    "num_machines": ((int,), "a whole number of machines, e.g. num_machines=2"),
    "trainer": ((str,), "a trainer name: {trainers}"),
}
_MODEL = (_PATHLIKE, "a hub id or a local directory (str): {what}")  # a model beside the policy (ModelInput)


def _check_parameters(**given: Any) -> None:
    """A parameter of the wrong type is a ConfigError naming it, the value and what to pass (every one at once),
    not the TypeError / AttributeError of wherever the value is first used."""
    declared = {m.param: m for m in model_inputs()}
    problems = []
    for name, value in given.items():
        kinds, what = _KINDS[name] if name in _KINDS else _MODEL
        what = what.replace("{trainers}", ", ".join(repr(n) for n in choices())).replace(
            "{what}", declared[name].help if name in declared else "")
        if value is None and name != "model":
            continue
        if isinstance(value, bool) or not isinstance(value, kinds):
            problems.append(f"{name}={value!r}: expected {what}, got {type(value).__name__}")
            continue
        if name == "fix":
            keys = [k for k in value if not isinstance(k, str)]
            if keys:
                problems.append(f"fix={value!r}: the keys are field names (str), got {keys[0]!r}")
    fix = given.get("fix")
    if isinstance(fix, (list, tuple)) and all(isinstance(x, str) and "=" in x for x in fix):
        shown = {x.partition("=")[0].strip(): x.partition("=")[2].strip() for x in fix}
        problems = [p if not p.startswith("fix=") else p + f"; write fix={shown!r}" for p in problems]
    if problems:
        raise ConfigError(problems, context="suggest()")


def _goal_args(given: Mapping[str, Any]) -> dict[str, Any]:
    """suggest()'s goal keywords (one per `Goals` field, by its `param` name) as Goals field values; a size or a
    fraction may be written as the CLI takes it ('40GB', '5%')."""
    unknown = sorted(set(given) - set(_GOALS))
    if unknown:
        raise UsageError(f"suggest(): unknown parameter(s) {', '.join(unknown)}; the goals are "
                         f"{', '.join(_GOALS)}")
    problems = []
    for k, v in given.items():
        g = _GOALS[k]
        if v is None:
            continue
        try:
            if g.kind == "size" and isinstance(v, str):
                given = {**given, k: parse_size(v, flag=k)}
            elif g.kind == "fraction" and isinstance(v, str):
                given = {**given, k: parse_fraction(v, flag=k)}
        except UsageError as exc:
            problems.append(str(exc))
            continue
        v = given[k]
        ok = {"size": (int,), "int": (int,), "fraction": (int, float), "switch": (bool,), "choice": (str,)}[g.kind]
        if (isinstance(v, bool) and g.kind != "switch") or not isinstance(v, ok):
            example = {"size": "an int of bytes or a size such as '40GB'", "int": "a whole number",
                       "fraction": "a number such as 0.05 or '5%'", "switch": "True or False",
                       "choice": f"one of {', '.join(g.choices)}"}[g.kind]
            problems.append(f"{k}={v!r}: expected {example}, got {type(v).__name__}")
    if problems:
        raise ConfigError(problems, context="suggest()")
    out = {_GOALS[k].name: v for k, v in given.items()}
    method = out.get("method")
    try:
        out["method"] = Method(method) if method is not None else None  # None: the Workload's (default auto)
    except ValueError:
        raise UsageError(f"--method {method!r}: choose one of full, lora, qlora, auto") from None
    return out


def _goals(base: Goals | None, **given: Any) -> Goals:
    """The Workload's goals (or the defaults) with every goal the caller passed (not None) over them: a value
    equal to the default still overrides a Workload's own (headroom=0.05 over a Workload's 0.1)."""
    merged = dict((base or Goals()).__dict__)
    merged.update({k: v for k, v in given.items() if v is not None})
    return Goals(**merged)


def _resolve_workload(model: str | Workload, gpu: str | None, dataset: str | None, goals: dict[str, Any],
                      world: dict[str, int] | None = None, trainer: str | None = None,
                      models: Mapping[str, str] | None = None) -> Workload:
    world = {k: v for k, v in (world or {}).items() if v is not None}  # num_gpus / num_machines given
    models = dict(models or {})
    if isinstance(model, Workload):
        if gpu is not None or dataset is not None or models:
            beside = ", ".join(["gpu", "dataset", *sorted(models)])
            raise UsageError(f"suggest(): pass {beside} inside the Workload, not beside it")
        if trainer is not None and trainer != model.trainer:
            raise UsageError(f"suggest(trainer={trainer!r}): the Workload was built for trainer={model.trainer!r} "
                             "(its dataset is that trainer's); build it with trainer=... or drop the argument")
        return dataclasses.replace(model, goals=_goals(model.goals, **goals), **world)
    return build_workload(model, gpu=gpu, dataset=dataset, goals=_goals(None, **goals), trainer=trainer or DEFAULT,
                          **models, **world)


def _split_keywords(given: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """suggest()'s other keywords: the models beside the policy (each trainer's declared ModelInput parameter:
    online RL's `reward_model`) and the goals."""
    params = {m.param for m in model_inputs()}
    return ({k: v for k, v in given.items() if k in params}, {k: v for k, v in given.items() if k not in params})


def suggest(
    model: str | Workload,
    gpu: str | None = None,
    dataset: str | None = None,
    *,
    backend: str | None = None,
    trials: int | None = None,
    time_budget_s: float | None = None,
    fix: Mapping[str, Any] | None = None,
    storage: str | None = None,
    study_name: str | None = None,
    cache: bool = True,
    exhaustive: bool = False,
    progress: Callable[[Progress], None] | None = None,
    workload_names: Mapping[str, Any] | None = None,
    jobs: int | None = None,
    num_gpus: int | None = None,
    num_machines: int | None = None,
    trainer: str | None = None,
    **keywords: Any,
) -> Suggestion:
    """The fastest candidate whose device peak stays under budget x (1 - headroom), measured by `backend`.

    Raises NoFitError (exit 1) when nothing fits, ConfigError / UsageError (exit 2) for bad input (a `cuda`
    backend without a CUDA device included, before any work), BackendError (exit 3) when the backend failed with
    an error on every candidate it measured.
    `evaluations` in the answer counts the distinct candidates this search measured with its backend (every
    method it tried, its workers included); those answered from a stored study are listed in the trials as
    cached but not counted. `num_gpus` / `num_machines` (default: the Workload's, else 1): N GPUs of the named
    kind over M machines; the budget applies to each rank, the effective batch counts every rank, and the
    answer's `accelerate_yaml()` / `launch_command()` launch it.
    `workload_names` (model, gpu, dataset, tokenizer, sample: the names a Workload
    passed as `model` was built from) are stored in the study so that `advisor worker` can rebuild the
    workload and join it. `trainer`: the TRL trainer (a registered name, advisor.trainers.choices(); default:
    the Workload's, else advisor.trainers.DEFAULT); the dataset is read as that trainer reads it, and the
    suggestion builds that trainer's config.
    """
    models, goals = _split_keywords(keywords)
    _check_parameters(model=model, gpu=gpu, dataset=dataset, backend=backend, trials=trials,
                      time_budget_s=time_budget_s, fix=fix, storage=storage, jobs=jobs, num_gpus=num_gpus,
                      num_machines=num_machines, trainer=trainer, **models)
    model, dataset, storage = (os.fspath(v) if isinstance(v, os.PathLike) else v for v in (model, dataset, storage))
    models = {k: os.fspath(v) for k, v in models.items() if v is not None}
    goals = _goal_args(goals)
    if trials is not None and trials < 1:
        raise UsageError(f"--trials {trials}: must be >= 1")
    ignored: list[Event] = [TrialsIgnored(trials)] if (exhaustive and trials is not None) else []
    if time_budget_s is not None and time_budget_s <= 0:
        raise UsageError(f"--time-budget {time_budget_s:g}: must be a positive number of seconds, e.g. 600")
    origin: dict[str, Any] = {"model": model if isinstance(model, str) else None, "gpu": gpu, "dataset": dataset,
                              "tokenizer": None, "sample": None}
    origin.update({k: v for k, v in (workload_names or {}).items() if k in origin and v is not None})
    if backend is not None:
        check_backend(backend)  # before the workload is built: an unusable backend fails in a second
    workload = _resolve_workload(model, gpu, dataset, goals, {"num_gpus": num_gpus, "num_machines": num_machines},
                                 trainer, models)
    run = _Search(workload, backend or default_backend_name(), fix, origin, ignored, progress)
    return run.search(trials=trials, time_budget_s=time_budget_s, storage=storage, study_name=study_name,
                      cache=cache, exhaustive=exhaustive, jobs=jobs)


class _Search:
    """One search of `workload` with one backend: the methods in order, one study each, until one has a confirmed
    pick (`search`); what it says about its run gathered in `events`."""

    def __init__(self, workload: Workload, backend_name: str, fix: Mapping[str, Any] | None,
                 origin: dict[str, Any], events: list[Event], progress: Callable[[Progress], None] | None):
        self.workload, self.backend_name, self.fix, self.origin = workload, backend_name, fix, origin
        self.be = get_backend(backend_name)
        self.trainer = trainer_of(workload)
        self.pins = parse_fix(fix, self.trainer)
        if PackingStrategy.WRAPPED in self.pins.values.get("packing_strategy", ()) and \
                not workload.goals.allow_wrapped:
            raise UsageError("--fix packing_strategy=wrapped: 'wrapped' packing mixes examples and cuts them "
                             "mid-sequence, a quality cost the search takes only when allowed; add --allow-wrapped "
                             "(suggest(allow_wrapped=True)) or drop the --fix")
        self.order = method_order(workload.goals.method, self.pins)
        self.rows = RowTokens(workload.dataset)
        self.tps = default_tokens_per_step(workload, self.rows)
        self.events, self.progress = events, progress
        self.smallest: list[tuple[int, Candidate]] = []
        self.runs: list[StudyRun] = []

    def search(self, *, trials: int | None, time_budget_s: float | None, storage: str | None,
               study_name: str | None, cache: bool, exhaustive: bool, jobs: int | None) -> Suggestion:
        wl, events = self.workload, self.events
        fallback = _STORE_FALLBACK.get()
        if fallback is None:
            store, kept = open_store(storage, cache, events, self.progress)
        else:  # the store failed in this search's first try: memory, what it holds copied in (after_failure)
            store, kept = fallback.storage, False
            events.append(StorageNote(fallback.note))
            if self.progress is not None:
                self.progress(Progress(0, 0, None, 0.0, note=fallback.note))
        if not wl.goals.tokens_per_step:  # the unit per_device_train_batch_size counts: the trainer's, else a row's
            events.append(EffectiveBatch(self.tps, self.trainer.batch_unit or wl.dataset.unit))
        full, spaces, left, empty = self._spaces()
        with open_search_pool(self.backend_name, jobs) as pool, _StorageGuard(kept) as guard:  # one for every method
            for i, m in enumerate(self.order):
                nxt = self.order[i + 1].value if i + 1 < len(self.order) else None
                if empty[m]:
                    events.append(NoAdmissible(m.value, empty[m], nxt))
                    continue
                name = study_name if study_name and len(self.order) == 1 else (
                    f"{study_name}-{m.value}" if study_name else name_study(wl, self.backend_name, m, spaces[m]))
                if not study_name and drop_failed_study(store, name):
                    events.append(ErrorsDiscarded(m.value))
                study = create_study(store, name, study_spec(wl, self.backend_name, m, spaces[m], self.origin),
                                     study_name)
                run = StudyRun(wl, m, spaces[m], self.be, study, self.progress, pool=pool, jobs=pool.jobs)
                self.runs.append(run)
                answer = self._run_method(run, m, name, nxt, trials, time_budget_s, exhaustive, kept, storage,
                                          full, left)
                if answer is not None:
                    return answer
        if guard.failed is not None:  # the store stopped taking writes: one line, and the search again in memory
            token = _STORE_FALLBACK.set(after_failure(store, storage, guard.failed))
            try:
                return suggest(wl, backend=self.backend_name, trials=trials, time_budget_s=time_budget_s,
                               fix=self.fix, storage=storage, study_name=study_name, cache=cache,
                               exhaustive=exhaustive, progress=self.progress, workload_names=self.origin, jobs=jobs)
            finally:
                _STORE_FALLBACK.reset(token)
        raise self._no_fit()

    def _spaces(self) -> tuple[dict, dict, dict, dict]:
        """Each method's space: the default space with the pins (`full`), what a run on this machine can import
        (`spaces`, with what was left out: `left`), and why a method has no admissible candidate (`empty`). No
        method with one is bad input (UsageError), not "nothing fits"."""
        wl, pins, tps, rows = self.workload, self.pins, self.tps, self.rows
        full = {m: StudySpace(wl, apply_pins(default_space(wl, m), pins), tps, rows) for m in self.order}
        spaces, left = dict(full), {}
        if wl.runs_here or self.be.runs_here:  # a run on this machine: only what it can import (advisor/packages.py)
            for m in self.order:
                installed, left[m] = installed_space(full[m].space, pins)
                spaces[m] = StudySpace(wl, installed, tps, rows)
        empty = {m: left[m].why_empty() if m in left and left[m].emptied else sp.why_empty()
                 for m, sp in spaces.items()}
        if all(empty.values()):
            why = "; ".join(f"{m.value}: {w}" for m, w in empty.items())
            batch_blocks = wl.num_gpus > 1 and all(w and w.startswith(NO_ACCUMULATION) for w in empty.values())
            if self.fix and not batch_blocks:  # several GPUs: an effective batch the ranks cannot split
                shown = " ".join(f"--fix {k}={v}" for k, v in self.fix.items())
                raise UsageError(f"{shown}: leaves no admissible candidate ({why}); drop or change the --fix")
            raise UsageError(empty_message(wl, spaces, empty, rows, tps, why))
        return full, spaces, left, empty

    def _run_method(self, run: StudyRun, m: Method, name: str, nxt: str | None, trials: int | None,
                    time_budget_s: float | None, exhaustive: bool, kept: bool, storage: str | None,
                    full: dict, left: dict) -> Suggestion | None:
        """One method's study: run, confirm, fit-check; the Suggestion, or None to go on to the next method."""
        events = self.events
        # the trials asked for, else the trainer's declared default (its front door's), else the search's
        run.run(trials=trials or self.trainer.default_trials or DEFAULT_TRIALS, time_budget_s=time_budget_s,
                exhaustive=exhaustive)
        run.wait_for_running()  # workers, or another run sharing the cache: their results belong in the answer
        raise_if_backend_failed(run, self.backend_name, name)
        best = confirmed_best(run, events)
        unmeasured = 0
        if best is None and not run.stopped_by_time:
            # The trial budget may have run out before anything that fits was tried: ask the estimate about
            # the whole admissible space and measure the few it says fit before escalating or giving up.
            extra, n_fit, unmeasured = fit_check(run.space, run.ledger, run.evaluator)
            if extra:
                events.append(FitCheck(m.value, len(run.ledger.measured), n_fit, len(extra)))
                run.enqueue(extra, "fit-check")
                run.run(trials=0, time_budget_s=None, exhaustive=False, queue_only=True)
                best = confirmed_best(run, events)
                unmeasured = fit_check(run.space, run.ledger, run.evaluator, 0)[2]
        if best is not None:
            entry, confirmed = best
            if not any(r.new_measurements for r in self.runs) and run.ledger.measured:
                events.append(AnsweredFromStored(name))
            elif kept:
                events.append(StoredAs(name, storage))
            if left.get(m) and left[m].by_package:
                events.extend(not_installed(run, full[m], left[m], entry.candidate))
            return build_suggestion(self.workload, self.runs, entry, confirmed, events, self.backend_name)
        if not run.ledger.measured and time_budget_s is not None and run.stopped_by_time:
            raise NoFitError(
                f"--time-budget {time_budget_s:g}s ended before any candidate was measured with {self.backend_name}; "
                "give it more time (finished trials are kept and the next run resumes)",
                details={"limit_bytes": self.workload.limit_bytes, "next_knob": "--time-budget"},
            )
        if not run.ledger.entries:
            events.append(EmptyStudy(m.value))
        low = smallest_run(run)
        if low is not None:
            self.smallest.append(low)
        events.append(NothingFits(m.value, self.workload.limit_bytes, low[0] if low else None,
                                  len(run.ledger.measured), unmeasured, self.backend_name == "estimate", nxt))
        return None

    def _no_fit(self) -> NoFitError:
        events, smallest = self.events, self.smallest
        low = min(smallest, key=lambda s: s[0]) if smallest else None
        return NoFitError(no_fit_message(self.workload, self.order, smallest, events), details={
            "limit_bytes": self.workload.limit_bytes,
            "smallest_device_bytes": low[0] if low else None,
            "smallest_config": low[1].to_dict() if low else None,
            "next_knob": next_knob(self.order[-1]),
            "notes": [render(e) for e in events],
            "events": [e.to_dict() for e in events],
        })


_STORE_FALLBACK: contextvars.ContextVar = contextvars.ContextVar("advisor_store_fallback", default=None)


class _StorageGuard:
    """Around a search that stores what it measures: a store that fails mid-run (a full disk) is recorded in
    `failed` instead of raised, and suggest() answers again in memory (what was stored is read back, not
    measured again)."""

    def __init__(self, kept: bool):
        self.kept = kept
        self.failed: BaseException | None = None

    def __enter__(self) -> _StorageGuard:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is not None and self.kept and is_storage_failure(exc):
            self.failed = exc
            return True
        return False


def _derive_keyword_parameters() -> None:
    """suggest()'s signature and docstring list the models beside the policy as the trainers declare them
    (advisor.trainers ModelInput) and the goals as `Goals` declares them (keyword-only, None: not given)."""
    sig = inspect.signature(suggest)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    keywords = [m.param for m in model_inputs()] + [g.param for g in _GOALS.values()]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in keywords]
    suggest.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    models = "".join(f"        {m.param}: {m.help} (trainers that take one: "
                     f"{', '.join(t for t in choices() if m in get_trainer(t).model_inputs)})\n"
                     for m in model_inputs())
    listed = "".join(f"        {g.param}: {g.help} (default "
                     f"{g.default.value if isinstance(g.default, Method) else g.default})\n" for g in _GOALS.values())
    suggest.__doc__ = (suggest.__doc__ or "") + "\n    Models beside the policy (hub id or directory):\n" + models \
        + "\n    Goals (each overrides the Workload's own when given):\n" + listed


_derive_keyword_parameters()


def check_backend(name: str) -> None:
    """UsageError (exit 2) for an unknown backend, or one that cannot run here (cuda without a CUDA device)."""
    check_usable(name)
