"""`--trainer dpo` end to end: the offline suggest on the synthetic preference set, its YAML through `trl dpo`'s own
parser with nothing left over, the DPOConfig object and snippet, the bad inputs (SFT data, an SFT-only key) exiting
2 by name, the lengths report for pairs, a baseline that records its trainer, and a cpu probe of the pick that
trains the real DPOTrainer."""

from __future__ import annotations

import json

import pytest
import yaml

from advisor.cli import main


def _suggest(cfg, *more):
    return ["suggest", "--trainer", "dpo", "--model", cfg, "--gpu", "cpu", "--backend", "estimate", "--trials", "6",
            "--no-cache", *more]


def _parse_dpo(path):
    """`trl dpo --config FILE`'s own parser (ScriptArguments, DPOConfig, ModelConfig): nothing may be left over."""
    from trl import DPOConfig, ModelConfig, ScriptArguments, TrlParser

    parser = TrlParser((ScriptArguments, DPOConfig, ModelConfig))
    parsed = parser.parse_args_and_config(["--config", str(path), "--use_cpu", "True"],
                                          return_remaining_strings=True, separate_remaining_strings=True)
    assert parsed[3] == [] and parsed[4] == [], parsed[3:]  # no key of the file and no argument left over
    return parsed


def test_offline_dpo_suggest_writes_a_yaml_trl_dpo_accepts(tiny_config, tmp_path, capsys):
    out = tmp_path / "run.yaml"
    assert main(_suggest(tiny_config, "--format", "yaml", "-o", str(out))) == 0
    text = out.read_text()
    data = yaml.safe_load(text)
    assert "run: trl dpo --config" in text
    assert "packing" not in data and "completion_only_loss" not in data  # SFT-only keys are not written
    assert isinstance(data["precompute_ref_log_probs"], bool) and data["per_device_train_batch_size"] >= 1
    _, training, model_args = _parse_dpo(out)[:3]
    assert type(training).__name__ == "DPOConfig"
    assert training.max_length == data["max_length"]
    assert training.precompute_ref_log_probs is data["precompute_ref_log_probs"]
    assert (training.per_device_train_batch_size, training.gradient_accumulation_steps) == \
        (data["per_device_train_batch_size"], data["gradient_accumulation_steps"])
    assert model_args.use_peft is (data.get("use_peft") is True)


def test_the_python_api_builds_a_dpoconfig_and_a_snippet(tiny_config):
    from trl import DPOConfig

    import advisor

    s = advisor.suggest(tiny_config, gpu="cpu", trainer="dpo", backend="estimate", trials=6, cache=False)
    assert s.workload.trainer == "dpo" and s.workload.dataset.synthetic
    assert hasattr(s.workload.dataset, "rejected_lengths")  # the built-in synthetic preference set
    config = s.trl_config(output_dir="out")
    assert isinstance(config, DPOConfig) and isinstance(s.dpo_config(output_dir="out"), DPOConfig)
    assert config.max_length == s.candidate.max_length
    snippet = s.to_python()
    assert "from trl import DPOConfig, DPOTrainer" in snippet and "DPOTrainer(" in snippet
    compile(snippet, "snippet.py", "exec")
    ref = next(n for n in s.measurement.notes if n.startswith("dpo (approximate)"))
    assert "the reference:" in ref
    # the pick's truncation is counted for chosen and rejected apart, and stays within --max-truncation
    chosen, rejected = s.workload.dataset.truncated_fraction(s.candidate.max_length)
    assert max(chosen, rejected) == s.truncated_fraction <= s.workload.goals.max_truncation


