"""From a Candidate to what TRL takes: SFTConfig kwargs, LoraConfig, model_init_kwargs, a `trl sft` YAML.

Every memory-relevant SFTConfig field is set explicitly: TRL's defaults change between versions (activation
checkpointing is on by default in TRL's configs, bf16 too). `load_run_config` reads such a YAML back.

A run config as the user wrote it is a Candidate (the knobs) over a `RunBase` (every other key the user set).
`KEY_USES` classifies each key `trl sft --config` accepts: a knob; simulated (passed as written to the SFTConfig /
LoraConfig of every measured run); neutral (no effect on memory: kept in what is emitted, not given to measured
runs, where hub, reporting and output options would act); or refused unless at a harmless value (it changes
memory in a way that is not simulated: a ConfigError names the key and the fix).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .errors import ConfigError, UsageError
from .knobs import KNOBS, TRL_DEFAULT, Home, Kind, Knob, knobs_in, yaml_keys
from .space import CHECKPOINT_EXTRA, UNSUPPORTED_OPTIMIZERS, Candidate, Optimizer, Precision, Quantization

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig
    from trl import SFTConfig

    from .workload import ModelSpec, Workload

ALLOC_CONF = "expandable_segments:True"
_ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


# ---- what each key of a run config is ------------------------------------------------------------------------

class KeyUse(str, Enum):
    KNOB = "knob"  # read into a Candidate field; emitted from it
    SIMULATED = "simulated"  # kept in the base and passed as written to every measured run
    NEUTRAL = "neutral"  # no effect on memory: kept in the base and in what is emitted, not in measured runs
    REFUSED = "refused"  # changes memory and is not simulated: refused unless at a harmless value (_HARMLESS)


# The keys each knob is read from (advisor/knobs.py), the dicts that hold the kwargs knobs, and what RunConfig carries
_KNOBS = (
    *(key for k in KNOBS for key in yaml_keys(k)),
    "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs", "model_init_kwargs",
    "model_name_or_path", "dataset_name",
)
_SIMULATED = (
    # the loss path and the optimizer step (TRL: another loss for label smoothing / dft; clipping's temporaries)
    "label_smoothing_factor", "loss_type", "neftune_noise_alpha", "max_grad_norm", "router_aux_loss_coef",
    "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optim_args", "use_cache",
    # which tokens are kept and trained
    "truncation_mode", "completion_only_loss",
    # steps: fewer than the simulator's 2 are simulated as written (simulate.simulate), more change nothing
    "max_steps",
    # LoraConfig (trl.get_peft_config)
    "use_rslora", "use_dora", "lora_modules_to_save",
    # BitsAndBytesConfig (trl.get_quantization_config); the 4-bit storage is modelled in simulate
    "bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage",
)
_REFUSED = {
    # key: (harmless, what to do)
    "torch_compile": (lambda v: not v, "compiled graphs are not simulated; set torch_compile: false to measure"),
    "deepspeed": (lambda v: not v, "the advisor measures one device without DeepSpeed; remove it"),
    "fsdp": (lambda v: not v, "the advisor measures one device without FSDP; remove it"),
    "fsdp_config": (lambda v: not v, "the advisor measures one device without FSDP; remove it"),
    "parallelism_config": (lambda v: not v, "the advisor measures one device; remove it"),
    "accelerator_config": (lambda v: not v, "accelerate's options are not simulated; remove it"),
    "auto_find_batch_size": (lambda v: not v, "the batch is then chosen at run time; remove it and set "
                                              "per_device_train_batch_size (what the advisor searches)"),
    "full_determinism": (lambda v: not v, "deterministic CUDA kernels and cuBLAS workspaces are not simulated; "
                                          "remove it"),
    "use_liger_kernel": (lambda v: not v, "Liger's Triton kernels cannot run on fake tensors; set "
                                          "use_liger_kernel: false"),
    "assistant_only_loss": (lambda v: not v, "the advisor trains on the dataset's completion mask; use "
                                             "prompt/completion data (completion_only_loss) instead"),
    "eval_strategy": (lambda v: v in (None, "no"), "evaluation steps are not simulated; measure with "
                                                   "eval_strategy: no (the training steps are what is measured)"),
    "eval_on_start": (lambda v: not v, "evaluation steps are not simulated; remove it to measure"),
    "lora_task_type": (lambda v: v == "CAUSAL_LM", "SFT trains a causal LM; set lora_task_type: CAUSAL_LM"),
    "lora_target_parameters": (lambda v: not v, "LoRA on parameters (MoE experts) is not simulated; use "
                                                "lora_target_modules"),
}
_NEUTRAL = (
    # ScriptArguments / DatasetMixtureConfig (the workload's data comes from --dataset or dataset_name)
    "dataset_config", "dataset_train_split", "dataset_test_split", "dataset_streaming", "ignore_bias_buffers",
    "datasets", "streaming", "test_split_size",
    # ModelConfig
    "model_revision",
    # data preparation: the advisor tokenizes the workload's data itself
    "trust_remote_code", "chat_template_path", "dataset_text_field", "dataset_kwargs", "dataset_num_proc",
    "eos_token", "pad_token", "shuffle_dataset", "remove_unused_columns", "label_names", "length_column_name",
    # schedule, steps and epochs (the peak is reached within the first two steps), seeds
    "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "num_train_epochs", "seed",
    "data_seed", "average_tokens_across_devices", "include_num_input_tokens_seen",
    # outputs, logging, reporting, saving, the hub
    "output_dir", "logging_strategy", "logging_steps", "logging_first_step", "logging_nan_inf_filter",
    "log_level", "log_level_replica", "log_on_each_node", "report_to", "run_name", "project", "trackio_space_id",
    "trackio_bucket_id", "trackio_static_space_id", "disable_tqdm", "skip_memory_metrics", "save_strategy",
    "save_steps", "save_total_limit", "save_only_model", "save_on_each_node", "push_to_hub", "hub_model_id",
    "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push", "hub_revision", "resume_from_checkpoint",
    "ignore_data_skip", "restore_callback_states_from_checkpoint", "enable_jit_checkpoint", "debug",
    # the host side of data loading
    "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
    "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "dataloader_in_order",
    # one process: DDP's options act only with several
    "local_rank", "ddp_backend", "ddp_timeout", "ddp_find_unused_parameters", "ddp_bucket_cap_mb",
    "ddp_broadcast_buffers", "ddp_static_graph",
    # speed only (TF32 matmuls), or the reserved memory between steps only (the peak within a step is unchanged)
    "tf32", "torch_empty_cache_steps", "use_cpu",
    # evaluation's options: inert while eval_strategy is "no" (refused otherwise)
    "do_train", "do_eval", "do_predict", "eval_steps", "eval_delay", "eval_packing", "per_device_eval_batch_size",
    "eval_accumulation_steps", "eval_do_concat_batches", "eval_use_gather_object", "batch_eval_metrics",
    "include_for_metrics", "prediction_loss_only", "metric_for_best_model", "greater_is_better",
    "load_best_model_at_end", "bf16_full_eval", "fp16_full_eval",
    # inert unless a refused key or an unsupported optimizer turns them on
    "torch_compile_backend", "torch_compile_mode", "liger_kernel_config", "optim_target_modules",
)

KEY_USES: dict[str, KeyUse] = {
    **{k: KeyUse.KNOB for k in _KNOBS}, **{k: KeyUse.SIMULATED for k in _SIMULATED},
    **{k: KeyUse.REFUSED for k in _REFUSED}, **{k: KeyUse.NEUTRAL for k in _NEUTRAL},
}
# Base keys at the value the emitter writes for a candidate without a base: not stored, so an emitted file reads
# back to the candidate it came from.
_EMITTED_DEFAULTS = {"truncation_mode": "keep_start", "completion_only_loss": None, "output_dir": "advisor-sft",
                     "bnb_4bit_quant_type": "nf4"}
# model_init_kwargs other than the knobs' (dtype, attn_implementation, use_kernels) that do not change memory; any
# other is refused
_NEUTRAL_INIT_KWARGS = ("revision", "trust_remote_code", "low_cpu_mem_usage", "cache_dir", "token",
                        "local_files_only", "subfolder", "use_safetensors", "force_download")
# activation_checkpointing_kwargs other than the knobs' (selective, every_n_layers, offload), given to torch's
# checkpoint
_CHECKPOINT_KWARGS = ("use_reentrant", "preserve_rng_state", "determinism_check", "debug")


def trl_fields() -> dict[str, tuple[type, dataclasses.Field]]:
    """Every key `trl sft --config` reads, from TRL's own dataclasses: name -> (class, field)."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig

    out: dict[str, tuple[type, dataclasses.Field]] = {}
    for cls in (DatasetMixtureConfig, ScriptArguments, ModelConfig, SFTConfig):
        out.update({f.name: (cls, f) for f in dataclasses.fields(cls)})
    return out


