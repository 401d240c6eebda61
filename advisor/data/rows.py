"""The formats TRL's SFT reads, recognised row by row: the format most rows have, the first problem of a row in
it (field and reason, as a BadRow records them) and the columns TRL's preparation reads."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..errors import DatasetError
from .dataset import DataFormat

_FORMAT_FIELDS = {
    DataFormat.TOKENIZED: "input_ids",
    DataFormat.PROMPT_COMPLETION: "prompt/completion",
    DataFormat.MESSAGES: "messages",
    DataFormat.CONVERSATIONS: "conversations",
    DataFormat.TEXT: "text",
}


def row_format(row: Any) -> DataFormat | None:
    if not isinstance(row, dict):
        return None
    if row.get("input_ids") is not None:
        return DataFormat.TOKENIZED
    if row.get("prompt") is not None and row.get("completion") is not None:
        return DataFormat.PROMPT_COMPLETION
    for fmt in (DataFormat.MESSAGES, DataFormat.CONVERSATIONS, DataFormat.TEXT):
        if row.get(fmt.value) is not None:
            return fmt
    return None


def detect_format(rows: Sequence[Any], label: str) -> DataFormat:
    """The format most rows have; rows of another shape become bad rows."""
    votes = Counter(f for f in map(row_format, rows) if f is not None)
    if not votes:
        first = rows[0]
        keys = sorted(first) if isinstance(first, dict) else type(first).__name__
        raise DatasetError(
            f"--dataset {label}: no row has a field TRL's SFT reads ({', '.join(_FORMAT_FIELDS.values())}); "
            f"row 0 has {keys}"
        )
    return votes.most_common(1)[0][0]


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_text(value: Any, name: str) -> tuple[str, str] | None:
    if value is None:
        return name, "missing"
    if not isinstance(value, str):
        return name, f"wrong type: expected a string, got {_type_name(value)}"
    if not value.strip():
        return name, "empty"
    return None


def _check_messages(value: Any, name: str, role: str = "role", content: str = "content") -> tuple[str, str] | None:
    if value is None:
        return name, "missing"
    if not isinstance(value, list):
        return name, f"wrong type: expected a list of messages, got {_type_name(value)}"
    if not value:
        return name, "empty"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"{name}[{i}]", f"wrong type: expected an object with {role!r} and {content!r}, got " \
                                   f"{_type_name(message)}"
        if not isinstance(message.get(role), str):
            return f"{name}[{i}].{role}", "missing" if message.get(role) is None else "wrong type: expected a string"
        body = message.get(content)
        if body is None and not message.get("tool_calls"):
            return f"{name}[{i}].{content}", "missing"
        if body is not None and not isinstance(body, (str, list)):
            return f"{name}[{i}].{content}", f"wrong type: expected a string, got {_type_name(body)}"
    return None


def check_row(row: Any, fmt: DataFormat, vocab_size: int) -> tuple[str, str] | None:
    """(field, reason) of the first problem of a row in format `fmt`, or None when TRL can take it."""
    if not isinstance(row, dict):
        return "<row>", f"wrong type: expected an object, got {_type_name(row)}"
    if fmt is DataFormat.TEXT:
        return _check_text(row.get("text"), "text")
    if fmt is DataFormat.MESSAGES:
        return _check_messages(row.get("messages"), "messages")
    if fmt is DataFormat.CONVERSATIONS:
        return _check_messages(row.get("conversations"), "conversations", "from", "value")
    if fmt is DataFormat.PROMPT_COMPLETION:
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(prompt, list) or isinstance(completion, list):
            for value, name in ((prompt, "prompt"), (completion, "completion")):
                if isinstance(value, str):
                    return name, "wrong type: a string where the other field is a list of messages"
                problem = _check_messages(value, name)
                if problem:
                    return problem
            return None
        if prompt is None:
            return "prompt", "missing"
        if not isinstance(prompt, str):
            return "prompt", f"wrong type: expected a string, got {_type_name(prompt)}"
        return _check_text(completion, "completion")
    ids = row.get("input_ids")
    if ids is None:
        return "input_ids", "missing"
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return "input_ids", f"wrong type: expected a list of integers, got {_type_name(ids)}"
    if not ids:
        return "input_ids", "empty"
    if min(ids) < 0 or max(ids) >= vocab_size:
        return "input_ids", f"token id out of the model's vocabulary [0, {vocab_size})"
    mask = row.get("completion_mask")
    if mask is not None and (not isinstance(mask, list) or len(mask) != len(ids)):
        return "completion_mask", "wrong type: expected a list of 0/1 as long as input_ids"
    return None


def columns(row: dict[str, Any], fmt: DataFormat) -> dict[str, Any]:
    """The columns TRL's preparation reads, so one odd extra column cannot break the Arrow schema."""
    keep = {
        DataFormat.TEXT: ("text",),
        DataFormat.MESSAGES: ("messages", "tools"),
        DataFormat.CONVERSATIONS: ("conversations", "tools"),
        DataFormat.PROMPT_COMPLETION: ("prompt", "completion", "tools"),
        DataFormat.TOKENIZED: ("input_ids", "completion_mask", "assistant_masks"),
    }[fmt]
    return {k: row[k] for k in keep if row.get(k) is not None}
