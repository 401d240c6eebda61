"""Where the next candidates come from, in the loop's order: stored results of a cheaper backend, the estimate's
best guesses (queued seeds), the neighbour walk of the best feasible candidates, and TPE (the study's sampler).
`fit_check` picks the few the estimate says fit before a method is given up."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import UsageError
from ..measurement import Measurement
from ..space import Candidate
from .backends import FunctionBackend, get_backend
from .evaluator import Evaluator
from .ledger import Ledger, candidate_key, device_bytes, feasible
from .liveness import storage_of
from .naming import SPEC_KEY
from .params import StudySpace

if TYPE_CHECKING:
    import optuna

# How many of the fastest feasible candidates the neighbour walk expands.
NEIGHBOUR_PARENTS = 4
SEEDS = 8
FIT_CHECK = 4  # before giving up on a method: measure this many of the candidates the estimate says fit


@contextlib.contextmanager
def walk_parameters(*, parents: int | None = None, seeds: int | None = None) -> Iterator[None]:
    """For the block, the neighbour walk's parents (NEIGHBOUR_PARENTS) and the estimate's seeds (SEEDS): what a
    benchmark's sweep varies to show the search does not hang on them (scripts/bench_search.py --sweep)."""
    global NEIGHBOUR_PARENTS, SEEDS
    for name, v in (("parents", parents), ("seeds", seeds)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise UsageError(f"walk_parameters({name}={v!r}): a positive integer")
    saved = NEIGHBOUR_PARENTS, SEEDS
    NEIGHBOUR_PARENTS = parents if parents is not None else NEIGHBOUR_PARENTS
    SEEDS = seeds if seeds is not None else SEEDS
    try:
        yield
    finally:
        NEIGHBOUR_PARENTS, SEEDS = saved


def make_sampler() -> optuna.samplers.BaseSampler:
    """TPE over the categoricals, constrained by the device bytes; the proposer of last resort."""
    import optuna  # lazy: loads optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=0, multivariate=True, group=True, constant_liar=True,
                                          n_startup_trials=5)


def seeds(space: StudySpace, ev: Evaluator, n: int) -> list[Candidate]:
    """The estimate's best guesses among candidates it does not put far over the limit, one per plateau: a
    candidate the estimate cannot tell from a better seed (equal memory and time within its resolution, e.g. two
    packing strategies that make the same batches) is not a seed of its own."""
    if not ev.has_estimate:
        return []
    scored = [(ev.estimated_tps(c), i, c) for i, c in enumerate(space.candidates())]
    scored = [s for s in scored if s[0] > 0]
    scored.sort(key=lambda s: (-s[0], s[1]))
    corr = ev.correction()
    picked: list[tuple[Candidate, Measurement]] = []
    for _, _, c in scored:
        est = ev.estimate(c)
        if est is None or any(corr.ties(est, other) for _, other in picked):
            continue
        picked.append((c, est))
        if len(picked) >= n:
            break
    return [c for c, _ in picked]


def frontier(space: StudySpace, ledger: Ledger, ev: Evaluator, in_flight: frozenset[str] = frozenset()
             ) -> Candidate | None:
    """Multi-fidelity's next move: the unmeasured candidate the corrected estimate ranks fastest among those that
    can still win (advisor/search/fidelity.py's rule) and are not tied with one measured or being measured;
    None when there is none left, which ends the search (the `Converged` event)."""
    if not ev.has_estimate:
        return None
    corr = ev.correction()
    known = [est for e in ledger.measured if (est := ev.estimate(e.candidate)) is not None and est.ok]
    known += [est for c in space.candidates() if candidate_key(c) in in_flight
              and (est := ev.estimate(c)) is not None and est.ok]
    ranked = []
    for i, c in enumerate(space.candidates()):
        key = candidate_key(c)
        if key in ledger or key in in_flight:
            continue
        tps = ev.estimated_tps(c)
        if tps > 0:
            ranked.append((-tps, i, c))
    ranked.sort(key=lambda r: (r[0], r[1]))
    for _, _, c in ranked:
        if not ev.can_still_win(c) or ledger.bound(c) is not None:
            continue
        est = ev.estimate(c)
        if est is not None and any(corr.ties(est, m) for m in known):
            continue
        return c
    return None


