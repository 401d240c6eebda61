"""GRPO and RLOO on the trainer seam (advisor/trainers/online_trainer.py, online_knobs.py, online_space.py,
online_files.py, grpo.py, rloo.py): the registry, the knobs'
TRL 1.16 defaults read back from the installed configs, the files through `trl grpo` / `trl rloo`'s own parser with
nothing left over, the config objects, the snippet, server mode's GPU split, the search space at a fixed
number of completions per optimizer step, and each bad input as a ConfigError naming the key and the fix."""

from __future__ import annotations

import ast
import dataclasses
import json

import pytest
import yaml

from advisor.cli import main
from advisor.errors import ConfigError
from advisor.space import Candidate, with_knobs
from advisor.trainers import choices, get_trainer, names
from advisor.trainers.online_knobs import KNOBS

ONLINE = ("grpo", "rloo")


def _online(c: Candidate | None = None, **knobs) -> Candidate:
    return with_knobs(c or Candidate(), **knobs)


# ---- the registry and the declarations ---------------------------------------------------------------------------
def test_grpo_and_rloo_are_built_in_trainers():
    assert {"grpo", "rloo"} <= set(choices()) and {"grpo", "rloo"} <= set(names())
    for name, cfg, tr in (("grpo", "GRPOConfig", "GRPOTrainer"), ("rloo", "RLOOConfig", "RLOOTrainer")):
        t = get_trainer(name)
        assert t.command == name and t.config_name == cfg and t.trainer_name == tr
        assert t.step_shape(Candidate()).generates and t.knob_view.KNOBS == KNOBS
        assert t.config_class().__name__ == cfg and t.trainer_class().__name__ == tr


@pytest.mark.parametrize("name", ONLINE)
def test_knob_defaults_are_the_installed_configs(name):
    """Every declared knob's default (or the trainer's own, where GRPO and RLOO differ) is the installed config's."""
    cls = get_trainer(name).config_class()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    view = get_trainer(name).knob_view
    k = view.of(Candidate())
    for kn in KNOBS:
        if kn.key not in fields:
            continue  # vllm_server_gpus (the launch), GRPO's own knobs on RLOO
        default = fields[kn.key].default
        assert getattr(k, kn.name) == default, kn.name
    assert view.DEFAULTS == {n: fields[n].default for n in view.DEFAULTS}
    assert (fields["beta"].default, fields["num_generations"].default) == {"grpo": (0.0, 8), "rloo": (0.05, 2)}[name]


def test_the_users_quality_knobs_are_never_searched():
    by = {k.name: k for k in KNOBS}
    for name in ("num_generations", "max_completion_length", "beta", "num_iterations", "cast_lm_head_to_fp32"):
        assert by[name].search is None, name
    # the generation engine is searched as one dimension from the target (OnlineRLTrainer.search_values /
    # joint_dimensions: tests/test_grpo_space.py), not by a static `search` of use_vllm
    assert by["steps_per_generation"].search is not None


# ---- the files: trl grpo / trl rloo's own parser, nothing left over -----------------------------------------------
CASES = {
    "defaults": {},
    "lora-beta": {"use_lora": True, "beta": 0.04, "num_iterations": 2, "steps_per_generation": 2,
                  "gradient_accumulation_steps": 2, "max_completion_length": 256},
    "colocate-sleep": {"use_vllm": True, "vllm_enable_sleep_mode": True, "vllm_gpu_memory_utilization": 0.45,
                       "expandable_segments": False},
    "generation-batch": {"generation_batch_size": 16, "num_generations": 4},
}


