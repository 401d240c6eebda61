"""Online RL's generation and scoring timed as they run: the fake run's ops of the GENERATE and SCORE phases through
the two queues (advisor/physics/timing/queues.py), as the training passes are (advisor/simulator/timing_hook.py).

transformers' `generate` is a loop of forwards: a prefill over the prompts, then one decode step per new token (a
forward of one position against the KV cache, the logits processors, sampling, the stopping criteria, whose
`unfinished_sequences.max() == 0` the host reads: a sync per token). Each forward opens a window (a forward
pre-hook on the transformers model); the ops of the window are costed by a TimingHook (host time per op of its
class, each kernel's device time: GEMMs of `rows` rows reading every weight, the cached attention reading the whole
KV cache) and the window timed by the two queues. The online fake run decodes to two short lengths
(advisor/simulator/online_rl.py): decode step j's time is fitted as a line in j over the middle steps and summed over
the full length's steps. Scoring (`_generate_and_score_completions` outside generate: the old policy's and the
reference's no-grad forwards, the rewards, the advantages and TRL's metrics) is one trace per generation call.

Reward functions that run Python on the host (decoding, regexes) are timed only by the ops they dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..physics import OpTrace, run_queues
from .timing_hook import BatchLayout, TimingHook

__all__ = ["PhaseTimers", "GenerationTime"]


@dataclass(frozen=True)
class GenerationTime:
    """Seconds of one generation call (prefill and setup, every decode step) and of its scoring, from the fake run."""

    generation_s: float
    prefill_s: float
    per_token_s: float  # a decode step at the middle of the completion
    decode_ops: int  # ops one decode step dispatches
    decode_syncs: int  # the host's waits in one decode step
    scoring_s: float
    scoring_ops: int


def _time(trace: OpTrace, serial: bool) -> float:
    return float(run_queues(trace, np.ones((1, trace.device.shape[1])), serial=serial).total[0])


class PhaseTimers:
    """Receives the GENERATE and SCORE phases' ops and syncs (the online tracker hands them over), and the model's
    forward pre-hook (`forward`)."""

    def __init__(self, target: Any, attn: str, quantized: str | None, model: Any) -> None:
        layout = BatchLayout(1, 1, (1,), 1, False)  # evaluated at the ops' own shapes: every basis is 1
        self.gen = TimingHook(target, layout, attn, quantized=quantized, model=model)
        self.score = TimingHook(target, layout, attn, quantized=quantized, model=model)
        self.serial = not self.gen.tc.cuda
        self.windows: dict[int, OpTrace] = {}  # decode step j (0: setup and prefill) -> its ops
        self._step = -1
        self._in_generate = False
        self.score_traces: list[OpTrace] = []
        self._scoring = False

    # -- the generate phase --
    def forward(self, input_ids: Any) -> None:
        """A forward of the policy begins (while generating): a new window."""
        if not self._in_generate:
            return
        prefill = input_ids is not None and int(input_ids.shape[-1]) > 1
        if prefill:  # generate's setup before the prefill belongs to its window
            if self._step >= 0:  # another generate call in the same phase (the short decode runs back to back)
                self._close_window()
                self.gen.begin_micro(True)
            self._step = 0
            return
        self._close_window()
        self._step += 1
        self.gen.begin_micro(True)

    def _close_window(self) -> None:
        if self.gen._trace is None:
            return
        self.gen.end_micro()
        if self._step >= 0:
            self.windows[self._step] = self.gen.traces.pop()
        else:
            self.gen.traces.pop()

    def generate_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if not self._in_generate:
            self._in_generate = True
            self._step = -1
            self.gen.begin_micro(True)
        self.gen(func, args, kwargs, out)

    def generate_sync(self, func: Any) -> None:
        if self._in_generate:
            self.gen.sync(func)

    def generate_end(self) -> None:
        """The phase left GENERATE: the last window (the loop's final check and return) is dropped."""
        if self._in_generate:
            self.gen.end_micro()
            if self.gen.traces:
                self.gen.traces.pop()
            self._in_generate = False

    # -- the score phase --
    def score_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if not self._scoring:
            self._scoring = True
            self.score.begin_micro(True)
        self.score(func, args, kwargs, out)

    def score_sync(self, func: Any) -> None:
        if self._scoring:
            self.score.sync(func)

    def score_end(self) -> None:
        """A generation call's scoring is over (the phase left SCORE for TRAIN): one trace per call, the last kept."""
        if self._scoring:
            self.score.end_micro()
            self.score_traces[:] = self.score.traces[-1:]
            self._scoring = False

    # -- the result --
    def timed(self, max_new_tokens: int) -> GenerationTime | None:
        """One generation call of `max_new_tokens` tokens and its scoring; None when no generate ran."""
        self.generate_end()
        self.score_end()
        if 0 not in self.windows:
            return None
        prefill = _time(self.windows[0], self.serial)
        steps = sorted(j for j in self.windows if j > 0)
        times = {j: _time(self.windows[j], self.serial) for j in steps}
        last = max(steps, default=0)
        middle = [j for j in steps if j < last] or steps
        decode = max(0, max_new_tokens - 1)  # the prefill picks the first token
        if middle and decode:
            if len(middle) >= 2:
                slope, at0 = np.polyfit(np.asarray(middle, float), np.asarray([times[j] for j in middle]), 1)
            else:
                slope, at0 = 0.0, times[middle[0]]
            mid = (decode + 1) / 2.0
            per_token = float(max(at0 + slope * mid, min(times.values())))
            total = prefill + decode * per_token
            ref = self.windows[middle[-1]]
        else:
            per_token, total, ref = 0.0, prefill, self.windows[0]
        score = self.score_traces[-1] if self.score_traces else None
        return GenerationTime(
            generation_s=total, prefill_s=prefill, per_token_s=per_token, decode_ops=len(ref),
            decode_syncs=ref.syncs, scoring_s=_time(score, self.serial) if score is not None else 0.0,
            scoring_ops=len(score) if score is not None else 0,
        )
