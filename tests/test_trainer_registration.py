"""A trainer of one's own, registered through the public API alone (advisor.trainers, advisor.knobs): suggest, simulate
and the one writer serve it; its own knob and the model it takes beside the policy (a mentor) flow from its
declarations to `--fix`, the default space, the config, the YAML and its reader, the CLI's flag, suggest()'s
parameter, the Workload, its fingerprint, the estimate, the simulator and the probe's job. No list of the advisor's
is edited: the declarations below are all there is."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

import advisor
from advisor.cli import main
from advisor.errors import ConfigError
from advisor.knobs import Home, Kind, Knob, KnobView, knob_view
from advisor.space import Candidate
from advisor.trainers import Head, ModelInput, TrlTrainer, get_trainer, model_inputs, names, register, unregister

NAME = "tiny-sft"
# a field SFTConfig (TrainingArguments) has that no knob declares: this trainer's own knob
OWN = Knob("average_tokens_across_devices", Kind.BOOL, True, Home.TRAINING_ARGUMENTS,
           "average_tokens_across_devices", "the loss averaged over every device's tokens", carried=True,
           search=(True, False), short=lambda c: None if c.base.get("average_tokens_across_devices", True) else "avg0")
MENTOR = ModelInput(role="mentor", flag="--mentor", yaml_key="mentor_model_name_or_path", head=Head.LM,
                     help="a mentor (hub id or local directory) resident beside the policy")


class _TinyKnobs(KnobView):
    CONTEXT = NAME


class TinySFT(TrlTrainer):
    """SFT under another name, with a knob of its own and a mentor beside the policy: what a trainer module of
    one's own declares (the rest is TrlTrainer's defaults)."""

    name = NAME
    command = "sft"
    config_name, trainer_name = "SFTConfig", "SFTTrainer"
    knob_view = knob_view("TinyKnobs", (OWN,), _TinyKnobs, __name__)
    model_inputs = (MENTOR,)


@pytest.fixture
def tiny_trainer():
    trainer = register(TinySFT())
    yield trainer
    unregister(NAME)


def test_registered_through_the_public_api(tiny_trainer):
    assert NAME in names() and get_trainer(NAME) is tiny_trainer and MENTOR in model_inputs()
    assert tiny_trainer.accepts(OWN) and not get_trainer("sft").accepts(OWN)
    from advisor.search import parse_fix

    with pytest.raises(ConfigError, match=rf"--fix average_tokens_across_devices: a knob of {NAME}, not of trainer"):
        parse_fix({"average_tokens_across_devices": "false"}, "sft")
    assert parse_fix({"average_tokens_across_devices": "false"}, NAME).values == {
        "average_tokens_across_devices": (False,)}


def test_suggest_and_the_writer_serve_it(tiny_trainer, tiny_config, tmp_path):
    s = advisor.suggest(tiny_config, gpu="cpu", trainer=NAME, backend="estimate", trials=4, cache=False,
                        mentor=tiny_config)
    assert s.trainer is tiny_trainer and s.workload.model_of("mentor").name == tiny_config
    from advisor.search import build_space

    assert build_space(s.workload).values[OWN.name] == (True, False)  # its knob searched, from its declaration
    plain = advisor.suggest(tiny_config, gpu="cpu", trainer=NAME, backend="estimate", trials=4, cache=False)
    assert s.workload.fingerprint() != plain.workload.fingerprint()
    # the mentor is resident: the estimate of one candidate grows by its weights
    from advisor.estimator import estimate
    from advisor.space import with_knobs

    cand = with_knobs(Candidate(max_length=128, per_device_train_batch_size=2), average_tokens_across_devices=False)
    taught, alone = estimate(s.workload, cand), estimate(plain.workload, cand)
    weights = _resident(s.workload.model_of("mentor"))
    assert taught.peak_bytes - alone.peak_bytes == weights
    # the one writer: the knob and the mentor in the file, read back to the same candidate
    data = tiny_trainer.run_config_dict(cand, model_name_or_path="m", workload=s.workload)
    assert data["mentor_model_name_or_path"] == tiny_config and data[OWN.key] is False
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    back = advisor.load_run_config(path, NAME).candidate
    assert back.replace(base={k: v for k, v in back.base.as_dict().items() if k != MENTOR.yaml_key}) == cand
    assert tiny_trainer.trl_config(cand, use_cpu=True).average_tokens_across_devices is False


def test_the_cli_takes_its_flag(tiny_trainer, tiny_config, capsys):
    rc = main(["suggest", "--trainer", NAME, "--model", tiny_config, "--gpu", "cpu", "--backend", "estimate",
               "--mentor", tiny_config, "--trials", "3", "--no-cache", "--format", "yaml"])
    out = capsys.readouterr().out
    assert rc == 0 and f"mentor_model_name_or_path: {tiny_config}" in out and "trl sft --config" in out
    rc = main(["suggest", "--trainer", "sft", "--model", tiny_config, "--gpu", "cpu", "--backend", "estimate",
               "--mentor", tiny_config])
    assert rc == 2 and f"use --trainer {NAME}, or drop --mentor" in capsys.readouterr().err


def test_simulate_and_the_probe_job_serve_it(tiny_trainer, tiny_workload, tiny_model):
    cand = Candidate(max_length=128, per_device_train_batch_size=2)
    wl = dataclasses.replace(tiny_workload, trainer=NAME)
    alone = advisor.simulate(wl, cand)
    taught = advisor.simulate(dataclasses.replace(wl, models={"mentor": tiny_model}), cand)
    assert alone.ok and taught.ok
    weights = _resident(tiny_model)
    assert taught.peak_bytes - alone.peak_bytes == weights and any("tiny-qwen2" in n for n in taught.notes)
    from advisor.probing.runner import job_dict

    job = job_dict(dataclasses.replace(wl, models={"mentor": tiny_model}), cand, "cpu", steps=1, warmup=0,
                   memory_budget_bytes=None, weights=None)
    assert job["trainer"] == NAME and job["models"]["mentor"]["name"] == tiny_model.name


def _resident(spec) -> int:
    """The mentor's float32 weights and buffers, as the model transformers builds holds them."""
    from advisor.modeling import input_model

    model = input_model(spec, Head.LM, dtype=None, pad_token_id=0, device="meta")
    return sum(t.numel() * 4 for t in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())
