"""`model.generate` on fake tensors, every sequence run to its maximum length (online RL's bound).

Three things stop transformers' decode loop and TRL's handling of its output from running on fake tensors, and
`DataShadow` (advisor/simulator/shadow.py) answers each with the real run's own computation, not a guess:

1. The loop's stop decision: `StopCheck.__call__` returns `bool(unfinished_sequences.max() == 0)`, a `.item()` that the
   tracker's ScalarOracle would answer True (stop after one token). Under `full_length_generate` the prompt ids are
   known, `unfinished_sequences` starts as a known factory (`torch.ones`), the max-length criterion is a known
   factory (`torch.full`), and the token picked from the fake logits is a known filler id that is no special token,
   so the EOS criterion's `isin` is computed on known ids too: the stop decision is the loop's own, on the values of
   a run whose completions never end early. The decode loop runs exactly to `max_length` (prompt + max_new_tokens),
   which is what the real run does with `min_new_tokens == max_new_tokens` (EOS suppressed until then).
2. What follows generate (TRL's EOS mask: `is_eos.any(dim=1)`, boolean indexing, `.tolist()`, decoding) reads the
   generated ids: they are known, [the real prompt ids | filler ids].
3. Floating tensors computed only from known data (TRL's rewards, advantages) are known, so a NaN check is answered
   on their values.

The wrapper checks that the loop did run to the full length and raises otherwise (a stop decision that was not
known would have been answered by the oracle): what is reported is never a shorter generation than the bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..measurement import Category
from .fake_step import BatchFacts, ScalarOracle, _materialise, real_path_patches
from .shadow import DataShadow
from .tracker import StorageTracker


def filler_token(model: torch.nn.Module) -> int:
    """The id generated tokens are taken to be: the smallest id that is no special token of the model's
    generation config (EOS, pad, BOS, decoder start), so no completion ends early and none is padding."""
    gc = model.generation_config
    special: set[int] = set()
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id"):
        value = getattr(gc, name, None)
        if value is None:
            value = getattr(model.config, name, None)
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        special.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None)
    return next(i for i in range(len(special) + 1) if i not in special)


def _max_length(model: torch.nn.Module, prompt: int, kwargs: dict) -> int:
    """The length generate decodes to, as transformers resolves it: max_new_tokens wins over max_length."""
    gc = kwargs.get("generation_config") or model.generation_config
    new = kwargs.get("max_new_tokens", getattr(gc, "max_new_tokens", None))
    if new is not None:
        return prompt + int(new)
    return int(kwargs.get("max_length", gc.max_length))


class IncompleteGeneration(RuntimeError):
    """The fake decode loop stopped before its maximum length: a stop decision was not known (a simulator defect)."""


@contextlib.contextmanager
def full_length_generate(model: torch.nn.Module, shadow: DataShadow) -> Iterator[None]:
    """While inside (with `shadow` entered above the tracker), `model.generate` runs every sequence to its maximum
    length on fake tensors and its output ids are known to `shadow`. Restores `model.generate` on exit."""
    original = model.generate
    token = filler_token(model)

    def generate(*args: Any, **kwargs: Any):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or shadow.real(ids) is None:
            raise IncompleteGeneration("full_length_generate needs the prompt ids as a known tensor (input_ids)")
        target = _max_length(model, ids.shape[1], kwargs)
        with shadow.filling(token):
            out = original(*args, **kwargs)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        known = shadow.real(sequences)
        if sequences.shape[1] != target or known is None:
            raise IncompleteGeneration(
                f"fake generate returned {tuple(sequences.shape)} ({'known' if known is not None else 'unknown'} "
                f"ids); expected {target} positions: the decode loop's stop decision was not computed on known "
                f"values")
        return out

    with generate_replaced(model, generate):
        yield


@contextlib.contextmanager
def generate_replaced(model: torch.nn.Module, generate: Any) -> Iterator[None]:
    """`model.generate` is `generate` (an instance attribute) while inside; on exit the model's own again: the
    instance attribute it had, or none, so the class's method shows again."""
    had = "generate" in vars(model)
    own = vars(model).get("generate")
    model.generate = generate
    try:
        yield
    finally:
        if had:
            model.generate = own
        else:
            del model.generate


@dataclass(frozen=True)
class GenerationRun:
    """One fake `generate`: the output's shape and ids, and the bytes it held above what was live before it."""

    shape: tuple[int, ...]
    ids: torch.Tensor  # the known output ids (real CPU tensor): prompt | filler
    peak_bytes: int  # the highest tracked total during generate, less what was live before (weights, buffers)


def simulate_generate(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      **generate_kwargs: Any) -> GenerationRun:
    """Run `model.generate` on fake tensors with every storage tracked. `model`: built on the meta device (as the
    simulator builds models); it is materialised as fake tensors here. `input_ids`/`attention_mask`: the real
    prompt batch. Every sequence runs to max length (see the module's docstring)."""
    facts = BatchFacts(unpadded=attention_mask is None or bool(attention_mask.all()), labelled=0,
                       tokens=int(input_ids.numel()), shape=(int(input_ids.shape[0]), int(input_ids.shape[1])))
    tracker = StorageTracker(answer_scalar=ScalarOracle(facts))
    shadow = DataShadow()
    with real_path_patches(False), FakeTensorMode(allow_non_fake_inputs=True), tracker:
        _materialise(model)
        tracker.set_category([*model.parameters(), *model.buffers()], Category.PARAMETERS)
        before = tracker.current
        with shadow, full_length_generate(model, shadow):
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        ids = shadow.real(sequences)
        peak = tracker.peak.peak_bytes - before
    return GenerationRun(shape=tuple(sequences.shape), ids=ids, peak_bytes=peak)
