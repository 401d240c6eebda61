"""GRPO: `trl.GRPOTrainer` / `trl.GRPOConfig`, parsed by `trl grpo`.

Group Relative Policy Optimization: `num_generations` completions per prompt (GRPOConfig 8), advantages within each
group, no reference at TRL's default `beta=0.0`. The step, the knobs and the files are online RL's (shared with
RLOO: online_trainer.py); this module declares TRL's classes and command, and GRPOConfig's defaults of the knobs
that declare "the trainer's default" (tests/test_grpo_trainer.py reads them back from the installed config).
"""

from __future__ import annotations

from .base import register
from .online_knobs import OnlineKnobs
from .online_trainer import OnlineRLTrainer


class GRPOKnobs(OnlineKnobs):
    """GRPO's online knobs: GRPOConfig's defaults resolved."""

    DEFAULTS = {"num_generations": 8, "beta": 0.0}
    CONTEXT = "grpo"


class GRPO(OnlineRLTrainer):
    """GRPO on prompt-only data (prompts.PromptDataset)."""

    name = "grpo"
    command = "grpo"
    config_name, trainer_name, config_label = "GRPOConfig", "GRPOTrainer", "GRPO"
    knob_view = GRPOKnobs


GRPO_TRAINER = register(GRPO())
