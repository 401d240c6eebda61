"""A Candidate's parts, private to `advisor/space.py` and `advisor/knobs.py` (the public ways to them): the knobs'
value types and what a knob declaration is, the base of the user's other keys and the quality cost, and TRL's rules.
Import from here, never from the modules inside."""

from .knob import (
    NO_STAND_IN,
    TRL_DEFAULT,
    FixResult,
    Home,
    Kind,
    Knob,
    KnobView,
    Memory,
    annotation,
    knob_view,
    parse_bool,
)
from .rules import LLAMA_LINEARS, candidate_problems, default_attention, model_linear_names, peft_default_targets
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
    "candidate_problems", "model_linear_names", "peft_default_targets", "LLAMA_LINEARS", "default_attention",
    "Home", "Kind", "Memory", "FixResult", "Knob", "KnobView", "knob_view", "annotation", "parse_bool", "TRL_DEFAULT",
    "NO_STAND_IN",
]
