"""Every FlashAttention name transformers 5 accepts for `attn_implementation` is a knob value, treated as flash
everywhere: read from a config and from --fix, simulated on the flash path, refused where it cannot run, written
back as the user wrote it. And `Measurement.peak_batch` names padding-free batches as such."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from advisor.errors import ConfigError
from advisor.space import Attention, Candidate
from advisor.workload import Goals, Workload

HUB_FA2 = "kernels-community/flash-attn2"
FLASH_NAMES = ("flash_attention_2", "flash_attention_3", "flash_attention_4", "kernels-community/flash-attn2",
               "kernels-community/flash-attn3", "kernels-community/vllm-flash-attn3", "kernels-community/flash-attn4")
BASE = dict(per_device_train_batch_size=4, precision="bf16", optim="adamw_torch", activation_checkpointing=False)
LENGTHS = (240, 180, 130, 90, 60, 40)


def _data(lengths=LENGTHS):
    from advisor.data import TokenizedDataset

    rng = np.random.default_rng(0)
    rows = tuple({"input_ids": rng.integers(10, 1024, size=n).tolist()} for n in lengths)
    return TokenizedDataset(name="fixed-lengths", source="local", rows=rows, completion_only_loss=False)


@pytest.fixture
def workload(tiny_model, h100_target):
    return Workload(model=tiny_model, gpu=h100_target, dataset=_data(), goals=Goals())


def test_the_flash_values_are_the_names_transformers_knows():
    """The Enum against transformers' own registry (AttentionInterface, the kernel fallbacks, the CUDA hub
    kernels, each passing `is_flash_attention_requested`): a name a later transformers adds fails here."""
    from transformers.utils.generic import is_flash_attention_requested

    from advisor.simulator import flash_attention_names

    flash = {a.value for a in Attention if a.is_flash}
    assert flash == set(flash_attention_names()) == set(FLASH_NAMES)
    for a in Attention:
        assert a.is_flash is bool(is_flash_attention_requested(requested_attention_implementation=a.value)), a


@pytest.mark.parametrize("name", FLASH_NAMES)
def test_what_each_name_needs(name):
    """pip packages as transformers imports them (FLASH_ATTENTION_COMPATIBILITY_MATRIX; hub kernels through
    `kernels`), and the compute capability (FA4: Hopper; FA2/FA3: Ampere)."""
    a = Attention(name)
    expected = {"flash_attention_2": "flash-attn", "flash_attention_3": "flash-attn-3",
                "flash_attention_4": "flash-attn-4"}.get(name, "kernels")
    assert Candidate(attn_implementation=name).requirements() == (expected,)
    assert a.min_compute_capability == (9.0 if name.endswith("4") else 8.0)
    assert a.flash_version == int(name[-1])
    assert Candidate(attn_implementation="sdpa").requirements() == ()


@pytest.mark.parametrize("name", FLASH_NAMES)
def test_accepted_from_a_yaml_config_and_round_trips_through_trl_sft(name, tmp_path):
    from trl.scripts.sft import make_parser

    from advisor.emit import load_run_config, to_yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": "Qwen/Qwen2.5-0.5B", "dataset_name": "trl-lib/Capybara",
                                    "attn_implementation": name, "bf16": True, "dtype": "bfloat16"}))
    cand = load_run_config(path).candidate
    assert cand.attn_implementation is Attention(name) and cand.attn_implementation.is_flash
    out = tmp_path / "emitted.yaml"
    out.write_text(to_yaml(cand, model_name_or_path="Qwen/Qwen2.5-0.5B", dataset_name="trl-lib/Capybara"))
    assert yaml.safe_load(out.read_text())["attn_implementation"] == name  # as the user wrote it
    _script, _training, model, _mixture, config_left, args_left = make_parser().parse_args_and_config(
        ["--config", str(out), "--use_cpu", "True"], return_remaining_strings=True, separate_remaining_strings=True
    )
    assert config_left == [] and args_left == [] and model.attn_implementation == name
    assert load_run_config(out).candidate == cand


@pytest.mark.parametrize("name", FLASH_NAMES)
def test_accepted_by_fix_and_pins_the_space(name, workload):
    from advisor.search import build_space

    space = build_space(workload, fix={"attn_implementation": name})
    assert space.values["attn_implementation"] == (Attention(name),)
    cands = list(space.candidates(workload.gpu, workload.model))
    assert cands and {c.attn_implementation for c in cands} == {Attention(name)}


def test_the_default_space_offers_one_flash_name(workload):
    from advisor.search import build_space

    assert build_space(workload).values["attn_implementation"] == (Attention.SDPA, Attention.FLASH_ATTENTION_2)


@pytest.mark.parametrize("name", [n for n in FLASH_NAMES if n != HUB_FA2])
def test_simulates_the_same_peak_as_the_hub_flash_attn2(name, workload, h100_target):
    """Every name takes transformers' one flash path (`_flash_attention_forward`) to the same stand-in; sdpa on
    the same batch is the control that the comparison can fail."""
    from advisor.simulator import simulate

    def sim(attn):
        return simulate(workload, Candidate(**BASE, attn_implementation=attn, max_length=256), h100_target)

    ref, got, sdpa = sim(HUB_FA2), sim(name), sim("sdpa")
    assert got.status.value == "ok"
    assert (got.peak_bytes, got.device_bytes) == (ref.peak_bytes, ref.device_bytes)
    assert got.step_time_s == pytest.approx(ref.step_time_s)
    assert any(n.startswith("FlashAttention:") for n in got.notes)
    modelled = [n for n in got.notes if "modelled as FlashAttention 2" in n]
    assert bool(modelled) is (Attention(name).flash_version != 2) and all(name in n for n in modelled)
    assert sdpa.peak_bytes != ref.peak_bytes


@pytest.mark.parametrize("name", FLASH_NAMES)
def test_estimate_treats_every_name_as_flash(name, workload):
    from advisor.estimator import estimate

    def est(attn):
        return estimate(workload, Candidate(**BASE, attn_implementation=attn, padding_free=True, max_length=None))

    assert est(name).peak_bytes == est(HUB_FA2).peak_bytes != est("sdpa").peak_bytes


@pytest.mark.parametrize("name", FLASH_NAMES)
def test_refused_on_the_cpu_and_before_ampere_naming_value_and_fix(name, cpu_target):
    from advisor.profiles import resolve_gpu

    cand = Candidate(**{**BASE, "precision": "fp16"}, attn_implementation=name)
    for gpu in (cpu_target, resolve_gpu("T4"), resolve_gpu("V100-16GB")):
        with pytest.raises(ConfigError) as err:
            cand.check(gpu)
        text = str(err.value)
        assert f"attn_implementation={name} on" in text and "attn_implementation=sdpa" in text, text
    a100 = resolve_gpu("A100-80GB")
    if name.endswith("4"):  # FlashAttention 4: Hopper and newer
        with pytest.raises(ConfigError, match=r"needs Hopper \(compute capability 9.0\)"):
            cand.check(a100)
    else:
        assert cand.check(a100) is cand
    assert cand.check(resolve_gpu("H100-80GB")) is cand


def test_fix_of_a_flash_name_on_the_cpu_exits_2_naming_it(tmp_path, monkeypatch, capsys):
    from advisor.cli import main
    from tests.conftest import TINY_QWEN2

    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_QWEN2))
    rc = main(["suggest", "--model", str(cfg), "--gpu", "cpu", "--backend", "estimate", "--trials", "2",
               "--no-cache", "--fix", "attn_implementation=flash_attention_2"])
    err = capsys.readouterr().err
    assert rc == 2 and "flash_attention_2" in err, err


def test_peak_batch_names_padding_free_rows(workload, h100_target):
    """4 sequences of the 6 (the longest: 240+180+130+90 = 640 tokens) flattened into one padding-free row, against
    the same micro-batch padded to 4 x 240."""
    from advisor.simulator import simulate

    free = simulate(workload, Candidate(**BASE, attn_implementation=HUB_FA2, padding_free=True, max_length=None),
                    h100_target)
    assert free.peak_batch == "1 x 640 (padding-free, 4 sequences; the longest rows)"
    padded = simulate(workload, Candidate(**BASE, attn_implementation="sdpa", max_length=256), h100_target)
    assert padded.peak_batch == "4 x 240 (padded; the longest rows)"
