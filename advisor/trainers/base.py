"""The trainer seam: what one TRL trainer declares, and the registry by name.

A trainer is one module (`sft.py`, `dpo.py`, `reward.py`), the way TRL pairs `<name>_config.py` /
`<name>_trainer.py` with `trl/scripts/<name>.py`. Everything the rest of the advisor does differently per trainer
goes through the `Trainer` protocol: which TRL classes run, how a Candidate becomes their config, which rows make
the worst batch and how the collator builds it, what the fake step must change on the trainer class (the hooks
`advisor/_sim/fake_step.py` applies), which models besides the policy the step runs, which `trl <command>`
parses the emitted YAML, and the step's phases (`phases.py`: what each holds on the device, and what it reserves
outside PyTorch's allocator). Its config object, YAML and Python snippet are written by one writer
(`TrlTrainer.trl_config` / `to_yaml` / `to_python` over advisor/_emit/writer.py), quantization included. Nothing
outside this package asks a trainer's name: the rest of the advisor calls the protocol. The private packages
(`_sim`, `_search`) import this; this never imports them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..errors import ConfigError
from .phases import ClosedForm

if TYPE_CHECKING:
    import datasets
    import torch

    from ..space import Candidate
    from ..workload import GPUSpec, ModelSpec, Workload
    from .phases import Phase


@runtime_checkable
class Trainer(Protocol):
    """One TRL trainer as the advisor measures and emits it."""

    name: str  # the registry name: "sft", "dpo", "reward"
    command: str  # `trl <command> --config FILE` parses what `run_config_dict` emits
    timed_over_batches: bool  # the simulator's step time is the step-time model over the sampler's batches (SFT);
    # else the worst batch's step

    # ---- TRL's classes --------------------------------------------------------------------------------------
    def config_class(self) -> type: ...  # trl.SFTConfig, trl.DPOConfig, ...

    def trainer_class(self) -> type: ...  # trl.SFTTrainer, trl.DPOTrainer, ...

    def make_parser(self) -> Any: ...  # the TrlParser `trl <command>` builds (trl/scripts/<command>.py)

    # ---- knobs, rules, config --------------------------------------------------------------------------------
    def defaults(self) -> Candidate: ...  # what `<Config>()` gives with TRL 1.16

    def problems(self, candidate: Candidate, gpu: GPUSpec | None = None, model: ModelSpec | None = None
                 ) -> list[str]: ...  # every rule of this trainer the candidate breaks, with the fix

    def config_kwargs(self, candidate: Candidate, workload: Workload | None = None, *,
                      measured: bool = False) -> dict[str, Any]: ...  # every memory-relevant field, explicitly

    def build_config(self, candidate: Candidate, workload: Workload | None = None, *, measured: bool = False,
                     **overrides: Any) -> Any: ...

    def run_config_dict(self, candidate: Candidate, *, model_name_or_path: str | None,
                        dataset_name: str | None = None, workload: Workload | None = None
                        ) -> dict[str, Any]: ...  # the `trl <command>` YAML's keys

    # ---- emission: one writer (advisor/_emit/writer.py) for every trainer's config object, YAML and snippet ----
    def emit_kwargs(self, candidate: Candidate, workload: Workload | None = None
                    ) -> dict[str, Any]: ...  # the config kwargs as emitted: the YAML's, the snippet's, trl_config's

    def trl_config(self, candidate: Candidate, workload: Workload | None = None, **overrides: Any
                   ) -> Any: ...  # `<Config>(**emit_kwargs)`, its model_init_kwargs with the quantization

    def to_yaml(self, candidate: Candidate, *, model_name_or_path: str | None, dataset_name: str | None = None,
                workload: Workload | None = None, header: str | None = None) -> str: ...  # `trl <command>`'s file

    def to_python(self, candidate: Candidate, *, model_name_or_path: str, dataset_name: str | None = None,
                  workload: Workload | None = None) -> str: ...  # `<Config>` + `<Trainer>` + LoRA + 4-bit

    def check_run_keys(self, data: Mapping[str, Any], *, source: str = "config") -> None: ...  # keys of others

    def candidate_from_run_dict(self, data: Mapping[str, Any], *, source: str = "config"
                                ) -> Candidate: ...  # a `trl <command>` config read back

    # ---- the model --------------------------------------------------------------------------------------------
    def build_model(self, spec: ModelSpec, candidate: Candidate, device: str = "cpu") -> Any: ...  # random weights

    def peft_config(self, candidate: Candidate, spec: ModelSpec | None = None) -> Any: ...  # LoraConfig or None

    # ---- data ------------------------------------------------------------------------------------------------
    def load_processing_class(self, path: str) -> Any: ...  # the tokenizer `trl <command>` trains with, loaded
    # from `path` (the model's directory or hub id, or --tokenizer) as `<Trainer>.__init__` loads it when its
    # processing_class is None

    def load_dataset(self, spec: str | None, model: ModelSpec, tokenizer: str | None = None, *,
                     sample: int | None = None, seed: int = 0, progress: bool = False) -> Any: ...
    # None: the built-in synthetic set; else a local file / directory / hub id, prepared as this trainer does;
    # `sample`: a seeded random sample of that many rows (pairs)

    def check_dataset(self, workload: Workload) -> None: ...  # the workload's data is what this trainer reads

    def dataset_from_rows(self, name: str, source: str, rows: tuple[dict, ...], *, dataset_name: str | None = None,
                          completion_only_loss: bool | None = None) -> Any: ...
    # the dataset of prepared rows a probe's job carries (the child rebuilds its workload from them)

    def kept_rows(self, workload: Workload, candidate: Candidate) -> Any: ...  # indices of the rows TRL trains on

    def worst_rows(self, workload: Workload, candidate: Candidate) -> list[dict]: ...  # the longest micro-batch

    def train_dataset(self, workload: Workload, rows: list[dict] | None = None) -> datasets.Dataset: ...

    def worst_batch(self, trainer: Any, batch_size: int) -> dict[str, torch.Tensor]: ...  # TRL's own collator

    def labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...  # per position, -100 where untrained

    # ---- the fake step's hooks (advisor/_sim/fake_step.py applies them) ---------------------------------------
    def real_overrides(self) -> dict[str, Callable]: ...  # methods every advisor-built trainer class replaces
    # (the probe's and the fake run's: e.g. DPO's dataset preparation of rows it prepared already)

    def fake_overrides(self) -> dict[str, Callable]: ...  # methods the fake trainer class replaces

    def construction(self, spec: ModelSpec, candidate: Candidate) -> contextlib.AbstractContextManager: ...

    def extra_models(self, trainer: Any) -> list[torch.nn.Module]: ...  # run besides trainer.model (reference)

    def before_train(self, trainer: Any) -> list[tuple[dict, Callable[[dict], None]]]: ...
    # passes the real run makes before train() (DPO's precompute): each a real batch, built outside the fake mode,
    # and what runs on it once it is lifted to fake tensors

    def shadows_integers(self) -> bool: ...  # the step indexes by data-dependent masks (_sim/shadow.py)

    closed_form: ClosedForm  # how the estimate counts this trainer's step (advisor/estimator.py maps the kind)

    def notes(self, candidate: Candidate) -> list[str]: ...  # what the Measurement's notes say of this trainer

    # ---- the step as phases (advisor/trainers/phases.py) -----------------------------------------------------
    def phases(self, candidate: Candidate) -> tuple[Phase, ...]: ...
    # SFT, DPO, Reward: one training phase; online RL: generate, score, train. What a phase reserves outside
    # PyTorch's allocator the estimate and the simulator add to device bytes (Category.OUTSIDE_ALLOCATOR).

    def outside_allocator_bytes(self, candidate: Candidate, card_bytes: int) -> int: ...

    # ---- what the report says of this trainer's pick ------------------------------------------------------------
    def report_rows(self, candidate: Candidate) -> list[list[str]]: ...  # [label, value] rows of the summary


_REGISTRY: dict[str, Trainer] = {}


def register(trainer: Trainer) -> Trainer:
    """Add a trainer under its `name` (a module registers its own at import). A name already taken by another
    trainer is refused (ConfigError naming it): one declaration per trainer, as `trl <command>` has one script."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"{trainer!r} does not implement advisor.trainers.Trainer")
    name = getattr(trainer, "name", None)
    if not name or not isinstance(name, str):
        raise ConfigError([f"name={name!r}: a trainer is registered under a non-empty name"], context="trainer")
    taken = _REGISTRY.get(name)
    if taken is not None and taken is not trainer:
        raise ConfigError([f"name={name!r}: already registered ({type(taken).__module__}."
                           f"{type(taken).__qualname__}); give the new trainer another name"], context="trainer")
    _REGISTRY[name] = trainer
    return trainer


