"""A run config is measured and emitted as TRL runs it: the knobs over a base of every other key the user wrote.

The accuracy of what is measured (each key within 1% of a real train() built by TRL's own parser) is in
tests/test_simulate_accuracy.py (AS_WRITTEN); here: what every key is, that nothing is dropped on the way in or
out, that what cannot be simulated is refused by name (CLI exit 2), and that every path gets the same base.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
from conftest import TINY_QWEN2

from advisor.cli import main
from advisor.emit import (
    KEY_USES,
    KeyUse,
    build_config,
    candidate_from_run_dict,
    load_run_config,
    peft_config,
    run_config_dict,
    to_python,
    to_yaml,
    trl_fields,
)
from advisor.errors import ConfigError
from advisor.space import Candidate, Optimizer, RunBase

EXTRA = dict(lora_dropout=0.1, label_smoothing_factor=0.1, logging_steps=7, seed=123, max_steps=1,
             hub_model_id="me/run", report_to="none", num_train_epochs=2)
RUN = dict(model_name_or_path="Qwen/Qwen2.5-0.5B", dataset_name="trl-lib/Capybara", output_dir="out/run",
           max_length=512, per_device_train_batch_size=4, bf16=True, dtype="bfloat16", use_peft=True, lora_r=8,
           lora_target_modules=["q_proj", "v_proj"], **EXTRA)


def _parse_like_trl_sft(path):
    from trl.scripts.sft import make_parser

    return make_parser().parse_args_and_config(
        ["--config", str(path), "--use_cpu", "True"], return_remaining_strings=True, separate_remaining_strings=True
    )


def _write(tmp_path, data, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_every_trl_key_is_classified():
    """Each field of ScriptArguments, SFTConfig, ModelConfig and DatasetMixtureConfig has a use; a key a later TRL
    adds is refused when set (test_an_unclassified_key_is_refused), never dropped."""
    assert set(trl_fields()) - set(KEY_USES) == set()
    assert set(KEY_USES) - set(trl_fields()) == set()
    assert KEY_USES["lora_dropout"] is KeyUse.KNOB and KEY_USES["label_smoothing_factor"] is KeyUse.SIMULATED
    assert KEY_USES["logging_steps"] is KeyUse.NEUTRAL and KEY_USES["torch_compile"] is KeyUse.REFUSED


def test_an_unclassified_key_is_refused(monkeypatch):
    from advisor import emit

    monkeypatch.delitem(emit.KEY_USES, "tf32")
    with pytest.raises(ConfigError, match=r"tf32=True: this TRL key is not known to the advisor"):
        candidate_from_run_dict({"tf32": True})
    assert candidate_from_run_dict({"tf32": None}).base == RunBase()  # at TRL's default: nothing to measure


def test_yaml_with_extra_keys_round_trips_through_trl_sft(tmp_path):
    """In: the user's keys become the base. Out: `trl sft`'s parser reads every one, nothing left over, and the
    file reads back to the same candidate and base."""
    cand = load_run_config(_write(tmp_path, RUN)).candidate
    assert cand.lora_dropout == 0.1 and cand.lora_target_modules == ("q_proj", "v_proj")
    assert cand.base.as_dict() == {"label_smoothing_factor": 0.1, "logging_steps": 7, "seed": 123, "max_steps": 1,
                                   "hub_model_id": "me/run", "report_to": "none", "num_train_epochs": 2,
                                   "output_dir": "out/run"}
    out = tmp_path / "emitted.yaml"
    out.write_text(to_yaml(cand, model_name_or_path=RUN["model_name_or_path"], dataset_name=RUN["dataset_name"]))
    script, training, model, _mixture, config_left, args_left = _parse_like_trl_sft(out)
    assert config_left == [] and args_left == []
    assert (training.label_smoothing_factor, training.logging_steps, training.seed, training.max_steps) == \
        (0.1, 7, 123, 1)
    assert training.hub_model_id == "me/run" and training.num_train_epochs == 2 and training.output_dir == "out/run"
    assert model.lora_dropout == 0.1 and model.lora_r == 8 and model.use_peft
    assert script.dataset_name == RUN["dataset_name"]
    assert load_run_config(out).candidate == cand


def test_lora_defaults_are_trls_and_pefts(tmp_path):
    """No lora_dropout: ModelConfig's 0.05. No lora_target_modules: PEFT's default for the model type, as
    trl.get_peft_config leaves target_modules None."""
    from trl import ModelConfig

    cand = candidate_from_run_dict({"use_peft": True})
    assert cand.lora_dropout == ModelConfig().lora_dropout == 0.05
    assert cand.lora_target_modules is None
    assert peft_config(cand).target_modules is None and peft_config(cand).lora_dropout == 0.05
    spec = _spec()
    assert cand.for_model(spec).lora_target_modules == ("q_proj", "v_proj")
    out = run_config_dict(cand, model_name_or_path="m")
    assert "lora_target_modules" not in out and out["lora_dropout"] == 0.05
    # the search's own candidates keep writing every target
    assert run_config_dict(Candidate(use_lora=True), model_name_or_path="m")["lora_target_modules"] == \
        list(Candidate().lora_target_modules)


def test_one_lora_target_is_written_so_trl_sft_matches_it(tmp_path):
    """ModelConfig turns a one-element list into a string that PEFT matches as a regex against full module names."""
    cand = Candidate(use_lora=True, lora_target_modules=("q_proj",))
    path = tmp_path / "one.yaml"
    path.write_text(to_yaml(cand, model_name_or_path="m"))
    _script, _training, model, *_ = _parse_like_trl_sft(path)
    import re

    assert re.fullmatch(model.lora_target_modules, "model.layers.0.self_attn.q_proj")
    assert load_run_config(path).candidate == cand
    with pytest.raises(ConfigError, match=r"lora_target_modules=\['q_proj'\].*matches nothing"):
        candidate_from_run_dict({"use_peft": True, "lora_target_modules": ["q_proj"]})


def test_sft_config_and_snippet_carry_the_base(tiny_model):
    cand = candidate_from_run_dict({**RUN, "push_to_hub": False, "report_to": "wandb"})
    full = build_config(cand, use_cpu=True)
    assert full.label_smoothing_factor == 0.1 and full.logging_steps == 7 and full.report_to == ["wandb"]
    assert full.output_dir == "out/run" and full.max_steps == 1
    # a measured run gets what changes memory, not the reporting, hub and output options
    measured = build_config(cand, measured=True, use_cpu=True, output_dir="tmp")
    assert measured.label_smoothing_factor == 0.1 and measured.max_steps == 1
    assert measured.logging_steps != 7 and measured.report_to == [] and measured.hub_model_id is None
    code = to_python(cand, model_name_or_path="m")
    assert "label_smoothing_factor=0.1" in code and "lora_dropout=0.1" in code and "output_dir='out/run'" in code
    from test_emit import _undefined_names

    assert _undefined_names(code) == [], code


def test_measured_runs_get_the_base(tiny_workload, tmp_path):
    """The probe's child rebuilds the candidate, base included, from its job file; a baseline stores it."""
    from advisor.probing.runner import job_dict
    from advisor.probing.worker import _rebuild
    from advisor.regress import load_baseline, record_baseline

    cand = candidate_from_run_dict({**RUN, "max_length": 128, "bf16": False, "dtype": "float32"})
    job = json.loads(json.dumps(job_dict(tiny_workload, cand, "cpu", steps=1, warmup=0, memory_budget_bytes=None,
                                         weights=None)))
    assert _rebuild(job)[1] == cand
    baseline = record_baseline(tiny_workload, cand, backend="estimate")
    path = baseline.save(tmp_path / "b.json")
    assert load_baseline(path).candidate == cand and load_baseline(path).candidate.base.get("max_steps") == 1


