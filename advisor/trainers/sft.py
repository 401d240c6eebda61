"""SFT: `trl.SFTTrainer` / `trl.SFTConfig`, parsed by `trl sft`.

SFT's data (chat rows as SFTTrainer prepares them: the rows that make the worst batch, packed when packing, TRL's own
collator on the longest prepared rows) is every trainer's default (base.py); this module declares TRL's classes, the
step-time model over the sampler's batches, and the one key of SFTConfig no knob owns (`completion_only_loss`). The
config itself is the one writer's (advisor/runconfig), from the knobs SFTConfig has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import TrlTrainer, register

if TYPE_CHECKING:
    from ..space import Candidate
    from ..workload import Workload


class SFT(TrlTrainer):
    """Supervised fine-tuning on prompt/completion, conversational or text data (advisor.data.TokenizedDataset)."""

    name = "sft"
    command = "sft"
    config_name, trainer_name = "SFTConfig", "SFTTrainer"
    timed_over_batches = True  # the step-time model over the sampler's batches (advisor/simulator/timing)
    space_holds = frozenset({"pad_to_multiple_of"})  # SFT pads rows to the batch's longest (or none: padding-free)

    # ---- config ---------------------------------------------------------------------------------------------------
    def config_extras(self, candidate: Candidate, workload: Workload | None, *, measured: bool) -> dict[str, Any]:
        """`completion_only_loss` (no knob owns it): as the user wrote it, else the workload's data's (pre-tokenized
        prompt/completion keeps it), None without a workload."""
        data = workload.dataset.completion_only_loss if workload is not None else None
        return {"completion_only_loss": candidate.base.get("completion_only_loss", data)}

    def emit_kwargs(self, candidate: Candidate, workload: Workload | None = None) -> dict[str, Any]:
        """SFTConfig's kwargs as emitted: `completion_only_loss` as the user wrote it, else explicit for the
        synthetic set (pre-tokenized prompt/completion), else TRL's own default (None)."""
        kw = self.config_kwargs(candidate)
        kw["completion_only_loss"] = candidate.base.get("completion_only_loss", completion_only_loss(workload))
        return kw

    # ---- the report ------------------------------------------------------------------------------------------------
    def report_rows(self, candidate: Candidate) -> list[list[str]]:
        return []  # the default trainer: the summary names none


def completion_only_loss(workload: Workload | None) -> bool | None:
    """What the emitted config says of `completion_only_loss`: explicit for the synthetic set (pre-tokenized
    prompt/completion, which TRL cannot tell apart), TRL's own default (None) for real data."""
    if workload is None:
        return None
    ds = workload.dataset
    return ds.completion_only_loss if ds.source == "synthetic" else None


SFT_TRAINER = register(SFT())