def _trl_default(name: str) -> Any:
    cls, f = trl_fields()[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _owner(name: str) -> str:
    """'sft' for SFTConfig fields, 'model' for ModelConfig's, 'script' for the others."""
    from trl import ModelConfig, SFTConfig

    cls = trl_fields()[name][0]
    return "sft" if cls is SFTConfig else "model" if cls is ModelConfig else "script"


def _base_keys(candidate: Candidate, owner: str, measured: bool) -> dict[str, Any]:
    base = candidate.base.as_dict()
    out = {}
    for k, v in base.items():
        if k in ("env", CHECKPOINT_EXTRA, "model_init_kwargs") or k not in KEY_USES:
            continue
        if measured and KEY_USES[k] is not KeyUse.SIMULATED:
            continue
        if _owner(k) == owner:
            out[k] = v
    return out


# ---- Candidate -> TRL ------------------------------------------------------------------------------------------

def sft_config_kwargs(candidate: Candidate, workload: Workload | None = None, *,
                      measured: bool = False) -> dict[str, Any]:
    """The SFTConfig fields that decide memory and speed, each set explicitly, then the base's SFTConfig keys
    (`measured`: only those that reach a measured run, see KeyUse)."""
    c = candidate
    completion_only = workload.dataset.completion_only_loss if workload is not None else None
    out: dict[str, Any] = {}
    for k in knobs_in(Home.SFT_CONFIG):
        out.update(_write_sft(k, c))
        if k.name == "max_length":
            out["truncation_mode"] = "keep_start"
    out["use_liger_kernel"] = False  # replaced by model_init_kwargs use_kernels (a knob)
    out["completion_only_loss"] = completion_only
    out["model_init_kwargs"] = model_init_kwargs(c, measured=measured)
    out.update(_base_keys(c, "sft", measured))
    return out


def _write_sft(k: Knob, c: Candidate) -> dict[str, Any]:
    """One SFTConfig knob as TRL spells it: its key, or the keys of the knobs TRL spells differently."""
    if k.name == "precision":
        return {"bf16": c.precision is Precision.BF16, "fp16": c.precision is Precision.FP16}
    if k.name == "group_by_length":
        return {"train_sampling_strategy": "group_by_length" if c.group_by_length else
                c.base.get("train_sampling_strategy", "random")}
    if k.name == "activation_checkpointing":
        return {"activation_checkpointing": c.activation_checkpointing,
                "activation_checkpointing_kwargs": c.checkpointing_kwargs}
    return {k.key: k.plain(getattr(c, k.name))}


def model_init_kwargs(candidate: Candidate, *, measured: bool = False) -> dict[str, Any]:
    """What `from_pretrained` gets through SFTConfig.model_init_kwargs (as trl/scripts/sft.py builds it).

    Quantization is passed separately, as the trainer's `quantization_config=` argument (see
    `quantization_config`), exactly like trl/scripts/sft.py does. No attn_implementation: transformers picks.
    The knobs that live in model_init_kwargs (advisor/knobs.py, Home.MODEL_INIT_KWARGS) are written explicitly.
    """
    out: dict[str, Any] = {} if measured else dict(candidate.base.get("model_init_kwargs") or {})
    out["dtype"] = candidate.weights_dtype.value
    if candidate.attn_implementation is not None:
        out["attn_implementation"] = candidate.attn_implementation.value
    for k in knobs_in(Home.MODEL_INIT_KWARGS):  # use_kernels, written explicitly
        out[k.key] = k.plain(getattr(candidate, k.name))
    return out


def quantization_config(candidate: Candidate) -> BitsAndBytesConfig | None:
    """The BitsAndBytesConfig of trl.get_quantization_config for this candidate, or None."""
    if candidate.quantization is Quantization.NONE:
        return None
    from transformers import BitsAndBytesConfig

    if candidate.quantization is Quantization.NF4:
        b = candidate.base
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_compute_dtype=_compute_dtype(candidate),
            bnb_4bit_quant_type=b.get("bnb_4bit_quant_type", "nf4"),
            bnb_4bit_use_double_quant=bool(b.get("use_bnb_nested_quant", False)),
            bnb_4bit_quant_storage=b.get("bnb_4bit_quant_storage"),
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def _compute_dtype(candidate: Candidate) -> str:
    """trl.get_quantization_config computes in the weights' dtype (ModelConfig.dtype); so do we."""
    return candidate.weights_dtype.value


def _peft_targets(candidate: Candidate) -> list[str] | str | None:
    """LoraConfig.target_modules: None is PEFT's default for the model type, 'all-linear' PEFT's own keyword."""
    t = candidate.lora_target_modules
    if t is None:
        return None
    return "all-linear" if t == ("all-linear",) else list(t)


def peft_config(candidate: Candidate, model: ModelSpec | None = None) -> LoraConfig | None:
    """The LoraConfig of trl.get_peft_config for this candidate (with the base's LoRA keys)."""
    if not candidate.use_lora:
        return None
    from peft import LoraConfig

    b = candidate.base
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=candidate.lora_r,
        target_modules=_peft_targets(candidate),
        lora_alpha=candidate.lora_alpha,
        lora_dropout=candidate.lora_dropout,
        bias="none",
        use_rslora=bool(b.get("use_rslora", False)),
        use_dora=bool(b.get("use_dora", False)),
        modules_to_save=b.get("lora_modules_to_save"),
    )


