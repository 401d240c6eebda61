"""Round trips: every file `advisor suggest` writes (the `trl <command>` YAML and, on several GPUs, the accelerate
config; or both in its --json answer) simulates back to the numbers the suggestion measured, and a command reading
those files names only flags it has. The matrix is chosen to break it: one and several GPUs (DDP, FSDP2: the
accelerate config decides), every trainer, online RL with generate, colocated vLLM with and without sleep, vLLM server
mode on 2 GPUs (the TRL file cannot say how many GPUs serve), a reward model given as a model (the file names it),
LoRA and QLoRA."""

from __future__ import annotations

import json

import pytest
import yaml

import advisor
from advisor.accelerate_config import accelerate_config, read_accelerate_config
from advisor.cli import main
from advisor.cli._common import emit_json
from advisor.errors import ConfigError
from advisor.measurement import Source
from advisor.parallelism import Layout, deepspeed_available
from advisor.space import Candidate, with_knobs
from advisor.trainers import get_trainer, launched_candidate

GPU = "H100-80GB"
PINS = {"optim": "adamw_torch_fused", "attn_implementation": "sdpa", "group_by_length": "false"}
ON = {"use_vllm": "true"}


def _served(c: Candidate) -> bool:
    return c.base.get("use_vllm") is True and c.base.get("vllm_mode") == "server" and \
        c.base.get("vllm_server_gpus") == 1