def reused(study: optuna.Study, space: StudySpace, ledger: Ledger, backend: FunctionBackend,
           n: int) -> tuple[list[Candidate], tuple[str, ...]]:
    """The fastest feasible candidates of stored studies of this workload, method and effective batch that a
    cheaper measuring backend (simulate for a cuda or cpu search) answered, and those backends: they seed the
    queue first."""
    import optuna  # lazy: loads optuna
    from optuna.trial import TrialState  # lazy: loads optuna

    limit = ledger.limit_bytes
    store = storage_of(study)
    own = study.user_attrs.get(SPEC_KEY) or {}
    found: dict[str, tuple[float, Candidate, int]] = {}
    sources: list[str] = []
    for summary in optuna.get_all_study_summaries(store, include_best_trial=False):
        spec = summary.user_attrs.get(SPEC_KEY) or {}
        if (summary.study_name == study.study_name or spec.get("backend") in (None, "estimate")
                or any(spec.get(k) != own.get(k) for k in ("workload_fingerprint", "method", "tokens_per_step"))):
            continue
        try:
            if get_backend(spec["backend"]).cost >= backend.cost:
                continue
        except UsageError:
            continue
        other = optuna.load_study(study_name=summary.study_name, storage=store)
        sources.append(spec["backend"])
        for t in other.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            a = t.user_attrs
            if not a.get("measured") or "measurement" not in a:
                continue
            m = Measurement.from_dict(a["measurement"])
            cand = space.admit(Candidate.from_dict(a["candidate"]))
            if not isinstance(cand, Candidate) or not feasible(m, limit):
                continue
            key = candidate_key(cand)
            if key not in ledger and m.tokens_per_second > found.get(key, (0.0,))[0]:
                found[key] = (m.tokens_per_second, cand, device_bytes(m) or 0)
    # the order the answer picks in: fastest, fewer extra packages, less memory, then the key
    best = [c for _, c, _ in sorted(found.values(), key=lambda v: (-v[0], len(v[1].requirements()), v[2],
                                                                    candidate_key(v[1])))[:n]]
    return best, tuple(sources)


def fit_check(space: StudySpace, ledger: Ledger, ev: Evaluator, n: int = FIT_CHECK) -> tuple[list[Candidate], int, int]:
    """Before giving up on this method: (the unmeasured candidates the estimate puts under the limit, the
    lowest-peak and the best-predicted first, at most `n`; how many it puts under the limit; how many
    admissible candidates remain unmeasured). Scans the whole admissible space with the estimate."""
    if not ev.has_estimate:
        return [], 0, 0
    fits: list[tuple[int, float, int, Candidate]] = []
    unmeasured = 0
    for i, c in enumerate(space.candidates()):
        hit = ledger.get(candidate_key(c))
        if hit is not None and hit.measured:
            continue
        unmeasured += 1
        if hit is not None or ledger.bound(c) is not None:
            continue
        est = ev.estimate(c)
        d = device_bytes(est) if est is not None and est.ok else None
        if d is not None and d <= ledger.limit_bytes:
            fits.append((d, est.tokens_per_second or 0.0, i, c))
    low = sorted(fits, key=lambda f: (f[0], f[2]))
    fast = sorted(fits, key=lambda f: (-f[1], f[2]))
    picked: list[Candidate] = []
    for pair in zip(low, fast, strict=True):
        for f in pair:
            if f[3] not in picked and len(picked) < n:
                picked.append(f[3])
    return picked, len(fits), unmeasured


def next_neighbour(space: StudySpace, ledger: Ledger, ev: Evaluator) -> Candidate | None:
    """The unmeasured neighbour, of the NEIGHBOUR_PARENTS fastest feasible candidates so far, that the (corrected)
    estimate ranks fastest. A parent is its plateau: it and its neighbours the estimate cannot tell from it (equal
    memory and time within the model's resolution) are one move, so the walk steps off the whole plateau, and a
    candidate tied with one already measured is not proposed (measuring it would say nothing new to the walk).
    So the walk's reach does not hang on how many parents it expands."""
    ok = [e for e in ledger.measured if feasible(e.measurement, ledger.limit_bytes)]
    parents = sorted(ok, key=lambda e: -(e.measurement.tokens_per_second or 0.0))[:NEIGHBOUR_PARENTS]
    corr = ev.correction() if ev.has_estimate else None
    measured_est = [est for e in ledger.measured if (est := ev.estimate(e.candidate)) is not None and est.ok]

    def tied_with_measured(c: Candidate) -> bool:
        est = ev.estimate(c)
        return corr is not None and est is not None and est.ok and any(corr.ties(est, m) for m in measured_est)

    fresh: dict[str, tuple[int, Candidate]] = {}
    for rank, parent in enumerate(parents):
        plateau = [parent.candidate]
        if corr is not None and (pest := ev.estimate(parent.candidate)) is not None and pest.ok:
            plateau += [c for c in space.neighbours(parent.candidate)
                        if (est := ev.estimate(c)) is not None and est.ok and corr.ties(est, pest)]
        for member in plateau:
            for c in space.neighbours(member):
                key = candidate_key(c)
                if key not in fresh and key not in ledger and ledger.bound(c) is None and not tied_with_measured(c):
                    fresh[key] = (rank, c)
    if not fresh:
        return None
    if not ev.has_estimate:
        return min(fresh.values(), key=lambda rc: rc[0])[1]
    rank, best = min(fresh.values(), key=lambda rc: (-ev.estimated_tps(rc[1]), rc[0]))
    return best if ev.estimated_tps(best) >= 0 else None