def env_vars(candidate: Candidate) -> dict[str, str]:
    """Allocator settings; both names, since PyTorch 2.10 reads PYTORCH_ALLOC_CONF and vLLM the CUDA one. Then
    the base's other environment variables."""
    out = dict(candidate.base.get("env") or {})
    if candidate.expandable_segments:
        out.update({name: ALLOC_CONF for name in _ALLOC_ENV})
    return out


def build_sft_config(candidate: Candidate, workload: Workload | None = None, *, measured: bool = False,
                     **overrides: Any) -> SFTConfig:
    """A trl.SFTConfig built through its constructor (so activation/gradient checkpointing names stay synced).

    `measured=True` for the simulator's and the probe's runs: the base's neutral keys (hub, reporting, output
    paths) stay out. On a machine without a GPU a bf16 config needs `use_cpu=True` among the overrides.
    """
    from trl import SFTConfig

    kwargs = sft_config_kwargs(candidate, workload, measured=measured)
    kwargs["output_dir"] = overrides.pop("output_dir", kwargs.get("output_dir", "advisor-sft"))
    kwargs.update(overrides)
    return SFTConfig(**kwargs)


# ---- YAML for `trl sft --config` -------------------------------------------------------------------------

# One target written for `trl sft`: ModelConfig turns a one-element list into a string, which PEFT matches as a
# regular expression against the full module name, so a bare name would match nothing.
_ONE_TARGET = re.compile(r"\.\*\\\.([A-Za-z_][A-Za-z0-9_]*)")


