"""RLOO: `trl.RLOOTrainer` / `trl.RLOOConfig`, parsed by `trl rloo`.

REINFORCE Leave-One-Out: `num_generations` completions per prompt (RLOOConfig 2), each baselined by the others'
mean; a reference at TRL's default `beta=0.05` (a separate copy without PEFT, the adapters disabled with it). The
step, the knobs and the files are online_rl.py's (shared with GRPO); this module declares TRL's classes and command.
"""

from __future__ import annotations

from .base import register
from .online_rl import OnlineRLTrainer


class RLOO(OnlineRLTrainer):
    """RLOO on prompt-only data (prompts.PromptDataset)."""

    name = "rloo"
    command = "rloo"
    config_name, trainer_name, config_label = "RLOOConfig", "RLOOTrainer", "RLOO"
    old_logps_always = True  # RLOOTrainer._generate_and_score_completions computes the old log-probs every time


RLOO_TRAINER = register(RLOO())