def test_sft_and_dpo_studies_never_share_results(tiny_config):
    from advisor.inputs import build_workload
    from advisor.search import RowTokens, StudySpace, default_space, default_tokens_per_step, name_study, study_spec
    from advisor.workload import Method

    names, spaces = {}, {}
    for trainer in ("sft", "dpo"):
        wl = build_workload(tiny_config, gpu="cpu", trainer=trainer)
        rows = RowTokens(wl.dataset)
        space = StudySpace(wl, default_space(wl, Method.FULL), default_tokens_per_step(wl, rows), rows)
        names[trainer] = name_study(wl, "estimate", Method.FULL, space)
        spaces[trainer] = space.to_json()
        assert study_spec(wl, "estimate", Method.FULL, space, {})["trainer"] == trainer
    assert names["sft"] != names["dpo"]
    assert "precompute_ref_log_probs" in spaces["dpo"] and "precompute_ref_log_probs" not in spaces["sft"]
    assert spaces["dpo"]["packing"] == [False]  # packing is an SFT-only key


def test_the_dpo_estimate_counts_the_reference_and_the_doubled_sequences(tiny_model, cpu_target):
    from advisor.estimator import estimate
    from advisor.space import Candidate
    from advisor.trainers.dpo import DPOKnobs
    from advisor.trainers.preference import synthetic_preferences
    from advisor.workload import Workload

    wl = Workload(model=tiny_model, gpu=cpu_target, trainer="dpo",
                  dataset=synthetic_preferences(vocab_size=1024, rows=32, seed=0, median=64, max_len=256))
    full = Candidate(max_length=256, per_device_train_batch_size=2)
    separate = estimate(wl, full)
    precomputed = estimate(wl, DPOKnobs(precompute_ref_log_probs=True).apply(full))
    params = sum(p.numel() for p in __import__("advisor.modeling", fromlist=["x"]).build_model(
        tiny_model, full, device="meta").parameters())
    # the separate copy holds one more copy of the (float32) weights than the precomputed reference
    assert separate.peak_bytes - precomputed.peak_bytes == pytest.approx(params * 4, rel=0.05)
    assert precomputed.step_time_s < separate.step_time_s  # no reference forward during training
    assert separate.peak_batch.startswith("2 pairs (4x")  # chosen and rejected: 2B sequences


def test_sft_data_with_trainer_dpo_exits_2_naming_the_missing_columns(tiny_config, tmp_path, capsys):
    sft = tmp_path / "chat.jsonl"
    sft.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello"}]}) + "\n")
    assert main(_suggest(tiny_config, "--dataset", str(sft))) == 2
    err = capsys.readouterr().err
    assert "'chosen', 'rejected'" in err and "preference data" in err and "messages" in err