def _yaml_targets(candidate: Candidate) -> list[str] | None:
    t = candidate.lora_target_modules
    if t is None:
        return None
    if len(t) == 1 and t[0] != "all-linear":
        return [f".*\\.{t[0]}"]
    return list(t)


def _write_model(k: Knob, c: Candidate) -> dict[str, Any]:
    """One ModelConfig / LoraConfig knob as `trl sft` reads it."""
    if k.name == "attn_implementation":
        return {} if c.attn_implementation is None else {"attn_implementation": c.attn_implementation.value}
    if k.name == "lora_target_modules":
        targets = _yaml_targets(c)
        return {} if targets is None else {"lora_target_modules": targets}
    if k.name == "quantization":
        out = {"load_in_4bit": c.quantization is Quantization.NF4, "load_in_8bit": c.quantization is Quantization.INT8}
        if c.quantization is Quantization.NF4:
            out["bnb_4bit_quant_type"] = "nf4"
        return out
    return {k.key: k.plain(getattr(c, k.name))}


def run_config_dict(
    candidate: Candidate, *, model_name_or_path: str | None, dataset_name: str | None = None,
    completion_only_loss: bool | None = None, output_dir: str = "advisor-sft",
) -> dict[str, Any]:
    """The keys `trl sft --config FILE` accepts: ScriptArguments, SFTConfig, ModelConfig and an `env:` block.
    The base's keys come after the knobs', as the user wrote them."""
    c = candidate
    kw = sft_config_kwargs(c)
    init = kw.pop("model_init_kwargs")  # trl sft builds it from ModelConfig's dtype / attn_implementation
    kw["completion_only_loss"] = c.base.get("completion_only_loss", completion_only_loss)
    out: dict[str, Any] = {}
    if model_name_or_path is not None:
        out["model_name_or_path"] = model_name_or_path
    if dataset_name is not None:
        out["dataset_name"] = dataset_name
    out.update(_base_keys(c, "script", measured=False))
    out["output_dir"] = c.base.get("output_dir", output_dir)
    out.update(kw)
    # model_init_kwargs goes into the YAML whole but for what ModelConfig's dtype / attn_implementation carry
    # (trl sft updates those with it): the model_init_kwargs knobs and the user's other loading keys
    extra_init = {k: v for k, v in init.items() if k not in ("dtype", "attn_implementation")}
    if extra_init:
        out["model_init_kwargs"] = extra_init
    for k in KNOBS:
        if k.home in (Home.MODEL_CONFIG, Home.LORA_CONFIG) and k.is_active(c):
            out.update(_write_model(k, c))
    out.update(_base_keys(c, "model", measured=False))
    env = env_vars(c)
    if env:
        out["env"] = env
    return out


