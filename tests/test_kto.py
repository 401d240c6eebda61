"""KTO (`trl kto`): the data as KTOTrainer prepares it, TRL's rules, the config `trl kto` parses and reads back, the
estimate, the lengths report, the Python API and bad input. The simulator against a real KTOTrainer.train() is
tests/test_simulate_accuracy_kto.py; the emitted file run as written, tests/test_run_as_written.py."""

from __future__ import annotations

import json

import pytest

from advisor.cli import main
from advisor.errors import ConfigError
from advisor.space import Candidate
from advisor.trainers import get_trainer
from advisor.trainers.kto import KTOKnobs

TEXT = "the quick brown fox jumps over the lazy dog"


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def kto_file(tmp_path):
    rows = [{"prompt": f"hello world number {i}", "completion": " " + " ".join([TEXT] * (1 + i % 4)),
             "label": i % 3 != 0} for i in range(40)]
    return _write(tmp_path / "kto.jsonl", rows)


# ---- the data, as KTOTrainer prepares it -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["unpaired", "paired", "conversational"])
def test_examples_are_what_ktotrainer_prepares(kind, tiny_model, tiny_tokenizer, tmp_path):
    """The advisor's examples are the prepared dataset of a real KTOTrainer (its own _prepare_dataset: the prompt
    extracted, pairs unpaired, EOS added, tokenized), in the same order, with the same labels."""
    import torch
    from transformers import AutoModelForCausalLM, AutoProcessor
    from trl import KTOConfig, KTOTrainer

    from advisor.trainers.unpaired import load_unpaired

    if kind == "unpaired":
        rows = [{"prompt": f"hello world number {i}", "completion": f" {TEXT}" * (1 + i % 3), "label": i % 2 == 0}
                for i in range(6)]
    elif kind == "paired":  # an implicit prompt: the common start of chosen and rejected
        rows = [{"chosen": f"hello world number {i} the fox", "rejected": f"hello world number {i} the lazy dog"}
                for i in range(6)]
    else:
        rows = [{"prompt": [{"role": "user", "content": f"hello number {i}"}],
                 "completion": [{"role": "assistant", "content": TEXT}], "label": bool(i % 2)} for i in range(6)]
    path = _write(tmp_path / "d.jsonl", rows)
    data = load_unpaired(path, tiny_model, str(tiny_tokenizer))

    torch.manual_seed(0)
    config = tiny_model.hf_config()
    model, ref = (AutoModelForCausalLM.from_config(config) for _ in range(2))
    import datasets

    trainer = KTOTrainer(model=model, ref_model=ref, train_dataset=datasets.load_dataset("json", data_files=path,
                                                                                        split="train"),
                         processing_class=AutoProcessor.from_pretrained(tiny_tokenizer),
                         args=KTOConfig(output_dir=str(tmp_path / "o"), max_length=None, use_cpu=True,
                                        per_device_train_batch_size=2, report_to="none"))
    real = trainer.train_dataset
    assert [r["prompt_ids"] for r in data.rows] == real["prompt_ids"]
    assert [r["completion_ids"] for r in data.rows] == real["completion_ids"]
    assert [r["label"] for r in data.rows] == [bool(x) for x in real["label"]]
    if kind == "paired":  # unpaired into one desirable and one undesirable example per pair
        assert len(data.rows) == 12 and data.desirable == 6


def test_the_kl_batch_is_trls_rotation_within_each_micro_batch(tiny_model):
    """prepared_as_is (the probe's and the simulator's KTOTrainer) rotates as TRL's own add_kl_completion_ids."""
    import types

    import datasets

    from advisor.trainers.kto import prepared_as_is
    from advisor.trainers.unpaired import kl_completions

    comps = [[i] * (1 + i) for i in range(7)]
    ds = datasets.Dataset.from_dict({"prompt_ids": [[1, 2]] * 7, "completion_ids": comps, "label": [True] * 7})
    args = types.SimpleNamespace(max_length=None, per_device_train_batch_size=3)
    out = prepared_as_is(types.SimpleNamespace(calculate_KL=True), ds, None, args, "train")
    assert out["KL_completion_ids"] == kl_completions(comps, 3) == [comps[2], comps[0], comps[1], comps[5], comps[3],
                                                                    comps[4], comps[6]]
    none = prepared_as_is(types.SimpleNamespace(calculate_KL=False), ds, None, args, "train")
    assert "KL_completion_ids" not in none.column_names


