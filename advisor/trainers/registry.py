"""The trainer registry: each trainer registered once by its name, with its own knobs (its typed view) registered in
the knob registry at the same time. Importing `advisor.trainers` registers the built-ins (every module of the
package); a trainer of one's own is a `register(MyTrainer())` away, with no list to edit."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..knobs import register_knobs, unregister_knobs
from ..space import Candidate
from ..workload import DEFAULT_TRAINER
from .protocol import ModelInput, Trainer

if TYPE_CHECKING:
    from ..space import Candidate
    from ..workload import Workload

DEFAULT = DEFAULT_TRAINER  # the trainer a workload is for unless it names another (--trainer's default)

_REGISTRY: dict[str, Trainer] = {}


def register(trainer: Trainer) -> Trainer:
    """Add a trainer under its `name`, and its own knobs (`trainer.knob_view.KNOBS`) to the knob registry. A name
    already taken by another trainer, or a knob name another knob has, is refused (ConfigError naming it): one
    declaration per trainer, as `trl <command>` has one script."""

    if not isinstance(trainer, Trainer):
        raise TypeError(f"{trainer!r} does not implement advisor.trainers.Trainer")
    name = getattr(trainer, "name", None)
    if not name or not isinstance(name, str):
        raise ConfigError([f"name={name!r}: a trainer is registered under a non-empty name"], context="trainer")
    taken = _REGISTRY.get(name)
    if taken is not None and taken is not trainer:
        raise ConfigError([f"name={name!r}: already registered ({type(taken).__module__}."
                           f"{type(taken).__qualname__}); give the new trainer another name"], context="trainer")
    _check_inputs(trainer)
    register_knobs(*trainer.knob_view.KNOBS)
    _REGISTRY[name] = trainer
    return trainer


def _check_inputs(trainer: Trainer) -> None:
    """A model input's role, parameter and flag mean one thing across trainers (the CLI has one flag per role)."""
    known = {m.role: m for t in _REGISTRY.values() for m in t.model_inputs}
    clash = [f"{m.role}: declared as {known[m.role]} by another trainer, here as {m}; declare it the same way or "
             "give it another role" for m in trainer.model_inputs if m.role in known and known[m.role] != m]
    if clash:
        raise ConfigError(clash, context="trainer")


def unregister(name: str) -> None:
    """Take a trainer of one's own out again (a test's), with its own knobs that no other trainer declares."""

    taken = _REGISTRY.get(name)
    if taken is not None and type(taken).__module__.startswith(f"{__package__}."):
        raise ConfigError([f"name={name!r}: a built-in trainer stays registered"], context="trainer")
    gone = _REGISTRY.pop(name, None)
    if gone is not None:
        kept = {id(k) for t in _REGISTRY.values() for k in t.knob_view.KNOBS}
        unregister_knobs(*(k for k in gone.knob_view.KNOBS if id(k) not in kept))


def names() -> tuple[str, ...]:
    """Every registered trainer's name, the built-ins first (in their modules' name order)."""
    return tuple(_REGISTRY)


def generating() -> tuple[str, ...]:
    """The registered trainers whose step generates completions (their StepShape at their defaults)."""
    return tuple(n for n, t in _REGISTRY.items() if t.step_shape(Candidate()).generates)


def choices() -> tuple[str, ...]:
    """The names `--trainer` accepts."""
    return names()


def get_trainer(name: str | Trainer = DEFAULT) -> Trainer:
    """The registered trainer `name`; a Trainer is returned as is."""
    if not isinstance(name, str):
        return name
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError([f"trainer={name!r}: not a trainer the advisor knows; use one of {', '.join(_REGISTRY)}"],
                          context="trainer") from None