def test_packing_in_a_dpo_config_exits_2_naming_the_key(tiny_config, tmp_path, capsys):
    cfg = tmp_path / "dpo.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": tiny_config, "packing": True, "max_length": 128}))
    assert main(["suggest", "--trainer", "dpo", "--config", str(cfg), "--gpu", "cpu", "--backend", "estimate",
                 "--trials", "2", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert "packing=True" in err and "SFT-only key" in err
    assert main(["simulate", "--trainer", "dpo", "--model", tiny_config, "--config", str(cfg), "--gpu", "cpu"]) == 2
    assert "packing" in capsys.readouterr().err


def test_lengths_for_preference_data_reports_chosen_and_rejected_apart(tiny_config, capsys):
    assert main(["lengths", "--trainer", "dpo", "--model", tiny_config, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pairs"] == 2048 and out["prompt_chosen"]["max"] != out["prompt_rejected"]["max"]
    first = out["max_lengths"][0]
    assert first["chosen_lost_fraction"] != first["rejected_lost_fraction"]
    suggested = next(m for m in out["max_lengths"] if m["max_length"] == out["suggested_max_length"])
    assert max(suggested["chosen_lost_fraction"], suggested["rejected_lost_fraction"]) <= out["max_truncation"]


def _small_pairs(tmp_path) -> str:
    """A local preference file of pre-tokenized pairs (prompt_ids / chosen_ids / rejected_ids)."""
    from advisor.trainers.preference import synthetic_preferences

    data = synthetic_preferences(vocab_size=1024, rows=16, seed=0, median=48, max_len=96)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in data.rows))
    return str(path)


def test_a_cpu_probe_of_the_dpo_pick_trains_for_real(tiny_config, tmp_path, capsys):
    pairs = _small_pairs(tmp_path)
    run = tmp_path / "run.yaml"
    assert main(_suggest(tiny_config, "--dataset", pairs, "--fix", "bf16=false", "--format", "yaml",
                         "-o", str(run))) == 0
    capsys.readouterr()
    assert main(["probe", "--trainer", "dpo", "--model", tiny_config, "--dataset", pairs, "--config", str(run),
                 "--gpu", "cpu", "--backend", "cpu", "--steps", "2", "--warmup", "0", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["status"] == "ok" and m["source"] == "probe-cpu" and m["peak_bytes"] > 0
    assert m["trained_tokens_per_step"] > 0


def test_a_dpo_baseline_records_its_trainer_and_checks_with_it(tiny_config, tmp_path, capsys):
    pairs = _small_pairs(tmp_path)
    cfg = tmp_path / "dpo.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": tiny_config, "max_length": 96, "bf16": False,
                                   "per_device_train_batch_size": 2, "precompute_ref_log_probs": True}))
    out = tmp_path / "base.json"
    assert main(["baseline", "--trainer", "dpo", "--config", str(cfg), "--dataset", pairs, "--gpu", "cpu",
                 "--backend", "estimate", "--out", str(out)]) == 0
    stored = json.loads(out.read_text())
    assert stored["workload"]["trainer"] == "dpo"
    assert main(["check", "--baseline", str(out), "--json"]) == 0
    capsys.readouterr()
    # an old baseline without the key is SFT's
    from advisor.inputs import WorkloadRef

    old = {k: v for k, v in stored["workload"].items() if k != "trainer"}
    assert WorkloadRef.from_dict(old).trainer == "sft"


def test_reward_suggest_writes_a_yaml_trl_reward_accepts(tiny_config, tmp_path, capsys):
    from advisor.trainers import get_trainer

    out = tmp_path / "reward.yaml"
    assert main(["suggest", "--trainer", "reward", "--model", tiny_config, "--gpu", "cpu", "--backend", "estimate",
                 "--trials", "4", "--no-cache", "--format", "yaml", "-o", str(out)]) == 0
    assert "run: trl reward --config" in out.read_text()
    parsed = get_trainer("reward").make_parser().parse_args_and_config(
        ["--config", str(out), "--use_cpu", "True"], return_remaining_strings=True, separate_remaining_strings=True)
    assert type(parsed[1]).__name__ == "RewardConfig" and parsed[-2] == [] and parsed[-1] == []


def test_reward_space_searches_pad_to_multiple_of_and_emits_it(tiny_config):
    """The issue's Reward knobs include pad_to_multiple_of: the default space offers it, a candidate keeps it
    (it is active on padded rows) and the RewardConfig YAML writes it."""
    import yaml

    from advisor.inputs import build_workload
    from advisor.search import build_space
    from advisor.trainers import get_trainer

    wl = build_workload(tiny_config, gpu="cpu", trainer="reward")
    space = build_space(wl)
    assert space.values["pad_to_multiple_of"] == (None, 8, 64)
    assert build_space(build_workload(tiny_config, gpu="cpu")).values["pad_to_multiple_of"] == (None,), "SFT as before"
    cand = next(c for c in space.grid() if c.pad_to_multiple_of == 64 and not c.use_lora).canonical()
    assert cand.pad_to_multiple_of == 64, "canonical() must not reset it on padded rows"
    written = get_trainer("reward").run_config_dict(cand, model_name_or_path=tiny_config)
    assert written["pad_to_multiple_of"] == 64
    assert yaml.safe_load(yaml.safe_dump(written))["pad_to_multiple_of"] == 64