def test_the_worst_micro_batch_is_the_longest_examples_and_their_kl_batch(tiny_model, cpu_target):
    from advisor.trainers.unpaired import UnpairedDataset
    from advisor.workload import Goals, Workload

    rows = tuple({"prompt_ids": [5] * p, "completion_ids": [6] * c, "label": bool(i % 2)}
                 for i, (p, c) in enumerate([(4, 4), (100, 3), (3, 50), (10, 10), (60, 60)]))
    data = UnpairedDataset(name="t", source="local", rows=rows)
    wl = Workload(model=tiny_model, gpu=cpu_target, dataset=data, goals=Goals(), trainer="kto")
    kto = get_trainer("kto")
    # max_length 64: the 100-token prompt is dropped (TRL drops a prompt that fills max_length); 60+60 and 3+50
    # are the longest after truncation
    picked = kto.worst_rows(wl, Candidate(max_length=64, per_device_train_batch_size=2))
    assert [len(r["prompt_ids"]) for r in picked] == [60, 3]
    assert list(kto.kept_rows(wl, Candidate(max_length=64))) == [0, 2, 3, 4]
    assert data.trained_after_truncation(64).tolist() == [4, 0, 50, 10, 4]
    # enough rows for the precompute pass's batch
    pre = KTOKnobs(precompute_ref_log_probs=True, precompute_ref_batch_size=4).apply(
        Candidate(max_length=64, per_device_train_batch_size=2))
    assert len(kto.worst_rows(wl, pre)) == 4


# ---- TRL's rules -------------------------------------------------------------------------------------------------
def test_trls_rules_for_kto_are_refused_with_the_fix():
    kto = get_trainer("kto")
    assert kto.problems(Candidate(per_device_train_batch_size=2)) == []
    (p,) = kto.problems(Candidate(per_device_train_batch_size=1))
    assert p.startswith("per_device_train_batch_size=1 with loss_type=kto") and "use 2 or more" in p
    assert kto.problems(KTOKnobs(loss_type="apo_zero_unpaired").apply(Candidate(per_device_train_batch_size=1))) == []
    (p,) = kto.problems(Candidate(group_by_length=True))
    assert "train_sampling_strategy=group_by_length with loss_type=kto" in p and "use sequential" in p
    packing = kto.problems(Candidate(packing=True))
    assert any(p.startswith("packing=True: `packing` is an SFT-only key") for p in packing)
    assert any(p.startswith("padding_free=True") for p in kto.problems(Candidate(padding_free=True)))
    lora_sync = KTOKnobs(sync_ref_model=True).apply(Candidate(use_lora=True))
    assert any(p.startswith("sync_ref_model=True with LoRA") for p in kto.problems(lora_sync))
    both = KTOKnobs(sync_ref_model=True, precompute_ref_log_probs=True).apply(Candidate())
    assert any("choose one" in p for p in kto.problems(both))
    with pytest.raises(ConfigError, match=r"loss_type='sigmoid': not one of kto, apo_zero_unpaired"):
        KTOKnobs(loss_type="sigmoid")


def test_what_trl_refuses_trl_refuses_too(tiny_model):
    """The rules above are TRL's own: KTOTrainer raises on each (checked on the installed TRL)."""
    import datasets
    from trl import KTOConfig, KTOTrainer

    from advisor.modeling import build_model, placeholder_tokenizer

    ds = datasets.Dataset.from_dict({"prompt_ids": [[5, 6]] * 4, "completion_ids": [[7]] * 4, "label": [True] * 4})
    for kwargs, message in ((dict(per_device_train_batch_size=1), "batch size must be > 1"),
                            (dict(train_sampling_strategy="random"), "requires `train_sampling_strategy='sequential")):
        args = KTOConfig(output_dir="/tmp/advisor-kto-test", use_cpu=True, report_to="none", **kwargs)
        with pytest.raises(ValueError, match=message):
            KTOTrainer(model=build_model(tiny_model), ref_model=build_model(tiny_model), args=args, train_dataset=ds,
                       processing_class=placeholder_tokenizer(tiny_model))


