"""The trainer seam: the registry, DPO's and Reward's emitted configs through `trl dpo` / `trl reward`'s own
parsers, preference data read as DPOTrainer reads it, and DPO's depth extrapolation."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from advisor.errors import ConfigError
from advisor.space import Candidate
from advisor.trainers import Trainer, get_trainer, names
from advisor.trainers.dpo import DPOKnobs, Reference


def test_every_trainer_implements_the_protocol_and_names_its_trl_classes():
    assert set(names()) >= {"sft", "dpo", "reward"}
    for name in names():
        t = get_trainer(name)
        assert isinstance(t, Trainer) and t.name == name
        assert t.trainer_class().__name__.lower().startswith(name)
        assert t.config_class().__name__.lower().startswith(name)
    with pytest.raises(ConfigError, match=r"trainer='ppo': not a trainer the advisor knows; use one of"):
        get_trainer("ppo")  # TRL's PPOTrainer: no module declares it (grpo and rloo do since issue 23)


def _parse(trainer, text: str, tmp_path):
    path = tmp_path / f"{trainer.name}.yaml"
    path.write_text(text)
    parsed = trainer.make_parser().parse_args_and_config(
        ["--config", str(path), "--use_cpu", "True"], return_remaining_strings=True, separate_remaining_strings=True)
    assert parsed[4] == [] and parsed[5] == [], parsed[4:]  # nothing left over
    return parsed


def test_dpo_yaml_goes_through_trl_dpo_and_reads_back(tmp_path):
    dpo = get_trainer("dpo")
    cand = DPOKnobs(precompute_ref_log_probs=True, precompute_ref_batch_size=8).apply(
        Candidate(max_length=512, per_device_train_batch_size=4, gradient_accumulation_steps=2))
    text = dpo.to_yaml(cand, model_name_or_path="Qwen/Qwen2.5-0.5B", dataset_name="trl-lib/ultrafeedback_binarized")
    data = yaml.safe_load(text)
    assert "packing" not in data and "completion_only_loss" not in data  # SFT-only keys are not written
    _, training, model_args, _ = _parse(dpo, text, tmp_path)[:4]
    assert type(training).__name__ == "DPOConfig"
    assert (training.precompute_ref_log_probs, training.precompute_ref_batch_size) == (True, 8)
    assert (training.max_length, training.per_device_train_batch_size, training.gradient_accumulation_steps) == \
        (512, 4, 2)
    assert model_args.use_peft is False
    assert dpo.candidate_from_run_dict(data) == cand
    assert DPOKnobs.of(cand).reference(cand) is Reference.PRECOMPUTED


def test_dpo_lora_yaml_reads_back_with_the_adapters_as_reference(tmp_path):
    dpo = get_trainer("dpo")
    cand = Candidate(use_lora=True, lora_r=8, lora_target_modules=("q_proj", "v_proj"), max_length=256)
    text = dpo.to_yaml(cand, model_name_or_path="m")
    _, training, model_args, _ = _parse(dpo, text, tmp_path)[:4]
    assert model_args.use_peft and model_args.lora_r == 8 and training.precompute_ref_log_probs is False
    back = dpo.candidate_from_run_dict(yaml.safe_load(text))
    assert back == cand and DPOKnobs.of(back).reference(back) is Reference.ADAPTERS_DISABLED


def test_dpo_rules_are_trl_s(tiny_model):
    dpo = get_trainer("dpo")
    synced = DPOKnobs(sync_ref_model=True)
    assert any("sync_ref_model=True with LoRA" in p for p in dpo.problems(synced.apply(Candidate(use_lora=True))))
    both = DPOKnobs(sync_ref_model=True, precompute_ref_log_probs=True).apply(Candidate())
    assert any("together with precompute_ref_log_probs" in p for p in dpo.problems(both))
    with pytest.raises(ConfigError, match=r"precompute_ref_batch_size=0: must be an integer >= 1"):
        dpo.candidate_from_run_dict({"precompute_ref_log_probs": True, "precompute_ref_batch_size": 0})


def test_reward_yaml_goes_through_trl_reward(tmp_path):
    reward = get_trainer("reward")
    cand = Candidate(use_lora=True, lora_r=8, max_length=512, pad_to_multiple_of=64)
    text = yaml.safe_dump(reward.run_config_dict(cand, model_name_or_path="m"), sort_keys=False)
    _, training, model_args, _ = _parse(reward, text, tmp_path)[:4]
    assert type(training).__name__ == "RewardConfig" and training.pad_to_multiple_of == 64
    assert model_args.lora_task_type == "SEQ_CLS"  # PEFT keeps the score head trainable
    assert any("padding_free=True: RewardConfig has no" in p for p in reward.problems(Candidate(padding_free=True)))
    with pytest.raises(ConfigError, match=r"packing=False: an SFT-only key"):
        reward.check_run_keys({"packing": False})


@pytest.mark.parametrize("conversational", [False, True])
def test_a_preference_file_is_tokenized_as_dpotrainer_does(conversational, tmp_path, tiny_model, tiny_tokenizer):
    """load_preferences on a .jsonl equals a real DPOTrainer's prepared dataset of the same file."""
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from advisor.data import load_tokenizer
    from advisor.trainers.preference import load_preferences

    words = "the quick brown fox jumps over the lazy dog".split()
    rows = []
    for i in range(6):
        prompt, good, bad = " ".join(words[: 2 + i]), " ".join(words[i:]), " ".join(words[:3])
        if conversational:
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         "chosen": [{"role": "assistant", "content": good}],
                         "rejected": [{"role": "assistant", "content": bad}]})
        else:
            rows.append({"prompt": prompt, "chosen": " " + good, "rejected": " " + bad})
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_preferences(str(path), tiny_model, tokenizer=str(tiny_tokenizer))
    assert data.conversational is conversational and len(data.rows) == 6

    tok = load_tokenizer(str(tiny_tokenizer), tiny_model)
    model = AutoModelForCausalLM.from_config(tiny_model.hf_config())
    ref = AutoModelForCausalLM.from_config(tiny_model.hf_config())
    args = DPOConfig(output_dir=str(tmp_path / "o"), max_length=None, use_cpu=True, report_to="none")
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, processing_class=tok,
                         train_dataset=datasets.load_dataset("json", data_files=str(path), split="train"))
    real = trainer.train_dataset
    for i, row in enumerate(data.rows):
        for column in ("prompt_ids", "chosen_ids", "rejected_ids"):
            assert row[column] == real[i][column], (i, column)