@pytest.mark.parametrize("name", ONLINE)
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_yaml_goes_through_trls_own_parser_and_reads_back(name, case, tmp_path, monkeypatch):
    from advisor.emit import load_run_config

    t = get_trainer(name)
    fields = {k: v for k, v in CASES[case].items() if not (name == "rloo" and k == "cast_lm_head_to_fp32")}
    cand = _online(**fields)
    assert t.problems(cand) == []
    text = t.to_yaml(cand, model_name_or_path="Qwen/Qwen2.5-0.5B", dataset_name="trl-lib/DeepMath-103K")
    data = yaml.safe_load(text)
    # every memory-relevant field explicit, the reward in the script's keys, both allocator variables
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
                "max_completion_length", "num_iterations", "beta", "use_vllm", "vllm_mode",
                "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "ds3_gather_for_generation",
                "activation_checkpointing", "bf16", "optim", "use_liger_kernel"):
        assert key in data, key
    assert data["reward_funcs"] == ["get_soft_overlong_punishment"]
    on = str(cand.expandable_segments)
    assert data["env"] == {"PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{on}",
                           "PYTORCH_ALLOC_CONF": f"expandable_segments:{on}"}
    path = tmp_path / "run.yaml"
    path.write_text(text)
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    script, config, model_args, mixture, config_left, args_left = t.make_parser().parse_args_and_config(
        ["--config", str(path), "--use_cpu", "True"], return_remaining_strings=True, separate_remaining_strings=True)
    assert config_left == [] and args_left == []
    assert type(config).__name__ == t.config_name
    assert script.reward_funcs == ["get_soft_overlong_punishment"]
    k = t.knobs(cand)
    assert (config.num_generations, config.beta, config.max_completion_length) == (
        k.num_generations, k.beta, k.max_completion_length)
    assert config.generation_batch_size == k.generation_batch(cand)
    assert config.use_vllm == k.use_vllm and config.vllm_enable_sleep_mode == k.vllm_enable_sleep_mode
    assert load_run_config(path, trainer=name).candidate == cand


@pytest.mark.parametrize("name", ONLINE)
def test_trl_config_and_the_snippet_build_the_trainers_objects(name):
    t = get_trainer(name)
    cand = _online(use_lora=True, beta=0.1, use_vllm=True)
    config = t.trl_config(cand, use_cpu=True)
    assert type(config).__name__ == t.config_name
    assert (config.use_vllm, config.beta, config.vllm_mode) == (True, 0.1, "colocate")
    snippet = t.to_python(cand, model_name_or_path="Qwen/Qwen2.5-0.5B")
    ast.parse(snippet)
    assert f"from trl import {t.config_name}, {t.trainer_name}" in snippet
    assert "from trl.rewards import get_soft_overlong_punishment" in snippet
    assert "reward_funcs=[get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)]" in snippet
    assert "peft_config=peft_config" in snippet
    assert "os.environ.setdefault('PYTORCH_CUDA_ALLOC_CONF'" in snippet
    assert "os.environ.setdefault('PYTORCH_ALLOC_CONF'" in snippet
    # a reward model given by id is the trainer's first reward, as trl grpo passes it
    rm = cand.replace(base={**cand.base.as_dict(), "reward_model_name_or_path": "org/rm"})
    assert "reward_funcs=['org/rm']" in t.to_python(rm, model_name_or_path="m")
    assert yaml.safe_load(t.to_yaml(rm, model_name_or_path="m"))["reward_model_name_or_path"] == "org/rm"


def test_the_suggestion_builds_the_trainers_config(tiny_model, h100_target):
    from advisor.measurement import Measurement, Source, Status
    from advisor.suggestion import Suggestion
    from advisor.trainers.prompts import synthetic_prompts
    from advisor.workload import Goals, Workload

    wl = Workload(model=tiny_model, gpu=h100_target, dataset=synthetic_prompts(1024, rows=32), goals=Goals(),
                  trainer="rloo")
    m = Measurement(status=Status.OK, peak_bytes=1, source=Source.ESTIMATE)
    s = Suggestion(workload=wl, candidate=_online(beta=0.0), measurement=m)
    cfg = s.trl_config(use_cpu=True)
    assert type(cfg).__name__ == "RLOOConfig" and cfg.beta == 0.0
    assert "trl rloo --config THIS_FILE" in s.to_yaml()


