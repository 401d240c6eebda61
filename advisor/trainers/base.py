"""The trainer seam: what one TRL trainer declares, and the registry by name.

A trainer is one module (`sft.py`, `dpo.py`, `reward.py`), the way TRL pairs `<name>_config.py` /
`<name>_trainer.py` with `trl/scripts/<name>.py`. Everything the rest of the advisor does differently per trainer
goes through the `Trainer` protocol: which TRL classes run, how a Candidate becomes their config, which rows make
the worst batch and how the collator builds it, what the fake step must change on the trainer class (the hooks
`advisor/_sim/fake_step.py` applies), which models besides the policy the step runs, and which `trl <command>`
parses the emitted YAML. The private packages (`_sim`, `_search`) import this; this never imports them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..errors import ConfigError

if TYPE_CHECKING:
    import datasets
    import torch

    from ..space import Candidate
    from ..workload import GPUSpec, ModelSpec, Workload


@runtime_checkable
class Trainer(Protocol):
    """One TRL trainer as the advisor measures and emits it."""

    name: str  # the registry name: "sft", "dpo", "reward"
    command: str  # `trl <command> --config FILE` parses what `run_config_dict` emits

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
                        dataset_name: str | None = None) -> dict[str, Any]: ...  # the `trl <command>` YAML's keys

    def check_run_keys(self, data: Mapping[str, Any], *, source: str = "config") -> None: ...  # keys of others

    # ---- the model --------------------------------------------------------------------------------------------
    def build_model(self, spec: ModelSpec, candidate: Candidate, device: str = "cpu") -> Any: ...  # random weights

    def peft_config(self, candidate: Candidate, spec: ModelSpec | None = None) -> Any: ...  # LoraConfig or None

    # ---- data ------------------------------------------------------------------------------------------------
    def load_dataset(self, spec: str | None, model: ModelSpec, tokenizer: str | None = None) -> Any: ...
    # None: the built-in synthetic set; else a local file / directory / hub id, prepared as this trainer does

    def check_dataset(self, workload: Workload) -> None: ...  # the workload's data is what this trainer reads

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

    def notes(self, candidate: Candidate) -> list[str]: ...  # what the Measurement's notes say of this trainer


_REGISTRY: dict[str, Trainer] = {}


def register(trainer: Trainer) -> Trainer:
    """Add a trainer under its `name` (a module registers its own at import)."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"{trainer!r} does not implement advisor.trainers.Trainer")
    _REGISTRY[trainer.name] = trainer
    return trainer


def names() -> tuple[str, ...]:
    _load_builtin()
    return tuple(_REGISTRY)


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


_BUILTIN = ("sft", "dpo", "reward")


def _load_builtin() -> None:
    import importlib

    for name in _BUILTIN:  # each module registers its trainer at import
        importlib.import_module(f"{__package__}.{name}")


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
    config_name: str  # e.g. "SFTConfig": trl.<config_name>
    trainer_name: str  # e.g. "SFTTrainer"

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

    # ---- the model ---------------------------------------------------------------------------------------------------
    def build_model(self, spec: ModelSpec, candidate: Candidate, device: str = "cpu") -> Any:
        from ..modeling import build_model

        return build_model(spec, candidate, device=device)

    def peft_config(self, candidate: Candidate, spec: ModelSpec | None = None) -> Any:
        from ..emit import peft_config

        return peft_config(candidate, spec)

    # ---- data ------------------------------------------------------------------------------------------------------
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

    def notes(self, candidate: Candidate) -> list[str]:
        return []


class PairTrainer(TrlTrainer):
    """A trainer of preference pairs (prompt / chosen / rejected; preference.PreferenceDataset): DPO, reward. Its
    config is not SFTConfig, so SFT-only keys in its YAML are refused by name (`config_label` names the file)."""

    config_label: str  # "DPO" in "remove it from the DPO config"

    def load_dataset(self, spec: str | None, model: ModelSpec, tokenizer: str | None = None) -> Any:
        from .preference import load_preferences

        return load_preferences(spec, model, tokenizer, trainer=self.name)

    def check_dataset(self, workload: Workload) -> None:
        from .preference import PreferenceDataset, check_preference_rows

        data = workload.dataset
        if not isinstance(data, PreferenceDataset):
            check_preference_rows(list(data.rows[:1]), data.name, self.name)

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


def python_snippet(trainer: Trainer, candidate: Candidate, *, model_name_or_path: str,
                   dataset_name: str | None = None, workload: Workload | None = None) -> str:
    """A snippet that trains `candidate` with `trainer`'s TRL classes (DPOConfig + DPOTrainer, RewardConfig +
    RewardTrainer): every memory-relevant field explicit, the LoraConfig when LoRA, the env vars first."""
    from .._emit import load_line, target_keys
    from ..emit import env_vars, peft_config

    cfg, cls = trainer.config_class().__name__, trainer.trainer_class().__name__
    kw = trainer.config_kwargs(candidate)
    if workload is not None:  # on its target, over the measured data (issue 25)
        kw.update(target_keys(workload.gpu))
    output_dir = kw.pop("output_dir", f"advisor-{trainer.name}")
    lines = ["import os", ""]
    for k, v in env_vars(candidate).items():
        lines.append(f"os.environ.setdefault({k!r}, {v!r})  # before torch initialises CUDA")
    lines += ["", "from datasets import load_dataset", f"from trl import {cfg}, {cls}"]
    if candidate.use_lora:
        lines.append("from peft import LoraConfig")
    load = load_line(workload, dataset_name, "your prompt/chosen/rejected pairs")
    lines += ["", f"dataset = {load}", f"config = {cfg}(", f"    output_dir={output_dir!r},"]
    lines += [f"    {k}={v!r}," for k, v in kw.items()]
    lines.append(")")
    args = [f"    model={model_name_or_path!r},", "    args=config,", "    train_dataset=dataset,"]
    if candidate.use_lora:
        lc = peft_config(candidate)
        lines.append(f"peft_config = LoraConfig(r={lc.r}, lora_alpha={lc.lora_alpha}, "
                     f"lora_dropout={lc.lora_dropout!r}, target_modules={sorted(lc.target_modules)!r}, "
                     f"bias=\"none\", task_type={lc.task_type!r})")
        args.append("    peft_config=peft_config,")
    lines += [f"trainer = {cls}(", *args, ")", "trainer.train()"]
    return "\n".join(lines) + "\n"


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
                   output_dir: str, model_extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The keys `trl <trainer.command> --config FILE` accepts for a trainer whose config is not SFTConfig:
    ScriptArguments and ModelConfig keys from emit's SFT file, the trainer's own config kwargs (model_init_kwargs
    without what ModelConfig already carries: dtype, attn_implementation), `model_extra` on the ModelConfig side
    and `env:`."""
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
    return out