# ---- the config `trl kto` parses, read back --------------------------------------------------------------------
CANDIDATES = {
    "defaults": Candidate(),
    "precompute-lora": KTOKnobs(precompute_ref_log_probs=True, precompute_ref_batch_size=16).apply(
        Candidate(use_lora=True, lora_r=8, per_device_train_batch_size=4, max_length=512)),
    "apo-random-batch1": KTOKnobs(loss_type="apo_zero_unpaired").apply(
        Candidate(per_device_train_batch_size=1, pad_to_multiple_of=64).replace(
            base={"train_sampling_strategy": "random", "desirable_weight": 1.33, "beta": 0.2})),
}


@pytest.mark.parametrize("name", sorted(CANDIDATES))
def test_the_yaml_is_what_trl_kto_parses_and_reads_back(name, tiny_workload, tmp_path):
    import dataclasses

    import yaml

    from advisor.emit import load_run_config

    kto = get_trainer("kto")
    cand = CANDIDATES[name]
    assert kto.problems(cand) == []
    wl = dataclasses.replace(tiny_workload, trainer="kto")
    text = kto.to_yaml(cand, model_name_or_path="m", workload=wl)
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert "# dataset_name: trl-lib/kto-mix-14k" in text  # the placeholder: an unpaired dataset on the hub
    parsed = kto.make_parser().parse_args_and_config(["--config", str(path), "--dataset_name", "d"],
                                                     return_remaining_strings=True, separate_remaining_strings=True)
    assert parsed[4] == [] and parsed[5] == [], parsed[4:]
    training = parsed[1]
    k = KTOKnobs.of(cand)
    assert type(training).__name__ == "KTOConfig"
    assert (training.loss_type, training.precompute_ref_log_probs, training.precompute_ref_batch_size) == (
        k.loss_type.value, k.precompute_ref_log_probs, k.precompute_ref_batch_size)
    assert training.per_device_train_batch_size == cand.per_device_train_batch_size
    assert training.max_length == cand.max_length and training.pad_to_multiple_of == cand.pad_to_multiple_of
    assert training.train_sampling_strategy == cand.base.get("train_sampling_strategy", "sequential")
    assert yaml.safe_load(text).get("desirable_weight") == cand.base.get("desirable_weight")
    back = load_run_config(path, trainer="kto")
    assert back.candidate == cand


def test_an_sft_only_key_in_a_kto_config_is_refused_by_name():
    kto = get_trainer("kto")
    with pytest.raises(ConfigError, match=r"padding_free=False: an SFT-only key \(KTOConfig has no 'padding_free'\)"):
        kto.candidate_from_run_dict({"max_length": 512, "padding_free": False})


def test_fix_loss_type_is_kto_s_own(tiny_config):
    from advisor.search import parse_fix

    assert parse_fix({"loss_type": "apo_zero_unpaired"}, "kto").values["loss_type"] == ("apo_zero_unpaired",)
    with pytest.raises(ConfigError, match=r"--fix loss_type: a knob of kto, not of trainer 'dpo'"):
        parse_fix({"loss_type": "kto"}, "dpo")
    assert parse_fix({"precompute_ref_log_probs": "true"}, "kto").values["precompute_ref_log_probs"] == (True,)


