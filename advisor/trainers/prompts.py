"""Prompt-only data (`prompt`) as GRPOTrainer and RLOOTrainer read it, and the built-in synthetic prompt set.

TRL 1.16's online trainers take a dataset whose `prompt` column is plain text or a conversation (a list of
messages); each step they tokenize the batch's prompts with their own `_tokenize_prompts` (plain text:
`processing_class(text=prompts)`; conversational: `processing_class.apply_chat_template(conversation=prompts,
add_generation_prompt=True, tokenize=True, return_dict=True, **chat_template_kwargs)`), with no truncation (TRL 1.16
has no `max_prompt_length`): a prompt's tokens all go into `generate` and into the training forward.
`load_prompts` reads a local .jsonl / .json / .parquet / .csv file, a `save_to_disk` directory or a hub id (through
advisor.data's readers) and tokenizes it with that same TRL method, so the lengths are the trainer's own.

The synthetic set draws each prompt's length as the synthetic chat set's prompts are drawn (advisor.data's
`synthetic_lengths`: a log-normal sequence length, median ~300 tokens, clipped to [16, 8192], times a prompt share
uniform in [0.2, 0.6)), so its prompts have a median of ~120 tokens.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..data import (
    SYNTHETIC_MAX,
    SYNTHETIC_MEDIAN,
    SYNTHETIC_SEED,
    SourcedRows,
    load_tokenizer,
    read_raw,
    synthetic_lengths,
    tokenizer_note,
)
from ..errors import ConfigError, DatasetError
from ..lengths import Percentiles, percentile_line
from .registry import get_trainer

if TYPE_CHECKING:
    import datasets

    from ..workload import ModelSpec

PROMPT_COLUMN = "prompt"
SYNTHETIC_PROMPTS = 2048
_TRAINERS = {"grpo": "GRPOTrainer", "rloo": "RLOOTrainer", "distillation": "DistillationTrainer"}
DEFAULT_COMPLETION = 512  # GRPOConfig / RLOOConfig max_completion_length (TRL 1.16), the online knob's default
_BATCH = 256  # prompts per call of TRL's tokenizer path (it tokenizes a batch per step; the result is per prompt)


@dataclass(frozen=True, eq=False)
class PromptDataset(SourcedRows):
    """Prompts as the trainer tokenizes them: one tuple of token ids per row (the chat template's tokens and the
    generation prompt included). A `Dataset` (advisor.data): a row is a prompt (`unit` "prompts"); `lengths` are the
    prompts' tokens (each completion adds the candidate's max_completion_length, `sequence_lengths`); the trained
    tokens are the completions' (every completion at max_completion_length: the bound); TRL 1.16 truncates no prompt
    (it has no max_prompt_length), so nothing is truncated."""

    name: str
    source: Literal["synthetic", "local", "hub"]
    rows: tuple[tuple[int, ...], ...]
    dataset_name: str | None = None
    notes: tuple[str, ...] = ()
    conversational: bool | None = None
    population: int | None = None  # the source's prompts when `rows` is a seeded sample of them (--sample)
    lengths: np.ndarray = field(init=False, repr=False)

    unit = "prompts"  # the Dataset protocol's word for one row
    completion_only_loss = True  # only the completions are trained (what a Workload reads of its dataset)
    bad_rows: tuple = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", np.array([len(r) for r in self.rows], dtype=np.int64))



    @property
    def fingerprint(self) -> str:
        return self.fingerprint_of("prompts", self.lengths)

    def longest(self, n: int) -> np.ndarray:
        """Indices of the `n` longest prompts, longest first (ties by row order): the generation batch whose every
        completion at max_completion_length needs the most memory."""
        order = np.argsort(-self.lengths, kind="stable")
        return order[: max(0, n)]

    def sequence_lengths(self, max_completion_length: int) -> np.ndarray:
        """Prompt + completion per row with every completion at `max_completion_length` (the bound)."""
        return self.lengths + int(max_completion_length)

    # ---- the Dataset protocol ---------------------------------------------------------------------------------
    def truncated_share(self, max_length: int | None, packing: bool = False, strategy: str = "bfd") -> float:
        """0: TRL 1.16's online trainers truncate no prompt, and `max_length` is not theirs (completions end at the
        user's max_completion_length, a quality choice the search never lowers)."""
        return 0.0

    def truncated_fraction(self, max_length: int | None, packing: bool = False, strategy: str = "bfd") -> float:
        return 0.0

    def trained_tokens(self, max_length: int | None = None, max_completion_length: int = DEFAULT_COMPLETION,
                       num_generations: int = 1) -> np.ndarray:
        """Trained tokens per prompt: its `num_generations` completions at `max_completion_length` each (the bound;
        `max_length` is not the online trainers')."""
        return np.full(len(self.rows), int(max_completion_length) * int(num_generations), dtype=np.int64)

    def trained_tokens_per_row(self, candidate: Any) -> float:
        """Trained tokens per micro-batch row, a row being one completion (per_device_train_batch_size counts
        completions): max_completion_length, so an effective batch of tokens is a number of completions."""
        return float(candidate.base.get("max_completion_length", DEFAULT_COMPLETION))

    def sequences(self) -> Any:
        """Prompts make sequences only with their completions, which the online step generates (its closed form
        counts them: advisor/estimator/online_step.py); refused by name."""
        raise DatasetError(f"dataset {self.name}: prompts have no sequences of their own (each completes at "
                           "max_completion_length in the online step)")

    def to_hf(self, rows: Sequence[int] | None = None) -> datasets.Dataset:
        """A `prompt` column of plain text that advisor.modeling's placeholder tokenizer (one word `<tN>` per id)
        turns back into exactly these ids: the same lengths, whatever the original format."""
        import datasets  # lazy: loads datasets

        picked = self.rows if rows is None else [self.rows[int(i)] for i in rows]
        return datasets.Dataset.from_dict({PROMPT_COLUMN: [placeholder_text(ids) for ids in picked]})