# (trainer, num_gpus, fix, what the pick must be for the case to test what it names)
CASES = [
    pytest.param("sft", 2, {"parallelism": "fsdp2"}, lambda c: c.parallelism is Layout.FSDP2, id="sft-fsdp2"),
    pytest.param("grpo", 2, {**ON, "vllm_mode": "server", "vllm_server_gpus": "1"}, _served, id="grpo-server-2"),
    pytest.param("sft", 1, {"use_peft": "true", "load_in_4bit": "true"},
                 lambda c: c.use_lora and c.quantization.value == "4bit", id="qlora"),
    pytest.param("sft", 1, {}, lambda c: True, id="sft", marks=pytest.mark.slow),
    pytest.param("sft", 2, {"parallelism": "ddp"}, lambda c: c.parallelism is Layout.DDP, id="sft-ddp",
                 marks=pytest.mark.slow),
    pytest.param("sft", 1, {"use_peft": "true"}, lambda c: c.use_lora, id="lora", marks=pytest.mark.slow),
    pytest.param("dpo", 1, {}, lambda c: True, id="dpo", marks=pytest.mark.slow),
    pytest.param("reward", 1, {}, lambda c: True, id="reward", marks=pytest.mark.slow),
    pytest.param("grpo", 1, {"use_vllm": "false"}, lambda c: not c.base.get("use_vllm"), id="grpo-generate",
                 marks=pytest.mark.slow),
    pytest.param("grpo", 1, {**ON, "vllm_mode": "colocate", "vllm_enable_sleep_mode": "false"},
                 lambda c: c.base.get("use_vllm") and not c.base.get("vllm_enable_sleep_mode"), id="grpo-colocate",
                 marks=pytest.mark.slow),
    pytest.param("grpo", 1, {**ON, "vllm_mode": "colocate", "vllm_enable_sleep_mode": "true"},
                 lambda c: c.base.get("vllm_enable_sleep_mode") is True, id="grpo-colocate-sleep",
                 marks=pytest.mark.slow),
    pytest.param("rloo", 1, {}, lambda c: True, id="rloo", marks=pytest.mark.slow),
    pytest.param("grpo", 1, {"use_vllm": "false"}, lambda c: True, id="grpo-reward-model",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("trainer, num_gpus, fix, picked", CASES)
def test_every_file_suggest_writes_simulates_back(trainer, num_gpus, fix, picked, tiny_config, tmp_path, capsys,
                                                   request):
    # a reward model given as a model: the file names it (reward_model_name_or_path), simulate reads it from there
    scorer = {"reward_model": tiny_config} if request.node.callspec.id == "grpo-reward-model" else {}
    s = advisor.suggest(tiny_config, gpu=GPU, backend="simulate", trials=1, cache=False, jobs=1, trainer=trainer,
                        num_gpus=num_gpus, fix={**PINS, **fix}, **scorer)
    m = s.measurement
    assert m.source is Source.SIMULATE and picked(s.candidate), s.candidate
    run = tmp_path / "run.yaml"
    run.write_text(s.to_yaml())  # what `suggest --format yaml -o run.yaml` writes
    argv = ["simulate", "--trainer", trainer, "--model", tiny_config, "--gpu", GPU, "--config", str(run), "--json"]
    if num_gpus > 1:  # and `--accelerate-output accelerate.yaml`
        acc = tmp_path / "accelerate.yaml"
        acc.write_text(s.accelerate_yaml(str(acc), str(run)))
        argv += ["--num-gpus", str(num_gpus), "--accelerate-config", str(acc)]
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    back = json.loads(capsys.readouterr().out)
    for key in ("peak_bytes", "reserved_bytes", "device_bytes", "tokens_per_second"):
        assert back[key] == getattr(m, key), (key, back[key], getattr(m, key))
    # `suggest --json -o answer.json`: the run config (and on several GPUs the accelerate config) in one file
    answer = tmp_path / "answer.json"
    answer.write_text(emit_json(s.to_json_dict()))
    argv = [str(answer) if a in (str(run), str(tmp_path / "accelerate.yaml")) else a for a in argv]
    assert main(argv) == 0, capsys.readouterr().err
    again = json.loads(capsys.readouterr().out)
    assert all(again[k] == back[k] for k in ("peak_bytes", "reserved_bytes", "device_bytes", "tokens_per_second"))
    if num_gpus == 1:  # a one-GPU answer launches without an accelerate config: asking for one is refused
        assert main([*argv, "--accelerate-config", str(answer)]) == 2
        assert "it has no accelerate config" in capsys.readouterr().err


def test_the_server_mode_file_simulates_back_on_two_gpus_without_more(tiny_config, tmp_path, capsys):
    """`suggest --num-gpus 2 --fix vllm_mode=server --fix vllm_server_gpus=1 -o run.yaml`, then `simulate --num-gpus 2
    --config run.yaml`: it was refused with "vllm_server_gpus=0 ... (--fix vllm_server_gpus=K ...)", a flag simulate
    has not: the TRL file cannot hold the split (TRL has no key for it). Two GPUs allow one split: one serves."""
    run = tmp_path / "run.yaml"
    assert main(["suggest", "--trainer", "grpo", "--model", tiny_config, "--gpu", GPU, "--num-gpus", "2", "--backend",
                 "estimate", "--trials", "2", "--jobs", "1", "--no-cache", "--fix", "use_vllm=true", "--fix",
                 "vllm_mode=server", "--fix", "vllm_server_gpus=1", "--format", "yaml", "-o", str(run)]) == 0
    assert yaml.safe_load(run.read_text())["vllm_mode"] == "server"
    capsys.readouterr()
    assert main(["simulate", "--trainer", "grpo", "--model", tiny_config, "--gpu", GPU, "--num-gpus", "2",
                 "--config", str(run), "--json"]) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    assert any("vLLM server mode" in n for n in out["notes"])
    # on three GPUs the file does not say how many serve: the accelerate config does, and the error says so
    assert main(["simulate", "--trainer", "grpo", "--model", tiny_config, "--gpu", GPU, "--num-gpus", "3",
                 "--config", str(run)]) == 2
    err = capsys.readouterr().err
    assert "give --accelerate-config FILE" in err and "--fix" not in err


def test_the_server_split_read_back():
    t = get_trainer("grpo")
    served = with_knobs(Candidate(), use_vllm=True, vllm_mode="server")
    k = t.knobs
    assert k(launched_candidate(t, served, 2)).vllm_server_gpus == 1  # the one split two GPUs allow
    assert k(launched_candidate(t, served, 4, processes=3)).vllm_server_gpus == 1  # the accelerate config's
    assert k(launched_candidate(t, served, 8, processes=5)).vllm_server_gpus == 3
    with pytest.raises(ConfigError, match="give --accelerate-config FILE"):
        launched_candidate(t, served, 4)
    with pytest.raises(ConfigError, match="no GPU is left for `trl vllm-serve`"):
        launched_candidate(t, served, 2, processes=2)
    with pytest.raises(ConfigError, match=r"on --num-gpus 1: server mode runs `trl vllm-serve` on GPUs of its own"):
        launched_candidate(t, served, 1)
    # every GPU trains otherwise: the accelerate config launches them all
    assert launched_candidate(t, Candidate(), 2, processes=2) == Candidate()
    with pytest.raises(ConfigError, match=r"num_processes 1 in the accelerate config .* give --num-gpus 1"):
        launched_candidate(get_trainer("sft"), Candidate(), 2, processes=1)


LAYOUTS = [lay for lay in Layout if deepspeed_available() or not lay.deepspeed]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay.value for lay in LAYOUTS])
def test_the_accelerate_config_reads_back_its_layout(layout, tmp_path):
    cand = Candidate(parallelism=layout, gradient_accumulation_steps=4)
    path = tmp_path / "accelerate.yaml"
    path.write_text(accelerate_config(cand, layout.parallelism, 4).yaml)
    back = read_accelerate_config(path)
    assert (back.layout, back.num_processes, back.num_machines) == (layout, 4, 1)
    back.matches(cand)  # what the TRL file's candidate launches as


