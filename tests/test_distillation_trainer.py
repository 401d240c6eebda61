"""Distillation on the trainer seam (advisor/trainers/distillation.py): the registry, the knobs' TRL 1.16 defaults
read back from the installed DistillationConfig, the files through `trl distillation`'s own parser with nothing left
over, the config object and the snippet, --teacher through the workload, the estimate and the simulator counting the
teacher and the divergence over the vocabulary, the Python API, and each bad input as an error naming the flag, the
value and the fix."""

from __future__ import annotations

import ast
import dataclasses
import json

import pytest
import yaml

from advisor.cli import main
from advisor.errors import ConfigError, UsageError
from advisor.space import Candidate, with_knobs
from advisor.trainers import choices, get_trainer, names


@pytest.fixture
def teacher_config(tmp_path):
    """A teacher of another width and depth than conftest's tiny student, the same vocabulary."""
    from conftest import TINY_QWEN2

    path = tmp_path / "teacher" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**TINY_QWEN2, "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3,
                                "num_attention_heads": 6}))
    return str(path)


def _workload(tiny_config, teacher_config, gpu="cpu", **kwargs):
    from advisor.inputs import build_workload

    return build_workload(tiny_config, gpu=gpu, trainer="distillation", teacher=teacher_config, **kwargs)


# ---- the registry and the declarations ---------------------------------------------------------------------------
def test_distillation_is_a_built_in_trainer():
    assert "distillation" in choices() and "distillation" in names()
    t = get_trainer("distillation")
    assert (t.command, t.config_name, t.trainer_name) == ("distillation", "DistillationConfig", "DistillationTrainer")
    shape = t.step_shape(Candidate())
    assert shape.generates and shape.distills_from == "teacher" and not shape.train_autocast
    (teacher,) = t.model_inputs
    assert (teacher.role, teacher.flag, teacher.yaml_key, teacher.head.value) == (
        "teacher", "--teacher", "teacher_model_name_or_path", "lm")
    assert teacher.required and teacher.same_vocabulary


def test_knob_defaults_are_the_installed_config():
    """Every knob DistillationConfig has is at its installed default in a plain candidate's view."""
    from trl import DistillationConfig

    fields = {f.name: f.default for f in dataclasses.fields(DistillationConfig)}
    t = get_trainer("distillation")
    k = t.knobs(Candidate())
    for kn in t.knob_view.KNOBS:
        if kn.key in fields:
            assert getattr(getattr(k, kn.name), "value", getattr(k, kn.name)) == fields[kn.key], kn.name
    assert k.beta == fields["beta"] == 1.0 and k.teacher_dtype is None
    assert not any(f in fields for f in ("num_generations", "steps_per_generation", "num_iterations"))


# ---- the files ---------------------------------------------------------------------------------------------------
CASES = {
    "defaults": {},
    "jsd-lora-ga": {"use_lora": True, "beta": 0.5, "gradient_accumulation_steps": 2, "max_completion_length": 256,
                    "teacher_dtype": "bfloat16"},
    "colocate-sleep": {"use_vllm": True, "vllm_enable_sleep_mode": True, "vllm_gpu_memory_utilization": 0.45,
                       "expandable_segments": False, "beta": 0.0},
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_yaml_goes_through_trls_own_parser_and_reads_back(case, tmp_path, monkeypatch):
    from advisor.emit import load_run_config

    t = get_trainer("distillation")
    cand = with_knobs(Candidate(), **CASES[case])
    cand = cand.replace(base={**cand.base.as_dict(), "teacher_model_name_or_path": "Qwen/Qwen2.5-1.5B"})
    assert t.problems(cand) == []
    text = t.to_yaml(cand, model_name_or_path="Qwen/Qwen2.5-0.5B", dataset_name="trl-lib/ultrafeedback-prompt")
    data = yaml.safe_load(text)
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_completion_length", "beta",
                "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode",
                "ds3_gather_for_generation", "activation_checkpointing", "bf16", "optim", "teacher_model_name_or_path"):
        assert key in data, key
    assert not {"num_generations", "reward_funcs", "steps_per_generation"} & set(data)
    path = tmp_path / "run.yaml"
    path.write_text(text)
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    script, config, model_args, mixture, config_left, args_left = t.make_parser().parse_args_and_config(
        ["--config", str(path), "--use_cpu", "True"], return_remaining_strings=True, separate_remaining_strings=True)
    assert config_left == [] and args_left == []
    assert type(config).__name__ == "DistillationConfig"
    k = t.knobs(cand)
    assert (config.beta, config.max_completion_length, config.use_vllm) == (k.beta, k.max_completion_length,
                                                                            k.use_vllm)
    assert config.teacher_model_name_or_path == "Qwen/Qwen2.5-1.5B"
    # the YAML spells out the teacher's dtype as trl distillation resolves it (ModelConfig's, unless pinned)
    assert config.teacher_model_init_kwargs["dtype"] == CASES[case].get("teacher_dtype", "float32")
    assert load_run_config(path, trainer="distillation").candidate == cand


