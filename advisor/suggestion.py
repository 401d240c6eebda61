"""The answer: the chosen candidate with its measurement, every trial, and the TRL objects built on demand."""

from __future__ import annotations

import dataclasses
import textwrap
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import __version__, emit
from .accelerate_config import accelerate_config
from .errors import UsageError
from .events import Event, render
from .measurement import Measurement
from .packages import missing
from .report import render_report
from .space import Candidate
from .trainers import trainer_of

if TYPE_CHECKING:
    from peft import LoraConfig
    from trl import SFTConfig

    from ._messages import LibraryMessage
    from .accelerate_config import LaunchConfig
    from .trainers import Trainer
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
    events: tuple[Event, ...] = ()  # what the search says about its run (advisor.events), rendered by `reasons`
    backend: str = "estimate"
    evaluations: int = 0
    front: tuple[Trial, ...] = ()
    messages: tuple[LibraryMessage, ...] = ()  # what libraries warned or logged while measuring, deduplicated

    @property
    def reasons(self) -> tuple[str, ...]:
        """The events as the lines the CLI and the report print."""
        return tuple(render(e) for e in self.events)

    @property
    def model_name_or_path(self) -> str:
        spec = self.workload.model
        return str(spec.local_dir) if spec.source == "local" and spec.local_dir else spec.name

    def sft_config(self, **overrides: Any) -> SFTConfig:
        """A trl.SFTConfig (a suggestion for SFT): `trl_config()`, refused for another trainer."""
        return self._config_named("SFTConfig", "sft_config", overrides)

    @property
    def trainer(self) -> Trainer:
        """The TRL trainer this suggestion is for (advisor.trainers; the workload's)."""
        return trainer_of(self.workload)

    def trl_config(self, **overrides: Any) -> Any:
        """The trainer's TRL config (an SFTConfig, a DPOConfig, a RewardConfig: `Trainer.trl_config`) that can be
        built where it is called; its `model_init_kwargs` carry the quantization, so `<Trainer>(model=<id>,
        args=s.trl_config(), peft_config=s.peft_config())` loads a QLoRA pick quantized.

        On a machine with no accelerator (no CUDA, MPS or XPU device) transformers refuses bf16/fp16 unless
        `use_cpu=True`; it is then set, with a UserWarning that says so (pass `use_cpu` to decide yourself).
        """
        if "use_cpu" not in overrides and self.candidate.precision.value != "fp32" and not _has_accelerator():
            overrides["use_cpu"] = True
            warnings.warn(
                f"no GPU (or other accelerator) here: trl_config() sets use_cpu=True, so this "
                f"{self.candidate.precision.value} configuration for {self.workload.gpu.name} can be built and "
                "would train on the CPU; on the target GPU it is built without use_cpu (or pass use_cpu=False)",
                UserWarning, stacklevel=2,
            )
        return self.trainer.trl_config(self.candidate, self.workload, **overrides)

    def dpo_config(self, **overrides: Any) -> Any:
        """A trl.DPOConfig (a suggestion for DPO): `trl_config()`, refused for another trainer."""
        return self._config_named("DPOConfig", "dpo_config", overrides)

    def _config_named(self, config_name: str, method: str, overrides: dict[str, Any]) -> Any:
        if self.trainer.config_class().__name__ != config_name:
            raise UsageError(f"{method}(): this suggestion is for trainer={self.trainer.name!r}; use trl_config() "
                             f"(a {self.trainer.config_class().__name__})")
        return self.trl_config(**overrides)

    def peft_config(self) -> LoraConfig | None:
        return self.trainer.peft_config(self.candidate, self.workload.model)

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

    def _emit_args(self) -> dict[str, Any]:
        return {"model_name_or_path": self.model_name_or_path, "dataset_name": self.workload.dataset.dataset_name,
                "workload": self.workload}

    def run_config(self) -> dict[str, Any]:
        """The keys of the trainer's `trl <command> --config` file."""
        return self.trainer.run_config_dict(self.candidate, **self._emit_args())

    def to_yaml(self) -> str:
        """A file for `trl <command> --config FILE`, headed by a comment: the target, the predicted peak and how it
        was obtained, and how to run it."""
        return self.trainer.to_yaml(self.candidate, header=self.yaml_header(), **self._emit_args())

    def yaml_header(self) -> str:
        m, wl = self.measurement, self.workload
        how = _SOURCE_WORDS.get(m.source.value, m.source.value)
        if m.source.value == "simulate" and wl.gpu.is_cuda:
            how += "; CUDA context and cuBLAS workspace from profiles/measurements/cuda_constants.json"
        peak = "-" if m.device_bytes is None else f"{m.device_bytes / 2**30:.2f} GiB"
        tps = "-" if m.tokens_per_second is None else f"{m.tokens_per_second:,.0f}"
        kind = "measured" if self.measured_on_target else "predicted"
        lines = [
            f"advisor {__version__}: the fastest configuration found for {wl.model.name} on {wl.gpu.name}",
            f"(limit {wl.limit_bytes / 2**30:.2f} GiB of {wl.budget_bytes / 2**30:.2f} GiB).",
            f"{kind} device peak {peak}, {tps} trained tokens/s: {how}.",
            f"data: {wl.dataset.name}" + (" (synthetic lengths)" if wl.dataset.synthetic else ""),
            f"run: trl {self.trainer.command} --config THIS_FILE"
            + ("" if wl.dataset.dataset_name or "datasets" in self.run_config() else " --dataset_name YOUR_DATASET")
            if wl.num_gpus == 1 else
            f"{wl.num_gpus} GPUs ({self.launch().chosen}), per rank: run: "
            f"{self.launch_command(trl_config_file='THIS_FILE')}",
        ]
        server = self.launch().server if wl.num_gpus > 1 else None
        if server:
            lines.append(f"first, on the server's GPUs: {server}")
        if self.candidate.requirements():  # what the target must have installed for the file to run as written
            lines.append(f"needs: pip install {' '.join(self.candidate.requirements())}")

        return "\n".join(part for line in lines for part in textwrap.wrap(line, 110, subsequent_indent="  "))

    # ---- several GPUs: the accelerate config beside the TRL config ------------------------------------------------
    def launch(self, config_file: str = "accelerate.yaml", trl_config_file: str = "trl.yaml") -> LaunchConfig:
        """The accelerate config of this pick (its `parallelism` on the workload's num_gpus / num_machines) and the
        commands that launch it (`accelerate launch --config_file ... -m trl.scripts.<command>`, `trl <command>
        --accelerate_config ...`), for this suggestion's trainer."""
        wl = self.workload
        # a trainer that sets GPUs aside (online RL's vLLM server) says how --num-gpus split; the rest train
        sp = self.trainer.gpu_split(self.candidate, self.model_name_or_path, wl.num_gpus)
        lc = accelerate_config(self.candidate, self.candidate.parallelism.parallelism,
                               sp.train_gpus if sp else wl.num_gpus, wl.num_machines, config_file=config_file,
                               trl_config_file=trl_config_file, command=self.trainer.command)
        if sp is None:
            return lc
        return dataclasses.replace(lc, command=f"{sp.train_env} {lc.command}", trl_command=f"{sp.train_env} "
                                   f"{lc.trl_command}", chosen=f"{lc.chosen}; {sp.chosen}", server=sp.server_command)

    def accelerate_yaml(self, config_file: str = "accelerate.yaml", trl_config_file: str = "trl.yaml") -> str:
        """A file for `accelerate launch --config_file FILE`, headed by what was chosen and how to launch it."""
        lc = self.launch(config_file, trl_config_file)
        m = self.measurement
        peak = "-" if m.device_bytes is None else f"{m.device_bytes / 2**30:.2f} GiB"
        head = (f"# advisor: {lc.chosen} on {self.workload.num_gpus} x {self.workload.gpu.name}, device peak {peak} "
                f"per rank\n# run: {lc.command}\n")
        return head + lc.yaml

    def launch_command(self, config_file: str = "accelerate.yaml", trl_config_file: str = "trl.yaml") -> str:
        return self.launch(config_file, trl_config_file).command

    def to_python(self) -> str:
        """A snippet that trains the pick with the trainer's TRL classes (the YAML's kwargs, LoRA, quantization)."""
        return self.trainer.to_python(self.candidate, **self._emit_args())

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
            **({"num_gpus": self.workload.num_gpus, "num_machines": self.workload.num_machines,
                "accelerate_config": self.launch().config, "launch_command": self.launch_command()}
               if self.workload.num_gpus > 1 else {}),
            "budget_bytes": self.workload.budget_bytes,
            "limit_bytes": self.workload.limit_bytes,
            "quality": self.candidate.quality_cost(self.truncated_fraction).describe(),
            "notes": notes,
            "events": [e.to_dict() for e in self.events],
            "trials": [
                {"number": t.number, "config": t.candidate.to_dict(), "measurement": t.measurement.to_dict(),
                 "why": t.reason, "cached": t.cached}
                for t in self.trials
            ],
        }

    @property
    def measured_on_target(self) -> bool:
        """Real steps on the target's kind of device, as opposed to a prediction (estimate, simulate)."""
        src = self.measurement.source.value
        cuda = self.workload.gpu.is_cuda
        return (src == "probe-cuda" and cuda) or (src == "probe-cpu" and not cuda)

    @property
    def requirements_note(self) -> str:
        """What the target must have installed; for a target that is not this machine, which of it this one lacks
        (a run here left such candidates out: advisor/packages.py)."""
        pkgs = self.candidate.requirements()
        if not pkgs:
            return ""
        absent = missing(pkgs)
        here = f" ({', '.join(absent)} not installed on this machine: the target must have it)" if absent else ""
        return f"training with this configuration needs: pip install {' '.join(pkgs)}{here}"

    @property
    def truncated_fraction(self) -> float:
        c = self.candidate  # for pairs: the worse of chosen / rejected (the Dataset protocol's truncated share)
        return self.workload.dataset.truncated_share(c.max_length, c.packing, c.packing_strategy.value)

    def report(self) -> str:
        return render_report(self)


# How each source obtains its numbers, in the words of the YAML header.
_SOURCE_WORDS = {
    "estimate": "the estimate backend (a closed-form prediction)",
    "simulate": "the simulate backend (the real TRL training step on fake tensors, every storage tracked, "
                "2 and 3 decoder layers extrapolated to full depth)",
    "probe-cuda": "the cuda backend (real SFTTrainer steps on this GPU)",
    "probe-cpu": "the cpu backend (real SFTTrainer steps on the CPU, peak from the allocator's events)",
}


def _has_accelerator() -> bool:
    """A device transformers can train on besides the CPU (CUDA, MPS, XPU...)."""
    import torch  # lazy: loads torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return bool(torch.cuda.is_available())