def to_yaml(candidate: Candidate, *, header: str | None = None, **kwargs: Any) -> str:
    """The `trl sft --config` file; `header` becomes leading `#` comment lines, and without a dataset_name a
    commented placeholder says where `trl sft` takes it from."""
    body = yaml.safe_dump(run_config_dict(candidate, **kwargs), sort_keys=False)
    if kwargs.get("dataset_name") is None:
        placeholder = ("# dataset_name: trl-lib/Capybara   # your dataset: a hub id or a local dataset directory "
                       "(or pass --dataset_name to trl sft)\n")
        lines = body.splitlines(keepends=True)
        at = 1 if lines and lines[0].startswith("model_name_or_path:") else 0
        body = "".join(lines[:at]) + placeholder + "".join(lines[at:])
    if header:
        body = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines()) + body
    return body


@dataclass(frozen=True)
class RunConfig:
    """A `trl sft --config` file read back: the candidate (knobs over the user's base) and what it says about
    model and data."""

    candidate: Candidate
    model_name_or_path: str | None = None
    dataset_name: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    path: Path | None = None


def candidate_from_run_dict(data: dict[str, Any], *, source: str = "config") -> Candidate:
    """Map SFTConfig / ModelConfig keys to a Candidate over a base of the other keys; unset knobs take TRL 1.16's
    defaults. A key that changes memory and is not simulated is a ConfigError naming it."""
    d = dict(data)
    problems: list[str] = []
    base: dict[str, Any] = {}
    fields_ = trl_fields()
    for key, value in d.items():
        use = KEY_USES.get(key)
        if key == "env" or use is KeyUse.KNOB:
            continue
        if use is None:
            if key not in fields_:
                problems.append(f"unknown key {key!r}: not a key trl sft --config accepts")
            elif value != _trl_default(key):
                problems.append(f"{key}={value!r}: this TRL key is not known to the advisor, so its effect on "
                                "memory is not simulated; remove it to measure")
            continue
        if use is KeyUse.REFUSED:
            harmless, fix = _REFUSED[key]
            if not harmless(value):
                problems.append(f"{key}={value!r}: changes memory and is not simulated: {fix}")
            continue
        if key in _EMITTED_DEFAULTS and value == _EMITTED_DEFAULTS[key]:
            continue
        base[key] = value

    ck_kwargs = _read_mapping(d.get("activation_checkpointing_kwargs", d.get("gradient_checkpointing_kwargs")),
                              "activation_checkpointing_kwargs", problems)
    ck_keys = {k.key for k in knobs_in(Home.CHECKPOINT_KWARGS)}
    extra_ck = {}
    for k, v in ck_kwargs.items():
        if k in ck_keys:
            continue  # a knob's (selective, every_n_layers, offload)
        if k == "use_reentrant" and v is False:
            continue  # what TRL sets when it is not given, and what the emitter writes
        if k in _CHECKPOINT_KWARGS:
            extra_ck[k] = v
        else:
            problems.append(f"activation_checkpointing_kwargs {k}={v!r}: not an option the advisor simulates "
                            f"(known: {', '.join([*sorted(ck_keys), *_CHECKPOINT_KWARGS])}); remove it")
    if extra_ck:
        base[CHECKPOINT_EXTRA] = extra_ck

    if d.get("load_in_4bit") and d.get("load_in_8bit"):
        problems.append("load_in_4bit and load_in_8bit both true: choose one")
    mik = _read_mapping(d.get("model_init_kwargs"), "model_init_kwargs", problems)
    init_keys = {"dtype", "torch_dtype", "attn_implementation", *(k.key for k in knobs_in(Home.MODEL_INIT_KWARGS))}
    extra_init = {}
    for k, v in mik.items():
        if k in init_keys:
            continue
        if k in _NEUTRAL_INIT_KWARGS:
            extra_init[k] = v
        else:
            problems.append(f"model_init_kwargs {k}={v!r}: changes how the model is loaded and is not simulated; "
                            "remove it (quantization: load_in_4bit / load_in_8bit)")
    if extra_init:
        base["model_init_kwargs"] = extra_init
    sampling = d.get("train_sampling_strategy")
    if sampling not in (None, "random", "group_by_length"):
        base["train_sampling_strategy"] = sampling
    env = dict(d.get("env") or {})
    alloc = {name: str(env.pop(name)) for name in _ALLOC_ENV if name in env}
    for name, value in alloc.items():
        options = [o.strip() for o in value.split(",") if o.strip()]
        other = [o for o in options if o.replace(" ", "") not in ("expandable_segments:True",
                                                                   "expandable_segments:False")]
        if other:
            problems.append(f"env {name}={value!r}: allocator options {other} are not simulated; keep only "
                            "expandable_segments")
    if env:
        base["env"] = {str(k): str(v) for k, v in env.items()}
    source_of = {Home.CHECKPOINT_KWARGS: ck_kwargs, Home.MODEL_INIT_KWARGS: mik}
    fields: dict[str, Any] = {"base": base}
    for k in KNOBS:
        if k.home is Home.LORA_CONFIG and not d.get("use_peft"):
            continue  # inactive: the Candidate's default
        fields[k.name] = _read_knob(k, d, source_of.get(k.home), alloc, problems)
    if problems:
        raise ConfigError(problems, context=source)
    try:
        return Candidate(**fields)
    except ConfigError as exc:
        raise ConfigError(exc.problems, context=source) from None


