"""Emitted configurations are accepted by TRL as they are: the YAML by `trl sft`'s own parser, the Python objects
by SFTTrainer, trained for 2 steps from a model loaded by path (so model_init_kwargs apply)."""

from __future__ import annotations

import ast

import pytest
import yaml

from advisor.emit import build_config, load_run_config, peft_config, run_config_dict, to_python, to_yaml
from advisor.errors import ConfigError, UsageError
from advisor.modeling import placeholder_tokenizer, save_random_model
from advisor.space import Candidate

CASES = [
    Candidate(),
    Candidate.trl_defaults(),
    Candidate(packing=True, packing_strategy="bfd_split", max_length=2048, checkpoint_selective=True,
              weights_dtype="bfloat16", optim="adamw_torch", group_by_length=True),
    Candidate(use_lora=True, lora_r=8, lora_target_modules=("q_proj", "v_proj"), quantization="4bit",
              activation_checkpointing=False, activation_offloading=True, checkpoint_every_n_layers=1),
    Candidate(padding_free=True, max_length=None, checkpoint_every_n_layers=2, quantization="none",
              precision="fp16", optim="paged_adamw_8bit"),
]


def _parse_like_trl_sft(path):
    from trl.scripts.sft import make_parser

    return make_parser().parse_args_and_config(
        ["--config", str(path), "--use_cpu", "True"], return_remaining_strings=True, separate_remaining_strings=True
    )


@pytest.mark.parametrize("cand", CASES, ids=range(len(CASES)))
def test_yaml_goes_through_trl_sft_parser_with_nothing_left(cand, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(to_yaml(cand, model_name_or_path="Qwen/Qwen2.5-0.5B", dataset_name="trl-lib/Capybara"))
    script, training, model, _mixture, config_left, args_left = _parse_like_trl_sft(path)
    assert config_left == [] and args_left == []
    assert script.dataset_name == "trl-lib/Capybara"
    assert model.model_name_or_path == "Qwen/Qwen2.5-0.5B"
    assert training.activation_checkpointing is cand.activation_checkpointing
    assert training.gradient_checkpointing is cand.activation_checkpointing  # synced for TRL's own reads
    assert training.per_device_train_batch_size == cand.per_device_train_batch_size
    assert training.max_length == cand.max_length and training.packing is cand.packing
    assert training.optim.value == cand.optim.value
    assert model.dtype == cand.weights_dtype.value and model.use_peft is cand.use_lora
    assert model.load_in_4bit is (cand.quantization.value == "4bit")
    # and it reads back to the same candidate
    assert load_run_config(path).candidate == cand


def test_env_block_sets_allocator(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    path = tmp_path / "run.yaml"
    path.write_text(to_yaml(Candidate(expandable_segments=True), model_name_or_path="m"))
    _parse_like_trl_sft(path)
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_every_memory_field_explicit():
    data = run_config_dict(Candidate(), model_name_or_path="m")
    for key in ("max_length", "packing", "padding_free", "per_device_train_batch_size", "gradient_accumulation_steps",
                "activation_checkpointing", "activation_offloading", "optim", "bf16", "fp16", "dtype",
                "attn_implementation", "use_peft", "load_in_4bit", "load_in_8bit", "use_liger_kernel"):
        assert key in data, key


def test_misspelt_key_is_an_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": "m", "per_device_train_batchsize": 4, "packin": True}))
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert "did you mean 'per_device_train_batch_size'" in str(info.value)
    assert "'packin'" in str(info.value)


def test_missing_and_malformed_config(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        load_run_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(UsageError, match="must be a YAML mapping"):
        load_run_config(bad)


def _undefined_names(code: str) -> list[str]:
    """Names read before any import or assignment binds them (top-level statements, in order)."""
    import builtins

    bound = set(dir(builtins))
    missing = []
    for stmt in ast.parse(code).body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in bound:
                missing.append(node.id)
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                bound.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return missing


@pytest.mark.parametrize("dataset_name", ["trl-lib/Capybara", None])
def test_python_snippet_runs_as_written(dataset_name):
    for cand in CASES:
        code = to_python(cand, model_name_or_path="Qwen/Qwen2.5-0.5B", dataset_name=dataset_name)
        assert _undefined_names(code) == [], code
        if cand.quantization.value != "none":
            assert "quantization_config=quantization_config" in code
    assert _undefined_names("x = y\n") == ["y"]


def test_sft_config_needs_use_cpu_for_bf16_on_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(ValueError, match="bf16"):
        build_config(Candidate(precision="bf16"), output_dir="x")
    assert build_config(Candidate(precision="bf16"), output_dir="x", use_cpu=True).bf16 is True


@pytest.mark.parametrize(
    "cand",
    [
        Candidate(precision="bf16", weights_dtype="bfloat16", per_device_train_batch_size=2, max_length=128,
                  activation_checkpointing=True),
        Candidate(precision="fp32", packing=True, max_length=128, per_device_train_batch_size=2,
                  use_lora=True, lora_r=4, lora_target_modules=("q_proj", "v_proj"), checkpoint_selective=True),
    ],
    ids=["full-bf16", "lora-packing"],
)
def test_emitted_config_trains_two_steps(cand, tiny_model, tiny_data, tmp_path):
    import torch
    from trl import SFTTrainer

    model_dir = save_random_model(tiny_model, tmp_path / "model")
    args = build_config(
        cand, None, output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=2, report_to="none",
        save_strategy="no", logging_steps=1, completion_only_loss=True,
    )
    trainer = SFTTrainer(
        model=str(model_dir), args=args, train_dataset=tiny_data.to_hf(),
        processing_class=placeholder_tokenizer(tiny_model), peft_config=peft_config(cand, tiny_model),
    )
    # model_init_kwargs applied: the weights dtype is the candidate's
    base = trainer.model.get_base_model() if cand.use_lora else trainer.model
    assert base.dtype == getattr(torch, cand.weights_dtype.value)
    assert base.config._attn_implementation == "sdpa"
    out = trainer.train()
    assert out.global_step == 2
    assert torch.isfinite(torch.tensor(out.training_loss))


def test_suggestion_sft_config_carries_quantization_and_masks(tiny_model, h100_target, tiny_data):
    from advisor.measurement import Measurement, Source, Status
    from advisor.suggestion import Suggestion
    from advisor.workload import Workload

    cand = Candidate(use_lora=True, quantization="4bit", lora_target_modules=("q_proj",))
    s = Suggestion(workload=Workload(model=tiny_model, gpu=h100_target, dataset=tiny_data), candidate=cand,
                   measurement=Measurement(status=Status.OK, source=Source.ESTIMATE))
    cfg = s.sft_config(use_cpu=True, output_dir="x")
    assert cfg.model_init_kwargs["quantization_config"].load_in_4bit
    assert cfg.completion_only_loss is True  # the synthetic set trains completions only, as the YAML says
    assert s.run_config()["completion_only_loss"] is True
    assert "completion_only_loss=True" in s.to_python()