def names() -> tuple[str, ...]:
    """Every registered trainer's name, the built-ins first (their modules are imported)."""
    _load_builtin()
    return tuple(_REGISTRY)


def choices() -> tuple[str, ...]:
    """The names `--trainer` accepts: the built-ins' (declared in `_BUILTIN`, not imported: the CLI's parser stays
    as cheap to build) and any other registered so far."""
    return (*_BUILTIN, *(n for n in _REGISTRY if n not in _BUILTIN))


def get_trainer(name: str | Trainer = "sft") -> Trainer:
    """The registered trainer `name` ("sft", "dpo", "reward"); a Trainer is returned as is."""
    if not isinstance(name, str):
        return name
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError([f"trainer={name!r}: not a trainer the advisor knows; use one of {', '.join(_REGISTRY)}"],
                          context="trainer") from None


def training_gpus(trainer: Trainer, candidate: Candidate, num_gpus: int) -> int:
    """The ranks of `num_gpus` that train `candidate` (accelerate's num_processes): all of them, unless the trainer
    sets some aside for it (`training_gpus`: online RL's `trl vllm-serve` GPUs in server mode)."""
    own = getattr(trainer, "training_gpus", None)
    return own(candidate, num_gpus) if own is not None else num_gpus


def training_workload(workload: Workload, candidate: Candidate) -> Workload:
    """The workload a backend measures `candidate` on: the training side of the run. Where its trainer sets GPUs of
    --num-gpus aside (`training_gpus`), the rest train, and the per-rank peak, the sharding and the trained tokens
    per second count those ranks only. The search (advisor/_search/evaluator.py) and `advisor simulate|probe|
    baseline --config` measure through this one rule."""
    import dataclasses

    n = training_gpus(get_trainer(workload.trainer), candidate, workload.num_gpus)
    if n == workload.num_gpus:
        return workload
    machines = workload.num_machines if n % workload.num_machines == 0 else 1
    return dataclasses.replace(workload, num_gpus=n, num_machines=machines)


