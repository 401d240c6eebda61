"""`advisor suggest --trainer grpo|rloo --model Qwen/Qwen2.5-0.5B --backend estimate` offline (profiles/models'
config, the built-in synthetic prompts): the pick builds a GRPOConfig / RLOOConfig, its YAML goes through `trl grpo` /
`trl rloo`'s own parser with nothing left over and reads back to the pick; the estimate counts each trainer's own
TRL defaults (RLOO's beta 0.05: a reference copy)."""

from __future__ import annotations

import pytest
import yaml

from advisor.cli import main


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_suggest_offline_writes_a_file_trl_reads(trainer, tmp_path, monkeypatch, capsys):
    from advisor.emit import load_run_config
    from advisor.trainers import get_trainer

    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run.yaml"
    rc = main(["suggest", "--trainer", trainer, "--model", "Qwen/Qwen2.5-0.5B", "--gpu", "H100-80GB", "--backend",
               "estimate", "--trials", "12", "--format", "yaml", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    data = yaml.safe_load(out.read_text())
    assert data["model_name_or_path"] == "Qwen/Qwen2.5-0.5B"
    t = get_trainer(trainer)
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    *parsed, config_left, args_left = t.make_parser().parse_args_and_config(
        ["--config", str(out), "--use_cpu", "True", "--dataset_name", "trl-lib/DeepMath-103K"],
        return_remaining_strings=True, separate_remaining_strings=True)
    assert config_left == [] and args_left == []
    assert type(parsed[1]).__name__ == t.config_name
    cand = load_run_config(out, trainer=trainer).candidate
    assert t.problems(cand) == []
    assert t.trl_config(cand, use_cpu=True).num_generations == t.knobs(cand).num_generations


def test_the_estimate_counts_rloos_own_reference():
    from advisor.estimator import estimate
    from advisor.profiles import resolve_gpu, resolve_model
    from advisor.space import Candidate, with_knobs
    from advisor.trainers import get_trainer
    from advisor.trainers.prompts import synthetic_prompts
    from advisor.workload import Goals, Workload

    m = resolve_model("Qwen/Qwen2.5-0.5B")
    get_trainer("rloo")
    wl = Workload(model=m, gpu=resolve_gpu("H100-80GB"), dataset=synthetic_prompts(m.vocab_size, rows=64),
                  goals=Goals(), trainer="rloo")
    plain, explicit = estimate(wl, Candidate()), estimate(wl, with_knobs(Candidate(), beta=0.05))
    assert plain.peak_bytes == explicit.peak_bytes
    none = estimate(wl, with_knobs(Candidate(), beta=0.0))
    assert plain.peak_bytes > none.peak_bytes  # the reference copy RLOO keeps at its default beta
