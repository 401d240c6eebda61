"""What every built-in trainer shares: `TrlTrainer`, the defaults of the whole `Trainer` protocol (protocol.py), so a
trainer module declares only what differs; `PairTrainer` for preference pairs (prompt / chosen / rejected).

A trainer is one module (`sft.py`, `dpo.py`, ...), the way TRL pairs `<name>_config.py` / `<name>_trainer.py` with
`trl/scripts/<name>.py`: TRL's classes by name, its own knobs (a typed view, registered with it), its rules, its data,
what the fake step changes on the trainer class, what the estimate counts of its step, the models it takes beside the
policy. Its config object, YAML and Python snippet are written by the one writer (advisor/runconfig) from the knobs
its TRL config class has; a trainer adds only the keys no knob owns (`config_extras`, `script_kwargs`,
`model_extras`). The backends' and the search's packages (`simulator`, `search`) import this package; it never
imports them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..data import TokenizedDataset, load_dataset, load_processing_class
from ..errors import ConfigError
from ..knobs import Home, KnobView, owned_rows
from ..lengths import LengthRequest, max_length_candidates, rows_length
from ..modeling import build_model
from ..runconfig import (
    candidate_from_run_dict,
    config_keys,
    config_kwargs,
    env_vars,
    peft_config,
    quantization_config,
    run_config_dict,
    trl_fields,
    write_python,
    write_yaml,
)
from ..space import Candidate
from .preference import (
    PreferenceDataset,
    check_preference_rows,
    load_preferences,
    preference_length_report,
    preference_max_lengths,
)
from .protocol import GpuSplit, ModelInput, StepShape
from .registry import register  # noqa: F401  (a trainer module registers its trainer through here)

if TYPE_CHECKING:
    import datasets
    import torch

    from ..knobs import Knob
    from ..workload import GPUSpec, ModelSpec, Workload

_CONFIG_HOMES = (Home.TRAINING_ARGUMENTS, Home.TRAINER_CONFIG)


class TrlTrainer:
    """Every member of the Trainer protocol with its default: TRL's classes by name (`config_name`, `trainer_name`
    in `trl`), `trl <command>`'s own parser, the knobs its config class has, the config written by the one writer,
    the model and LoraConfig as SFT builds them, the prepared dataset as is, no search values or derived knobs of
    its own, every GPU training, no model besides the policy, no fake-step hooks."""

    name: str
    command: str
    config_name: str  # e.g. "SFTConfig": trl.<config_name>
    trainer_name: str  # e.g. "SFTTrainer"
    # what `<Trainer>.__init__` calls when `trl <command>` passes no processing_class (trl/trainer/*_trainer.py:
    # `AutoProcessor.from_pretrained(get_config_model_id(model.config), ...)` for SFT, DPO, GRPO, RLOO)
    processing_class_loader = "AutoProcessor"
    example_dataset = "trl-lib/Capybara"  # a hub id of this trainer's kind of data, for the YAML's placeholder
    data_hint = "your data"  # what the snippet's train.jsonl holds, in words
    timed_over_batches = False  # the simulator's step time over the sampler's batches (else the worst batch's)
    knob_view: type[KnobView] = KnobView  # its own knobs: none
    model_inputs: tuple[ModelInput, ...] = ()
    default_trials: int | None = None  # the search's own default (advisor.search.DEFAULT_TRIALS)
    batch_unit: str | None = None  # per_device_train_batch_size counts dataset rows
    # the knobs its config has that its default space holds at their default: group_by_length changes which rows
    # share a batch, a distribution the step-time model has only where the time is taken over the sampler's
    # batches (`timed_over_batches`); pad_to_multiple_of is searched only where the padding is the trainer's own
    space_holds: frozenset[str] = frozenset({"group_by_length", "pad_to_multiple_of"})
    space_adds: frozenset[str] = frozenset()  # knobs its space varies though its config lacks them (see PairTrainer)
    not_offered: frozenset[str] = frozenset()  # knobs its config has that the advisor does not offer for it

    # ---- TRL's classes --------------------------------------------------------------------------------------------
    def config_class(self) -> type:
        import trl  # lazy: loads trl

        return getattr(trl, self.config_name)

    def trainer_class(self) -> type:
        import trl  # lazy: loads trl

        return getattr(trl, self.trainer_name)

    def make_parser(self) -> Any:
        return importlib.import_module(f"trl.scripts.{self.command}").make_parser()

    def config_fields(self) -> frozenset[str]:
        """The dataclass fields of its TRL config class."""
        cached = self.__dict__.get("_config_fields")
        if cached is None:
            cached = self.__dict__["_config_fields"] = frozenset(field_names(self.config_class()))
        return cached

    # ---- knobs, rules --------------------------------------------------------------------------------------------
    def accepts(self, knob: Knob) -> bool:
        """Its config has the knob: a TrainingArguments / trainer-config knob whose field its config class has (a
        trainer's own knob: of its view too), a model_init_kwargs key where the config has model_init_kwargs, and
        every ModelConfig / LoRA / environment / accelerate knob; never one it does not offer."""
        if knob.name in self.not_offered:
            return False
        if knob.carried and knob not in self.knob_view.KNOBS:
            return False
        if knob.home in _CONFIG_HOMES:
            return knob.key in self.config_fields()
        if knob.home is Home.MODEL_INIT_KWARGS:
            return "model_init_kwargs" in self.config_fields()
        return True

    def searches(self, knob: Knob) -> bool:
        """Its default space varies the knob (its declared `search` values, or what the workload decides)."""
        return knob.name in self.space_adds or (self.accepts(knob) and knob.name not in self.space_holds)

    def knobs(self, candidate: Candidate) -> Any:
        """Its own knobs of `candidate`, typed (its TRL defaults resolved)."""
        return self.knob_view.of(candidate)

    def problems(self, candidate: Candidate, gpu: GPUSpec | None = None, model: ModelSpec | None = None
                 ) -> list[str]:
        return candidate.problems(gpu, model)

    def check_world(self, candidate: Candidate, num_gpus: int) -> list[str]:
        return []

    def canonical(self, candidate: Candidate) -> Candidate:
        return candidate

    # ---- the search space ------------------------------------------------------------------------------------------
    def search_values(self, workload: Workload, values: Mapping[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
        return {}

    def joint_dimensions(self, values: Mapping[str, tuple[Any, ...]]) -> dict[str, tuple[tuple[str, dict], ...]]:
        return {}

    def derive(self, workload: Workload, candidate: Candidate, values: Mapping[str, tuple[Any, ...]]
               ) -> Candidate | str:
        return candidate

    def derivation_notes(self, workload: Workload, candidate: Candidate, values: Mapping[str, tuple[Any, ...]]
                         ) -> list[str]:
        return []

    def training_gpus(self, candidate: Candidate, num_gpus: int) -> int:
        return num_gpus

    def world_from_launch(self, candidate: Candidate, num_gpus: int, processes: int | None = None) -> Candidate:
        return candidate

    def max_length_values(self, workload: Workload) -> tuple[int, ...]:
        """The default space's max_length rungs from its data: the smallest losing at most --max-truncation of the
        trained tokens, then larger rungs up to the longest row (advisor/lengths.py max_length_candidates)."""

        return tuple(sorted({int(v) for v in max_length_candidates(workload.dataset, workload.goals.max_truncation)}))

    def completions_per_row(self, candidate: Candidate) -> int:
        return 1

    # ---- the config and the files: the one writer (advisor/runconfig) ---------------------------------------------
    def config_kwargs(self, candidate: Candidate, workload: Workload | None = None, *,
                      measured: bool = False) -> dict[str, Any]:
        return config_kwargs(self, candidate, workload, measured=measured)

    def config_extras(self, candidate: Candidate, workload: Workload | None, *, measured: bool) -> dict[str, Any]:
        return {}

    def emit_kwargs(self, candidate: Candidate, workload: Workload | None = None) -> dict[str, Any]:
        """The config kwargs as emitted (the user's neutral keys kept): what the YAML, the snippet and
        `trl_config` carry."""
        return self.config_kwargs(candidate)

    def build_config(self, candidate: Candidate, workload: Workload | None = None, *, measured: bool = False,
                     **overrides: Any) -> Any:
        """`<Config>(**config_kwargs)`, through its constructor (so its own checks and synced names apply)."""
        kwargs = self.config_kwargs(candidate, workload, measured=measured)
        kwargs["output_dir"] = overrides.pop("output_dir", kwargs.get("output_dir", f"advisor-{self.name}"))
        kwargs.update(overrides)
        return self.config_class()(**kwargs)

    def trl_config(self, candidate: Candidate, workload: Workload | None = None, **overrides: Any) -> Any:
        """`<Config>(**emit_kwargs)` through its constructor; its `model_init_kwargs` carry the BitsAndBytesConfig
        when quantized, so `<Trainer>(model=<id>, args=config, peft_config=...)` loads the pick quantized."""

        kwargs = self.emit_kwargs(candidate, workload)
        qc = quantization_config(candidate)
        if qc is not None:
            kwargs["model_init_kwargs"] = {**kwargs.get("model_init_kwargs", {}), "quantization_config": qc}
        kwargs["output_dir"] = overrides.pop("output_dir", kwargs.get("output_dir", f"advisor-{self.name}"))
        kwargs.update(overrides)
        return self.config_class()(**kwargs)

    def script_kwargs(self, candidate: Candidate, workload: Workload | None = None) -> dict[str, Any]:
        return {}

    def script_keys(self) -> frozenset[str]:
        return frozenset()

    def model_extras(self, candidate: Candidate) -> dict[str, Any]:
        return {}

    def env(self, candidate: Candidate) -> dict[str, str]:
        return env_vars(candidate)

    def snippet_arguments(self, candidate: Candidate, workload: Workload | None
                          ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (), ()

    def run_config_dict(self, candidate: Candidate, *, model_name_or_path: str | None,
                        dataset_name: str | None = None, workload: Workload | None = None) -> dict[str, Any]:
        return run_config_dict(self, candidate, model_name_or_path=model_name_or_path, dataset_name=dataset_name,
                               workload=workload)

    def to_yaml(self, candidate: Candidate, *, model_name_or_path: str | None, dataset_name: str | None = None,
                workload: Workload | None = None, header: str | None = None) -> str:
        """The file `trl <command> --config` reads, through the one writer."""

        data = self.run_config_dict(candidate, model_name_or_path=model_name_or_path, dataset_name=dataset_name,
                                    workload=workload)
        return write_yaml(data, header=header, command=self.command, example_dataset=self.example_dataset)

    def to_python(self, candidate: Candidate, *, model_name_or_path: str, dataset_name: str | None = None,
                  workload: Workload | None = None) -> str:
        """A snippet that trains the candidate with this trainer's TRL classes, through the one writer."""

        return write_python(self, candidate, model_name_or_path=model_name_or_path, dataset_name=dataset_name,
                            workload=workload)

    def gpu_split(self, candidate: Candidate, model_name_or_path: str, num_gpus: int) -> GpuSplit | None:
        return None

    def check_run_keys(self, data: Mapping[str, Any], *, source: str = "config") -> None:
        return None

    def candidate_from_run_dict(self, data: Mapping[str, Any], *, source: str = "config") -> Candidate:
        """A `trl <command>` config read back into a Candidate: the shared keys as advisor/runconfig reads them, the
        keys of the models it takes beside the policy (their ModelInput.yaml_key) in the base as written."""
        keys = {m.yaml_key for m in self.model_inputs}
        return self.read_config({k: v for k, v in data.items() if k not in keys},
                                {k: v for k, v in data.items() if k in keys}, source=source)

    def read_config(self, shared: Mapping[str, Any], own: Mapping[str, Any], *, source: str) -> Candidate:
        """The shared keys read as advisor/runconfig reads them, the output_dir the writer gives this trainer left out,
        and `own` (the trainer's own keys) in the base as written."""

        cand = candidate_from_run_dict(dict(shared), source=source)
        base = cand.base.as_dict()
        if base.get("output_dir") == f"advisor-{self.name}":
            base.pop("output_dir")
        base.update(own)
        return cand.replace(base=base) if base != cand.base.as_dict() else cand

    # ---- the model ---------------------------------------------------------------------------------------------------
    def build_model(self, spec: ModelSpec, candidate: Candidate, device: str = "cpu") -> Any:
        return build_model(spec, candidate, device=device)

    def peft_config(self, candidate: Candidate, spec: ModelSpec | None = None) -> Any:
        return peft_config(candidate, spec)

    def trainer_kwargs(self, workload: Workload, candidate: Candidate, models: Mapping[str, tuple[Any, Any]]
                       ) -> dict[str, Any]:
        return {}

    def input_dtype(self, candidate: Candidate, role: str) -> Any:
        """A model given beside the policy is loaded in the policy's dtype (ModelConfig's `dtype`)."""
        return candidate.weights_dtype

    # ---- data: chat rows (advisor.data.TokenizedDataset), as SFTTrainer prepares them --------------------------------
    def load_processing_class(self, path: str) -> Any:
        """The tokenizer this trainer's `trl <command>` tokenizes with: `transformers.<processing_class_loader>` on
        `path`, as `<Trainer>.__init__` calls it (advisor/data.py `load_processing_class`)."""

        return load_processing_class(self.processing_class_loader, path)

    def load_dataset(self, spec: str | None, model: ModelSpec, tokenizer: str | None = None, *,
                     sample: int | None = None, seed: int = 0, progress: bool = False) -> Any:
        return load_dataset(spec, model, tokenizer=tokenizer, sample=sample, seed=seed, progress=progress,
                            trainer=self)

    def check_dataset(self, workload: Workload) -> None:
        if not isinstance(workload.dataset, TokenizedDataset):
            raise ConfigError([f"dataset={workload.dataset.name}: {workload.dataset.unit} given to the {self.name} "
                               "trainer, which reads chat rows (prompt/completion, messages or text); give such data, "
                               "or a trainer that reads these"], context=self.name)

    def dataset_from_rows(self, name: str, source: str, rows: tuple[dict, ...], *, dataset_name: str | None = None,
                          completion_only_loss: bool | None = None) -> Any:
        return TokenizedDataset(name=name, source=source, rows=rows, completion_only_loss=completion_only_loss,
                                dataset_name=dataset_name)

    def kept_rows(self, workload: Workload, candidate: Candidate) -> Any:
        """Indices of the rows TRL keeps: with a completion-only loss, rows whose trained tokens all fall past
        `max_length` are dropped as fully masked (SFTTrainer's "Dropping fully masked examples")."""

        data = workload.dataset
        if not data.completion_only_loss or not candidate.max_length:
            return np.arange(len(data.rows))
        return np.flatnonzero(data.trained_after_truncation(candidate.max_length) > 0)

    def worst_rows(self, workload: Workload, candidate: Candidate) -> list[dict]:
        """Enough of the longest rows to fill one micro-batch (packed rows when packing), of the rows TRL keeps."""

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

    def train_dataset(self, workload: Workload, rows: list | None = None) -> datasets.Dataset:
        return workload.dataset.to_hf(rows)

    # ---- the step: what the estimate counts, the fake step's hooks -------------------------------------------------
    def step_shape(self, candidate: Candidate) -> StepShape:
        return StepShape()

    def real_overrides(self) -> dict[str, Callable]:
        return {}

    def fake_overrides(self) -> dict[str, Callable]:
        return {}

    def construction(self, spec: ModelSpec, candidate: Candidate) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def extra_models(self, trainer: Any) -> list:
        return []

    def before_train(self, trainer: Any) -> list:
        return []

    def shadows_integers(self) -> bool:
        return False

    # ---- the notes and the report ----------------------------------------------------------------------------------
    def notes(self, candidate: Candidate, workload: Workload | None = None) -> list[str]:
        return []

    def length_report(self, data: Any, request: LengthRequest) -> Any:
        """`advisor lengths` on its data (chat rows): percentiles, truncation, padding per micro-batch, packing."""
        return rows_length(data, request)

    def report_rows(self, candidate: Candidate) -> list[list[str]]:
        """The summary's rows of this trainer: which TRL trainer runs, then its own knobs (their labels and values
        from their declarations in the knob registry)."""

        return [["trainer", f"{self.name} ({self.trainer_name})"], *owned_rows(candidate, self)]


class PairTrainer(TrlTrainer):
    """A trainer of preference pairs (prompt / chosen / rejected; preference.PreferenceDataset): DPO, reward. Its
    config is not SFTConfig, so SFT-only keys in its YAML are refused by name (`config_label` names the file)."""

    config_label: str  # "DPO" in "remove it from the DPO config"
    example_dataset = "trl-lib/ultrafeedback_binarized"
    data_hint = "your prompt/chosen/rejected pairs"
    # packing_strategy: inactive where packing is held off (canonical() resets it), yet a dimension of the pair
    # trainers' studies since they were added: kept, so their studies' parameters, and so their trials, stay
    space_adds = frozenset({"packing_strategy"})

    def max_length_values(self, workload: Workload) -> tuple[int, ...]:
        return preference_max_lengths(workload.dataset, workload.goals.max_truncation)

    def load_dataset(self, spec: str | None, model: ModelSpec, tokenizer: str | None = None, *,
                     sample: int | None = None, seed: int = 0, progress: bool = False) -> Any:
        return load_preferences(spec, model, tokenizer, trainer=self.name, sample=sample, seed=seed)

    def check_dataset(self, workload: Workload) -> None:
        data = workload.dataset
        if not isinstance(data, PreferenceDataset):
            check_preference_rows(list(data.rows[:1]), data.name, self.name)

    def dataset_from_rows(self, name: str, source: str, rows: tuple[dict, ...], *, dataset_name: str | None = None,
                          completion_only_loss: bool | None = None) -> Any:
        return PreferenceDataset(name=name, source=source, rows=rows, dataset_name=dataset_name)

    def kept_rows(self, workload: Workload, candidate: Candidate) -> Any:
        return every_row(workload)

    def length_report(self, data: Any, request: LengthRequest) -> Any:
        """The lengths of prompt + chosen and prompt + rejected, and for each max_length the chosen and the
        rejected tokens it cuts off (apart) and the pairs it drops."""
        request.refuse_completion_length()
        return preference_length_report(data, max_lengths=request.max_lengths, max_truncation=request.max_truncation)

    def check_run_keys(self, data: Mapping[str, Any], *, source: str = "config") -> None:
        """An SFT-only key in this trainer's config is refused by name (`trl <command>` would pass it on silently)."""
        bad = sorted(k for k in data if k in sft_only_keys(self))
        if bad:
            raise ConfigError([f"{k}={data[k]!r}: an SFT-only key ({self.config_name} has no {k!r}); remove it from "
                               f"the {self.config_label} config" for k in bad], context=source)

    def shadows_integers(self) -> bool:
        return True  # the pairs' losses index by data-dependent masks


def every_row(workload: Workload) -> Any:
    """Indices (numpy) of every row of the workload's data: what TRL keeps of pairs and prompts."""

    return np.arange(len(workload.dataset.rows))


def field_names(cls: type) -> set[str]:
    """The dataclass fields of a TRL config class."""

    return {f.name for f in dataclasses.fields(cls)}


def sft_only_keys(trainer: TrlTrainer) -> set[str]:
    """The keys the shared reader knows as SFTConfig's that `trainer`'s config lacks (refused by name in its file)."""

    return set(config_keys()) - set(trainer.config_fields())


def own_keys(trainer: TrlTrainer) -> set[str]:
    """The keys of `trainer`'s config the shared reader does not know (its own: DPO's loss, GRPO's generation)."""

    return set(trainer.config_fields()) - set(trl_fields())