def _six_layer_dpo(tiny_model, cpu_target, cand):
    from advisor.simulator import simulate
    from advisor.trainers.preference import synthetic_preferences
    from advisor.workload import Goals, Workload

    spec = dataclasses.replace(tiny_model, name="tiny-qwen2-6", config={**tiny_model.config, "num_hidden_layers": 6})
    wl = Workload(model=spec, gpu=cpu_target, goals=Goals(),
                  dataset=synthetic_preferences(vocab_size=1024, rows=16, seed=0, median=64, max_len=256))
    return simulate(wl, cand, "cpu", trainer="dpo"), simulate(wl, cand, "cpu", layers=None, trainer="dpo")


DEPTH_BASE = dict(max_length=128, per_device_train_batch_size=2, precision="fp32", optim="adamw_torch")


@pytest.mark.slow
@pytest.mark.parametrize("fields", [{}, {"use_lora": True, "activation_checkpointing": False}],
                         ids=["separate-copy-ckpt", "adapters-disabled-no-ckpt"])
def test_dpo_default_depths_are_extrapolated_to_the_full_depth_peak(fields, tiny_model, cpu_target):
    """The default simulation builds the 6-layer stream from the 2- and 3-layer runs: the reference's no-grad
    forward (which frees each layer's output in the next layer, and the embedding only at the pass's end) splits
    into identical layers too, and the peak equals the full-depth run's."""
    default, full = _six_layer_dpo(tiny_model, cpu_target, Candidate(**{**DEPTH_BASE, **fields}))
    assert any("layer by layer" in n for n in default.notes), default.notes
    assert default.peak_bytes == pytest.approx(full.peak_bytes, rel=0.001), (default.peak_bytes, full.peak_bytes)


