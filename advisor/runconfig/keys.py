"""What each key of a run config is (`KEY_USES`): a knob, simulated as written, memory-neutral, or refused unless
at a harmless value; every key `trl sft --config` accepts, from TRL's own dataclasses (`trl_fields`)."""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..knobs import KNOBS, yaml_keys
from ..space import CHECKPOINT_EXTRA

if TYPE_CHECKING:
    from ..space import Candidate


# The script whose TrlParser reads the shared vocabulary of run-config keys (SFTConfig's, ModelConfig's, the script
# arguments': `trl_fields`), which every trainer's reader starts from
SHARED_SCRIPT = "trl.scripts.sft"


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
REFUSED = {
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
    **{k: KeyUse.REFUSED for k in REFUSED}, **{k: KeyUse.NEUTRAL for k in _NEUTRAL},
}
# Base keys at the value the emitter writes for a candidate without a base: not stored, so an emitted file reads
# back to the candidate it came from.
EMITTED_DEFAULTS = {"truncation_mode": "keep_start", "completion_only_loss": None, "output_dir": "advisor-sft",
                     "bnb_4bit_quant_type": "nf4"}
# model_init_kwargs other than the knobs' (dtype, attn_implementation, use_kernels) that do not change memory; any
# other is refused
NEUTRAL_INIT_KWARGS = ("revision", "trust_remote_code", "low_cpu_mem_usage", "cache_dir", "token",
                        "local_files_only", "subfolder", "use_safetensors", "force_download")
# activation_checkpointing_kwargs other than the knobs' (selective, every_n_layers, offload), given to torch's
# checkpoint
CHECKPOINT_KWARGS = ("use_reentrant", "preserve_rng_state", "determinism_check", "debug")


def trl_fields() -> dict[str, tuple[type, dataclasses.Field]]:
    """Every key `trl sft --config` reads, from TRL's own dataclasses: name -> (class, field)."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig  # lazy: loads trl

    out: dict[str, tuple[type, dataclasses.Field]] = {}
    for cls in (DatasetMixtureConfig, ScriptArguments, ModelConfig, SFTConfig):
        out.update({f.name: (cls, f) for f in dataclasses.fields(cls)})
    return out


def trl_default(name: str) -> Any:
    cls, f = trl_fields()[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def owner_of(name: str) -> str:
    """'config' for the shared config's fields (SFTConfig), 'model' for ModelConfig's, 'script' for the others."""
    from trl import ModelConfig, SFTConfig  # lazy: loads trl

    cls = trl_fields()[name][0]
    return "config" if cls is SFTConfig else "model" if cls is ModelConfig else "script"


def config_keys() -> tuple[str, ...]:
    """The shared config's fields (SFTConfig's): what another trainer's reader refuses by name when its config
    lacks one."""
    return tuple(name for name in trl_fields() if owner_of(name) == "config")


def base_keys(candidate: Candidate, owner: str, measured: bool) -> dict[str, Any]:
    base = candidate.base.as_dict()
    out = {}
    for k, v in base.items():
        if k in ("env", CHECKPOINT_EXTRA, "model_init_kwargs") or k not in KEY_USES:
            continue
        if measured and KEY_USES[k] is not KeyUse.SIMULATED:
            continue
        if owner_of(k) == owner:
            out[k] = v
    return out