def trainer_of(workload: Workload) -> Trainer:
    """The trainer `workload` is for, its models checked against what the trainer declares: a model the trainer
    takes none of is a ConfigError naming it and the trainers that take one (never silently left out)."""
    kind = get_trainer(workload.trainer)
    roles = {m.role for m in kind.model_inputs}
    problems = []
    for role, spec in workload.models:
        if role not in roles:
            inp = model_input(role)
            takers = [t.name for t in _REGISTRY.values() if any(m.role == role for m in t.model_inputs)]
            flag = inp.flag if inp is not None else role
            problems.append(f"{role}={spec.name!r}: trainer {workload.trainer!r} takes no {role.replace('_', ' ')}; "
                            f"use --trainer {' or '.join(takers) or '(none declares it)'}, or drop {flag}")
    given = dict(workload.models)
    for m in kind.model_inputs:
        spec = given.get(m.role)
        if spec is None and m.required:
            problems.append(f"trainer={workload.trainer!r} needs a {m.role.replace('_', ' ')}: pass {m.flag} ID "
                            f"(suggest({m.param}=...)), a hub id, a model directory or a config.json"
                            + (f" of a model with the policy's vocabulary ({workload.model.vocab_size} tokens)"
                               if m.same_vocabulary else ""))
        elif spec is not None and m.same_vocabulary and spec.vocab_size != workload.model.vocab_size:
            problems.append(f"{m.param}={spec.name!r}: its vocabulary has {spec.vocab_size} tokens and the policy "
                            f"{workload.model.name!r}'s {workload.model.vocab_size}: {kind.trainer_name} compares "
                            f"the two models' next-token distributions over one vocabulary and refuses another; give "
                            f"{m.flag} a model of the policy's family (the same tokenizer)")
    if problems:
        raise ConfigError(problems, context="workload")
    return kind


def model_inputs() -> tuple[ModelInput, ...]:
    """Every registered trainer's model inputs, each role once, in registration order: the CLI's flags and
    suggest()'s parameters."""
    out: dict[str, ModelInput] = {}
    for t in _REGISTRY.values():
        for m in t.model_inputs:
            out.setdefault(m.role, m)
    return tuple(out.values())


def model_input(role: str) -> ModelInput | None:
    return next((m for m in model_inputs() if m.role == role), None)


def owners(knob: Any) -> tuple[str, ...]:
    """The registered trainers whose config has `knob` (an error naming where a --fix belongs)."""
    return tuple(t.name for t in _REGISTRY.values() if t.accepts(knob))


def training_workload(workload: Workload, candidate: Candidate) -> Workload:
    """The workload a backend measures `candidate` on: the training side of the run. Where its trainer sets GPUs of
    --num-gpus aside (`training_gpus`: online RL's `trl vllm-serve` GPUs in server mode), the rest train, and the
    per-rank peak, the sharding and the trained tokens per second count those ranks only. The search
    (advisor/search/evaluator.py) and `advisor simulate|probe|baseline --config` measure through this one rule."""
    n = get_trainer(workload.trainer).training_gpus(candidate, workload.num_gpus)
    if n == workload.num_gpus:
        return workload
    machines = workload.num_machines if n % workload.num_machines == 0 else 1
    return dataclasses.replace(workload, num_gpus=n, num_machines=machines)


def launched_candidate(trainer: Trainer, candidate: Candidate, num_gpus: int, processes: int | None = None
                       ) -> Candidate:
    """`candidate` read back from a run's files, launched on `num_gpus` GPUs (`processes`: the accelerate config's
    num_processes, when that file is given): the knobs a trainer keeps outside the TRL file read back from the
    launch (`world_from_launch`: online RL's server GPUs), then the accelerate config checked to launch the ranks
    that train. ConfigError naming the flags and the fix."""
    cand = trainer.world_from_launch(candidate, num_gpus, processes)
    problems = list(trainer.check_world(cand, num_gpus))
    train = trainer.training_gpus(cand, num_gpus)
    if processes is not None and processes != train:
        problems.append(f"num_processes {processes} in the accelerate config (--accelerate-config) with --num-gpus "
                        f"{num_gpus}: this run trains on {train} rank(s); give --num-gpus {processes} (the "
                        "suggestion's), or the accelerate config written with this TRL file")
    if problems:
        raise ConfigError(problems, context="num_gpus")
    return cand
