"""TRL trainers behind one seam: `get_trainer("sft" | "dpo" | "reward")` (see base.py for the protocol)."""

from .base import Trainer, get_trainer, names, register

__all__ = ["Trainer", "get_trainer", "names", "register"]