def _read_mapping(value: Any, name: str, problems: list[str]) -> dict[str, Any]:
    """A kwargs key of a run config (a mapping, or the JSON text the CLI passes)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            problems.append(f"{name}={value!r}: not a JSON object")
            return {}
    if not isinstance(value, dict):
        problems.append(f"{name}={value!r}: must be a mapping")
        return {}
    return value


def _read_knob(k: Knob, d: dict[str, Any], kwargs: dict[str, Any] | None, alloc: dict[str, str],
               problems: list[str]) -> Any:
    """One knob's value from a run config: its key in its home, else what TRL takes when it is not set."""
    absent = _trl_default(k.key) if k.absent is TRL_DEFAULT else k.absent
    if k.name == "precision":
        bf16, fp16 = d.get("bf16"), bool(d.get("fp16", False))
        return Precision.FP16 if fp16 else Precision.BF16 if bf16 in (None, True) else Precision.FP32
    if k.name == "quantization":
        return Quantization.NF4 if d.get("load_in_4bit") else Quantization.INT8 if d.get("load_in_8bit") else \
            Quantization.NONE
    if k.name == "group_by_length":
        return d.get("train_sampling_strategy") == "group_by_length" or bool(d.get("group_by_length"))
    if k.name == "expandable_segments":
        return any("expandable_segments:True" in v.replace(" ", "") for v in alloc.values())
    if k.name == "lora_target_modules":
        return _read_targets(d.get("lora_target_modules"), problems)
    if k.name == "weights_dtype":
        # trl sft: model_init_kwargs update what ModelConfig's dtype gives
        mik = _read_mapping(d.get("model_init_kwargs"), "model_init_kwargs", [])
        dtype = mik.get("dtype") or mik.get("torch_dtype") or d.get("dtype") or _trl_default("dtype")
        if dtype == "auto":
            problems.append("dtype=auto: the advisor needs an explicit dtype (float32, bfloat16 or float16)")
            return "float32"
        return dtype
    if k.name == "attn_implementation":
        mik = _read_mapping(d.get("model_init_kwargs"), "model_init_kwargs", [])
        return mik.get("attn_implementation") or d.get("attn_implementation")  # None: what transformers picks
    if kwargs is not None:
        value = kwargs.get(k.key, absent)
    else:
        value = next((d[key] for key in yaml_keys(k) if key in d), absent)
    if k.name == "optim" and value in UNSUPPORTED_OPTIMIZERS:
        known = ", ".join(o.value for o in Optimizer)
        problems.append(f"optim={value!r}: {UNSUPPORTED_OPTIMIZERS[value]}; use one of {known}")
        return Optimizer.ADAMW_TORCH.value
    if k.name == "pad_to_multiple_of" and value == "auto":
        return None
    if k.kind is Kind.BOOL:
        return bool(value)
    if k.name == "checkpoint_every_n_layers":
        return int(value)
    return value


