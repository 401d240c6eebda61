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

This module is the public API; the parts live in `advisor/_search/`: `loop` (one method's ask / evaluate / tell),
`proposers` (stored results, estimate seeds, the frontier, the neighbour walk, TPE, the fit check), `evaluator`
(dedup, bounds, pruning, the pool), `pool` / `pool_child` / `forkserver` (the warm worker processes), `fidelity`
(the estimate corrected by measured points), `ledger` (what was measured, the bounds of failures), `liveness`
(heartbeats, owners, stale trials), `worker` (a worker's side of a shared study), `naming` (study names, specs,
opening the store), `storage` (SQLite, RDB URLs, journal files), `space` (the default space, `--fix` pins, the
accumulation that keeps the effective batch), `params` (the space as Optuna sees it) and `answer` (the confirmed
pick, the Suggestion, the no-fit message). What the search says about its run are typed events (`advisor.events`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._search import (
    FIDELITY_FLOOR,
    FIDELITY_MIN_POINTS,
    FIDELITY_SHRINK,
    HEARTBEAT_S,
    NO_ACCUMULATION,
    PRUNE_FACTOR,
    SPEC_KEY,
    STALE_S,
    Correction,
    InProcessPool,
    ProcessPool,
    RowTokens,
    SerialPool,
    StudyRun,
    StudySpace,
    accumulation_for,
    after_failure,
    apply_pins,
    build_suggestion,
    cache_dir,
    candidate_key,
    cannot_win,
    check_jobs,
    confirmation_note,
    confirmed_best,
    create_study,
    default_jobs,
    default_space,
    default_tokens_per_step,
    device_bytes,
    drop_failed_study,
    empty_message,
    failure_reason,
    feasible,
    fit_check,
    fit_correction,
    installed_space,
    is_storage_failure,
    messages_of,
    method_order,
    needs_at_least,
    next_knob,
    no_fit_message,
    not_installed,
    open_for_reading,
    open_pool,
    open_search_pool,
    open_storage,
    open_store,
    parse_fix,
    prestarted,
    raise_if_backend_failed,
    space_from_json,
    study_names,
    study_spec,
    value_requirements,
    walk_parameters,
    with_accumulation,
    work,
)
from ._search import smallest as smallest_run
from ._search import study_name as name_study
from .backends import (
    FunctionBackend,
    backend_names,
    default_backend_name,
    get_backend,
    register_backend,
    unregister_backend,
)
from .errors import ConfigError, NoFitError, UsageError
from .events import (
    AnsweredFromStored,
    ConfirmationFailed,
    EffectiveBatch,
    EmptyStudy,
    ErrorsDiscarded,
    Event,
    FitCheck,
    NoAdmissible,
    NoConfirmationStored,
    NothingFits,
    Progress,
    ShownFromStored,
    StorageNote,
    StoredAs,
    TrialsIgnored,
    render,
)
from .measurement import Measurement, Source, Status
from .space import Candidate, PackingStrategy, SearchSpace
from .suggestion import Suggestion
from .workload import Goals, Method, Workload, fingerprint, parse_fraction, parse_size

if TYPE_CHECKING:
    pass

__all__ = [
    "suggest", "run_worker", "build_space", "Progress", "check_backend", "stored_studies", "stored_suggestion",
    "StoredStudy", "register_backend", "unregister_backend", "backend_names",
    "default_backend_name", "prestarted", "walk_parameters", "cache_dir", "parse_fix", "DEFAULT_TRIALS",
    "confirmation_note",
    # the search's parts (advisor/_search), public for tools, benchmarks and their tests:
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
]

DEFAULT_TRIALS = 40
_GiB = 2**30
_Space = StudySpace  # the name tests used before the split


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
    "reward_model": (_PATHLIKE, "a reward model's hub id or local directory (str), for a trainer that scores "
                                "completions with one (online RL)"),
    "teacher": (_PATHLIKE, "a teacher's hub id, local directory or config.json (str), for a trainer that distills "
                           "from one (distillation)"),
}


def _check_parameters(**given: Any) -> None:
    """A parameter of the wrong type is a ConfigError naming it, the value and what to pass (every one at once),
    not the TypeError / AttributeError of wherever the value is first used."""
    problems = []
    for name, value in given.items():
        kinds, what = _KINDS[name]
        if "{trainers}" in what:  # the registry's names, not a list kept here
            from .trainers import choices

            what = what.format(trainers=", ".join(repr(n) for n in choices()))
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
                      reward_model: str | None = None, teacher: str | None = None) -> Workload:
    world = {k: v for k, v in (world or {}).items() if v is not None}  # num_gpus / num_machines given
    if isinstance(model, Workload):
        if gpu is not None or dataset is not None or reward_model is not None or teacher is not None:
            raise UsageError("suggest(): pass gpu, dataset, reward_model and teacher inside the Workload, not beside "
                             "it")
        if trainer is not None and trainer != model.trainer:
            raise UsageError(f"suggest(trainer={trainer!r}): the Workload was built for trainer={model.trainer!r} "
                             "(its dataset is that trainer's); build it with trainer=... or drop the argument")
        return dataclasses.replace(model, goals=_goals(model.goals, **goals), **world)
    from .inputs import build_workload

    return build_workload(model, gpu=gpu, dataset=dataset, goals=_goals(None, **goals), trainer=trainer or "sft",
                          reward_model=reward_model, teacher=teacher, **world)


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
    reward_model: str | None = None,
    teacher: str | None = None,
    **goals: Any,
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
    the Workload's, else "sft"); the dataset is read as that trainer reads it, and the suggestion builds that
    trainer's config.
    `reward_model` (online RL: GRPO, RLOO): a reward model's hub id or directory, resident beside the policy.
    `teacher` (distillation): the teacher's hub id, directory or config.json, resident beside the student.
    """
    _check_parameters(model=model, gpu=gpu, dataset=dataset, backend=backend, trials=trials,
                      time_budget_s=time_budget_s, fix=fix, storage=storage, jobs=jobs, num_gpus=num_gpus,
                      num_machines=num_machines, trainer=trainer, reward_model=reward_model, teacher=teacher)
    model, dataset, storage = (os.fspath(v) if isinstance(v, os.PathLike) else v for v in (model, dataset, storage))
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
                                 trainer, os.fspath(reward_model) if reward_model is not None else None,
                                 os.fspath(teacher) if teacher is not None else None)
    backend_name = backend or default_backend_name()
    be = get_backend(backend_name)
    pins = parse_fix(fix, workload.trainer)
    if PackingStrategy.WRAPPED in pins.values.get("packing_strategy", ()) and not workload.goals.allow_wrapped:
        raise UsageError("--fix packing_strategy=wrapped: 'wrapped' packing mixes examples and cuts them "
                         "mid-sequence, a quality cost the search takes only when allowed; add --allow-wrapped "
                         "(suggest(allow_wrapped=True)) or drop the --fix")
    order = method_order(workload.goals.method, pins)
    rows = RowTokens(workload.dataset)
    tps = default_tokens_per_step(workload, rows)
    events: list[Event] = list(ignored)
    fallback = _STORE_FALLBACK.get()
    if fallback is None:
        store, kept = open_store(storage, cache, events, progress)
    else:  # the store failed in this search's first try: memory, what it holds copied in (after_failure)
        store, kept = fallback.storage, False
        events.append(StorageNote(fallback.note))
        if progress is not None:
            progress(Progress(0, 0, None, 0.0, note=fallback.note))
    if not workload.goals.tokens_per_step:
        # the unit per_device_train_batch_size counts: the trainer's (online RL: completions), else a dataset row's
        from .trainers import get_trainer

        unit = getattr(get_trainer(workload.trainer), "batch_unit", None) or getattr(workload.dataset, "unit", "rows")
        events.append(EffectiveBatch(tps, unit))
    smallest: list[tuple[int, Candidate]] = []
    runs: list[StudyRun] = []
    full = {m: StudySpace(workload, apply_pins(default_space(workload, m), pins), tps, rows) for m in order}
    spaces, left = dict(full), {}
    if workload.runs_here or be.runs_here:  # a run on this machine: only what it can import (advisor/packages.py)
        for m in order:
            installed, left[m] = installed_space(full[m].space, pins)
            spaces[m] = StudySpace(workload, installed, tps, rows)
    empty = {m: left[m].why_empty() if m in left and left[m].emptied else sp.why_empty() for m, sp in spaces.items()}
    if all(empty.values()):  # no method has an admissible candidate: bad input, not "nothing fits"
        why = "; ".join(f"{m.value}: {w}" for m, w in empty.items())
        batch_blocks = workload.num_gpus > 1 and all(w and w.startswith(NO_ACCUMULATION) for w in empty.values())
        if fix and not batch_blocks:  # several GPUs: an effective batch the ranks cannot split names the batch flags
            shown = " ".join(f"--fix {k}={v}" for k, v in fix.items())
            raise UsageError(f"{shown}: leaves no admissible candidate ({why}); drop or change the --fix")
        raise UsageError(empty_message(workload, spaces, empty, rows, tps, why))
    with open_search_pool(backend_name, jobs) as pool, _StorageGuard(kept) as guard:  # one pool for every method
        for i, m in enumerate(order):
            space = spaces[m]
            if empty[m]:
                nxt = order[i + 1].value if i + 1 < len(order) else None
                events.append(NoAdmissible(m.value, empty[m], nxt))
                continue
            name = study_name if study_name and len(order) == 1 else (
                f"{study_name}-{m.value}" if study_name else name_study(workload, backend_name, m, space))
            if not study_name and drop_failed_study(store, name):
                events.append(ErrorsDiscarded(m.value))
            study = create_study(store, name, study_spec(workload, backend_name, m, space, origin), study_name)
            run = StudyRun(workload, m, space, be, study, progress, pool=pool, jobs=pool.jobs)
            runs.append(run)
            run.run(trials=trials or DEFAULT_TRIALS, time_budget_s=time_budget_s, exhaustive=exhaustive)
            run.wait_for_running()  # workers, or another run sharing the cache: their results belong in the answer
            raise_if_backend_failed(run, backend_name, name)
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
                if not any(r.new_measurements for r in runs) and run.ledger.measured:
                    events.append(AnsweredFromStored(name))
                elif kept:
                    events.append(StoredAs(name, storage))
                if left.get(m) and left[m].by_package:
                    events += not_installed(run, full[m], left[m], entry.candidate)
                return build_suggestion(workload, runs, entry, confirmed, events, backend_name)
            if not run.ledger.measured and time_budget_s is not None and run.stopped_by_time:
                raise NoFitError(
                    f"--time-budget {time_budget_s:g}s ended before any candidate was measured with {backend_name}; "
                    "give it more time (finished trials are kept and the next run resumes)",
                    details={"limit_bytes": workload.limit_bytes, "next_knob": "--time-budget"},
                )
            if not run.ledger.entries:
                events.append(EmptyStudy(m.value))
            low = smallest_run(run)
            if low is not None:
                smallest.append(low)
            nxt = order[i + 1].value if i + 1 < len(order) else None
            events.append(NothingFits(m.value, workload.limit_bytes, low[0] if low else None, len(run.ledger.measured),
                                      unmeasured, backend_name == "estimate", nxt))
    if guard.failed is not None:  # the store stopped taking writes: one line, and the search again in memory
        token = _STORE_FALLBACK.set(after_failure(store, storage, guard.failed))
        try:
            return suggest(workload, backend=backend, trials=trials, time_budget_s=time_budget_s, fix=fix,
                           storage=storage, study_name=study_name, cache=cache, exhaustive=exhaustive,
                           progress=progress, workload_names=origin, jobs=jobs)
        finally:
            _STORE_FALLBACK.reset(token)
    low = min(smallest, key=lambda s: s[0]) if smallest else None
    raise NoFitError(no_fit_message(workload, order, smallest, events), details={
        "limit_bytes": workload.limit_bytes,
        "smallest_device_bytes": low[0] if low else None,
        "smallest_config": low[1].to_dict() if low else None,
        "next_knob": next_knob(order[-1]),
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


def _derive_goal_parameters() -> None:
    """suggest()'s signature and docstring list the goals as `Goals` declares them (keyword-only, None: not given)."""
    import inspect

    sig = inspect.signature(suggest)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(g.param, inspect.Parameter.KEYWORD_ONLY, default=None) for g in _GOALS.values()]
    suggest.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    listed = "".join(f"        {g.param}: {g.help} (default "
                     f"{g.default.value if isinstance(g.default, Method) else g.default})\n" for g in _GOALS.values())
    suggest.__doc__ = (suggest.__doc__ or "") + "\n    Goals (each overrides the Workload's own when given):\n" + listed


_derive_goal_parameters()


def check_backend(name: str) -> None:
    """UsageError (exit 2) for an unknown backend, or one that cannot run here (cuda without a CUDA device)."""
    from .backends import check_usable

    check_usable(name)



# ---- stored searches, shown again without measuring ------------------------------------------------------------
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
    import optuna
    from optuna.trial import TrialState

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
    import optuna

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
        from .inputs import WorkloadRef

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