def test_old_policy_forward_follows_trls_rule():
    k = get_trainer("grpo").knobs
    assert not k(Candidate()).old_policy_forward(Candidate())
    c = _online(num_iterations=2)
    assert k(c).old_policy_forward(c)  # GA 1 % (spg 1 x 2) != 0
    c = _online(use_vllm=True)
    assert k(c).old_policy_forward(c)  # vLLM's importance-sampling correction
    c = _online(use_vllm=True, vllm_importance_sampling_correction=False)
    assert not k(c).old_policy_forward(c)
    rloo = get_trainer("rloo")
    assert rloo.knobs(Candidate()).old_logps_always and rloo.knobs(Candidate()).old_policy_forward(Candidate())
    assert rloo.knob_view.DEFAULTS == {"num_generations": 2, "beta": 0.05}


# ---- server mode: the GPUs split, the accelerate config counts the training ones ------------------------------------
def test_server_mode_names_vllm_serve_and_the_gpu_split(tiny_model, h100_target):
    from advisor.accelerate_config import check_loads
    from advisor.measurement import Measurement, Source, Status
    from advisor.suggestion import Suggestion
    from advisor.trainers.prompts import synthetic_prompts
    from advisor.workload import Goals, Workload

    wl = Workload(model=tiny_model, gpu=h100_target, dataset=synthetic_prompts(1024, rows=32), goals=Goals(),
                  trainer="grpo", num_gpus=4)
    cand = _online(use_vllm=True, vllm_mode="server", vllm_server_gpus=1)
    s = Suggestion(workload=wl, candidate=cand,
                   measurement=Measurement(status=Status.OK, peak_bytes=1, source=Source.ESTIMATE))
    lc = s.launch()
    assert lc.config["num_processes"] == 3
    assert lc.server == "CUDA_VISIBLE_DEVICES=3 trl vllm-serve --model tiny-qwen2 --tensor-parallel-size 1"
    assert lc.command.startswith("CUDA_VISIBLE_DEVICES=0,1,2 accelerate launch")
    check_loads(lc.yaml)
    assert "trl vllm-serve --model tiny-qwen2" in s.to_yaml()
    assert yaml.safe_load(s.to_yaml())["vllm_mode"] == "server"


# ---- the data ------------------------------------------------------------------------------------------------------
def test_prompt_data_is_a_dataset(tmp_path, tiny_model, tiny_tokenizer):
    from advisor.data import Dataset
    from advisor.trainers.prompts import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"hello world number {i}"}) + "\n" for i in range(10)))
    data = load_prompts(str(path), tiny_model, str(tiny_tokenizer), trainer="grpo", sample=4, seed=1)
    assert isinstance(data, Dataset) and data.unit == "prompts" and len(data.rows) == 4
    assert data.sampled and data.population == 10 and data.truncated_share(None) == 0.0
    assert list(data.trained_tokens(None, max_completion_length=64, num_generations=8)) == [512] * 4
    assert data.trained_tokens_per_row(_online(max_completion_length=64)) == 64.0
    conv = tmp_path / "c.jsonl"
    conv.write_text(json.dumps({"prompt": [{"role": "user", "content": "hello world"}]}) + "\n")
    assert load_prompts(str(conv), tiny_model, str(tiny_tokenizer), trainer="rloo").conversational


