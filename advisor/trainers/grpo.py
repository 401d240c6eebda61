"""GRPO: `trl.GRPOTrainer` / `trl.GRPOConfig`, parsed by `trl grpo`.

Group Relative Policy Optimization: `num_generations` completions per prompt (GRPOConfig 8), advantages within each
group, no reference at TRL's default `beta=0.0`. The step, the knobs and the files are online_rl.py's (shared with
RLOO); this module declares TRL's classes and command.
"""

from __future__ import annotations

from .base import register
from .online_rl import OnlineRLTrainer


class GRPO(OnlineRLTrainer):
    """GRPO on prompt-only data (prompts.PromptDataset)."""

    name = "grpo"
    command = "grpo"
    config_name, trainer_name, config_label = "GRPOConfig", "GRPOTrainer", "GRPO"


GRPO_TRAINER = register(GRPO())
