"""Every trainer through one seam: what is emitted and measured for DPO and Reward is what SFT gets, by
the trainer's own declarations: the launch line runs `trl <command>`, `--sample N` reads N pairs, a QLoRA pick's
snippet and config object carry the 4-bit config with the YAML's kwargs."""

from __future__ import annotations

import json

import pytest

import advisor
from advisor.cli import main


def test_a_two_gpu_dpo_pick_launches_trl_dpo(tiny_config):
    s = advisor.suggest(tiny_config, gpu="cpu", trainer="dpo", backend="estimate", trials=4, cache=False,
                        num_gpus=2)
    launch = s.launch("acc.yaml", "run.yaml")
    assert launch.command.endswith("-m trl.scripts.dpo --config run.yaml"), launch.command
    assert launch.trl_command.startswith("trl dpo --config run.yaml --accelerate_config acc.yaml")
    assert "trl.scripts.sft" not in s.to_yaml() and "trl sft" not in s.to_yaml()
    assert s.to_json_dict()["launch_command"] == launch.command.replace("acc.yaml", "accelerate.yaml").replace(
        "run.yaml", "trl.yaml")


def _pairs_file(tmp_path, n=300):
    path = tmp_path / "pairs.jsonl"
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt_ids": [5 + i % 7] * (4 + i % 11), "chosen_ids": [9] * (3 + i % 13),
                                "rejected_ids": [11] * (2 + i % 5)}) + "\n")
    return str(path)


