"""The SearchSpace as Optuna sees it: one categorical per knob with more than one value; decoding checks validity
(TRL's rules, the attention pins, truncation, the effective batch) and fills the accumulation."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator, Mapping
from enum import Enum
from typing import Any

from ..errors import ConfigError
from ..parallelism import layout_problems
from ..space import Candidate, SearchSpace, carried_knobs, knob_value, with_knobs
from ..trainers import trainer_of
from ..workload import Workload
from .space import BATCH_TOLERANCE, RowTokens, attention_refusal, with_accumulation

NO_ACCUMULATION = "no accumulation"  # how StudySpace.admit starts the reason an effective batch cannot be met


def _encode(v: Any) -> Any:
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, tuple):
        return ",".join(v)
    return v


class StudySpace:
    """A SearchSpace seen by Optuna: one categorical per knob with more than one value; decoding checks validity."""

    def __init__(self, workload: Workload, space: SearchSpace, tokens_per_step: int, rows: RowTokens):
        self.workload, self.space, self.tokens_per_step, self.rows = workload, space, tokens_per_step, rows
        self.trainer = trainer_of(workload)
        # a trainer's joint dimensions (online RL's generation engine): one categorical whose choices each set
        # several knobs, so the study never proposes a combination that is refused (sleep mode with expandable
        # segments on) or the same (sleep mode without vLLM); the knobs they set are not dimensions of their own
        self.joint: dict[str, dict[str, dict[str, Any]]] = {
            name: dict(opts) for name, opts in self.trainer.joint_dimensions(space.values).items()}
        covered = {k for opts in self.joint.values() for a in opts.values() for k in a}
        self.fixed = {k: v[0] for k, v in space.values.items() if len(v) == 1}
        for opts in self.joint.values():
            if len(opts) == 1:
                self.fixed.update(next(iter(opts.values())))
        self.params = {k: tuple(v) for k, v in sorted(space.values.items()) if len(v) > 1 and k not in covered}
        self.params.update({name: tuple(opts) for name, opts in sorted(self.joint.items()) if len(opts) > 1})
        self.base = with_knobs(Candidate(), **self.fixed) if self.fixed else Candidate()
        self._candidates: tuple[Candidate, ...] | None = None
        self._neighbours: dict[Candidate, tuple[Candidate, ...]] = {}

    def choices(self, name: str) -> list[Any]:
        return [_encode(v) for v in self.params[name]]

    def decode(self, params: Mapping[str, Any]) -> Candidate | str:
        """The candidate for Optuna params, or why it is not admissible."""
        values: dict[str, Any] = {}
        for k, vals in self.params.items():
            enc = self.choices(k)
            if k in self.joint:
                values.update(self.joint[k][vals[enc.index(params[k])]])
            else:
                values[k] = vals[enc.index(params[k])]
        try:
            cand = with_knobs(self.base, **values).canonical()
        except ConfigError as exc:
            return str(exc)
        return self.admit(cand)

    def admit(self, cand: Candidate) -> Candidate | str:
        wl = self.workload
        cand = self.trainer.canonical(cand)  # its own knobs that have no effect back to their defaults
        problems = self.trainer.problems(cand, wl.gpu, wl.model)  # SFT's: Candidate.problems
        if problems:
            # a rule on the accumulation this micro-batch is given below (online RL's generation batch holds whole
            # groups of num_generations): judged with that accumulation
            derived = with_accumulation(cand, self.tokens_per_step, self.rows, self._world(cand))
            if derived is None or derived == cand or self.trainer.problems(derived, wl.gpu, wl.model):
                return "; ".join(problems)
        refused = attention_refusal(self.space, cand)
        if refused:
            return refused
        ctx = wl.model.max_position_embeddings
        if cand.max_length is None and ctx is not None and len(wl.dataset.lengths) and \
                int(wl.dataset.lengths.max()) > ctx:
            return (f"max_length=None keeps rows of {int(wl.dataset.lengths.max())} tokens, beyond the model's "
                    f"context (max_position_embeddings {ctx})")
        lost = self.rows.truncation(cand)
        if lost > wl.goals.max_truncation:
            return f"loses {lost:.2%} of trained tokens to truncation (--max-truncation {wl.goals.max_truncation:.2%})"

        world = layout_problems(cand.parallelism, self._world(cand))  # the layout of the ranks that train
        if world:
            return "; ".join(world)
        out = with_accumulation(cand, self.tokens_per_step, self.rows, self._world(cand))
        if out is None:
            return (NO_ACCUMULATION + " keeps this micro-batch within "
                    f"{BATCH_TOLERANCE:.0%} of {self.tokens_per_step} trained tokens per optimizer step")
        if out != cand:  # the rules on the accumulation given (online RL's whole groups of num_generations)
            problems = self.trainer.problems(out, wl.gpu, wl.model)
            if problems:
                return "; ".join(problems)
        return self.trainer.derive(wl, out, self.space.values)  # what it derives (colocated vLLM's utilization)

    def _world(self, cand: Candidate) -> int:
        """The ranks that train, which the effective batch counts: --num-gpus, less the GPUs a trainer sets aside
        for this candidate (online RL's vLLM server: `training_gpus`)."""
        return self.trainer.training_gpus(cand, self.workload.num_gpus)

    def derivation_notes(self, cand: Candidate) -> list[str]:
        """How the trainer derived the pick's derived knobs (the search's notes)."""
        return list(self.trainer.derivation_notes(self.workload, cand, self.space.values))

    def params_of(self, cand: Candidate) -> dict[str, Any]:
        out = {}
        for k in self.params:
            if k in self.joint:  # the choice whose knobs the candidate has (else the first)
                out[k] = next((label for label, a in self.joint[k].items()
                               if all(knob_value(cand, n) == v for n, v in a.items())), self.choices(k)[0])
                continue
            v = _encode(knob_value(cand, k))
            out[k] = v if v in self.choices(k) else self.choices(k)[0]  # irrelevant knobs canonicalise away
        return out

    def _walk(self) -> Iterator[Candidate | str]:
        """Each distinct canonical grid point, admitted (a Candidate) or refused (the reason)."""
        seen: set[Candidate] = set()
        admitted: set[Candidate] = set()
        joint = [tuple(opts.values()) for name, opts in sorted(self.joint.items()) if name in self.params]
        rest = SearchSpace({k: v for k, v in self.space.values.items() if k in self.params})
        for point in rest.grid(self.base):
            for choice in itertools.product(*joint):
                try:
                    cand = with_knobs(point, **{k: v for a in choice for k, v in a.items()}).canonical()
                except ConfigError as exc:
                    yield str(exc)
                    continue
                if cand in seen:
                    continue
                seen.add(cand)
                out = self.admit(cand)
                if isinstance(out, Candidate):
                    if out in admitted:
                        continue
                    admitted.add(out)
                yield out

    def candidates(self) -> Iterator[Candidate]:
        """The admissible candidates, in the grid's order (walked once: the space and workload do not change)."""
        if self._candidates is None:
            self._candidates = tuple(out for out in self._walk() if isinstance(out, Candidate))
        return iter(self._candidates)

    def why_empty(self) -> str | None:
        """None when some candidate is admissible, else the commonest reason the grid's candidates are refused."""
        why: Counter[str] = Counter()
        for out in self._walk():
            if isinstance(out, Candidate):
                return None
            why[out] += 1
        return why.most_common(1)[0][0] if why else "the space is empty"

    def neighbours(self, cand: Candidate) -> Iterator[Candidate]:
        """Admissible candidates that differ from `cand` in one knob (computed once per candidate)."""
        if cand not in self._neighbours:
            self._neighbours[cand] = tuple(self._neighbours_of(cand))
        return iter(self._neighbours[cand])

    def _neighbours_of(self, cand: Candidate) -> Iterator[Candidate]:
        for k, vals in self.params.items():
            for v in vals:
                if k in self.joint:
                    change = self.joint[k][v]
                    if all(knob_value(cand, n) == x for n, x in change.items()):
                        continue
                elif v == knob_value(cand, k):
                    continue
                else:
                    change = {k: v}
                try:
                    other = with_knobs(cand, **change).canonical()
                except ConfigError:
                    continue
                out = self.admit(other)
                if isinstance(out, Candidate) and out != cand:
                    yield out

    def to_json(self) -> dict[str, list[Any]]:
        return {k: [_encode(v) for v in vals] for k, vals in self.space.values.items()}


def space_from_json(data: Mapping[str, list[Any]]) -> SearchSpace:
    """A study's stored space read back (what `to_json` wrote), its values typed as the knobs declare them (every
    registered trainer's own knobs included: importing advisor.trainers registers them)."""
    def dec(k: str, v: Any) -> Any:
        return tuple(x for x in v.split(",") if x) if k == "lora_target_modules" and isinstance(v, str) else v

    values = {}
    carried = carried_knobs()
    for k, vals in data.items():
        decoded = []
        for v in vals:
            d = dec(k, v)
            decoded.append(d if k in carried else getattr(Candidate(**{k: d}), k))  # strings back to Enums
        values[k] = tuple(decoded)
    return SearchSpace(values)