def test_the_offline_default_is_the_synthetic_preference_set(tiny_model):
    import numpy as np

    for name in ("dpo", "reward"):
        data = get_trainer(name).load_dataset(None, tiny_model)
        assert data.synthetic and len(data.rows) == 2048
        assert 250 <= float(np.median(data.chosen_lengths)) <= 350  # the documented median of prompt + chosen
        assert (data.chosen_lengths != data.rejected_lengths).mean() > 0.9  # two completions of their own length
        assert max(max(r["chosen_ids"]) for r in data.rows) < tiny_model.vocab_size
    sft = get_trainer("sft").load_dataset(None, tiny_model)
    assert sft.synthetic and "input_ids" in sft.rows[0]


def test_a_cpu_probe_of_dpo_trains_for_real(tiny_model, cpu_target, tmp_path):
    """The probe's child (advisor/probe/worker.py) runs the real DPOTrainer on preference rows: the policy and
    its reference loaded by TRL from the saved random model, two optimizer steps, each micro-batch 2B sequences."""
    import dataclasses as dc

    from advisor.probing.worker import Heartbeat, run_job
    from advisor.trainers.preference import synthetic_preferences

    data = synthetic_preferences(vocab_size=1024, rows=8, seed=0, median=48, max_len=96)
    cand = Candidate(max_length=64, per_device_train_batch_size=2, precision="fp32", optim="adamw_torch")
    job = {
        "backend": "cpu", "steps": 2, "warmup": 0, "memory_budget_bytes": None, "weights": None, "trainer": "dpo",
        "candidate": cand.to_dict(),
        "model": {"name": tiny_model.name, "config": dict(tiny_model.config), "source": "local", "local_dir": None},
        "gpu": dc.asdict(cpu_target), "goals": {},
        "dataset": {"kind": "preference", "name": data.name, "source": data.source, "dataset_name": None,
                    "rows": [dict(r) for r in data.rows[:4]]},
        "kinds": ["longest", "typical"], "rows_per_step": 2,
    }
    result = run_job(job, tmp_path, Heartbeat(tmp_path / "heartbeat"), "", {})
    assert result["status"] == "ok" and result["peak_bytes"] > 0
    assert len(result["steps"]) == 2
    for step in result["steps"]:
        assert step["shapes"] and step["shapes"][0][0] == 4  # 2 pairs: chosen and rejected
        assert step["trained_tokens"] > 0


@pytest.mark.parametrize("cand", [Candidate(), Candidate(use_lora=True), Candidate(use_lora=True, quantization="4bit")],
                         ids=["full", "lora", "qlora"])
def test_reward_config_reads_back_as_written(cand, tmp_path):
    """What `advisor suggest --trainer reward` writes (LoRA with lora_task_type: SEQ_CLS, the default output_dir)
    reads back into the same candidate; another LoRA task type is refused by name."""
    import yaml

    from advisor.emit import load_run_config
    from advisor.errors import ConfigError
    from advisor.trainers import get_trainer

    data = get_trainer("reward").run_config_dict(cand, model_name_or_path="Qwen/Qwen2.5-0.5B")
    path = tmp_path / "reward.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_run_config(path, trainer="reward").candidate == cand.canonical()
    if cand.use_lora:
        path.write_text(yaml.safe_dump({**data, "lora_task_type": "CAUSAL_LM"}))
        with pytest.raises(ConfigError, match="lora_task_type='CAUSAL_LM'.*SEQ_CLS"):
            load_run_config(path, trainer="reward")
