"""What the user wants to train, on what, under which goals."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .errors import ConfigError, UsageError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from .data import Dataset

# the trainer a workload is for unless it names another (--trainer's default; advisor/trainers registers it), and the
# one trainer whose workloads' fingerprints name none (they were made before trainers existed)
DEFAULT_TRAINER = "sft"


class Method(str, Enum):
    """A training method; AUTO (a goal only) escalates full -> lora -> qlora until something fits."""

    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"
    AUTO = "auto"


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """A model architecture, resolved from the hub, a local directory/config.json or profiles/models/."""

    name: str
    config: Mapping[str, Any]
    source: Literal["hub", "local", "profile"]
    local_dir: Path | None = None

    def hf_config(self) -> PretrainedConfig:
        from transformers import AutoConfig  # lazy: loads transformers

        data = dict(self.config)
        model_type = data.pop("model_type")
        return AutoConfig.for_model(model_type, **data)

    def text_value(self, key: str, default: Any = None) -> Any:
        """A value of the text config (nested `text_config` for multimodal configs)."""
        cfg = self.config.get("text_config") or self.config
        return cfg.get(key, self.config.get(key, default))

    @property
    def num_layers(self) -> int:
        return int(self.text_value("num_hidden_layers"))

    @property
    def hidden_size(self) -> int:
        return int(self.text_value("hidden_size"))

    @property
    def vocab_size(self) -> int:
        return int(self.text_value("vocab_size"))

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.text_value("tie_word_embeddings", False))

    @property
    def max_position_embeddings(self) -> int | None:
        """The longest sequence the model was built for (config.json's `max_position_embeddings`), if it says."""
        v = self.text_value("max_position_embeddings")
        return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    def fingerprint(self) -> str:
        return fingerprint(dict(self.config))


@dataclass(frozen=True)
class GPUSpec:
    """A target device: a profile in profiles/gpus/, or the host CPU."""

    name: str
    kind: Literal["cuda", "cpu"]
    memory_bytes: int
    bf16_tflops: float
    fp16_tflops: float
    fp32_tflops: float
    memory_bandwidth_gbs: float
    supports_bf16: bool
    supports_flash_attention: bool
    compute_capability: str | None = None
    aliases: tuple[str, ...] = ()
    description: str = ""

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, flag: str = "--memory-budget") -> int:
    """'40GB', '40GiB', '81559MiB', '4e10' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise UsageError(f"{flag} {text!r}: not a size; write e.g. 40GB, 40GiB or 42949672960")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"{flag} {text!r}: must be positive")
    return value


def parse_fraction(text: str, flag: str) -> float:
    """'5%' or '0.05' -> 0.05."""
    s = str(text).strip()
    try:
        return float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: not a fraction; write e.g. 5% or 0.05") from None


@dataclass(frozen=True)
class GoalField:
    """One goal as `Goals` declares it."""

    name: str  # the Goals field
    param: str  # the suggest() parameter
    flag: str  # the CLI flag
    kind: str  # int, size, fraction, choice, switch
    help: str
    default: Any
    choices: tuple[str, ...] = ()


def _goal(default: Any, flag: str, param: str, kind: str, help: str) -> Any:
    """A goal's one declaration: its default, its CLI flag, its `suggest()` parameter, how the CLI parses it
    (int, size, fraction, choice, switch) and its help. `suggest()` and `advisor suggest` derive theirs from it."""
    return field(default=default, metadata={"flag": flag, "param": param, "kind": kind, "help": help})


@dataclass(frozen=True)
class Goals:
    """The user's constraints. `tokens_per_step` is the fixed effective batch in trained tokens."""

    tokens_per_step: int | None = _goal(None, "--tokens-per-step", "tokens_per_step", "int",
                                        "trained tokens per optimizer step (the effective batch; default: TRL's "
                                        "8 rows x mean trained tokens per row)")
    memory_budget_bytes: int | None = _goal(None, "--memory-budget", "memory_budget", "size",
                                            "memory the training may use (default: the card's capacity), e.g. 40GB")
    headroom: float = _goal(0.05, "--headroom", "headroom", "fraction",
                            "keep the device peak under budget x (1 - headroom)")
    method: Method = _goal(Method.AUTO, "--method", "method", "choice",
                           "auto: full fine-tuning if anything fits, else LoRA, else QLoRA")
    max_truncation: float = _goal(0.01, "--max-truncation", "max_truncation", "fraction",
                                  "share of trained tokens truncation may drop")
    allow_low_precision_weights: bool = _goal(False, "--allow-low-precision-weights", "allow_low_precision_weights",
                                              "switch", "allow pure bf16/fp16 weights")
    allow_wrapped: bool = _goal(False, "--allow-wrapped", "allow_wrapped", "switch",
                                "allow 'wrapped' packing (mixes examples)")

    @classmethod
    def declared(cls) -> tuple[GoalField, ...]:
        """Every goal as declared: what `suggest()`'s goal parameters and the CLI's goal flags are built from."""
        out = []
        for f in dataclasses.fields(cls):
            md = f.metadata
            choices = tuple(m.value for m in Method) if f.name == "method" else ()
            out.append(GoalField(f.name, md["param"], md["flag"], md["kind"], md["help"], f.default, choices))
        return tuple(out)

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method(self.method))
        problems = []
        if not 0.0 <= self.headroom < 1.0:
            problems.append(f"--headroom {self.headroom}: must be in [0, 1), e.g. 0.05 for 5%")
        if not 0.0 <= self.max_truncation <= 1.0:
            problems.append(f"--max-truncation {self.max_truncation}: must be in [0, 1], e.g. 0.01 for 1%")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            problems.append(f"--memory-budget {self.memory_budget_bytes}: must be positive, e.g. 40GB")
        if self.tokens_per_step is not None and self.tokens_per_step <= 0:
            problems.append(f"--tokens-per-step {self.tokens_per_step}: must be a positive number of tokens")
        if problems:
            raise ConfigError(problems)


