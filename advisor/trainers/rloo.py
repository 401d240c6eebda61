"""RLOO: `trl.RLOOTrainer` / `trl.RLOOConfig`, parsed by `trl rloo`.

REINFORCE Leave-One-Out: `num_generations` completions per prompt (RLOOConfig 2), each baselined by the others'
mean; a reference at TRL's default `beta=0.05` (a separate copy without PEFT, the adapters disabled with it). The
step, the knobs and the files are online RL's (shared with GRPO: online_trainer.py); this module declares TRL's
classes and command, RLOOConfig's defaults, and that its scoring always runs the old policy's forward.
"""

from __future__ import annotations

from .base import register
from .online_knobs import OnlineKnobs
from .online_trainer import OnlineRLTrainer


class RLOOKnobs(OnlineKnobs):
    """RLOO's online knobs: RLOOConfig's defaults resolved."""

    DEFAULTS = {"num_generations": 2, "beta": 0.05}
    CONTEXT = "rloo"
    old_logps_always = True  # RLOOTrainer._generate_and_score_completions computes the old log-probs every time


class RLOO(OnlineRLTrainer):
    """RLOO on prompt-only data (prompts.PromptDataset)."""

    name = "rloo"
    command = "rloo"
    config_name, trainer_name, config_label = "RLOOConfig", "RLOOTrainer", "RLOO"
    knob_view = RLOOKnobs


RLOO_TRAINER = register(RLOO())