def test_the_space_varies_the_micro_batch_at_fixed_completions_per_step(tiny_model, cpu_target):
    from advisor.search import RowTokens, default_space, default_tokens_per_step, with_accumulation
    from advisor.trainers.prompts import synthetic_prompts
    from advisor.workload import Goals, Method, Workload

    wl = Workload(model=tiny_model, gpu=cpu_target, dataset=synthetic_prompts(1024, rows=32), goals=Goals(),
                  trainer="rloo")
    space = default_space(wl, Method.FULL)
    assert space.values["max_length"] == (1024,)  # RLOOConfig has no max_length
    for held in ("num_generations", "max_completion_length", "beta"):
        assert held not in space.values
    rows = RowTokens(wl.dataset)
    tps = default_tokens_per_step(wl, rows)
    assert tps == 8 * 512  # TRL's 8 completions of max_completion_length a step
    t = get_trainer("rloo")
    seen = set()
    for b in (1, 2, 4, 8):
        c = with_accumulation(Candidate(per_device_train_batch_size=b), tps, rows)
        assert c.per_device_train_batch_size * c.gradient_accumulation_steps == 8
        assert t.problems(c) == []
        seen.add(b)
    assert seen == {1, 2, 4, 8}
    # steps_per_generation 1 generates each micro-batch alone; it must still hold whole groups (TRL's rule)
    assert t.problems(_online(Candidate(per_device_train_batch_size=2, gradient_accumulation_steps=4),
                              steps_per_generation=1)) == []
    assert any("must be divisible by num_generations" in p for p in t.problems(
        _online(Candidate(per_device_train_batch_size=1, gradient_accumulation_steps=8), steps_per_generation=1)))