def test_trl_config_and_the_snippet_load_the_teacher_as_trl_distillation_does(teacher_config, tiny_config):
    """The snippet and the config object carry the teacher's dtype as `trl distillation` resolves it from the
    YAML's ModelConfig (a DistillationTrainer built in Python would load it in float32 without it)."""
    wl = _workload(tiny_config, teacher_config)
    t = get_trainer("distillation")
    cand = Candidate(weights_dtype="bfloat16", use_lora=True)
    config = t.trl_config(cand, wl, use_cpu=True)
    assert type(config).__name__ == "DistillationConfig"
    assert config.teacher_model_init_kwargs["dtype"] == "bfloat16"
    assert config.teacher_model_name_or_path == teacher_config
    snippet = t.to_python(cand, model_name_or_path="m", workload=wl)
    ast.parse(snippet)
    assert "from trl import DistillationConfig, DistillationTrainer" in snippet
    assert f"teacher_model={teacher_config!r}" in snippet and "peft_config=peft_config" in snippet
    assert "'dtype': 'bfloat16'" in snippet.split("teacher_model_init_kwargs=")[1].split("\n")[0]
    # the YAML says the dtype trl distillation loads the teacher in (ModelConfig's dtype, unless pinned)
    written = yaml.safe_load(t.to_yaml(cand, model_name_or_path="m", workload=wl))
    assert written["teacher_model_init_kwargs"]["dtype"] == "bfloat16" == written["dtype"]


def test_the_phases_hold_the_teacher_in_every_phase(tiny_config, teacher_config):
    """The estimate's phases: the teacher resident in generate, score and train; no reference."""
    import advisor

    wl = _workload(tiny_config, teacher_config, gpu="H100-80GB")
    m = advisor.estimate(wl, with_knobs(Candidate(), use_vllm=True, vllm_gpu_memory_utilization=0.2))
    assert m.ok
    assert any("training state resident throughout (weights, optimizer state, the teacher)" in n for n in m.notes)
    assert not any("a separate reference" in n for n in m.notes)


# ---- the workload: --teacher -----------------------------------------------------------------------------------
def test_the_teacher_is_part_of_the_workload(tiny_config, teacher_config):
    from advisor.inputs import WorkloadRef

    wl = _workload(tiny_config, teacher_config)
    assert wl.model_of("teacher").name == teacher_config and wl.dataset.unit == "prompts"
    ref = WorkloadRef.of(wl)
    assert dict(WorkloadRef.from_spec(ref.to_spec()).models)["teacher"] == teacher_config
    assert WorkloadRef.from_dict(ref.to_dict()).build().fingerprint() == wl.fingerprint()
    other = _workload(tiny_config, tiny_config)
    assert other.fingerprint() != wl.fingerprint()


def test_a_teacher_of_another_vocabulary_is_refused(tiny_config, tmp_path, capsys):
    from conftest import TINY_QWEN2

    big = tmp_path / "big.json"
    big.write_text(json.dumps({**TINY_QWEN2, "vocab_size": 2048}))
    with pytest.raises(ConfigError, match=r"its vocabulary has 2048 tokens and the policy .*'s 1024"):
        _workload(tiny_config, str(big))
    rc = main(["suggest", "--trainer", "distillation", "--model", tiny_config, "--teacher", str(big), "--gpu", "cpu",
               "--backend", "estimate"])
    err = capsys.readouterr().err
    assert rc == 2 and "teacher=" in err and "same tokenizer" in err


def test_no_teacher_and_a_teacher_for_another_trainer_are_refused(tiny_config, teacher_config, capsys):
    from advisor.inputs import build_workload

    with pytest.raises(ConfigError, match=r"trainer='distillation' needs a teacher: pass --teacher ID"):
        build_workload(tiny_config, gpu="cpu", trainer="distillation")
    with pytest.raises(ConfigError, match="trainer 'sft' takes no teacher; use --trainer distillation"):
        build_workload(tiny_config, gpu="cpu", teacher=teacher_config)
    rc = main(["suggest", "--trainer", "distillation", "--model", tiny_config, "--gpu", "cpu", "--backend",
               "estimate"])
    assert rc == 2 and "needs a teacher: pass --teacher ID" in capsys.readouterr().err
    with pytest.raises(UsageError, match="--teacher 'no/such-teacher'"):
        build_workload(tiny_config, gpu="cpu", trainer="distillation", teacher="no/such-teacher")


