"""Online RL's generate on fake tensors, its decode loop run to two short lengths and the full length extrapolated per
moment of a decode step (checked on the runs themselves: a failed check runs the full loop, `NotAffine`); what
`run_online_fake` (online_rl.py) installs as the policy's `generate` (its docstring has the measurements)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import AdvisorError
from ..measurement import Category
from .generation import IncompleteGeneration, filler_token, generate_replaced
from .shadow import DataShadow

if TYPE_CHECKING:
    from .online_rl import _PhaseTracker


class NotAffine(AdvisorError):
    """The short fake generations' decode steps are not affine in the decode step: the extrapolation would be a
    guess. The run then runs the full decode loop instead and says so in its notes (`GenerateExtrapolation.fallback`).
    """


@dataclass(frozen=True)
class GenerateExtrapolation:
    """How the generate phase's peak was obtained: the short lengths run, the per-decode-step slope, and the peak."""

    max_new_tokens: int
    short_lengths: tuple[int, ...]  # () where the decode loop ran to its full length
    bytes_per_step: int  # the steepest growth of a decode step's moment, bytes a step (0: not extrapolated)
    peak_bytes: int  # the highest total inside `generate` at max_new_tokens (0: vLLM, no generate here)
    fallback: str = ""  # why the full decode loop ran although short lengths were asked (a failed check)


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model whose forward each decode step calls (under PEFT: the base model)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(inner, "module", inner)


_Series = list[tuple[int, dict[Category, int]]]  # the total live (and by category) at each moment of a window


@dataclass
class _Steps:
    """The windows of one fake generate: before the first forward, then one per forward (the prefill, each decode
    step), each from one forward's start to the next's (the last: to generate's return)."""

    windows: list[_Series] = field(default_factory=list)

    def peak(self) -> int:
        return max(t for w in self.windows for t, _ in w)


def _run_windows(model: torch.nn.Module, tracker: _PhaseTracker, call: Any) -> tuple[Any, _Steps]:
    steps = _Steps()
    hf = _hf_model(model)

    def pre(module: Any, args: Any, kwargs: Any) -> None:
        steps.windows.append(tracker.close_window())
        tracker.open_window()

    handle = hf.register_forward_pre_hook(pre, with_kwargs=True)
    tracker.open_window()
    try:
        out = call()
    finally:
        handle.remove()
        steps.windows.append(tracker.close_window())
    return out, steps


def _totals(w: _Series) -> list[int]:
    return [t for t, _ in w]


def _lines(points: dict[int, _Series], what: str) -> tuple[int, list[tuple[int, int]]]:
    """Per moment of the window, the (value at x0, slope) of the line through the windows at the decode steps in
    `points`: the windows must have the same moments, each exactly on its line (checked where there are three
    points or more). Returns x0 and the lines."""
    xs = sorted(points)
    sizes = {len(points[x]) for x in xs}
    if len(sizes) != 1:
        raise NotAffine(f"{what}: decode steps {xs} have {[len(points[x]) for x in xs]} moments, not one count")
    x0, x1 = xs[0], xs[1]
    lines = []
    for i, (v0, v1) in enumerate(zip(_totals(points[x0]), _totals(points[x1]), strict=True)):
        dy = v1 - v0
        if dy % (x1 - x0):
            raise NotAffine(f"{what}: moment {i} grows {dy}/{x1 - x0} B a decode step, not whole")
        slope = dy // (x1 - x0)
        off = [x for x in xs[2:] if points[x][i][0] != v0 + slope * (x - x0)]
        if off:
            raise NotAffine(f"{what}: moment {i} of decode steps {off} is off the line through steps {x0}, {x1} "
                            f"({[points[x][i][0] for x in xs]} B)")
        lines.append((v0, slope))
    return x0, lines


