"""TRL trainers behind one seam (the protocol: protocol.py; the defaults: base.py; the registry: registry.py).
Importing this package registers the built-in trainers, each with its own knobs."""

from importlib import import_module

from .base import PairTrainer, TrlTrainer
from .protocol import GpuSplit, Head, ModelInput, StepShape, Trainer
from .registry import (
    BUILTIN,
    DEFAULT,
    choices,
    get_trainer,
    model_input,
    model_inputs,
    names,
    owners,
    register,
    trainer_of,
    unregister,
)

for _name in BUILTIN:  # each module registers its trainer at import
    import_module(f".{_name}", __name__)

__all__ = ["DEFAULT", "GpuSplit", "Head", "ModelInput", "PairTrainer", "StepShape", "Trainer", "TrlTrainer", "choices",
           "get_trainer", "model_input", "model_inputs", "names", "owners", "register", "trainer_of", "unregister"]
