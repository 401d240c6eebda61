"""The trainer seam's interface: everything the backends, the search and the writer may ask of one TRL trainer.

`Trainer` declares every member; `base.TrlTrainer` gives each a default, so a trainer module declares only what
differs. Nothing outside advisor/trainers/ probes a trainer for an optional member: what a trainer does not do, its
default says (no search values of its own, no joint dimension, every GPU trains, no model besides the policy...).
The value types a trainer declares with live here too: `ModelInput` (a model it takes beside the policy, e.g. online
RL's reward model: one declaration from which the CLI flag, the suggest() parameter, the Workload's entry, the
fingerprint, the probe's job and the YAML key derive) and `StepShape` (what the estimate counts of its step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import datasets
    import torch

    from ..knobs import Knob, KnobView
    from ..lengths import LengthRequest
    from ..space import Candidate, WeightsDtype
    from ..workload import GPUSpec, ModelSpec, Workload


class Head(str, Enum):
    """What a model given beside the policy is built as (advisor/modeling.py `input_model`)."""

    SCORE = "score"  # a one-label sequence classifier (AutoModelForSequenceClassification, num_labels=1)
    LM = "lm"  # a causal LM (AutoModelForCausalLM)


@dataclass(frozen=True)
class ModelInput:
    """A model a trainer takes beside the policy, declared once by the trainer: the rest derives from it. `role` keys
    it in the Workload (`Workload.models`), the fingerprint, the study's spec, a baseline and the probe's job; `param`
    is the build_workload() / suggest() parameter, `flag` the CLI's, `yaml_key` what `trl <command>` reads it from.
    It is resident on the device beside the policy (the backends count it, built as `head`, in the trainer's
    `input_dtype`). `required`: the trainer runs only with it (a workload without it is refused naming the flag);
    `same_vocabulary`: it must have the policy's vocabulary (one of another is refused naming both sizes)."""

    role: str  # "reward_model"
    flag: str  # "--reward-model"
    yaml_key: str  # "reward_model_name_or_path"
    help: str
    head: Head = Head.SCORE
    param: str = ""  # the Python parameter; "" means the role
    required: bool = False
    same_vocabulary: bool = False
    init_kwargs_key: str | None = None  # its config's from_pretrained kwargs (a run given it built sets None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "head", Head(self.head))
        if not self.param:
            object.__setattr__(self, "param", self.role)


@dataclass(frozen=True)
class StepShape:
    """What the estimate counts of a trainer's step (advisor/estimator.py), declared by the trainer per candidate.

    `generates`: the step generates completions (online RL: the estimate's and the simulator's online paths);
    otherwise an offline step over its data's sequences (`Dataset.sequences`): `sequences_per_row` sequences a row
    (preference pairs: chosen and rejected, so a micro-batch of B pairs runs 2B), the LM head's logits or a
    one-label score (`lm_head`), a reference copy of the weights resident (`reference_copy`), a reference's
    no-grad forward in the step (`reference_forward`), or its log-probs computed before training instead
    (`reference_precomputed`: neither). `no_grad_batches`: further batches of the micro-batch's shape a step runs
    under no_grad (KTO's KL batch: the same prompts, the completions rotated by one), through the policy before its
    trained forward and through the reference beside the micro-batch; `reference_held`: the reference's no-grad
    forwards run while the policy's activations are held (their working memory counted at the end of the forward;
    otherwise only their time). A step that generates may train against a model input's distribution
    (`distills_from`: its role; the loss a divergence over the vocabulary, that model's forward on every training
    micro-batch) and run its training passes outside accelerate's autocast (`train_autocast` False: in the weights'
    dtype whatever bf16 / fp16 say)."""

    generates: bool = False
    sequences_per_row: int = 1
    lm_head: bool = True
    reference_copy: bool = False
    reference_forward: bool = False
    reference_precomputed: bool = False
    no_grad_batches: int = 0
    reference_held: bool = False
    distills_from: str | None = None
    train_autocast: bool = True

    @property
    def plain(self) -> bool:
        """The step over the rows as they are (SFT's): nothing added, nothing left out."""
        return self == StepShape()


@dataclass(frozen=True)
class GpuSplit:
    """How --num-gpus split when a trainer sets GPUs aside (online RL's vLLM server): the training GPUs
    (accelerate's num_processes, `train_env` before the launch) and the command on the others."""

    train_gpus: int
    train_env: str  # CUDA_VISIBLE_DEVICES=0,1,...
    server_command: str  # CUDA_VISIBLE_DEVICES=... trl vllm-serve --model ... --tensor-parallel-size ...
    chosen: str


