"""The inputs layer: names resolved to a Workload, and the one reference type that names a workload.

Above the value types (`workload.py`: Workload, ModelSpec, GPUSpec, Goals; `data.py`: TokenizedDataset), which
import none of the resolvers: `profiles.py` resolves GPU and model names, `data.py` loads and tokenizes a
dataset, and `build_workload` here puts them together. `WorkloadRef` is what rebuilds a workload later, as the
user named it: a baseline stores one, a study's spec stores one (flat, `to_spec`/`from_spec`), a worker rebuilds
the study's workload from it, and a probe job records it next to the values the child rebuilds from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ._files import check_names
from .data import Dataset
from .errors import ConfigError, UsageError
from .profiles import decide_offline, detect_gpu, resolve_gpu, resolve_model
from .trainers import get_trainer, model_input, model_inputs, trainer_of
from .workload import DEFAULT_TRAINER, Goals, Method, ModelSpec, Workload, check_budget, check_world

DEFAULT_GPU = "H100-80GB"


def build_workload(
    model: str,
    gpu: str | None = None,
    dataset: str | None = None,
    tokenizer: str | None = None,
    sample: int | None = None,
    goals: Goals | None = None,
    seed: int = 0,
    num_gpus: int = 1,
    num_machines: int = 1,
    trainer: str = DEFAULT_TRAINER,
    **models: str | None,
) -> Workload:
    """Resolve names to a Workload. With no `gpu`, the local GPU through NVML, else DEFAULT_GPU (noted). `models`:
    the models the trainer takes beside the policy, each by its declared parameter (advisor.trainers ModelInput,
    e.g. online RL's `reward_model`), a hub id or a local directory; one the trainer takes none of is refused."""
    declared = {m.param: m for m in model_inputs()}
    unknown = sorted(set(models) - set(declared))
    if unknown:
        raise UsageError(f"build_workload(): unknown parameter(s) {', '.join(unknown)}; the models a trainer takes "
                         f"are {', '.join(declared) or 'none'}")
    given = {declared[p]: v for p, v in models.items() if v is not None}
    check_names({"--model": model, "--dataset": dataset, "--tokenizer": tokenizer,
                 **{m.flag: v for m, v in given.items()}})
    notes: list[str] = []
    offline_note = decide_offline(model, dataset, tokenizer)
    if offline_note:
        notes.append(offline_note)
    spec = resolve_model(model)
    local = detect_gpu()
    if gpu is None:
        target = local if local is not None else resolve_gpu(DEFAULT_GPU)
        if local is None:
            notes.append(f"no --gpu given and no local GPU found: assuming {target.name}")
        else:
            notes.append(f"no --gpu given: using the local {target.name}")
    else:
        target = resolve_gpu(gpu)
    check_budget(goals or Goals(), target)  # before the dataset is read and tokenized
    check_world(num_gpus, num_machines)
    # the trainer reads its own data (chat rows for SFT, preference pairs for DPO / Reward), refusing others by
    # their columns; `sample` draws the same seeded sample whatever the trainer
    data = get_trainer(trainer).load_dataset(dataset, spec, tokenizer, sample=sample, seed=seed)
    context = context_note(spec, data)
    if context:
        notes.append(context)
    out = Workload(model=spec, gpu=target, dataset=data, goals=goals or Goals(), notes=tuple(notes),
                   num_gpus=num_gpus, num_machines=num_machines, trainer=trainer,
                   models={m.role: _resolved(m.flag, v) for m, v in given.items()},  # their configs: resident, counted
                   local_gpu=local is not None and target.is_cuda and target.name == local.name)
    trainer_of(out)  # a model the trainer takes none of: refused, naming the trainers that take one
    return out


def _resolved(flag: str, name: str) -> ModelSpec:
    """A model given beside the policy (its ModelInput's `flag`), resolved as a model is; its errors name `flag`
    (resolve_model's name --model, the policy's flag)."""
    try:
        return resolve_model(name)
    except UsageError as exc:
        raise type(exc)(str(exc).replace("--model ", f"{flag} ", 1)) from None


def context_note(model: ModelSpec, data: Dataset) -> str | None:
    """Say when rows are longer than the model's context: max_length cannot keep them whole."""
    ctx = model.max_position_embeddings
    if ctx is None or not len(data.lengths):
        return None
    over = int((data.lengths > ctx).sum())
    if not over:
        return None
    if data.unit != "rows":  # pairs (prompts): the longest sequence of each (prompt + chosen, prompt + rejected)
        return (f"{over} of {len(data.lengths)} {data.unit} have a sequence longer than {model.name}'s context "
                f"(max_position_embeddings {ctx}; the longest has {int(data.lengths.max())} tokens): max_length "
                f"stays <= {ctx}, so those sequences are truncated")
    return (f"{over} of {len(data.lengths)} rows are longer than {model.name}'s context (max_position_embeddings "
            f"{ctx}; the longest has {int(data.lengths.max())} tokens): max_length stays <= {ctx}, so those rows "
            "are truncated (or split by bfd_split packing)")


def goals_to_dict(goals: Goals) -> dict[str, Any]:
    """Goals as JSON (enums by value): what a baseline, a study spec and a probe job store."""
    return {k: (v.value if isinstance(v, Enum) else v) for k, v in dataclasses.asdict(goals).items()}


def goals_from_dict(data: Mapping[str, Any] | None) -> Goals:
    data = dict(data or {})
    return Goals(**{**data, "method": Method(data.get("method", Method.AUTO))})


@dataclass(frozen=True)
class WorkloadRef:
    """What rebuilds the workload: the names as given to `--model`, `--gpu`, `--dataset`, plus the goals.

    `model` is None for a study made from a Workload object (nothing to rebuild it from); `gpu` None means the
    local GPU (or the default target). `fingerprint` is the built workload's, to tell when it has changed.
    """

    model: str | None
    gpu: str | None
    dataset: str | None = None
    tokenizer: str | None = None
    sample: int | None = None
    goals: Goals = field(default_factory=Goals)
    fingerprint: str = ""
    num_gpus: int = 1  # a baseline or spec written without them: one GPU
    num_machines: int = 1
    trainer: str = DEFAULT_TRAINER  # a baseline or spec written before trainers existed is the default's
    models: tuple[tuple[str, str], ...] = ()  # the models beside the policy, (role, name as given)

    @classmethod
    def of(cls, workload: Workload, **given: Any) -> WorkloadRef:
        """From a built workload; `given` (model=, gpu=, dataset=, ...) overrides what is derived."""
        data = workload.dataset
        derived: dict[str, Any] = {
            "model": workload.model.name,  # the id, or the path as the user gave it
            "gpu": workload.gpu.name,
            "dataset": None if data.source == "synthetic" else (data.dataset_name or data.name),
            # a sampled dataset is rebuilt with the same seeded sample
            "sample": len(data.rows) if data.population is not None else None,
            "trainer": workload.trainer,
            "models": tuple((role, spec.name) for role, spec in workload.models),
        }
        derived.update({k: v for k, v in given.items() if v is not None})
        return cls(goals=workload.goals, fingerprint=workload.fingerprint(), num_gpus=workload.num_gpus,
                   num_machines=workload.num_machines, **derived)

    def build(self, goals: Goals | None = None) -> Workload:
        """Resolve the names again (the goals are the ref's unless given)."""
        if not self.model:
            raise ConfigError("the workload was given as a Workload object, not by name: pass workload=... "
                              "to rebuild it", context="workload")
        models = {model_input(role).param: name for role, name in self.models}
        return build_workload(self.model, gpu=self.gpu, dataset=self.dataset, tokenizer=self.tokenizer,
                              sample=self.sample, goals=goals or self.goals, num_gpus=self.num_gpus,
                              num_machines=self.num_machines, trainer=self.trainer, **models)

    def to_dict(self) -> dict[str, Any]:
        """The baseline file's `workload` object (each model beside the policy under its role)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "models"}
        data["goals"] = goals_to_dict(self.goals)
        data.update(self.models)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkloadRef:
        """From `to_dict`'s object; KeyError without a model or gpu key, ValueError/ConfigError on bad goals."""
        return cls(model=str(data["model"]), gpu=str(data["gpu"]), dataset=data.get("dataset"),
                   tokenizer=data.get("tokenizer"), sample=data.get("sample"),
                   goals=goals_from_dict(data.get("goals")), fingerprint=str(data.get("fingerprint", "")),
                   num_gpus=int(data.get("num_gpus", 1)), num_machines=int(data.get("num_machines", 1)),
                   trainer=str(data.get("trainer") or DEFAULT_TRAINER), models=_models_of(data))

    def to_spec(self) -> dict[str, Any]:
        """The flat keys a study's spec stores (model, gpu, dataset, tokenizer, sample, goals,
        workload_fingerprint, trainer, each model beside the policy under its role)."""
        return {"model": self.model, "gpu": self.gpu, "dataset": self.dataset, "tokenizer": self.tokenizer,
                "sample": self.sample, "goals": goals_to_dict(self.goals), "workload_fingerprint": self.fingerprint,
                "trainer": self.trainer, **dict(self.models),
                **({"num_gpus": self.num_gpus, "num_machines": self.num_machines}
                   if (self.num_gpus, self.num_machines) != (1, 1) else {})}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> WorkloadRef:
        """From a study's spec (what `to_spec` wrote, or the same keys written by an earlier version)."""
        return cls(model=spec.get("model"), gpu=spec.get("gpu"), dataset=spec.get("dataset"),
                   tokenizer=spec.get("tokenizer"), sample=spec.get("sample"),
                   goals=goals_from_dict(spec.get("goals")), fingerprint=str(spec.get("workload_fingerprint", "")),
                   num_gpus=int(spec.get("num_gpus") or 1), num_machines=int(spec.get("num_machines") or 1),
                   trainer=str(spec.get("trainer") or DEFAULT_TRAINER), models=_models_of(spec))


def _models_of(data: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The models beside the policy a baseline's or a spec's keys name: each declared role's key (advisor.trainers
    ModelInput), where it is set."""
    return tuple((m.role, str(data[m.role])) for m in model_inputs() if data.get(m.role))