def placeholder_text(ids: Sequence[int]) -> str:
    return " ".join(f"<t{int(i)}>" for i in ids)


def synthetic_prompts(vocab_size: int, rows: int = SYNTHETIC_PROMPTS, seed: int = SYNTHETIC_SEED,
                      median: int = SYNTHETIC_MEDIAN, max_len: int = SYNTHETIC_MAX) -> PromptDataset:
    """The built-in prompt set: seeded token ids, each prompt as long as the synthetic chat set's prompt of the same
    draw (`max(1, int(length x share))`)."""
    if vocab_size < 2 or rows < 1:
        raise ConfigError(f"synthetic prompts need a vocabulary of at least 2 ids and at least one row (got "
                          f"vocab_size={vocab_size}, rows={rows})", context="synthetic prompts")
    rng = np.random.default_rng(seed)
    lengths, share = synthetic_lengths(rng, rows, median, max_len)
    low = min(10, vocab_size - 1)
    out = tuple(tuple(rng.integers(low, vocab_size, size=max(1, int(n * s))).tolist())
                for n, s in zip(lengths, share, strict=True))
    return PromptDataset(
        name=f"synthetic-prompts(rows={rows},seed={seed},median={median})",
        source="synthetic",
        rows=out,
        notes=("synthetic prompts: no dataset was given; lengths are the synthetic chat set's prompts (log-normal), "
               "see README",),
    )


