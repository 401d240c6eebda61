"""A training step as phases: what each holds on the device (a value type: imports nothing of the advisor).

SFT, DPO and Reward run one training phase a step. Online RL (GRPO, RLOO) runs a cycle: generate completions
(the policy's weights and a KV cache, with colocated vLLM a share of the card reserved outside PyTorch's
allocator), score them (a reward model or functions, the reference's log-probs), then train on them. A trainer
declares its step as `Trainer.phases(candidate)`; memory a phase reserves outside PyTorch's allocator is the
`Category.OUTSIDE_ALLOCATOR` of a Measurement, counted in its device bytes and so in every fit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum


class PhaseKind(str, Enum):
    """What a phase of the step does."""

    GENERATE = "generate"  # sample completions (TRL's generate, or vLLM)
    SCORE = "score"  # reward model / reward functions and reference log-probs on the completions, no gradient
    TRAIN = "train"  # forward, backward and optimizer step of the trained model


class ClosedForm(str, Enum):
    """How the estimate backend counts a trainer's step in closed form. A trainer declares its kind
    (`Trainer.closed_form`); advisor/estimator.py maps each kind to its function, so the trainers never import
    the estimate (and, through it, the simulator never reaches the estimate)."""

    ROWS = "rows"  # SFT: the step over the rows as they are (the LM head on the trained positions)
    PAIRS_WITH_REFERENCE = "pairs_with_reference"  # DPO: 2B sequences a micro-batch of B pairs, plus the reference
    PAIRS_SCORED = "pairs_scored"  # Reward: 2B sequences, a one-label score head instead of the LM head
    ONLINE_RL = "online_rl"  # GRPO / RLOO: generate, score, train (advisor/_physics/online_rl.py)


class Resident(str, Enum):
    """A model (or its state) a phase holds on the device."""

    POLICY = "policy"  # the trained model's weights (with its adapters under LoRA)
    REFERENCE = "reference"  # a separate reference copy (DPO full fine-tuning, GRPO with beta > 0)
    REWARD_MODEL = "reward_model"  # a scoring model (online RL with a reward model)
    TEACHER = "teacher"  # the teacher whose distribution the student is distilled towards (no gradient)
    GRADIENTS = "gradients"  # the trained parameters' gradients
    OPTIMIZER_STATE = "optimizer_state"  # the optimizer's state


@dataclass(frozen=True)
class Phase:
    """One phase of a training step and what it holds on the device.

    `resident`: the models and states live during the phase; `activations`: a forward's activations are saved for
    a backward; `kv_cache`: a generation's KV cache; `outside_allocator_fraction`: the share of the card reserved
    outside PyTorch's caching allocator (colocated vLLM's `gpu_memory_utilization`), 0 for today's trainers.
    """

    kind: PhaseKind
    resident: tuple[Resident, ...]
    activations: bool = False
    kv_cache: bool = False
    outside_allocator_fraction: float = 0.0

    def __post_init__(self) -> None:
        from ..errors import ConfigError

        object.__setattr__(self, "kind", PhaseKind(self.kind))
        object.__setattr__(self, "resident", tuple(Resident(r) for r in self.resident))
        problems = []
        f = self.outside_allocator_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0.0 <= f < 1.0:
            problems.append(f"outside_allocator_fraction={f!r}: a share of the card in [0, 1)")
        if self.kv_cache and self.kind is not PhaseKind.GENERATE:
            problems.append(f"kv_cache=True in a {self.kind.value} phase: only a generate phase holds a KV cache")
        if self.kind is PhaseKind.TRAIN and not {Resident.GRADIENTS, Resident.OPTIMIZER_STATE} <= set(self.resident):
            problems.append("a train phase holds gradients and optimizer state: add Resident.GRADIENTS and "
                            "Resident.OPTIMIZER_STATE to resident")
        if problems:
            raise ConfigError(problems, context="phase")

    def outside_allocator_bytes(self, card_bytes: int) -> int:
        """The bytes this phase reserves outside PyTorch's allocator on a card of `card_bytes`."""
        return int(self.outside_allocator_fraction * card_bytes)


def training_phase(*extra: Resident) -> Phase:
    """The one phase of an offline trainer's step (SFT, DPO, Reward): the policy trained, `extra` resident too."""
    return Phase(PhaseKind.TRAIN, (Resident.POLICY, *extra, Resident.GRADIENTS, Resident.OPTIMIZER_STATE),
                 activations=True)


def outside_allocator_bytes(phases: Iterable[Phase], card_bytes: int) -> int:
    """What a step's phases reserve outside PyTorch's allocator at most (a reservation such as vLLM's is held
    across the step, so the largest phase's counts once, not the sum)."""
    return max((p.outside_allocator_bytes(card_bytes) for p in phases), default=0)
