"""TRL trainers behind one seam: `get_trainer("sft" | "dpo" | "reward" | "grpo" | "rloo" | "kto")` (the protocol:
base.py)."""

from .base import DEFAULT, Trainer, choices, get_trainer, names, register

__all__ = ["DEFAULT", "Trainer", "choices", "get_trainer", "names", "register"]