# ---- checks ----------------------------------------------------------------------------------------------------
def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def check_prompt_rows(rows: Sequence[Any], label: str, trainer: str = "grpo") -> bool:
    """ConfigError naming the column and the fix when the data has no `prompt`; DatasetError naming every row whose
    prompt TRL cannot take (missing, empty, not text or messages, or of the other kind than the first row: TRL
    decides plain vs conversational from a batch's first prompt). Returns whether the prompts are conversational."""
    name = _TRAINERS.get(trainer, trainer)
    first = rows[0] if len(rows) else {}
    if not isinstance(first, dict) or PROMPT_COLUMN not in first:
        have = sorted(first) if isinstance(first, dict) else type(first).__name__
        hint = ""
        if isinstance(first, dict) and "messages" in first:
            hint = " (a chat dataset: keep each conversation without its last assistant turn as 'prompt')"
        elif isinstance(first, dict) and {"chosen", "rejected"} <= set(first):
            hint = f" (a preference dataset: its prompts are what {name} takes)"
        raise ConfigError(
            [f"dataset={label}: the {trainer} trainer reads prompt-only data ({name} takes the {PROMPT_COLUMN!r} "
             f"column: a string, or a list of messages), and row 0 has no {PROMPT_COLUMN!r} column (it has "
             f"{have}){hint}; rename the column that holds the prompts to {PROMPT_COLUMN!r} (datasets: "
             f"dataset.rename_column('question', 'prompt')), or omit the dataset for the built-in synthetic prompts"],
            context=f"trainer={trainer}",
        )
    conversational = _is_messages(first.get(PROMPT_COLUMN))
    bad = []
    for i, row in enumerate(rows):
        value = row.get(PROMPT_COLUMN) if isinstance(row, dict) else None
        if value is None:
            bad.append(f"row {i}: 'prompt' is missing")
        elif isinstance(value, str):
            if not value.strip():
                bad.append(f"row {i}: 'prompt' is empty")
            elif conversational:
                bad.append(f"row {i}: 'prompt' is text where row 0's is a list of messages")
        elif _is_messages(value):
            if not conversational:
                bad.append(f"row {i}: 'prompt' is a list of messages where row 0's is text")
        else:
            bad.append(f"row {i}: 'prompt' is a {type(value).__name__}, not text or a list of messages "
                       "({'role': ..., 'content': ...})")
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise DatasetError(f"--dataset {label}: {len(bad)} row(s) {name} cannot take: {shown}; fix or drop them")
    return conversational


# ---- TRL's own tokenization ------------------------------------------------------------------------------------
def tokenize_prompts(prompts: Sequence[Any], tok: Any, *, trainer: str = "grpo",
                     chat_template_kwargs: dict[str, Any] | None = None, label: str = "") -> list[list[int]]:
    """`GRPOTrainer._tokenize_prompts` / `RLOOTrainer._tokenize_prompts` (no model, no trainer), per batch."""
    if trainer not in _TRAINERS:
        raise ConfigError(f"trainer={trainer!r} does not read prompt-only data; use one of {', '.join(_TRAINERS)}",
                          context="trainer")
    import trl  # lazy: loads trl

    cls = getattr(trl, _TRAINERS[trainer])
    conversational = bool(prompts) and _is_messages(prompts[0])
    if conversational and getattr(tok, "chat_template", None) is None:
        raise DatasetError(f"--dataset {label}: the prompts are conversational and the tokenizer has no chat template; "
                           "pass --tokenizer PATH (a tokenizer with a chat template), or give the prompts as text")
    trainer_like = types.SimpleNamespace(processing_class=tok, _is_vlm=False, environment_factories=None, tools=None,
                                         chat_template=None, chat_template_kwargs=dict(chat_template_kwargs or {}))
    out: list[list[int]] = []
    for start in range(0, len(prompts), _BATCH):
        batch = list(prompts[start:start + _BATCH])
        try:
            ids, _, _ = cls._tokenize_prompts(trainer_like, batch)
        except Exception as exc:  # jinja2's TemplateError, tokenizers' errors, KeyError...
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DatasetError(f"--dataset {label}: {cls.__name__} could not tokenize rows {start}.."
                               f"{start + len(batch) - 1} ({text})") from exc
        out.extend([int(t) for t in row] for row in ids)
    return out