@pytest.mark.parametrize(
    "data, key",
    [
        ({"torch_compile": True}, "torch_compile"),
        ({"eval_strategy": "steps"}, "eval_strategy"),
        ({"use_liger_kernel": True}, "use_liger_kernel"),
        ({"deepspeed": "ds.json"}, "deepspeed"),
        ({"optim": "lomo"}, "optim"),
        ({"optim": "galore_adamw"}, "optim"),
        ({"use_peft": True, "lora_target_parameters": ["mlp.experts.gate_up_proj"]}, "lora_target_parameters"),
        ({"use_peft": True, "lora_task_type": "SEQ_CLS"}, "lora_task_type"),
        ({"model_init_kwargs": {"device_map": "auto"}}, "model_init_kwargs device_map"),
        # offload is a knob now (checkpoint_offload, tests/test_knobs.py); torch's context_fn is not simulated
        ({"activation_checkpointing_kwargs": {"context_fn": "x"}}, "context_fn"),
        ({"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128"}},
         "PYTORCH_CUDA_ALLOC_CONF"),
    ],
)
def test_what_changes_memory_unsimulated_is_refused_by_name(data, key):
    with pytest.raises(ConfigError) as info:
        candidate_from_run_dict(data)
    assert key in str(info.value) and info.value.exit_code == 2


