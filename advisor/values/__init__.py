"""The value types, the lowest layer above errors and the workload: the knobs' values (str-Enums, `enums.py`), what
a knob declaration is (`knob.py`), the base of the user's other keys and the quality cost (`runbase.py`), and TRL's
rules between knob values (`rules.py`). `knobs.py` (the registry of knobs) and `space.py` (`Candidate`, derived from
that registry) build on it. Import from here, never from the modules inside."""

from .enums import (
    UNSUPPORTED_OPTIMIZERS,
    Attention,
    Optimizer,
    PackingStrategy,
    Precision,
    Quantization,
    WeightsDtype,
)
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

__all__ = [  # noqa: RUF022
    "PackingStrategy", "Precision", "WeightsDtype", "Quantization", "Optimizer", "Attention", "UNSUPPORTED_OPTIMIZERS",
    "RunBase", "QualityCost", "CHECKPOINT_EXTRA",
    "candidate_problems", "model_linear_names", "peft_default_targets", "LLAMA_LINEARS", "default_attention",
    "Home", "Kind", "Memory", "FixResult", "Knob", "KnobView", "knob_view", "annotation", "parse_bool", "TRL_DEFAULT",
    "NO_STAND_IN",
]