@runtime_checkable
class Trainer(Protocol):
    """One TRL trainer as the advisor measures and emits it (defaults: advisor/trainers/base.py TrlTrainer)."""

    name: str  # the registry name
    command: str  # `trl <command> --config FILE` parses what `run_config_dict` emits
    config_name: str  # trl.<config_name>
    trainer_name: str  # trl.<trainer_name>
    processing_class_loader: str  # transformers.<loader> loads its tokenizer, as `<Trainer>.__init__` does
    timed_over_batches: bool  # the simulator's step time is the step-time model over the sampler's batches
    knob_view: type[KnobView]  # its own knobs, typed (advisor/knobs.py knob_view); registered with it
    model_inputs: tuple[ModelInput, ...]  # the models it takes beside the policy
    batch_unit: str | None  # what per_device_train_batch_size counts when not a dataset row ("completions")
    default_trials: int | None  # the search's trials when none are given (None: advisor.search.DEFAULT_TRIALS)

    # ---- TRL's classes --------------------------------------------------------------------------------------
    def config_class(self) -> type: ...

    def trainer_class(self) -> type: ...

    def make_parser(self) -> Any: ...  # the TrlParser `trl <command>` builds (trl/scripts/<command>.py)

    def config_fields(self) -> frozenset[str]: ...  # the dataclass fields of its TRL config class

    # ---- knobs, rules ------------------------------------------------------------------------------------------
    def accepts(self, knob: Knob) -> bool: ...  # its config has the knob's field (its own: its view's)

    def searches(self, knob: Knob) -> bool: ...  # its default space varies the knob (else holds its default)

    def knobs(self, candidate: Candidate) -> KnobView: ...  # its own knobs of `candidate`, typed

    def problems(self, candidate: Candidate, gpu: GPUSpec | None = None, model: ModelSpec | None = None
                 ) -> list[str]: ...  # every rule of this trainer the candidate breaks, with the fix

    def check_world(self, candidate: Candidate, num_gpus: int) -> list[str]: ...  # the rules needing --num-gpus

    def canonical(self, candidate: Candidate) -> Candidate: ...  # its own knobs without effect at their defaults

    # ---- the search space (advisor/search) -------------------------------------------------------------------
    def search_values(self, workload: Workload, values: Mapping[str, tuple[Any, ...]]
                      ) -> dict[str, tuple[Any, ...]]: ...  # its knobs' values the target decides

    def joint_dimensions(self, values: Mapping[str, tuple[Any, ...]]
                         ) -> dict[str, tuple[tuple[str, dict], ...]]: ...  # one categorical setting several knobs

    def derive(self, workload: Workload, candidate: Candidate, values: Mapping[str, tuple[Any, ...]]
               ) -> Candidate | str: ...  # a knob derived, not searched (or why the candidate is not admitted)

    def derivation_notes(self, workload: Workload, candidate: Candidate, values: Mapping[str, tuple[Any, ...]]
                         ) -> list[str]: ...

    def training_gpus(self, candidate: Candidate, num_gpus: int) -> int: ...  # the ranks that train

    def world_from_launch(self, candidate: Candidate, num_gpus: int, processes: int | None = None
                          ) -> Candidate: ...  # a run read back from its files: the knobs its launch carries

    def max_length_values(self, workload: Workload) -> tuple[int, ...]: ...  # max_length rungs from its data

    def completions_per_row(self, candidate: Candidate) -> int: ...  # micro-batch rows per dataset row

    # ---- the config and the files: one writer (advisor/runconfig) ------------------------------------------------
    def config_kwargs(self, candidate: Candidate, workload: Workload | None = None, *,
                      measured: bool = False) -> dict[str, Any]: ...  # every memory-relevant field, explicitly

    def config_extras(self, candidate: Candidate, workload: Workload | None, *, measured: bool
                      ) -> dict[str, Any]: ...  # the config keys no knob owns (written after the knobs')

    def emit_kwargs(self, candidate: Candidate, workload: Workload | None = None
                    ) -> dict[str, Any]: ...  # the config kwargs as emitted: the YAML's, the snippet's

    def build_config(self, candidate: Candidate, workload: Workload | None = None, *, measured: bool = False,
                     **overrides: Any) -> Any: ...

    def trl_config(self, candidate: Candidate, workload: Workload | None = None, **overrides: Any) -> Any: ...

    def script_kwargs(self, candidate: Candidate, workload: Workload | None = None
                      ) -> dict[str, Any]: ...  # `trl <command>`'s own script arguments (trl grpo's reward_funcs)

    def script_keys(self) -> frozenset[str]: ...  # the keys of those arguments its YAML's reader accepts

    def model_extras(self, candidate: Candidate) -> dict[str, Any]: ...  # ModelConfig keys it writes itself

    def env(self, candidate: Candidate) -> dict[str, str]: ...  # the YAML's `env:` block

    def snippet_arguments(self, candidate: Candidate, workload: Workload | None
                          ) -> tuple[tuple[str, ...], tuple[str, ...]]: ...  # `<Trainer>(...)` args, imports

    def run_config_dict(self, candidate: Candidate, *, model_name_or_path: str | None,
                        dataset_name: str | None = None, workload: Workload | None = None
                        ) -> dict[str, Any]: ...  # the `trl <command>` YAML's keys

    def to_yaml(self, candidate: Candidate, *, model_name_or_path: str | None, dataset_name: str | None = None,
                workload: Workload | None = None, header: str | None = None) -> str: ...

    def to_python(self, candidate: Candidate, *, model_name_or_path: str, dataset_name: str | None = None,
                  workload: Workload | None = None) -> str: ...

    def gpu_split(self, candidate: Candidate, model_name_or_path: str, num_gpus: int
                  ) -> GpuSplit | None: ...  # GPUs set aside for another process (None: every GPU trains)

    def check_run_keys(self, data: Mapping[str, Any], *, source: str = "config") -> None: ...  # others' keys

    def candidate_from_run_dict(self, data: Mapping[str, Any], *, source: str = "config"
                                ) -> Candidate: ...  # a `trl <command>` config read back

    # ---- the model ------------------------------------------------------------------------------------------
    def build_model(self, spec: ModelSpec, candidate: Candidate, device: str = "cpu") -> Any: ...

    def peft_config(self, candidate: Candidate, spec: ModelSpec | None = None) -> Any: ...

    def trainer_kwargs(self, workload: Workload, candidate: Candidate, models: Mapping[str, tuple[Any, Any]]
                       ) -> dict[str, Any]: ...  # `<Trainer>(...)` beyond the shared arguments, its models given

    def input_dtype(self, candidate: Candidate, role: str) -> WeightsDtype: ...  # a model input's dtype as loaded

    # ---- data ------------------------------------------------------------------------------------------------
    example_dataset: str  # a hub id of this trainer's kind of data (the YAML's placeholder)
    data_hint: str  # what the snippet's train.jsonl holds, in words

    def load_processing_class(self, path: str) -> Any: ...

    def load_dataset(self, spec: str | None, model: ModelSpec, tokenizer: str | None = None, *,
                     sample: int | None = None, seed: int = 0, progress: bool = False) -> Any: ...

    def check_dataset(self, workload: Workload) -> None: ...

    def dataset_from_rows(self, name: str, source: str, rows: tuple[dict, ...], *, dataset_name: str | None = None,
                          completion_only_loss: bool | None = None) -> Any: ...

    def kept_rows(self, workload: Workload, candidate: Candidate) -> Any: ...

    def worst_rows(self, workload: Workload, candidate: Candidate) -> list: ...

    def train_dataset(self, workload: Workload, rows: list | None = None) -> datasets.Dataset: ...

    def worst_batch(self, trainer: Any, batch_size: int) -> dict[str, torch.Tensor]: ...

    def labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    # ---- the step: what the estimate counts, the fake step's hooks (advisor/simulator/fake_step.py)
    # -------------------
    def step_shape(self, candidate: Candidate) -> StepShape: ...

    def real_overrides(self) -> dict[str, Callable]: ...

    def fake_overrides(self) -> dict[str, Callable]: ...

    def construction(self, spec: ModelSpec, candidate: Candidate) -> contextlib.AbstractContextManager: ...

    def extra_models(self, trainer: Any) -> list[torch.nn.Module]: ...  # run besides trainer.model (reference)

    def before_train(self, trainer: Any) -> list[tuple[dict, Callable[[dict], None]]]: ...

    def shadows_integers(self) -> bool: ...

    # ---- what the notes and the report say ---------------------------------------------------------------------
    def notes(self, candidate: Candidate, workload: Workload | None = None) -> list[str]: ...

    def report_rows(self, candidate: Candidate) -> list[list[str]]: ...

    def length_report(self, data: Any, request: LengthRequest) -> Any: ...  # `advisor lengths`: to_dict(), text()
