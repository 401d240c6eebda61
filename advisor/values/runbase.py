"""What a Candidate carries besides its knobs: `RunBase`, the user's other run-config keys, and `QualityCost`,
what a candidate gives up against full fine-tuning."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .enums import Quantization

# The base key that holds the user's activation_checkpointing_kwargs other than the knobs' (selective,
# every_n_layers): use_reentrant, preserve_rng_state, ...
CHECKPOINT_EXTRA = "activation_checkpointing_kwargs"


@dataclass(frozen=True)
class RunBase:
    """The keys of a run config that are not knobs, as the user wrote them: what every measured and emitted run
    keeps (see emit.KEY_USES for which keys reach the measured run). Sorted (key, JSON text) pairs, so a Candidate
    that carries it stays hashable and comparable; empty for the search's own candidates."""

    items: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, mapping: Mapping[str, Any] | RunBase | None) -> RunBase:
        if isinstance(mapping, RunBase):
            return mapping
        problems, items = [], []
        for k, v in sorted((mapping or {}).items()):
            try:
                items.append((str(k), json.dumps(v, sort_keys=True)))
            except (TypeError, ValueError):
                problems.append(f"{k}={v!r}: not a YAML/JSON value")
        if problems:
            raise ConfigError(problems, context="run config")
        return cls(tuple(items))

    def as_dict(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self.items}

    def get(self, key: str, default: Any = None) -> Any:
        for k, v in self.items:
            if k == key:
                return json.loads(v)
        return default

    def __contains__(self, key: object) -> bool:
        return any(k == key for k, _ in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)



@dataclass(frozen=True)
class QualityCost:
    """What a candidate gives up against full fine-tuning of every token in float32 weights."""

    truncated_fraction: float = 0.0
    adapters: bool = False
    quantization: Quantization = Quantization.NONE
    low_precision_weights: bool = False
    mixed_examples: bool = False

    @property
    def neutral(self) -> bool:
        return not (
            self.truncated_fraction > 0
            or self.adapters
            or self.quantization is not Quantization.NONE
            or self.low_precision_weights
            or self.mixed_examples
        )

    def describe(self) -> list[str]:
        out = []
        if self.truncated_fraction > 0:
            out.append(f"{self.truncated_fraction:.2%} of trained tokens lost to truncation")
        if self.adapters:
            out.append("LoRA adapters instead of full weights")
        if self.quantization is not Quantization.NONE:
            out.append(f"{self.quantization.value} quantized base weights")
        if self.low_precision_weights:
            out.append("pure low-precision weights (no float32 master copy)")
        if self.mixed_examples:
            out.append("'wrapped' packing mixes examples and cuts them mid-sequence")
        return out