# ---- the estimate ------------------------------------------------------------------------------------------------
def test_the_estimate_counts_the_reference_and_the_kl_batch(tiny_model, h100_target):
    from advisor.estimator import estimate
    from advisor.trainers.unpaired import synthetic_unpaired
    from advisor.workload import Goals, Workload

    data = synthetic_unpaired(vocab_size=1024, rows=64, seed=0, median=256, max_len=1024)
    wl = Workload(model=tiny_model, gpu=h100_target, dataset=data, goals=Goals(), trainer="kto")
    base = Candidate(max_length=1024, per_device_train_batch_size=8)
    full, pre = estimate(wl, base), estimate(wl, KTOKnobs(precompute_ref_log_probs=True).apply(base))
    apo = estimate(wl, KTOKnobs(loss_type="apo_zero_unpaired", precompute_ref_log_probs=True).apply(base))
    from advisor.modeling import build_model

    params = sum(p.numel() * 4 for p in build_model(tiny_model, Candidate(), device="meta").parameters())
    assert full.breakdown["parameters"] - pre.breakdown["parameters"] == pytest.approx(params, rel=0.05)
    # the extra no-grad forwards: policy + reference on the KL batch and the reference on the examples (4/3 + 1/3
    # + 1/3 of the policy's step), the KL batch's alone (4/3), none (apo_zero_unpaired, precomputed)
    assert full.step_time_s / apo.step_time_s == pytest.approx(2.0)
    assert pre.step_time_s / apo.step_time_s == pytest.approx(4 / 3)
    assert full.peak_bytes > pre.peak_bytes >= apo.peak_bytes
    # what the step declares (StepShape), said: the KL batch's forward, the reference's held forwards
    assert any(n.startswith("kto (approximate)") and "1 further batch(es) of its shape through the policy" in n
               and "while the activations are held" in n for n in full.notes)
    assert not any("further batch" in n for n in apo.notes)
    assert full.peak_batch.startswith("8 examples")


# ---- lengths, the Python API -----------------------------------------------------------------------------------
def test_lengths_report_examples_labels_and_what_max_length_drops(kto_file, tiny_config, tiny_tokenizer, capsys):
    assert main(["lengths", "--trainer", "kto", "--model", tiny_config, "--tokenizer", str(tiny_tokenizer),
                 "--dataset", kto_file, "--max-length", "16", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["examples"] == 40 and out["desirable"] == 26 and out["undesirable"] == 14
    by = {m["max_length"]: m for m in out["max_lengths"]}
    assert by[64]["examples_dropped"] == 0 and by[64]["completion_lost_fraction"] == 0.0
    assert by[16]["examples_truncated"] > 0 and by[16]["completion_lost_fraction"] > 0
    assert main(["lengths", "--trainer", "kto", "--model", tiny_config, "--tokenizer", str(tiny_tokenizer),
                 "--dataset", kto_file, "--sample", "10"]) == 0
    text = capsys.readouterr().out
    assert "10 examples" in text and "completion lost" in text and "sample (seed 0) of 10 of 40 rows" in text


def test_suggest_kto_in_python_gives_a_ktoconfig_and_a_snippet(tiny_config, kto_file, tiny_tokenizer):
    import advisor

    wl = advisor.build_workload(tiny_config, gpu="cpu", dataset=kto_file, tokenizer=str(tiny_tokenizer),
                                trainer="kto")
    s = advisor.suggest(wl, backend="estimate", trials=4, cache=False)
    assert s.trainer.name == "kto" and get_trainer("kto").problems(s.candidate) == []
    config = s.trl_config(output_dir="/tmp/advisor-kto-out", use_cpu=True)
    assert type(config).__name__ == "KTOConfig" and config.train_sampling_strategy == "sequential"
    code = s.to_python()
    assert "KTOConfig(" in code and "KTOTrainer(" in code and f"data_files={kto_file!r}" in code


# ---- bad input ---------------------------------------------------------------------------------------------------
def test_a_dataset_without_the_columns_is_refused_naming_them(tiny_model, tmp_path, tiny_workload):
    from advisor.simulator import simulate
    from advisor.trainers.unpaired import load_unpaired

    sft = _write(tmp_path / "sft.jsonl", [{"messages": [{"role": "user", "content": "a"}]}] * 3)
    with pytest.raises(ConfigError, match=r"lack the column\(s\) 'prompt', 'completion', 'label' "
                                          r"\(row 0 has \['messages'\]\).*trainer='sft'"):
        load_unpaired(sft, tiny_model)
    no_label = _write(tmp_path / "nolabel.jsonl", [{"prompt": "a", "completion": "b"}] * 3)
    with pytest.raises(ConfigError, match=r"lack the column\(s\) 'label'"):
        load_unpaired(no_label, tiny_model)
    import dataclasses

    with pytest.raises(ConfigError, match=r"reads unpaired preference data"):  # SFT rows handed to the kto trainer
        simulate(dataclasses.replace(tiny_workload, trainer="kto"), Candidate(per_device_train_batch_size=2), "cpu",
                 layers=None, trainer="kto")


@pytest.mark.parametrize("label", ["good", 2, None])
def test_a_label_trl_cannot_count_is_refused(label, tiny_model, tmp_path):
    from advisor.trainers.unpaired import load_unpaired

    path = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b", "label": True},
                                           {"prompt": "a", "completion": "b", "label": label}])
    with pytest.raises(ConfigError, match=r"row 1 (has label=|lacks the column\(s\) 'label')"):
        load_unpaired(path, tiny_model)


