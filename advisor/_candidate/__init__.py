"""A Candidate's parts, private to `advisor/space.py` (the public way to them): the knobs' value types, the base of
the user's other keys and the quality cost, and TRL's rules. Import from here, never from the modules inside."""

from .rules import LLAMA_LINEARS, candidate_problems, model_linear_names, peft_default_targets
from .runbase import CHECKPOINT_EXTRA, QualityCost, RunBase
from .values import (
    UNSUPPORTED_OPTIMIZERS,
    Attention,
    Optimizer,
    PackingStrategy,
    Precision,
    Quantization,
    WeightsDtype,
)

__all__ = [  # noqa: RUF022
    "PackingStrategy", "Precision", "WeightsDtype", "Quantization", "Optimizer", "Attention", "UNSUPPORTED_OPTIMIZERS",
    "RunBase", "QualityCost", "CHECKPOINT_EXTRA",
    "candidate_problems", "model_linear_names", "peft_default_targets", "LLAMA_LINEARS",
]