@pytest.mark.parametrize("trainer", ["dpo", "reward"])
def test_sample_reads_that_many_pairs(trainer, tiny_config, tmp_path, capsys):
    from advisor.inputs import WorkloadRef, build_workload

    data = _pairs_file(tmp_path)
    wl = build_workload(tiny_config, gpu="cpu", dataset=data, sample=100, trainer=trainer)
    assert len(wl.dataset.rows) == 100 and wl.dataset.population == 300 and wl.dataset.sampled
    assert any("sample (seed 0) of 100 of 300 pairs" in n for n in wl.dataset.notes)
    # the same seeded sample again (a study's spec, a baseline rebuild it from the ref)
    ref = WorkloadRef.of(wl, model=tiny_config, dataset=data)
    assert ref.sample == 100 and ref.build().fingerprint() == wl.fingerprint()
    assert main(["lengths", "--trainer", trainer, "--model", tiny_config, "--dataset", data, "--sample", "100",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pairs"] == 100


def _snippet_calls(text: str) -> dict[str, dict]:
    """The snippet's calls by name (DPOConfig, BitsAndBytesConfig, ...) with their literal keyword arguments."""
    import ast

    out = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            out[node.func.id] = {k.arg: (ast.literal_eval(k.value) if not isinstance(k.value, ast.Name) else
                                         k.value.id) for k in node.keywords}
    return out


@pytest.mark.parametrize("trainer", ["sft", "dpo", "reward"])
def test_qlora_snippet_and_trl_config_carry_the_4bit_config_as_the_yaml_does(trainer, tiny_config, tmp_path):
    import yaml
    from trl import ModelConfig, get_quantization_config

    from advisor.space import Candidate
    from advisor.suggestion import Suggestion
    from advisor.trainers import get_trainer

    wl = advisor.build_workload(tiny_config, gpu="cpu", trainer=trainer)
    cand = Candidate(use_lora=True, quantization="4bit", precision="bf16", weights_dtype="bfloat16",
                     per_device_train_batch_size=2, max_length=256)
    s = Suggestion(workload=wl, candidate=cand, measurement=advisor.estimate(wl, cand))
    t = get_trainer(trainer)
    data = yaml.safe_load(s.to_yaml())
    assert data["load_in_4bit"] is True and data["bnb_4bit_quant_type"] == "nf4"
    # what `trl <command>` makes of the YAML: its ModelConfig's BitsAndBytesConfig
    path = tmp_path / "run.yaml"
    path.write_text(s.to_yaml())
    parsed = t.make_parser().parse_args_and_config(["--config", str(path), "--use_cpu", "True"],
                                                   return_remaining_strings=True, separate_remaining_strings=True)
    model_args = next(p for p in parsed if isinstance(p, ModelConfig))
    want = get_quantization_config(model_args)
    assert want is not None and want.load_in_4bit

    calls = _snippet_calls(s.to_python())
    cfg = t.config_class().__name__
    assert "BitsAndBytesConfig" in calls, s.to_python()
    bnb = calls["BitsAndBytesConfig"]
    assert bnb["load_in_4bit"] is True
    assert bnb["bnb_4bit_quant_type"] == want.bnb_4bit_quant_type
    assert bnb["bnb_4bit_compute_dtype"] == str(want.bnb_4bit_compute_dtype).removeprefix("torch.")
    assert bnb["bnb_4bit_use_double_quant"] == want.bnb_4bit_use_double_quant
    assert calls[t.trainer_class().__name__]["quantization_config"] == "quantization_config"
    # the snippet's config kwargs equal the YAML's keys of that config
    config_fields = {f for f in t.config_class().__dataclass_fields__}
    yaml_kwargs = {k: v for k, v in data.items() if k in config_fields}
    snippet_kwargs = {k: v for k, v in calls[cfg].items() if k != "model_init_kwargs"}
    yaml_kwargs.pop("model_init_kwargs", None)
    assert snippet_kwargs == yaml_kwargs

    config = s.trl_config(output_dir=str(tmp_path / "out"), use_cpu=True)
    qc = config.model_init_kwargs["quantization_config"]
    assert qc.load_in_4bit and qc.bnb_4bit_quant_type == want.bnb_4bit_quant_type
    assert qc.bnb_4bit_compute_dtype == want.bnb_4bit_compute_dtype


def test_registering_a_taken_name_is_refused_and_choices_come_from_the_registry():
    from advisor.cli import _common
    from advisor.errors import ConfigError
    from advisor.trainers import DEFAULT, choices, get_trainer, names, register
    from advisor.trainers.sft import SFT

    assert set(choices()) == set(names()) and DEFAULT in choices()
    sft = get_trainer("sft")
    assert register(sft) is sft  # the same object again (a module imported twice) is no new declaration
    with pytest.raises(ConfigError, match=r"name='sft': already registered \(advisor\.trainers\.sft\.SFT\)"):
        register(SFT())
    assert get_trainer("sft") is sft

    import argparse

    parser = argparse.ArgumentParser()
    _common.add_workload_args(parser)
    action = next(a for a in parser._actions if a.dest == "trainer")
    assert tuple(action.choices) == choices() and action.default == DEFAULT


def test_memory_reserved_outside_the_allocator_counts_in_device_bytes_and_fit():
    from advisor.measurement import Category, Measurement, Source, Status

    cpu = Measurement(Status.OK, Source.SIMULATE, peak_bytes=1000, reserved_bytes=1200, tokens_per_second=1.0,
                      outside_allocator_bytes=500)
    assert cpu.budget_bytes == 1700 and cpu.fits(1700) and not cpu.fits(1699) and not cpu.feasible(1699)
    gpu = Measurement(Status.OK, Source.ESTIMATE, peak_bytes=1000, reserved_bytes=1200, device_bytes=2300,
                      breakdown={"parameters": 1000, Category.OUTSIDE_ALLOCATOR.value: 500}, tokens_per_second=1.0,
                      outside_allocator_bytes=500)
    assert gpu.budget_bytes == 2300 and not gpu.fits(2299) and gpu.fits(2300)
    assert Measurement.from_dict(gpu.to_dict()) == gpu
    plain = Measurement(Status.OK, Source.ESTIMATE, peak_bytes=1)
    assert "outside_allocator_bytes" not in plain.to_dict()