def test_harmless_values_of_refusable_keys_pass():
    cand = candidate_from_run_dict({"torch_compile": False, "eval_strategy": "no", "use_liger_kernel": False,
                                    "deepspeed": None, "fsdp": ""})
    assert cand.base == RunBase()


def test_every_torch_optimizer_trl_accepts_is_measured_and_the_rest_named():
    from transformers.training_args import OptimizerNames

    from advisor.space import UNSUPPORTED_OPTIMIZERS

    names = {o.value for o in OptimizerNames}
    assert names == {o.value for o in Optimizer} | set(UNSUPPORTED_OPTIMIZERS) - {"adamw_apex_fused"}
    for name in ("sgd", "adagrad", "rmsprop"):
        assert candidate_from_run_dict({"optim": name}).optim.value == name


def test_default_attention_is_what_transformers_picks():
    """For every shipped model profile, and Gemma2 (no sdpa: softcapping) in particular."""
    import torch
    from transformers import AutoModelForCausalLM

    from advisor.modeling import default_attention
    from advisor.profiles import resolve_model
    from advisor.simulator import with_depth

    picks = {}
    for name in ("Qwen/Qwen2.5-0.5B", "google/gemma-2-2b", "meta-llama/Llama-3.1-8B", "mistralai/Mistral-7B-v0.3",
                 "HuggingFaceTB/SmolLM2-135M"):
        spec = with_depth(resolve_model(name), 1)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(spec.hf_config())
        picks[name] = default_attention(spec).value
        assert picks[name] == model.config._attn_implementation, name
    assert picks["google/gemma-2-2b"] == "eager" and picks["Qwen/Qwen2.5-0.5B"] == "sdpa"


def _spec(config=None):
    from advisor.workload import ModelSpec

    return ModelSpec(name="tiny", config=dict(config or TINY_QWEN2), source="local")


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "tiny-qwen2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_QWEN2))
    return d


def test_cli_refuses_with_exit_2_naming_the_key(tmp_path, model_dir, capsys):
    path = _write(tmp_path, {"max_length": 128, "torch_compile": True, "label_smoothing_factor": 0.1})
    for command in ("simulate", "probe", "baseline"):
        argv = [command, "--model", str(model_dir), "--gpu", "cpu", "--config", str(path)]
        argv += ["--out", str(tmp_path / "b.json")] if command == "baseline" else []
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "torch_compile=True" in err and "torch_compile: false" in err, err


def test_cli_simulates_the_config_as_written(tmp_path, model_dir, capsys):
    """max_steps: 1 and lora_dropout reach `advisor simulate`: its peak is the library's on the same base."""
    from advisor.inputs import build_workload
    from advisor.simulator import simulate

    data = {"max_length": 128, "per_device_train_batch_size": 2, "bf16": False, "use_peft": True, "max_steps": 1,
            "logging_steps": 5}
    path = _write(tmp_path, data)
    assert main(["simulate", "--model", str(model_dir), "--gpu", "cpu", "--config", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    wl = build_workload(str(model_dir), gpu="cpu")
    base_only = dataclasses.replace(candidate_from_run_dict(data), base=RunBase())
    assert shown["peak_bytes"] == simulate(wl, candidate_from_run_dict(data)).peak_bytes
    assert shown["peak_bytes"] != simulate(wl, base_only).peak_bytes  # max_steps 1: no second step