def load_prompts(spec: str | None, model: ModelSpec, tokenizer: str | None = None, trainer: str = "grpo",
                 chat_template_kwargs: dict[str, Any] | None = None, *, sample: int | None = None,
                 seed: int = 0) -> PromptDataset:
    """None: the synthetic set. Else the file / directory / hub id, tokenized by the trainer's own method.
    `sample`: a seeded random sample of that many prompts, drawn as advisor.data.load_dataset draws rows (the same
    indices for the same file size and seed)."""
    if sample is not None and sample <= 0:
        raise DatasetError(f"--sample {sample}: must be a positive number of prompts, e.g. --sample 2000")
    if spec is None:
        data = synthetic_prompts(model.vocab_size)
        if sample is not None:
            note = f"--sample {sample} ignored: the synthetic set is generated whole ({len(data.rows)} prompts)"
            data = dataclasses.replace(data, notes=data.notes + (note,))
        return data

    raw = read_raw(spec)
    population = len(raw.rows)
    if not population:
        raise DatasetError(f"--dataset {spec}: it has no rows")
    indices: Any = range(population)
    sampled = sample is not None and sample < population
    if sampled:
        indices = np.sort(np.random.default_rng(seed).choice(population, size=sample, replace=False))
    rows = [raw.rows[int(i)] for i in indices]
    conversational = check_prompt_rows(rows, raw.label, trainer)
    kind = get_trainer(trainer)
    tok = load_tokenizer(tokenizer, model, kind)  # as GRPOTrainer / RLOOTrainer load it (AutoProcessor)
    loaded_as = tokenizer_note(tok, tokenizer, model, kind)
    ids = tokenize_prompts([r[PROMPT_COLUMN] for r in rows], tok, trainer=trainer,
                           chat_template_kwargs=chat_template_kwargs, label=raw.label)
    return PromptDataset(name=raw.label, source=raw.source, rows=tuple(tuple(r) for r in ids),
                         dataset_name=spec if raw.source == "hub" else None, conversational=conversational,
                         population=population if sampled else None,
                         notes=((f"a seeded random sample (seed {seed}) of {len(rows)} of {population} prompts",)
                                if sampled else ()) + ((loaded_as,) if loaded_as is not None else ()))


# ---- the lengths report for prompt data (`advisor lengths --trainer grpo|rloo`) --------------------------------
@dataclass(frozen=True)
class PromptLengthReport:
    """The prompts' token lengths (as the trainer tokenizes them) and the sequences they make with every completion
    at max_completion_length (the bound the memory is measured at): TRL 1.16 truncates neither."""

    name: str
    synthetic: bool
    prompts: int
    prompt: Any  # advisor.lengths.Percentiles
    max_completion_length: int
    sequence: Any  # prompt + max_completion_length
    notes: tuple[str, ...] = ()

    def text(self) -> str:
        """`advisor lengths`' text for prompts."""
        kind = "synthetic prompts (no --dataset given)" if self.synthetic else "prompt dataset"
        lines = [f"{self.name}: {kind}, {self.prompts} prompts",
                 f"prompt:                      {percentile_line(self.prompt)}",
                 f"prompt + {self.max_completion_length} completion tokens: {percentile_line(self.sequence)}",
                 "TRL 1.16 truncates no prompt; every completion is counted at max_completion_length (the bound)"]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "synthetic": self.synthetic, "prompts": self.prompts,
                "prompt": self.prompt.to_dict(), "max_completion_length": self.max_completion_length,
                "prompt_completion": self.sequence.to_dict(), "notes": list(self.notes)}


def prompt_length_report(data: PromptDataset, max_completion_length: int = DEFAULT_COMPLETION) -> PromptLengthReport:
    return PromptLengthReport(name=data.name, synthetic=data.synthetic, prompts=len(data.rows),
                              prompt=Percentiles.of(data.lengths), max_completion_length=int(max_completion_length),
                              sequence=Percentiles.of(data.sequence_lengths(max_completion_length)),
                              notes=tuple(data.notes))
