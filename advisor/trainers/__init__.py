"""TRL trainers behind one seam (the protocol: protocol.py; the defaults: base.py; the registry: registry.py).
Importing this package imports every module in it, so each built-in trainer module registers its trainer (and its own
knobs) by being here: adding one is adding its module, no list to edit."""

import pkgutil
from importlib import import_module

from .base import PairTrainer, TrlTrainer
from .protocol import GpuSplit, Head, ModelInput, StepShape, Trainer
from .registry import (
    DEFAULT,
    choices,
    generating,
    get_trainer,
    launched_candidate,
    model_input,
    model_inputs,
    names,
    owners,
    register,
    trainer_of,
    training_workload,
    unregister,
)

for _module in pkgutil.iter_modules(__path__):  # in name order; a trainer module registers its trainer at import
    import_module(f".{_module.name}", __name__)

__all__ = ["DEFAULT", "GpuSplit", "Head", "ModelInput", "PairTrainer", "StepShape", "Trainer", "TrlTrainer", "choices",
           "generating", "get_trainer", "launched_candidate", "model_input", "model_inputs", "names", "owners",
           "register", "trainer_of", "training_workload", "unregister"]