def _cats_at(points: dict[int, _Series], i: int, x: int) -> dict[Category, int]:
    """The breakdown at moment `i` of the window at decode step `x`, each category on its own line."""
    x0, x1 = sorted(points)[:2]
    lo, hi = points[x0][i][1], points[x1][i][1]
    out = {k: lo.get(k, 0) + (hi.get(k, 0) - lo.get(k, 0)) // (x1 - x0) * (x - x0) for k in set(lo) | set(hi)}
    return {k: v for k, v in out.items() if v}


def _extrapolate(short: dict[int, _Steps], full: int) -> tuple[int, dict[Category, int], int]:
    """The peak inside generate at `full` new tokens from runs at the two short lengths in `short`, and its
    breakdown and the largest per-step growth of a moment. Windows: index 0 before the first forward, 1 the prefill
    (token 1), 1 + j decode step j (token j + 1); a decode step that another follows is a "middle" step, the last
    one (n - 1 of a run of n tokens) ends with generate's return instead of preparing the next step's inputs.

    A decode step's moments (the total live after each allocation) are each affine in the step: the DynamicCache,
    the ids and the attention mask grow by one position a step, every other allocation is the same. A step's peak
    is the highest of its moments, so it is piecewise affine (a steeper moment overtakes at some step): every moment
    is extrapolated, not the step's peak. Checked: the windows both runs share are equal; the middle steps have the
    same moments, each on its line (three or more steps); the last step's moments begin as the middle step's at the
    same decode step."""
    n1, n2 = sorted(short)
    a, b = short[n1].windows, short[n2].windows
    if len(a) != n1 + 1 or len(b) != n2 + 1:
        raise NotAffine(f"expected {n1 + 1} and {n2 + 1} windows (one per forward, one before), got {len(a)} and "
                        f"{len(b)}")
    if [_totals(w) for w in a[:-1]] != [_totals(w) for w in b[:n1]]:
        raise NotAffine(f"the windows before decode step {n1 - 1} differ between {n1} and {n2} new tokens")
    middle = {j: b[1 + j] for j in range(1, n2 - 1)}
    m0, mid = _lines(middle, "middle decode steps")
    last = {n1 - 1: a[-1], n2 - 1: b[-1]}
    l0, end = _lines(last, "last decode step")
    # the last step does what a middle step does until the loop ends: its moments begin as the middle step's
    shared = 0
    while shared < min(len(mid), len(end)) and all(
            end[shared][0] + end[shared][1] * (x - l0) == mid[shared][0] + mid[shared][1] * (x - m0)
            for x in (n1 - 1, n2 - 1)):
        shared += 1
    if shared < 2:
        raise NotAffine("the last decode step does not begin as a middle step does")
    candidates: list[tuple[int, dict[Category, int]]] = [max(w, key=lambda m: m[0]) for w in b[:3]]
    for i, (v0, s) in enumerate(mid):
        x = full - 2 if s >= 0 else 1  # the middle steps run 1 .. full - 2
        candidates.append((v0 + s * (x - m0), _cats_at(middle, i, x)))
    for i, (v0, s) in enumerate(end):
        candidates.append((v0 + s * (full - 1 - l0), _cats_at(last, i, full - 1)))
    best = max(candidates, key=lambda c: c[0])
    return best[0], best[1], max(s for _, s in mid)


@contextlib.contextmanager
def generate_extrapolated(model: torch.nn.Module, shadow: DataShadow, tracker: _PhaseTracker,
                           decode_lengths: tuple[int, int] | None, record: list) -> Iterator[None]:
    """`model.generate` on fake tensors, every completion at its maximum length (full_length_generate's rules), its
    peak inside generate extrapolated from `decode_lengths` (None: the full decode loop)."""
    original = model.generate
    token = filler_token(model)

    def run(args: tuple, kwargs: dict, new_tokens: int) -> tuple[torch.Tensor, _Steps]:
        kw = dict(kwargs)
        gc = kw.get("generation_config")
        if gc is not None:
            gc = copy.deepcopy(gc)
            gc.max_new_tokens = new_tokens
            kw["generation_config"] = gc
        else:
            kw["max_new_tokens"] = new_tokens
        kw.pop("max_length", None)
        with shadow.filling(token):
            out, steps = _run_windows(model, tracker, lambda: original(*args, **kw))
        seqs = out if isinstance(out, torch.Tensor) else out.sequences
        return seqs, steps

    def generate(*args: Any, **kwargs: Any):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or shadow.real(ids) is None:
            raise IncompleteGeneration("the fake generate needs the prompt ids as a known tensor (input_ids)")
        gc = kwargs.get("generation_config") or model.generation_config
        full = int(kwargs.get("max_new_tokens", getattr(gc, "max_new_tokens", None) or 0))
        if not full:
            raise IncompleteGeneration("the fake generate needs max_new_tokens (TRL sets max_completion_length)")
        prompt = int(ids.shape[1])
        fallback = ""
        if decode_lengths is not None and full > max(decode_lengths):
            tracker.suspended += 1
            try:
                short: dict[int, _Steps] = {}
                for n in decode_lengths:
                    seqs, steps = run(args, kwargs, n)
                    _check_full(seqs, prompt + n, shadow)
                    short[n] = steps
                    del seqs
                peak, cats, slope = _extrapolate(short, full)
            except NotAffine as e:
                fallback = str(e)
            finally:
                tracker.suspended -= 1
        if decode_lengths is None or full <= max(decode_lengths) or fallback:
            # the full decode loop, run (no extrapolation asked or possible, or its checks failed)
            seqs, steps = run(args, kwargs, full)
            _check_full(seqs, prompt + full, shadow)
            record.append(GenerateExtrapolation(full, (), 0, steps.peak(), fallback))
            return seqs
        tracker.suspended += 1
        try:
            # the full-length output: one tensor of [prompt | filler] ids, as the real loop's last torch.cat
            with _disable_current_modes():
                prompt_ids = shadow.real(ids)
                real = torch.cat([prompt_ids, torch.full((ids.shape[0], full), token, dtype=prompt_ids.dtype)],
                                 dim=1)
            out = ids.new_empty((ids.shape[0], prompt + full))
            shadow.know(out, real)
        finally:
            tracker.suspended -= 1
        tracker.note_bytes(tracker.phase, peak, cats)
        record.append(GenerateExtrapolation(full, tuple(sorted(decode_lengths)), slope, peak))
        return out

    with generate_replaced(model, generate):
        yield


def _check_full(seqs: torch.Tensor, target: int, shadow: DataShadow) -> None:
    if seqs.shape[1] != target or shadow.real(seqs) is None:
        raise IncompleteGeneration(
            f"fake generate returned {tuple(seqs.shape)}; expected {target} positions of known ids: the decode "
            "loop's stop decision was not computed on known values")
