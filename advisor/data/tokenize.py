"""Tokenizing with TRL's own code: the tokenizer a dataset needs (`--tokenizer`, the model's directory, its hub
id) and SFTTrainer's `_prepare_dataset` run on the rows with `max_length=None`."""

from __future__ import annotations

import contextlib
import json
import tempfile
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._messages import capture, said_note
from ..errors import DatasetError
from .dataset import DataFormat
from .readers import first_line

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..trainers import Trainer
    from ..workload import ModelSpec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # what `PreTrainedTokenizerFast.save_pretrained`
# writes as `tokenizer_class`: no model's own class, so a config.json beside it picks another


def load_processing_class(loader: str, path: str) -> Any:
    """The tokenizer `transformers.<loader>` loads from `path`, as `<Trainer>.__init__` calls it when `trl <command>`
    passes no processing_class (no remote code: `trust_remote_code` is TRL's default False). Not AutoTokenizer's
    class when it differs: transformers 5 picks the class from a `config.json` beside the tokenizer (Qwen2Tokenizer
    for qwen2, rebuilt from the saved vocabulary), whatever class the tokenizer was saved as, and TRL trains on what
    that class gives. A processor's text side is its `tokenizer`, as the trainers take it
    (`self._tokenizer = processing_class.tokenizer`)."""
    import transformers  # lazy: loads transformers

    loaded = getattr(transformers, loader).from_pretrained(path, trust_remote_code=False)
    return loaded.tokenizer if isinstance(loaded, transformers.ProcessorMixin) else loaded


DEFAULT_LOADER = "AutoProcessor"  # what SFTTrainer, DPOTrainer, GRPOTrainer and RLOOTrainer load with


def load_tokenizer(tokenizer: str | None, model: ModelSpec, trainer: Trainer | None = None
                   ) -> PreTrainedTokenizerBase:
    """The tokenizer `trainer` trains with (`Trainer.load_processing_class`; without one, TRL's AutoProcessor), loaded
    as its `trl <command>` loads it: from `--tokenizer PATH`, else the model's directory, else its hub id.
    DatasetError says how to provide one.

    The class is the trainer's loader's, not the one the tokenizer was saved as: a tokenizer saved as the generic
    `TokenizersBackend` / `PreTrainedTokenizerFast` beside a qwen2 `config.json` is rebuilt as Qwen2Tokenizer by
    AutoProcessor / AutoTokenizer, and TRL trains on that class's tokens, so the advisor counts those."""
    def load(path: str) -> Any:
        if trainer is not None:
            return trainer.load_processing_class(path)
        return load_processing_class(DEFAULT_LOADER, path)

    if tokenizer is not None:
        try:
            return load(tokenizer)
        except Exception as exc:  # transformers raises OSError, ValueError, EnvironmentError...
            raise DatasetError(
                f"--tokenizer {tokenizer}: no tokenizer could be loaded ({first_line(exc)}); pass a directory that "
                f"holds one of {', '.join(TOKENIZER_FILES)}"
            ) from exc
    local = model.local_dir
    if local is not None and any((Path(local) / f).exists() for f in TOKENIZER_FILES):
        try:
            return load(str(local))
        except Exception as exc:
            raise DatasetError(
                f"--model {model.name}: the tokenizer in {local} could not be loaded ({first_line(exc)}); "
                "pass --tokenizer PATH"
            ) from exc
    hint = ("pass --tokenizer PATH (a directory with tokenizer.json or tokenizer_config.json), "
            "or omit --dataset to use the built-in synthetic data")
    if model.source == "local":
        raise DatasetError(f"--model {model.name}: its directory has no tokenizer; {hint}")
    try:
        return load(model.name)
    except Exception as exc:
        raise DatasetError(
            f"--model {model.name}: no tokenizer reachable (not local, hub unreachable: {first_line(exc)}); {hint}"
        ) from exc


def tokenizer_note(tok: PreTrainedTokenizerBase, tokenizer: str | None, model: ModelSpec,
                   trainer: Trainer | None = None) -> str | None:
    """What the dataset's notes say when the trainer's loader built another class than the generic one the
    tokenizer was saved as (`load_tokenizer` counts the loader's tokens, as TRL trains; the user may expect the
    saved class's). None otherwise."""
    path = tokenizer if tokenizer is not None else model.local_dir
    if path is None:
        return None
    try:
        saved = json.loads((Path(path) / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):  # a hub id, no such file, not JSON, not an object
        return None
    loaded = type(tok).__name__
    if saved not in GENERIC_CLASSES or loaded in GENERIC_CLASSES:
        return None
    who, loader = (trainer.trainer_name, trainer.processing_class_loader) if trainer is not None else \
        ("the trainer", DEFAULT_LOADER)
    runs = f"`trl {trainer.command}`" if trainer is not None else "TRL"
    return (f"tokenizer: {path} holds a tokenizer saved as {saved}; {who} loads it as {loaded} "
            f"({loader}.from_pretrained: the config.json beside it picks the class), so the tokens counted are "
            f"{loaded}'s, which {runs} trains on. To train with the saved class, move it to a directory without "
            "config.json, pass that as --tokenizer and its tokenizer as the trainer's processing_class in Python")


def prepare_with_trl(
    rows: list[dict[str, Any]], fmt: DataFormat, tok: PreTrainedTokenizerBase | None, spec: str, progress: bool
) -> tuple[list[list[int]], list[list[int]], str | None]:
    """Run SFTTrainer's own `_prepare_dataset` (no model, no trainer) with `max_length=None`: the input ids, the
    labels, and a note of what the libraries said meanwhile (collected: TRL's per-row "shown once" warning quotes
    each row, so it is said once per row; each distinct message once with its count), or None."""
    import datasets  # lazy: loads datasets
    from trl import SFTConfig, SFTTrainer  # lazy: loads trl

    columns = sorted({k for r in rows for k in r})
    try:
        hf = datasets.Dataset.from_dict({c: [r.get(c) for r in rows] for c in columns})
    except Exception as exc:  # pyarrow cannot unify the rows' types
        raise DatasetError(f"--dataset {spec}: rows of mixed types in one field ({first_line(exc)})") from exc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        args = SFTConfig(output_dir=tempfile.gettempdir(), max_length=None, use_cpu=True, report_to="none")
    # SFTTrainer.__init__ decides these three attributes; `completion_only_loss=None` (the default) means
    # "prompt/completion data only", and no custom chat template unless `assistant_only_loss`.
    trainer_like = types.SimpleNamespace(
        _tokenizer=tok,
        completion_only_loss=fmt is DataFormat.PROMPT_COMPLETION,
        chat_template=None,
    )
    try:
        with progress_bars(progress), capture(streams=not progress) as said:
            prepared = SFTTrainer._prepare_dataset(trainer_like, hf, tok, args, False, None, "train")
    except Exception as exc:  # TRL/transformers raise ValueError, TemplateError, KeyError...
        raise DatasetError(
            f"--dataset {spec}: TRL could not tokenize it ({first_line(exc)}); a conversational dataset needs a "
            "tokenizer with a chat template (--tokenizer PATH)"
        ) from exc
    return prepared["input_ids"], prepared["labels"], said_note(said, "tokenizing the dataset")


@contextlib.contextmanager
def progress_bars(enabled: bool) -> Iterator[None]:
    from datasets.utils import logging as dlogging  # lazy: loads datasets

    was = dlogging.is_progress_bar_enabled()
    (dlogging.enable_progress_bar if enabled else dlogging.disable_progress_bar)()
    try:
        yield
    finally:
        (dlogging.enable_progress_bar if was else dlogging.disable_progress_bar)()