def _read_targets(targets: Any, problems: list[str]) -> tuple[str, ...] | None:
    """lora_target_modules as trl sft reads it: None is PEFT's default for the model type; ModelConfig turns a
    one-element list into a string that PEFT matches as a regular expression against full module names."""
    if targets is None:
        return None
    items = [targets] if isinstance(targets, str) else list(targets)
    if len(items) != 1 or items[0] == "all-linear":
        return tuple(str(t) for t in items)
    one = str(items[0])
    m = _ONE_TARGET.fullmatch(one)
    if m:
        return (m.group(1),)
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", one):
        problems.append(
            f"lora_target_modules={targets!r}: trl sft passes one module as a regular expression matched against "
            f"full module names, so {one!r} matches nothing and PEFT raises \"Target modules not found\"; write "
            f"'.*\\.{one}' or list several modules"
        )
    else:
        problems.append(f"lora_target_modules={targets!r}: a regular expression is not simulated; list the module "
                        "names, or write one module as '.*\\.NAME'")
    return None


def load_run_config(path: str | Path, trainer: str = "sft") -> RunConfig:
    """Read a RUN.yaml (what `advisor suggest --format yaml` writes and `trl sft --config` accepts; `trl dpo` /
    `trl reward`'s with `trainer`: another trainer's keys, e.g. `packing` in a DPO config, are refused by name)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--config {path}: no such file; write one with `advisor suggest --format yaml --output "
                         f"{path}`")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UsageError(f"--config {path}: not valid YAML ({exc}); fix the file") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: must be a YAML mapping of trl sft keys, got {type(data).__name__}")
    env = {str(k): str(v) for k, v in (data.get("env") or {}).items()}
    if trainer != "sft":
        from .trainers import get_trainer

        kind = get_trainer(trainer)
        kind.check_run_keys(data, source=f"--config {path}")
        _check_keys(data, path, extra={f.name for f in dataclasses.fields(kind.config_class())})
        read = getattr(kind, "candidate_from_run_dict", None)
        cand = (read or candidate_from_run_dict)(data, source=f"--config {path}")
    else:
        _check_keys(data, path)
        cand = candidate_from_run_dict(data, source=f"--config {path}")
    return RunConfig(
        candidate=cand,
        model_name_or_path=data.get("model_name_or_path"),
        dataset_name=data.get("dataset_name"),
        env=env,
        path=path,
    )


def _check_keys(data: dict[str, Any], path: Path, extra: set[str] | frozenset[str] = frozenset()) -> None:
    """`trl sft` passes unknown keys on silently; we don't: a misspelt key is an error here (`extra`: another
    trainer's config fields)."""
    known = {"env", *trl_fields(), *extra}
    unknown = sorted(set(data) - known)
    if unknown:
        import difflib

        problems = []
        for key in unknown:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            problems.append(f"unknown key {key!r}" + (f"; did you mean {near[0]!r}?" if near else ""))
        raise ConfigError(problems, context=f"--config {path}")