@pytest.mark.parametrize("edit, says", [
    ({"fsdp_config": {"fsdp_version": 1}}, "fsdp_config.fsdp_version: 1: FSDP1 is not simulated"),
    ({"fsdp_config": {"fsdp_activation_checkpointing": True}},
     "fsdp_config.fsdp_activation_checkpointing: True: the TRL file launches as False"),
    ({"fsdp_config": {"fsdp_sharding_strategy": "HYBRID_SHARD"}},
     "fsdp_config.fsdp_sharding_strategy: 'HYBRID_SHARD': changes memory and is not simulated; remove it"),
    ({"mixed_precision": "no"}, "mixed_precision: 'no': the TRL file launches as 'bf16'"),
    ({"distributed_type": "XLA"}, "distributed_type: 'XLA': not simulated"),
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 1}},
     "deepspeed_config.zero_stage: 1: the advisor simulates ZeRO-2 and ZeRO-3"),
    ({"num_processes": 0}, "num_processes: 0: a whole number >= 1"),
])
def test_an_accelerate_config_the_advisor_does_not_simulate_is_refused_by_key(edit, says, tmp_path):
    cand = Candidate(parallelism=Layout.FSDP2)
    data = accelerate_config(cand, Layout.FSDP2.parallelism, 2).config
    for key, value in edit.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and key in data else value
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=f"--accelerate-config {path}") as info:
        read_accelerate_config(path).matches(cand)
    assert any(says in p for p in info.value.problems), info.value.problems


def test_simulate_reads_the_layout_from_the_accelerate_config(tiny_config, tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text(get_trainer("sft").to_yaml(Candidate(), model_name_or_path=tiny_config))
    acc = tmp_path / "accelerate.yaml"
    acc.write_text(accelerate_config(Candidate(), Layout.FSDP2.parallelism, 2).yaml)
    base = ["simulate", "--model", tiny_config, "--gpu", GPU, "--config", str(run), "--json", "--num-gpus", "2"]
    assert main([*base, "--accelerate-config", str(acc)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert any("FSDP2 on 2 ranks" in n for n in out["notes"])
    assert main([*base, "--accelerate-config", str(acc), "--parallelism", "ddp"]) == 2
    assert "--parallelism ddp with --accelerate-config" in capsys.readouterr().err
    assert main([*base[:-2], "--num-gpus", "4", "--accelerate-config", str(acc)]) == 2
    assert "num_processes 2 in the accelerate config (--accelerate-config) with --num-gpus 4" in \
        capsys.readouterr().err


def test_a_rule_broken_in_a_file_names_the_files_key(tiny_config, tmp_path, capsys):
    """Sleep mode with expandable segments: the rule's fix is a --fix for suggest; simulate says the file's key."""
    t = get_trainer("grpo")
    cand = with_knobs(Candidate(expandable_segments=True), use_vllm=True, vllm_enable_sleep_mode=True)
    run = tmp_path / "run.yaml"
    run.write_text(t.to_yaml(cand, model_name_or_path=tiny_config))
    assert main(["simulate", "--trainer", "grpo", "--model", tiny_config, "--gpu", GPU, "--config", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Expandable segments are not compatible with memory pool" in err and "--fix" not in err
    assert f"env PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF: expandable_segments:False in --config {run}" in err


@pytest.mark.parametrize("trainer", ["grpo", "rloo", "dpo"])
def test_a_file_of_another_trainer_names_the_trainer_flag(trainer, tiny_config, tmp_path, capsys):
    """The issue's command had no --trainer: a GRPO file read as the default sft's listed every GRPO key as unknown,
    never saying which --trainer reads it."""
    run = tmp_path / "run.yaml"
    run.write_text(get_trainer(trainer).to_yaml(Candidate(), model_name_or_path=tiny_config))
    assert main(["simulate", "--model", tiny_config, "--gpu", GPU, "--config", str(run)]) == 2
    err = capsys.readouterr().err
    assert "config, not `trl sft`'s: give " in err and f"--trainer {trainer}" in err
