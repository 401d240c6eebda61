"""SFT: `trl.SFTTrainer` / `trl.SFTConfig`, parsed by `trl sft`. The first implementation of the trainer seam.

The SFT-specific parts of the simulator, the probe and the data loader live here: the rows that make the worst
batch (packed rows when packing), the pre-tokenized dataset SFTTrainer takes as is, TRL's own collator on the
longest prepared rows. The config itself is `advisor.emit`'s (SFTConfig kwargs, the `trl sft` YAML).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .base import TrlTrainer, register

if TYPE_CHECKING:
    import torch

    from ..space import Candidate
    from ..workload import GPUSpec, ModelSpec, Workload


class SFT(TrlTrainer):
    """Supervised fine-tuning on prompt/completion, conversational or text data (advisor.data.TokenizedDataset)."""

    name = "sft"
    command = "sft"
    config_name, trainer_name = "SFTConfig", "SFTTrainer"
    example_dataset, data_hint = "trl-lib/Capybara", "your data"
    timed_over_batches = True  # the step-time model over the sampler's batches (advisor/_sim/timing)

    # ---- rules, config ------------------------------------------------------------------------------------------
    def problems(self, candidate: Candidate, gpu: GPUSpec | None = None, model: ModelSpec | None = None
                 ) -> list[str]:
        return candidate.problems(gpu, model)

    def config_kwargs(self, candidate: Candidate, workload: Workload | None = None, *,
                      measured: bool = False) -> dict[str, Any]:
        from ..emit import sft_config_kwargs

        return sft_config_kwargs(candidate, workload, measured=measured)

    def emit_kwargs(self, candidate: Candidate, workload: Workload | None = None) -> dict[str, Any]:
        """SFTConfig's kwargs as emitted: `completion_only_loss` as the user wrote it, else explicit for the
        synthetic set (pre-tokenized prompt/completion), else TRL's own default (None)."""
        from ..emit import emitted_sft_kwargs

        return emitted_sft_kwargs(candidate, completion_only_loss(workload))

    def run_config_dict(self, candidate: Candidate, *, model_name_or_path: str | None,
                        dataset_name: str | None = None, workload: Workload | None = None) -> dict[str, Any]:
        from ..emit import run_config_dict

        return run_config_dict(candidate, model_name_or_path=model_name_or_path, dataset_name=dataset_name,
                               completion_only_loss=completion_only_loss(workload), workload=workload)

    def check_run_keys(self, data: Mapping[str, Any], *, source: str = "config") -> None:
        return None  # advisor.emit.candidate_from_run_dict checks every SFT key itself

    # ---- data ----------------------------------------------------------------------------------------------------
    def load_dataset(self, spec: str | None, model: ModelSpec, tokenizer: str | None = None, *,
                     sample: int | None = None, seed: int = 0, progress: bool = False) -> Any:
        from ..data import load_dataset

        return load_dataset(spec, model, tokenizer=tokenizer, sample=sample, seed=seed, progress=progress)

    def check_dataset(self, workload: Workload) -> None:
        from ..data import TokenizedDataset
        from ..errors import ConfigError

        if not isinstance(workload.dataset, TokenizedDataset):
            raise ConfigError([f"dataset={workload.dataset.name}: preference data (prompt/chosen/rejected) given to "
                               "the SFT trainer; use trainer='dpo' or 'reward', or give SFT data"], context="sft")

    def dataset_from_rows(self, name: str, source: str, rows: tuple[dict, ...], *, dataset_name: str | None = None,
                          completion_only_loss: bool | None = None) -> Any:
        from ..data import TokenizedDataset

        return TokenizedDataset(name=name, source=source, rows=rows, completion_only_loss=completion_only_loss,
                                dataset_name=dataset_name)

    def kept_rows(self, workload: Workload, candidate: Candidate) -> Any:
        """Indices of the rows TRL keeps: with a completion-only loss, rows whose trained tokens all fall past
        `max_length` are dropped as fully masked (SFTTrainer's "Dropping fully masked examples")."""
        import numpy as np

        data = workload.dataset
        if not data.completion_only_loss or not candidate.max_length:
            return np.arange(len(data.rows))
        return np.flatnonzero(data.trained_after_truncation(candidate.max_length) > 0)

    def worst_rows(self, workload: Workload, candidate: Candidate) -> list[dict]:
        """Enough of the longest rows to fill one micro-batch (packed rows when packing), of the rows TRL keeps."""
        import numpy as np

        b = candidate.per_device_train_batch_size
        data = workload.dataset
        cap = candidate.max_length
        kept = self.kept_rows(workload, candidate)
        lengths = np.minimum(data.lengths[kept], cap) if cap else data.lengths[kept]
        order = [int(kept[i]) for i in np.argsort(-lengths, kind="stable")]
        if not candidate.packing or not cap:
            return [data.rows[i] for i in order[:b]]
        need = b * cap
        rows, total = [], 0
        for i in order:
            rows.append(data.rows[i])
            total += min(len(data.rows[i]["input_ids"]), cap)
            if total >= need + cap:
                break
        return rows

    def worst_batch(self, trainer: Any, batch_size: int) -> dict[str, torch.Tensor]:
        """The batch that needs the most memory: the longest prepared (packed, truncated) rows, TRL's own collator."""
        ds = trainer.train_dataset
        lengths = [len(x) for x in ds["input_ids"]]
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:batch_size]
        rows = [ds[i] for i in order]
        keep = set(getattr(trainer, "_signature_columns", None) or ()) | {"input_ids", "completion_mask",
                                                                          "seq_lengths"}
        rows = [{k: v for k, v in r.items() if k in keep} for r in rows]
        return trainer.data_collator(rows)

    def labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["labels"]

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