# ---- bad input: a ConfigError naming the key and the fix, exit 2 on the CLI -----------------------------------------
def test_a_dataset_without_prompt_is_refused_by_column(tmp_path, tiny_config, capsys):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    rc = main(["lengths", "--trainer", "grpo", "--model", tiny_config, "--dataset", str(path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "has no 'prompt' column" in err and "rename the column" in err and "without its last assistant" in err


@pytest.mark.parametrize("name", ONLINE)
def test_num_generations_that_does_not_divide_the_generation_batch(name, tmp_path, tiny_config, capsys):
    t = get_trainer(name)
    bad = _online(Candidate(per_device_train_batch_size=4), num_generations=3)
    (problem,) = t.problems(bad)
    assert problem.startswith("num_generations=3:") and "generation_batch_size (4) must be divisible by " \
        "num_generations (3)" in problem and "make per_device_train_batch_size x steps_per_generation" in problem
    path = tmp_path / "run.yaml"
    path.write_text(t.to_yaml(bad, model_name_or_path="m"))
    rc = main(["simulate", "--trainer", name, "--model", tiny_config, "--gpu", "H100-80GB-SXM", "--config",
               str(path)])
    assert rc == 2 and "generation_batch_size (4) must be divisible by num_generations (3)" in capsys.readouterr().err


def test_use_liger_loss_is_refused_with_its_replacement(tmp_path, tiny_config, capsys):
    t = get_trainer("grpo")
    path = tmp_path / "run.yaml"
    data = yaml.safe_load(t.to_yaml(Candidate(), model_name_or_path="m"))
    data["use_liger_loss"] = True
    path.write_text(yaml.safe_dump(data))
    rc = main(["simulate", "--trainer", "grpo", "--model", tiny_config, "--gpu", "H100-80GB-SXM", "--config",
               str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and "use_liger_loss=True: `use_liger_loss` was removed from TRL" in err
    assert "use_liger_kernel" in err and "use_kernels" in err
    rc = main(["suggest", "--trainer", "grpo", "--model", tiny_config, "--gpu", "H100-80GB-SXM", "--backend",
               "estimate", "--fix", "use_liger_loss=true"])
    err = capsys.readouterr().err
    assert rc == 2 and "--fix use_liger_loss=true: `use_liger_loss` was removed from TRL" in err


def test_server_mode_without_server_gpus(tmp_path, tiny_config, capsys):
    t = get_trainer("grpo")
    cand = _online(use_vllm=True, vllm_mode="server")
    assert any(p.startswith("vllm_mode='server' with vllm_server_gpus=0") for p in t.problems(cand))
    path = tmp_path / "run.yaml"
    path.write_text(t.to_yaml(cand, model_name_or_path="m"))
    # a server-mode file read back on one GPU: the file cannot say how many serve, and one GPU leaves none to train;
    # the error names the flags simulate has (it has no --fix)
    rc = main(["simulate", "--trainer", "grpo", "--model", tiny_config, "--gpu", "H100-80GB-SXM", "--config",
               str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and "vllm_mode='server' on --num-gpus 1" in err and "give --num-gpus N (N >= 2" in err
    assert "--fix" not in err
    # one server GPU of one: none left to train
    one = _online(use_vllm=True, vllm_mode="server", vllm_server_gpus=1)
    assert t.problems(one) == []
    (problem,) = t.check_world(one, 1)
    assert "vllm_server_gpus=1 of --num-gpus 1: no GPU is left to train" in problem
    with pytest.raises(ConfigError, match="no GPU is left to train"):
        t.gpu_split(one, "m", 1)


@pytest.mark.parametrize("name", ONLINE)
def test_auto_find_batch_size_is_refused(name, tmp_path):
    from advisor.emit import load_run_config

    t = get_trainer(name)
    data = yaml.safe_load(t.to_yaml(Candidate(), model_name_or_path="m"))
    data["auto_find_batch_size"] = True
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"auto_find_batch_size=True: .* set auto_find_batch_size: false"):
        load_run_config(path, trainer=name)


def test_sft_only_keys_and_sleep_with_expandable_segments_are_refused(tmp_path):
    from advisor.emit import load_run_config

    t = get_trainer("grpo")
    data = yaml.safe_load(t.to_yaml(Candidate(), model_name_or_path="m"))
    data["max_length"] = 2048
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="max_length=2048: an SFT-only key"):
        load_run_config(path, trainer="grpo")
    sleepy = _online(use_vllm=True, vllm_enable_sleep_mode=True)  # expandable_segments on (the default)
    assert any("Expandable segments are not compatible with memory pool" in p for p in t.problems(sleepy))
    cpu = Candidate(expandable_segments=False)
    from advisor.workload import GPUSpec

    target = GPUSpec(name="cpu", kind="cpu", memory_bytes=2**34, bf16_tflops=1, fp16_tflops=1, fp32_tflops=1,
                     memory_bandwidth_gbs=1, supports_bf16=True, supports_flash_attention=False)
    assert any("vLLM generates on CUDA GPUs only" in p for p in t.problems(_online(cpu, use_vllm=True), target))


def test_a_reward_model_is_part_of_the_workload_and_the_files(tiny_config):
    from advisor.inputs import WorkloadRef, build_workload

    wl = build_workload(tiny_config, gpu="H100-80GB-SXM", trainer="grpo", reward_model=tiny_config)
    plain = build_workload(tiny_config, gpu="H100-80GB-SXM", trainer="grpo")
    assert wl.model_of("reward_model") is not None and wl.fingerprint() != plain.fingerprint()
    ref = WorkloadRef.of(wl)
    assert WorkloadRef.from_spec(ref.to_spec()).models == (("reward_model", tiny_config),)
    assert WorkloadRef.from_dict(ref.to_dict()).build().fingerprint() == wl.fingerprint()
    data = get_trainer("grpo").run_config_dict(Candidate(), model_name_or_path="m", workload=wl)
    assert data["reward_model_name_or_path"] == tiny_config and "reward_funcs" not in data
    with pytest.raises(ConfigError, match="trainer 'sft' takes no reward model; use --trainer grpo or rloo"):
        build_workload(tiny_config, gpu="H100-80GB-SXM", reward_model=tiny_config)


def test_the_estimate_counts_a_reward_model(tiny_config):
    """The online estimate counts its training micro-batch as an SFT workload; that workload kept the reward model,
    which an SFT workload refuses, so every GRPO estimate with --reward-model ended in an error (and a search with it
    found nothing)."""
    from advisor.estimator import estimate
    from advisor.inputs import build_workload
    from advisor.measurement import Category

    scored = estimate(build_workload(tiny_config, gpu="H100-80GB-SXM", trainer="grpo", reward_model=tiny_config),
                      Candidate())
    plain = estimate(build_workload(tiny_config, gpu="H100-80GB-SXM", trainer="grpo"), Candidate())
    assert scored.ok and plain.ok, scored.message
    params = Category.PARAMETERS.value
    assert scored.breakdown[params] == 2 * plain.breakdown[params]  # the policy's weights again, resident


def test_simulate_reads_the_reward_model_the_file_names(tiny_config, tmp_path, capsys):
    """The file `suggest --reward-model ID` writes names it (reward_model_name_or_path, as trl grpo loads it);
    `simulate --config` took the model and the data from the file but not the reward model, so it simulated the step
    without it (a smaller peak than the suggestion's, by the reward model's weights)."""
    from advisor.inputs import build_workload

    wl = build_workload(tiny_config, gpu="H100-80GB-SXM", trainer="grpo", reward_model=tiny_config)
    run = tmp_path / "run.yaml"
    run.write_text(get_trainer("grpo").to_yaml(Candidate(), model_name_or_path=tiny_config, workload=wl))
    assert yaml.safe_load(run.read_text())["reward_model_name_or_path"] == tiny_config
    argv = ["simulate", "--trainer", "grpo", "--model", tiny_config, "--gpu", "H100-80GB-SXM", "--config"]
    assert main([*argv, str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert any("1 reward model(s) resident" in n for n in out["notes"])
    bad = tmp_path / "bad.yaml"  # a reward model that is not there: the error names the file's key
    bad.write_text(yaml.safe_dump({**yaml.safe_load(run.read_text()),
                                   "reward_model_name_or_path": str(tmp_path / "missing")}))
    assert main([*argv, str(bad)]) == 2
    assert f"--config {bad}: reward_model_name_or_path" in capsys.readouterr().err


def test_reward_model_flag_on_the_cli(tiny_config, capsys):
    rc = main(["suggest", "--trainer", "sft", "--model", tiny_config, "--gpu", "H100-80GB-SXM", "--backend",
               "estimate", "--reward-model", tiny_config])
    assert rc == 2 and "drop --reward-model" in capsys.readouterr().err


def test_vllm_is_a_requirement_of_the_pick():
    assert "vllm" in _online(use_vllm=True).requirements() and "vllm" not in Candidate().requirements()


def test_lengths_reports_the_prompts(tiny_config, capsys):
    rc = main(["lengths", "--trainer", "rloo", "--model", tiny_config, "--json"])
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    assert rc == 0 and report["prompts"] == 2048 and report["max_completion_length"] == 512
    assert report["prompt_completion"]["max"] == report["prompt"]["max"] + 512


def test_the_search_admits_each_micro_batch_with_its_accumulation():
    """TRL's rule on the generation batch depends on the accumulation the search derives for a micro-batch: a
    micro-batch of 1 completion is admitted with its 8 accumulation steps (generation batch 8, one group of 8)."""
    from advisor.profiles import resolve_gpu, resolve_model
    from advisor.search import RowTokens, StudySpace, build_space, default_tokens_per_step
    from advisor.trainers.prompts import synthetic_prompts
    from advisor.workload import Goals, Method, Workload

    m = resolve_model("Qwen/Qwen2.5-0.5B")
    wl = Workload(model=m, gpu=resolve_gpu("H100-80GB"), dataset=synthetic_prompts(m.vocab_size, rows=64),
                  goals=Goals(), trainer="grpo")
    rows = RowTokens(wl.dataset)
    space = StudySpace(wl, build_space(wl, Method.FULL), default_tokens_per_step(wl, rows), rows)
    admitted = {(c.per_device_train_batch_size, c.gradient_accumulation_steps) for c in space._walk()
                if not isinstance(c, str)}
    assert admitted == {(1, 8), (2, 4), (4, 2), (8, 1)}
