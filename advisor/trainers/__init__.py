"""TRL trainers behind one seam: `get_trainer("sft" | "dpo" | "reward" | "grpo" | "rloo")` (the protocol: base.py)."""

from .base import (
    DEFAULT,
    Trainer,
    choices,
    get_trainer,
    launched_candidate,
    names,
    register,
    training_gpus,
    training_workload,
)

__all__ = ["DEFAULT", "Trainer", "choices", "get_trainer", "launched_candidate", "names", "register",
           "training_gpus", "training_workload"]