def to_python(candidate: Candidate, *, model_name_or_path: str, dataset_name: str | None = None,
              completion_only_loss: bool | None = None) -> str:
    """A snippet that trains with this configuration."""
    c = candidate
    kw = sft_config_kwargs(c)
    kw["completion_only_loss"] = c.base.get("completion_only_loss", completion_only_loss)
    output_dir = kw.pop("output_dir", "advisor-sft")
    lines = ["import os", ""]
    for k, v in env_vars(c).items():
        lines.append(f"os.environ.setdefault({k!r}, {v!r})  # before torch initialises CUDA")
    lines += ["", "from datasets import load_dataset", "from trl import SFTConfig, SFTTrainer"]
    if c.use_lora:
        lines.append("from peft import LoraConfig")
    if c.quantization is not Quantization.NONE:
        lines.append("from transformers import BitsAndBytesConfig")
    lines += ["", "config = SFTConfig(", f"    output_dir={output_dir!r},"]
    lines += [f"    {k}={v!r}," for k, v in kw.items()]
    lines.append(")")
    args = [f"    model={model_name_or_path!r},", "    args=config,", "    train_dataset=dataset,"]
    load = f"load_dataset({dataset_name!r}, split=\"train\")" if dataset_name else \
        'load_dataset("json", data_files="train.jsonl", split="train")  # your data'
    lines.insert(lines.index("config = SFTConfig("), f"dataset = {load}")
    if c.use_lora:
        lc = peft_config(c)
        extra = "".join(f", {k}={getattr(lc, k)!r}" for k in ("use_rslora", "use_dora", "modules_to_save")
                        if getattr(lc, k) not in (None, False))
        lines.append(
            f"peft_config = LoraConfig(r={c.lora_r}, lora_alpha={c.lora_alpha}, lora_dropout={c.lora_dropout!r}, "
            f"target_modules={_peft_targets(c)!r}, bias=\"none\", task_type={lc.task_type!r}{extra})"
        )
        args.append("    peft_config=peft_config,")
    qc = quantization_config(c)
    if qc is not None:
        if c.quantization is Quantization.NF4:
            lines.append(
                f"quantization_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="
                f"{qc.bnb_4bit_quant_type!r}, bnb_4bit_compute_dtype={_compute_dtype(c)!r}, "
                f"bnb_4bit_use_double_quant={qc.bnb_4bit_use_double_quant!r})"
            )
        else:
            lines.append("quantization_config = BitsAndBytesConfig(load_in_8bit=True)")
        args.append("    quantization_config=quantization_config,")
    lines += ["trainer = SFTTrainer(", *args, ")", "trainer.train()", ""]
    return "\n".join(lines)


__all__ = [  # noqa: RUF022
    "KEY_USES", "KeyUse", "RunConfig", "build_sft_config", "candidate_from_run_dict", "env_vars", "load_run_config",
    "model_init_kwargs", "peft_config", "quantization_config", "run_config_dict", "sft_config_kwargs", "to_python",
    "to_yaml", "trl_fields",
]