def launched_candidate(trainer: Trainer, candidate: Candidate, num_gpus: int, processes: int | None = None
                       ) -> Candidate:
    """`candidate` read back from a run's files, launched on `num_gpus` GPUs (`processes`: the accelerate config's
    num_processes, when that file is given): the knobs a trainer keeps outside the TRL file read back from the
    launch (`world_from_launch`: online RL's server GPUs), then the accelerate config checked to launch the ranks
    that train. ConfigError naming the flags and the fix."""
    own = getattr(trainer, "world_from_launch", None)
    cand = own(candidate, num_gpus, processes) if own is not None else candidate
    world = getattr(trainer, "check_world", None)
    problems = list(world(cand, num_gpus)) if world is not None else []
    train = training_gpus(trainer, cand, num_gpus)
    if processes is not None and processes != train:
        problems.append(f"num_processes {processes} in the accelerate config (--accelerate-config) with --num-gpus "
                        f"{num_gpus}: this run trains on {train} rank(s); give --num-gpus {processes} (the "
                        "suggestion's), or the accelerate config written with this TRL file")
    if problems:
        raise ConfigError(problems, context="num_gpus")
    return cand


# the built-ins' modules, each registering its trainer
_BUILTIN = ("sft", "dpo", "reward", "grpo", "rloo", "distillation")
DEFAULT = _BUILTIN[0]  # the trainer a workload is for unless it names another (--trainer's default)


_LOADED: list[bool] = []


def _load_builtin() -> None:
    if _LOADED:  # the estimate asks for its trainer on every call
        return
    import importlib

    for name in _BUILTIN:  # each module registers its trainer at import
        importlib.import_module(f"{__package__}.{name}")
    _LOADED.append(True)


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield


class TrlTrainer:
    """What the built-in trainers share, so a trainer module declares only what differs: TRL's classes by name
    (`config_name`, `trainer_name` in `trl`), `trl <command>`'s own parser, TRL 1.16's memory defaults, the config
    built through its constructor from `config_kwargs`, the model and LoraConfig as SFT builds them, the prepared
    dataset as is, and no fake-step hooks."""

    name: str
    command: str
    timed_over_batches = False
    config_name: str  # e.g. "SFTConfig": trl.<config_name>
    trainer_name: str  # e.g. "SFTTrainer"
    # what `<Trainer>.__init__` calls when `trl <command>` passes no processing_class (trl/trainer/*_trainer.py:
    # `AutoProcessor.from_pretrained(get_config_model_id(model.config), ...)` for SFT, DPO, GRPO, RLOO)
    processing_class_loader = "AutoProcessor"
    example_dataset: str  # a hub id of this trainer's kind of data, for the YAML's dataset_name placeholder
    data_hint: str  # what the snippet's train.jsonl holds, in words

    # ---- TRL's classes --------------------------------------------------------------------------------------------
    def config_class(self) -> type:
        import trl

        return getattr(trl, self.config_name)

    def trainer_class(self) -> type:
        import trl

        return getattr(trl, self.trainer_name)

    def make_parser(self) -> Any:
        import importlib

        return importlib.import_module(f"trl.scripts.{self.command}").make_parser()

    # ---- knobs, config ---------------------------------------------------------------------------------------------
    def defaults(self) -> Candidate:
        from ..space import Candidate

        return Candidate.trl_defaults()  # every built-in config's memory defaults equal SFTConfig's (1024, bf16, ...)

    def build_config(self, candidate: Candidate, workload: Workload | None = None, *, measured: bool = False,
                     **overrides: Any) -> Any:
        """`<Config>(**config_kwargs)`, through its constructor (so its own checks and synced names apply)."""
        kwargs = self.config_kwargs(candidate, workload, measured=measured)
        kwargs["output_dir"] = overrides.pop("output_dir", kwargs.get("output_dir", f"advisor-{self.name}"))
        kwargs.update(overrides)
        return self.config_class()(**kwargs)

    def candidate_from_run_dict(self, data: Mapping[str, Any], *, source: str = "config") -> Candidate:
        """A `trl <command>` config read back into a Candidate: the keys as advisor.emit reads SFT's."""
        from ..emit import candidate_from_run_dict

        return candidate_from_run_dict(data, source=source)

    # ---- emission: the one writer (advisor/_emit/writer.py) -------------------------------------------------------
    def emit_kwargs(self, candidate: Candidate, workload: Workload | None = None) -> dict[str, Any]:
        """The config kwargs as emitted (the user's neutral keys kept): what the YAML, the snippet and
        `trl_config` carry."""
        return self.config_kwargs(candidate)

    def trl_config(self, candidate: Candidate, workload: Workload | None = None, **overrides: Any) -> Any:
        """`<Config>(**emit_kwargs)` through its constructor; its `model_init_kwargs` carry the BitsAndBytesConfig
        when quantized, so `<Trainer>(model=<id>, args=config, peft_config=...)` loads the pick quantized."""
        from ..emit import quantization_config

        kwargs = self.emit_kwargs(candidate, workload)
        qc = quantization_config(candidate)
        if qc is not None:
            kwargs["model_init_kwargs"] = {**kwargs.get("model_init_kwargs", {}), "quantization_config": qc}
        kwargs["output_dir"] = overrides.pop("output_dir", kwargs.get("output_dir", f"advisor-{self.name}"))
        kwargs.update(overrides)
        return self.config_class()(**kwargs)

    def to_yaml(self, candidate: Candidate, *, model_name_or_path: str | None, dataset_name: str | None = None,
                workload: Workload | None = None, header: str | None = None) -> str:
        """The file `trl <command> --config` reads, through the one writer."""
        from ..emit import write_yaml

        data = self.run_config_dict(candidate, model_name_or_path=model_name_or_path, dataset_name=dataset_name,
                                    workload=workload)
        return write_yaml(data, header=header, command=self.command, example_dataset=self.example_dataset)

    def to_python(self, candidate: Candidate, *, model_name_or_path: str, dataset_name: str | None = None,
                  workload: Workload | None = None) -> str:
        """A snippet that trains the candidate with this trainer's TRL classes, through the one writer: the same
        config kwargs as the YAML, this trainer's LoraConfig, the BitsAndBytesConfig when quantized."""
        from ..emit import write_python

        return write_python(candidate, config_name=self.config_name, trainer_name=self.trainer_name,
                            kwargs=self.emit_kwargs(candidate, workload), peft=self.peft_config(candidate),
                            model_name_or_path=model_name_or_path, dataset_name=dataset_name,
                            default_output_dir=f"advisor-{self.name}", data_hint=self.data_hint, workload=workload)

    # ---- the model ---------------------------------------------------------------------------------------------------
    def build_model(self, spec: ModelSpec, candidate: Candidate, device: str = "cpu") -> Any:
        from ..modeling import build_model

        return build_model(spec, candidate, device=device)

    def peft_config(self, candidate: Candidate, spec: ModelSpec | None = None) -> Any:
        from ..emit import peft_config

        return peft_config(candidate, spec)

    # ---- data ------------------------------------------------------------------------------------------------------
    def load_processing_class(self, path: str) -> Any:
        """The tokenizer this trainer's `trl <command>` tokenizes with: `transformers.<processing_class_loader>`
        on `path`, as `<Trainer>.__init__` calls it (no remote code: `trust_remote_code` is TRL's default False).
        Not AutoTokenizer's class when it differs: transformers 5 picks the class from a `config.json` beside
        the tokenizer (Qwen2Tokenizer for qwen2, rebuilt from the saved vocabulary), whatever class the tokenizer
        was saved as, and TRL trains on what that class gives. A processor's text side is its `tokenizer`, as the
        trainers take it (`self._tokenizer = processing_class.tokenizer`)."""
        import transformers

        loaded = getattr(transformers, self.processing_class_loader).from_pretrained(path, trust_remote_code=False)
        return loaded.tokenizer if isinstance(loaded, transformers.ProcessorMixin) else loaded

    def kept_rows(self, workload: Workload, candidate: Candidate) -> Any:
        """Indices (numpy) of the dataset's rows TRL's preparation keeps for this candidate: all of them."""
        import numpy as np

        return np.arange(len(workload.dataset.rows))

    def train_dataset(self, workload: Workload, rows: list[dict] | None = None) -> datasets.Dataset:
        return workload.dataset.to_hf(rows)

    # ---- the fake step's hooks: none ------------------------------------------------------------------------------
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

    closed_form = ClosedForm.ROWS

    def notes(self, candidate: Candidate) -> list[str]:
        return []

    # ---- the step as phases ------------------------------------------------------------------------------------------
    def phases(self, candidate: Candidate) -> tuple[Phase, ...]:
        """One training phase: the policy, its gradients and optimizer state, the activations."""
        from .phases import training_phase

        return (training_phase(),)

    def outside_allocator_bytes(self, candidate: Candidate, card_bytes: int) -> int:
        """What the step's phases reserve outside PyTorch's allocator on a card of `card_bytes` (0 for SFT, DPO
        and Reward; colocated vLLM's share for online RL)."""
        from .phases import outside_allocator_bytes

        return outside_allocator_bytes(self.phases(candidate), card_bytes)

    # ---- the report --------------------------------------------------------------------------------------------------
    def report_rows(self, candidate: Candidate) -> list[list[str]]:
        """The summary's rows of this trainer: which TRL trainer runs, then its own knobs (their labels and values
        from their declarations in the knob registry)."""
        from ..knobs import owned_rows

        return [["trainer", f"{self.name} ({self.trainer_name})"], *owned_rows(candidate, self.name)]