@dataclass(frozen=True, eq=False)
class Workload:
    model: ModelSpec
    gpu: GPUSpec
    dataset: Dataset
    goals: Goals = field(default_factory=Goals)
    notes: tuple[str, ...] = ()
    # N GPUs of the named kind over M machines; the budget applies to each rank
    num_gpus: int = 1
    num_machines: int = 1
    # the TRL trainer that runs (a registered name, advisor.trainers); the dataset is that trainer's data
    trainer: str = DEFAULT_TRAINER
    # the models the trainer takes beside the policy, by the role its declaration gives (advisor.trainers
    # ModelInput: online RL's "reward_model" from --reward-model), each resident on the device, so counted; a
    # mapping given is kept as (role, spec) pairs in role order. advisor.trainers.trainer_of checks them against
    # the trainer's declarations
    models: tuple[tuple[str, ModelSpec], ...] = ()
    # the target GPU is this machine's own (build_workload: detected through NVML, or a --gpu naming it): a run has
    # the packages installed here, so the search leaves out candidates needing one that is missing (`runs_here`)
    local_gpu: bool = False

    def __post_init__(self) -> None:
        check_budget(self.goals, self.gpu)
        check_world(self.num_gpus, self.num_machines)
        models = self.models.items() if isinstance(self.models, Mapping) else self.models
        object.__setattr__(self, "models", tuple(sorted((str(r), m) for r, m in models if m is not None)))

    def model_of(self, role: str) -> ModelSpec | None:
        """The model given for `role` (a trainer's ModelInput), or None."""
        return dict(self.models).get(role)

    @property
    def runs_here(self) -> bool:
        """The target is this machine (its own GPU, or the host CPU): a run can use only what is installed here."""
        return self.local_gpu or self.gpu.kind == "cpu"

    @property
    def budget_bytes(self) -> int:
        """The memory the training may use on the target (the card's capacity unless the user said less)."""
        return self.goals.memory_budget_bytes or self.gpu.memory_bytes

    @property
    def limit_bytes(self) -> int:
        """The device peak that a candidate must stay under: budget x (1 - headroom)."""
        return int(self.budget_bytes * (1.0 - self.goals.headroom))

    def fingerprint(self) -> str:
        """Identifies model, data, target and goals (not the backend or library versions)."""
        return fingerprint(
            {
                "model": self.model.fingerprint(),
                "dataset": self.dataset.fingerprint,
                "gpu": self.gpu.name,
                "goals": {k: str(v) for k, v in self.goals.__dict__.items()},
                **({"world": [self.num_gpus, self.num_machines]} if (self.num_gpus, self.num_machines) != (1, 1)
                   else {}),
                **({"trainer": self.trainer} if self.trainer != DEFAULT_TRAINER else {}),
                **{role: spec.fingerprint() for role, spec in self.models},
            }
        )


def fingerprint(obj: Any) -> str:
    """A short, stable hash of JSON-able data (keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_budget(goals: Goals, gpu: GPUSpec) -> None:
    """A --memory-budget above the target's memory is refused (ConfigError), not capped: it is a typo or the wrong
    --gpu, and capping it silently would answer a question the user did not ask."""
    budget, capacity = goals.memory_budget_bytes, gpu.memory_bytes
    if budget is not None and budget > capacity:
        what = "this host's memory" if gpu.kind == "cpu" else f"{gpu.name}'s memory"
        raise ConfigError(
            f"--memory-budget {_size(budget)}: more than {what} ({_size(capacity)}); omit --memory-budget to "
            f"use the whole {gpu.name}, give at most {_size(capacity)}, or name a larger --gpu"
        )


def check_world(num_gpus: object, num_machines: object) -> None:
    """--num-gpus N (at least 1) over --num-machines M (at least 1, the same number of GPUs on each)."""
    problems = []
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        problems.append(f"--num-gpus {num_gpus!r} (num_gpus): must be a whole number of GPUs, at least 1; give "
                        "--num-gpus 1 for one GPU")
    if isinstance(num_machines, bool) or not isinstance(num_machines, int) or num_machines < 1:
        problems.append(f"--num-machines {num_machines!r} (num_machines): must be a whole number, at least 1")
    elif not problems and num_gpus % num_machines:
        problems.append(f"--num-machines {num_machines} (num_machines): does not divide --num-gpus {num_gpus}; "
                        "give the same number of GPUs on every machine (N a multiple of M)")
    if problems:
        raise ConfigError(problems, context="workload")


def _size(n: int) -> str:
    """Bytes as the user writes them: 24GB (22.49 GiB)."""
    return f"{n / 1e9:.4g}GB ({n / 2**30:.2f} GiB)"

