"""What libraries say while a candidate is measured (warnings, log records, prints), collected instead of printed.

TRL, transformers and friends warn once per trainer, and the search builds a trainer per candidate: the same
"[RANK 0] You are using a per_device_train_batch_size of 1 with padding-free training..." forty times on stderr.
`capture()` records them (deduplicated, with counts) for the report; nested captures hand theirs to the outer
one, and the outermost drops nothing but prints nothing either: the library never prints.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

# Libraries whose loggers print through their own handler instead of propagating to the root logger.
_OWN_HANDLERS = ("transformers", "datasets", "accelerate", "peft", "trl", "torch", "optuna")
_MAX_TEXT = 500  # characters of a message shown (str(LibraryMessage))
_KEPT_TEXT = 4000  # characters of a message kept: enough that two differing only in a quoted literal stay so


@dataclass(frozen=True)
class LibraryMessage:
    """One distinct message: where it came from (a warning's category or a logger's name), its text, how often."""

    origin: str
    text: str
    count: int = 1
    variants: int = 1  # distinct texts merged into this one (summarize(merge_quoted=True)); `text` is the first

    def __str__(self) -> str:
        times = f"x{self.count}" if self.count > 1 else ""
        if self.variants > 1:
            times += f", {self.variants} variants of the quoted text"
        text = self.text if len(self.text) <= _MAX_TEXT else self.text[:_MAX_TEXT] + "…"
        return f"[{self.origin}] {text}" + (f" ({times})" if times else "")


_STACK: list[Counter[tuple[str, str]]] = []


def _add(counter: Counter[tuple[str, str]], origin: str, text: str) -> None:
    text = " ".join(str(text).split())[:_KEPT_TEXT]
    if text:
        counter[(origin, text)] += 1


class _Handler(logging.Handler):
    def __init__(self, counter: Counter[tuple[str, str]]):
        super().__init__(logging.WARNING)
        self.counter = counter

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _add(self.counter, record.name, record.getMessage())
        except Exception:  # a malformed record must not break a measurement
            pass


class _Lines(io.TextIOBase):
    """A stdout / stderr stand-in that records whole lines (tqdm's carriage returns are kept to the last)."""

    def __init__(self, counter: Counter[tuple[str, str]], origin: str):
        self.counter, self.origin, self.buf = counter, origin, ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.buf += s
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            _add(self.counter, self.origin, line.rsplit("\r", 1)[-1])
        return len(s)

    def flush_rest(self) -> None:
        if self.buf.strip():
            _add(self.counter, self.origin, self.buf.rsplit("\r", 1)[-1])
        self.buf = ""


@contextlib.contextmanager
def capture(streams: bool = True) -> Iterator[Counter[tuple[str, str]]]:
    """Record warnings, WARNING+ log records and Python-level prints of the block as (origin, text) -> count.
    `streams=False` leaves stdout and stderr alone (progress bars the user asked for stay on the terminal)."""
    counter: Counter[tuple[str, str]] = Counter()
    handler = _Handler(counter)
    loggers = [logging.getLogger()] + [logging.getLogger(n) for n in _OWN_HANDLERS]
    saved = [(lg, lg.handlers[:], lg.propagate) for lg in loggers]
    out, err = _Lines(counter, "stdout"), _Lines(counter, "stderr")
    _STACK.append(counter)
    try:
        for lg in loggers:
            lg.handlers = [handler]
            lg.propagate = False
        with warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stdout(out) if streams else contextlib.nullcontext(), \
                contextlib.redirect_stderr(err) if streams else contextlib.nullcontext():
            warnings.simplefilter("always")
            try:
                yield counter
            finally:
                for w in caught:
                    _add(counter, w.category.__name__, str(w.message))
                out.flush_rest()
                err.flush_rest()
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers = handlers
            lg.propagate = propagate
        _STACK.pop()
        if _STACK:
            _STACK[-1].update(counter)


_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")  # a quoted literal inside a message (a row's text, a token)


def summarize(counter: Counter[tuple[str, str]], *, merge_quoted: bool = False) -> tuple[LibraryMessage, ...]:
    """Distinct messages, the most frequent first. `merge_quoted`: messages that differ only in their quoted
    literals are one (TRL's "This warning is shown once" quotes each row's own prompt tail, so `warning_once` says
    it once per row), shown by its most frequent text with the count of all and of the variants."""
    ordered = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))
    if not merge_quoted:
        return tuple(LibraryMessage(o, t, n) for (o, t), n in ordered)
    groups: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for (origin, text), n in ordered:
        groups.setdefault((origin, _QUOTED.sub("'…'", text)), []).append((text, n))
    merged = [LibraryMessage(origin, texts[0][0], sum(n for _, n in texts), len(texts))
              for (origin, _), texts in groups.items()]
    return tuple(sorted(merged, key=lambda m: (-m.count, m.origin, m.text)))


def said_note(counter: Counter[tuple[str, str]], doing: str) -> str | None:
    """One note for what libraries said while `doing` (e.g. "tokenizing the dataset"): each distinct message once
    with its count (quoted variants merged), or None when they said nothing."""
    messages = summarize(counter, merge_quoted=True)
    if not messages:
        return None
    return f"libraries said while {doing} (each distinct message once): " + "; ".join(map(str, messages))