class PairTrainer(TrlTrainer):
    """A trainer of preference pairs (prompt / chosen / rejected; preference.PreferenceDataset): DPO, reward. Its
    config is not SFTConfig, so SFT-only keys in its YAML are refused by name (`config_label` names the file)."""

    config_label: str  # "DPO" in "remove it from the DPO config"
    example_dataset = "trl-lib/ultrafeedback_binarized"
    data_hint = "your prompt/chosen/rejected pairs"

    def load_dataset(self, spec: str | None, model: ModelSpec, tokenizer: str | None = None, *,
                     sample: int | None = None, seed: int = 0, progress: bool = False) -> Any:
        from .preference import load_preferences

        return load_preferences(spec, model, tokenizer, trainer=self.name, sample=sample, seed=seed)

    def check_dataset(self, workload: Workload) -> None:
        from .preference import PreferenceDataset, check_preference_rows

        data = workload.dataset
        if not isinstance(data, PreferenceDataset):
            check_preference_rows(list(data.rows[:1]), data.name, self.name)

    def dataset_from_rows(self, name: str, source: str, rows: tuple[dict, ...], *, dataset_name: str | None = None,
                          completion_only_loss: bool | None = None) -> Any:
        from .preference import PreferenceDataset

        return PreferenceDataset(name=name, source=source, rows=rows, dataset_name=dataset_name)

    def check_run_keys(self, data: Mapping[str, Any], *, source: str = "config") -> None:
        """An SFT-only key in this trainer's config is refused by name (`trl <command>` would pass it on silently)."""
        from trl import SFTConfig

        sft_only = field_names(SFTConfig) - field_names(self.config_class())
        bad = sorted(k for k in data if k in sft_only)
        if bad:
            raise ConfigError([f"{k}={data[k]!r}: an SFT-only key ({self.config_name} has no {k!r}); remove it from "
                               f"the {self.config_label} config" for k in bad], context=source)

    def shadows_integers(self) -> bool:
        return True  # the pairs' losses index by data-dependent masks