def test_a_dataset_without_prompt_is_refused_by_column(tmp_path, tiny_config, teacher_config, capsys):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"chosen": "a", "rejected": "b"}) + "\n")
    rc = main(["lengths", "--trainer", "distillation", "--model", tiny_config, "--dataset", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and "the distillation trainer reads prompt-only data" in err
    assert "DistillationTrainer takes the 'prompt' column" in err and "rename the column" in err


def test_bad_knobs_are_refused_by_name(tmp_path):
    from advisor.emit import load_run_config

    t = get_trainer("distillation")
    (problem,) = t.problems(with_knobs(Candidate(), beta=1.5))
    assert problem.startswith("beta=1.5:") and "[0.0, 1.0]" in problem
    lora_head = Candidate(use_lora=True, lora_target_modules=("q_proj", "lm_head"))
    assert any("LoRA on lm_head" in p for p in t.problems(lora_head))
    data = yaml.safe_load(t.to_yaml(Candidate(), model_name_or_path="m"))
    for key, value, match in (("max_length", 2048, "max_length=2048: an SFT-only key"),
                              ("num_generations", 4, "num_generations=4: an online-RL key"),
                              ("auto_find_batch_size", True, "auto_find_batch_size=True")):
        path = tmp_path / f"{key}.yaml"
        path.write_text(yaml.safe_dump({**data, key: value}))
        with pytest.raises(ConfigError, match=match):
            load_run_config(path, trainer="distillation")


# ---- lengths, the estimate, the simulator, the API ---------------------------------------------------------------
def test_lengths_reports_the_prompts(tiny_config, teacher_config, capsys):
    rc = main(["lengths", "--trainer", "distillation", "--model", tiny_config, "--json",
               "--max-completion-length", "128"])
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    assert rc == 0 and report["prompts"] == 2048 and report["max_completion_length"] == 128


def test_the_estimate_counts_the_teacher_and_the_vocabulary_tiles(tiny_config, teacher_config):
    import advisor

    wl = _workload(tiny_config, teacher_config, gpu="H100-80GB")
    cand = with_knobs(Candidate(per_device_train_batch_size=2), max_completion_length=64)
    m = advisor.estimate(wl, cand)
    assert m.ok
    assert any(n.startswith("vocabulary logits: TRL's chunked divergence") for n in m.notes)
    assert any(n.startswith("teacher: resident") for n in m.notes)
    assert "teacher_and_divergence" in m.time_breakdown
    # a bigger teacher costs more, a 16-bit one less
    from advisor.inputs import build_workload

    own = build_workload(tiny_config, gpu="H100-80GB", trainer="distillation", teacher=tiny_config)
    assert advisor.estimate(own, cand).peak_bytes < m.peak_bytes
    half = advisor.estimate(wl, with_knobs(cand, teacher_dtype="bfloat16"))
    assert half.peak_bytes < m.peak_bytes


def test_simulate_runs_distillation_trainer_with_the_teacher_resident(tiny_config, teacher_config):
    """simulate() through the seam: the fake DistillationTrainer.train() with the teacher TRL builds from its name
    (on meta); a wider teacher is counted in the parameters at the peak."""
    import advisor

    cand = with_knobs(Candidate(per_device_train_batch_size=2, activation_checkpointing=False),
                      max_completion_length=8)
    wl = _workload(tiny_config, teacher_config)
    m = advisor.simulate(wl, cand)
    assert m.ok and m.source.value == "simulate"
    own = _workload(tiny_config, tiny_config)  # the student as its own teacher
    n = advisor.simulate(own, cand)

    def nbytes(spec):
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
        return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))

    assert m.breakdown["parameters"] - n.breakdown["parameters"] == nbytes(wl.model_of("teacher")) - nbytes(wl.model)
    assert any("teacher resident" in note for note in m.notes)


def test_suggest_in_python_takes_the_teacher(tiny_config, teacher_config):
    import advisor

    s = advisor.suggest(tiny_config, gpu="H100-80GB", trainer="distillation", teacher=teacher_config,
                        backend="estimate", trials=6)
    assert s.workload.model_of("teacher").name == teacher_config
    assert type(s.trl_config(use_cpu=True)).__name__ == "DistillationConfig"
    assert yaml.safe_load(s.to_yaml())["teacher_model_name_or_path"] == teacher_config
    with pytest.raises(ConfigError, match="teacher=3: expected a hub id"):
        advisor.suggest(tiny_config, trainer="distillation", teacher=3)