def test_labels_all_one_value_are_trained_by_trl_and_said(tiny_model, tiny_tokenizer, tmp_path):
    """TRL 1.16 trains all-desirable (or all-undesirable) data (measured: KTOTrainer.train() runs; the loss of the
    missing kind is empty), so it is not refused; the notes say so."""
    from advisor.trainers.unpaired import load_unpaired

    path = _write(tmp_path / "one.jsonl", [{"prompt": f"hello {i}", "completion": " world", "label": True}
                                           for i in range(4)])
    data = load_unpaired(path, tiny_model, str(tiny_tokenizer))
    assert any("every one of the 4 examples is desirable" in n for n in data.notes)


# ---- the CLI: suggest, probe, simulate, baseline / check -----------------------------------------------------------
def _examples(tmp_path) -> str:
    """Prepared token ids (as KTOTrainer's prepared dataset holds them), so no tokenizer is needed."""
    from advisor.trainers.unpaired import synthetic_unpaired

    data = synthetic_unpaired(vocab_size=1024, rows=16, seed=0, median=48, max_len=96)
    return _write(tmp_path / "examples.jsonl", data.rows)


def test_a_cpu_probe_of_the_kto_pick_trains_for_real_and_peaks_as_simulated(tiny_config, tmp_path, capsys):
    from advisor.emit import load_run_config
    from advisor.inputs import build_workload
    from advisor.simulator import simulate

    data = _examples(tmp_path)
    run = tmp_path / "run.yaml"
    assert main(["suggest", "--trainer", "kto", "--model", tiny_config, "--gpu", "cpu", "--backend", "estimate",
                 "--trials", "4", "--dataset", data, "--fix", "bf16=false", "--no-cache", "--format", "yaml",
                 "-o", str(run)]) == 0
    capsys.readouterr()
    assert main(["probe", "--trainer", "kto", "--model", tiny_config, "--dataset", data, "--config", str(run),
                 "--gpu", "cpu", "--backend", "cpu", "--steps", "2", "--warmup", "0", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["status"] == "ok" and m["source"] == "probe-cpu" and m["trained_tokens_per_step"] > 0
    # the probe's first micro-batch is the longest examples, the simulated one: the same peak (the probe's
    # DataLoader and profiler aside)
    cand = load_run_config(run, trainer="kto").candidate
    sim = simulate(build_workload(tiny_config, gpu="cpu", dataset=data, trainer="kto"), cand, "cpu", layers=None,
                   trainer="kto")
    assert m["peak_bytes"] == pytest.approx(sim.peak_bytes, rel=0.01), (m["peak_bytes"], sim.peak_bytes)
    assert main(["simulate", "--trainer", "kto", "--model", tiny_config, "--dataset", data, "--config", str(run),
                 "--gpu", "cpu", "--json"]) == 0
    shown = capsys.readouterr().out
    assert json.loads(shown[shown.index("{"):])["peak_bytes"] == sim.peak_bytes


def test_a_kto_baseline_records_its_trainer_and_checks_with_it(tiny_config, tmp_path, capsys):
    import yaml

    data = _examples(tmp_path)
    cfg = tmp_path / "kto.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": tiny_config, "max_length": 96, "bf16": False,
                                   "per_device_train_batch_size": 2, "precompute_ref_log_probs": True,
                                   "loss_type": "kto", "desirable_weight": 1.2}))
    out = tmp_path / "base.json"
    assert main(["baseline", "--trainer", "kto", "--config", str(cfg), "--dataset", data, "--gpu", "cpu",
                 "--backend", "estimate", "--out", str(out)]) == 0
    stored = json.loads(out.read_text())
    assert stored["workload"]["trainer"] == "kto"
    assert stored["candidate"]["base"] == {"precompute_ref_log_probs": True, "desirable_weight": 1.2}
    assert main(["check", "--baseline", str(out), "--json"]) == 0