def field_names(cls: type) -> set[str]:
    """The dataclass fields of a TRL config class."""
    import dataclasses

    return {f.name for f in dataclasses.fields(cls)}


def base_config_keys(candidate: Candidate, config_fields: set[str], *, measured: bool,
                     own: set[str] | frozenset[str] = frozenset(),
                     skip: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """The base's keys that are fields of the trainer's config (`config_fields`), as the user wrote them: not `env`,
    the checkpointing extras or `model_init_kwargs` (the knobs write those), not `skip`. `measured`: only those that
    reach a measured run, the trainer's `own` keys (its loss, which the simulator runs as written) and TRL's
    simulated keys (emit.KEY_USES)."""
    from ..emit import KEY_USES, KeyUse
    from ..space import CHECKPOINT_EXTRA

    out: dict[str, Any] = {}
    for key, value in candidate.base.as_dict().items():
        if key in skip or key in ("env", CHECKPOINT_EXTRA, "model_init_kwargs") or key not in config_fields:
            continue
        if measured and not (key in own or KEY_USES.get(key) is KeyUse.SIMULATED):
            continue
        out[key] = value
    return out


def run_config_for(trainer: Any, candidate: Candidate, *, model_name_or_path: str | None, dataset_name: str | None,
                   output_dir: str, model_extra: Mapping[str, Any] | None = None,
                   workload: Workload | None = None) -> dict[str, Any]:
    """The keys `trl <trainer.command> --config FILE` accepts for a trainer whose config is not SFTConfig:
    ScriptArguments and ModelConfig keys from emit's SFT file, the trainer's own config kwargs (model_init_kwargs
    without what ModelConfig already carries: dtype, attn_implementation), `model_extra` on the ModelConfig side
    and `env:`; with `workload`, the target's device keys and the measured data (as SFT's file carries them)."""
    from .._emit import add_workload_keys
    from ..emit import run_config_dict, trl_fields

    shared = run_config_dict(candidate, model_name_or_path=model_name_or_path, dataset_name=dataset_name)
    owners = trl_fields()
    config_fields = field_names(trainer.config_class())
    head = {k: v for k, v in shared.items() if k in ("model_name_or_path", "dataset_name")}
    script = {k: v for k, v in shared.items() if k not in head and k in owners and k not in config_fields
              and owners[k][0].__name__ in ("ScriptArguments", "DatasetMixtureConfig")}
    model = {k: v for k, v in shared.items() if k in owners and owners[k][0].__name__ == "ModelConfig"}
    model.update(model_extra or {})
    kw = trainer.config_kwargs(candidate)
    init = kw.pop("model_init_kwargs")  # trl <command> builds it from ModelConfig's dtype / attn_implementation
    out = {**head, **script, "output_dir": candidate.base.get("output_dir", output_dir), **kw}
    extra_init = {k: v for k, v in init.items() if k not in ("dtype", "attn_implementation")}
    if extra_init:
        out["model_init_kwargs"] = extra_init
    out.update(model)
    if "env" in shared:
        out["env"] = shared["env"]
    return add_workload_keys(out, workload)
