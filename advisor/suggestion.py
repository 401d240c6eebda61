"""The answer: the chosen candidate with its measurement, every trial, and the TRL objects built on demand."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import emit
from .measurement import Measurement
from .space import Candidate

if TYPE_CHECKING:
    from peft import LoraConfig
    from trl import SFTConfig

    from ._messages import LibraryMessage
    from .workload import Workload


@dataclass(frozen=True)
class Trial:
    """One candidate the search looked at, with its measurement and why it lost (or was pruned)."""

    candidate: Candidate
    measurement: Measurement
    number: int | None = None
    reason: str = ""
    cached: bool = False


@dataclass(frozen=True, eq=False)
class Suggestion:
    """The chosen fields are kept as plain data; TRL objects are built when asked for."""

    workload: Workload
    candidate: Candidate
    measurement: Measurement
    trials: tuple[Trial, ...] = ()
    reasons: tuple[str, ...] = ()
    backend: str = "estimate"
    evaluations: int = 0
    front: tuple[Trial, ...] = ()
    messages: tuple[LibraryMessage, ...] = ()  # what libraries warned or logged while measuring, deduplicated

    @property
    def model_name_or_path(self) -> str:
        spec = self.workload.model
        return str(spec.local_dir) if spec.source == "local" and spec.local_dir else spec.name

    def sft_config(self, **overrides: Any) -> SFTConfig:
        """A trl.SFTConfig; on a machine without a GPU, a bf16 config needs `use_cpu=True`.

        Its `model_init_kwargs` carry the quantization too, so `SFTTrainer(model=<id>, args=s.sft_config(),
        peft_config=s.peft_config())` loads a QLoRA pick quantized.
        """
        overrides.setdefault("model_init_kwargs", self.model_init_kwargs)
        overrides.setdefault("completion_only_loss", self._completion_only_loss)
        return emit.build_sft_config(self.candidate, self.workload, **overrides)

    def peft_config(self) -> LoraConfig | None:
        return emit.peft_config(self.candidate, self.workload.model)

    @property
    def model_init_kwargs(self) -> dict[str, Any]:
        """dtype and attention for `from_pretrained`, plus `quantization_config` when quantized."""
        kwargs = emit.model_init_kwargs(self.candidate)
        qc = emit.quantization_config(self.candidate)
        if qc is not None:
            kwargs["quantization_config"] = qc
        return kwargs

    @property
    def env(self) -> dict[str, str]:
        return emit.env_vars(self.candidate)

    @property
    def _completion_only_loss(self) -> bool | None:
        """Explicit for the synthetic set (pre-tokenized prompt/completion); TRL's own default for real data."""
        ds = self.workload.dataset
        return ds.completion_only_loss if ds.source == "synthetic" else None

    def run_config(self) -> dict[str, Any]:
        return emit.run_config_dict(
            self.candidate,
            model_name_or_path=self.model_name_or_path,
            dataset_name=self.workload.dataset.dataset_name,
            completion_only_loss=self._completion_only_loss,
        )

    def to_yaml(self) -> str:
        """A file for `trl sft --config FILE`."""
        import yaml

        return yaml.safe_dump(self.run_config(), sort_keys=False)

    def to_python(self) -> str:
        return emit.to_python(
            self.candidate, model_name_or_path=self.model_name_or_path,
            dataset_name=self.workload.dataset.dataset_name, completion_only_loss=self._completion_only_loss,
        )

    def to_json_dict(self) -> dict[str, Any]:
        m = self.measurement
        notes = list(self.workload.notes) + list(self.workload.dataset.notes) + list(self.reasons) + list(m.notes)
        if self.candidate.requirements():
            notes.append(self.requirements_note)
        return {
            "config": self.run_config(),
            "peak_bytes": m.peak_bytes,
            "reserved_bytes": m.reserved_bytes,
            "device_bytes": m.device_bytes,
            "breakdown": dict(m.breakdown),
            "tokens_per_second": m.tokens_per_second,
            "evaluations": self.evaluations,
            "backend": self.backend,
            "source": m.source.value,
            "gpu": self.workload.gpu.name,
            "budget_bytes": self.workload.budget_bytes,
            "limit_bytes": self.workload.limit_bytes,
            "quality": self.candidate.quality_cost(self.truncated_fraction).describe(),
            "notes": notes,
        }

    @property
    def requirements_note(self) -> str:
        pkgs = self.candidate.requirements()
        return f"training with this configuration needs: pip install {' '.join(pkgs)}" if pkgs else ""

    @property
    def truncated_fraction(self) -> float:
        c = self.candidate
        return self.workload.dataset.truncated_fraction(c.max_length, c.packing, c.packing_strategy.value)

    def report(self) -> str:
        from .report import render_report

        return render_report(self)
