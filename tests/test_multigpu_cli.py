"""--num-gpus end to end (issue 16): the search explores the parallelism knob, the budget applies per rank, the
effective batch counts every rank, the answer carries the accelerate config and launch command beside the TRL YAML,
bad input exits 2 naming the flag, and one GPU is what it was."""

from __future__ import annotations

import json

import pytest
import yaml

import advisor
from advisor.cli import main
from advisor.parallelism import Layout, deepspeed_available
from advisor.space import Candidate
from tests.conftest import TINY_QWEN2

LLAMA_8B = "meta-llama/Llama-3.1-8B"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


@pytest.fixture
def tiny_config(cache):
    path = cache / "config.json"
    path.write_text(json.dumps(TINY_QWEN2))
    return str(path)


@pytest.fixture(scope="module")
def eight_b():
    """The 8B full fine-tune with AdamW on 8 x H100-80GB, searched with the estimate (AdamW and SDPA pinned to
    keep the walk over the space short)."""
    return advisor.suggest(LLAMA_8B, gpu="H100-80GB", num_gpus=8, backend="estimate", cache=False, trials=12,
                           method="full", fix=_PINS)


_PINS = {"optim": "adamw_torch_fused", "attn_implementation": "sdpa", "group_by_length": "false"}


def test_8b_on_8_gpus_fits_per_rank_and_is_sharded(eight_b):
    s = eight_b
    m = s.measurement
    assert s.candidate.method.value == "full"
    assert m.fits(s.workload.limit_bytes)
    assert m.device_bytes <= s.workload.limit_bytes < 80 * 2**30
    # AdamW's full 8B states (~128 GB) cannot fit one 80 GB rank with plain DDP: the pick shards them
    assert s.candidate.parallelism is not Layout.DDP
    ddp = advisor.estimate(s.workload, s.candidate.replace(parallelism=Layout.DDP))
    assert ddp.device_bytes > s.workload.limit_bytes
    # the search explored the parallelism knob
    assert len({t.candidate.parallelism for t in s.trials}) >= 2
    # global throughput: every rank's trained tokens
    single = advisor.estimate(s.workload.__class__(model=s.workload.model, gpu=s.workload.gpu,
                                                   dataset=s.workload.dataset, goals=s.workload.goals),
                              s.candidate.replace(parallelism=Layout.DDP))
    assert m.trained_tokens_per_step == 8 * single.trained_tokens_per_step


def test_8b_answer_carries_both_configs(eight_b, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    s = eight_b
    trl = yaml.safe_load(s.to_yaml())
    assert trl["per_device_train_batch_size"] == s.candidate.per_device_train_batch_size
    path = tmp_path / "accelerate.yaml"
    path.write_text(s.accelerate_yaml(str(path), "run.yaml"))
    loaded = load_config_from_file(str(path))  # accelerate's own loader, as `accelerate launch --config_file`
    assert loaded.num_processes == 8
    chosen = s.candidate.parallelism.parallelism
    if chosen.strategy.deepspeed:
        assert loaded.deepspeed_config["zero_stage"] == (2 if chosen.strategy.value == "zero2" else 3)
    else:
        assert loaded.distributed_type.value == "FSDP"
        assert loaded.fsdp_config["fsdp_version"] == 2
        assert loaded.fsdp_config["fsdp_reshard_after_forward"] == chosen.reshard_after_forward
    cmd = s.launch_command(str(path), "run.yaml")
    assert cmd.startswith(f"accelerate launch --config_file {path}") and cmd.endswith("--config run.yaml")
    out = s.to_json_dict()
    assert out["num_gpus"] == 8 and out["launch_command"] == s.launch_command()
    assert out["accelerate_config"]["num_processes"] == 8


def test_per_rank_estimate_orders_the_layouts(eight_b):
    """Physics of the closed form: sharding lowers the per-rank peak; keeping the gathered layers raises it; CPU
    offload lowers it further and costs time."""
    wl, c = eight_b.workload, eight_b.candidate
    m = {lay: advisor.estimate(wl, c.replace(parallelism=lay))
         for lay in (Layout.DDP, Layout.FSDP2, Layout.FSDP2_NO_RESHARD, Layout.FSDP2_OFFLOAD)}
    peak = {k: v.peak_bytes for k, v in m.items()}
    assert peak[Layout.FSDP2_OFFLOAD] < peak[Layout.FSDP2] < peak[Layout.FSDP2_NO_RESHARD] < peak[Layout.DDP]
    assert m[Layout.FSDP2_OFFLOAD].tokens_per_second < m[Layout.FSDP2].tokens_per_second
    assert m[Layout.FSDP2].breakdown["optimizer_state"] * 8 == pytest.approx(
        advisor.estimate(wl, c.replace(parallelism=Layout.DDP)).breakdown["optimizer_state"], rel=1e-6)


def test_8b_cli_table_prints_the_launch_command(cache, tmp_path, capsys):
    acc = tmp_path / "acc.yaml"
    argv = ["suggest", "--model", LLAMA_8B, "--gpu", "H100-80GB", "--num-gpus", "8", "--backend", "estimate",
            "--trials", "6", "--method", "full", "--no-cache", "--accelerate-output", str(acc),
            *(f"--fix={k}={v}" for k, v in _PINS.items())]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "parallelism" in out and f"accelerate launch --config_file {acc}" in out
    assert yaml.safe_load(acc.read_text())["num_processes"] == 8


# ---- bad input: exit 2 naming the flag and the fix -----------------------------------------------------------------

def test_zero_gpus_exits_2_naming_the_flag(tiny_config, capsys):
    argv = ["suggest", "--model", tiny_config, "--gpu", "cpu", "--backend", "estimate", "--num-gpus", "0"]
    assert main(argv) == 2
    assert "--num-gpus 0" in capsys.readouterr().err


def test_zero_gpus_in_the_python_api_names_the_parameter(tiny_config):
    with pytest.raises(advisor.ConfigError, match="num_gpus"):
        advisor.suggest(tiny_config, gpu="cpu", backend="estimate", num_gpus=0, cache=False)


@pytest.mark.skipif(deepspeed_available(), reason="deepspeed is installed here")
def test_zero3_pinned_without_deepspeed_names_the_install(tiny_config, capsys):
    argv = ["suggest", "--model", tiny_config, "--gpu", "H100-80GB", "--backend", "estimate", "--num-gpus", "2",
            "--fix", "parallelism=zero3", "--trials", "4", "--no-cache", "--method", "full",
            *(f"--fix={k}={v}" for k, v in _PINS.items())]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--fix parallelism=zero3" in err and "pip install advisor[deepspeed]" in err


def test_a_batch_the_ranks_cannot_split_names_the_flags(tiny_config, capsys):
    # a few dozen trained tokens per step cannot give each of 64 ranks a row
    argv = ["suggest", "--model", tiny_config, "--gpu", "H100-80GB", "--backend", "estimate", "--num-gpus", "64",
            "--num-machines", "8", "--tokens-per-step", "64", "--trials", "4", "--no-cache", "--method", "full",
            *(f"--fix={k}={v}" for k, v in _PINS.items())]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--tokens-per-step" in err and "--num-gpus 64" in err


def test_probe_of_several_machines_is_refused_not_measured_on_one(tiny_config, tmp_path, capsys):
    """A probe runs its ranks on this machine (tests/test_multiprobe.py runs several); M machines are refused."""
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"model_name_or_path": tiny_config, "max_length": 64,
                                   "per_device_train_batch_size": 1}))
    assert main(["probe", "--model", tiny_config, "--config", str(run), "--gpu", "cpu", "--num-gpus", "2",
                 "--num-machines", "2"]) == 2
    assert "--num-machines 2: a probe runs its ranks on this machine only" in capsys.readouterr().err


# ---- one GPU is unchanged -------------------------------------------------------------------------------------------

def test_one_gpu_gives_the_same_pick_and_study(tiny_config, cache):
    from advisor.search import build_space, name_study, study_spec

    a = advisor.suggest(tiny_config, gpu="H100-80GB", backend="estimate", trials=6, cache=False)
    b = advisor.suggest(tiny_config, gpu="H100-80GB", backend="estimate", trials=6, cache=False, num_gpus=1)
    assert a.candidate == b.candidate and a.candidate.parallelism is Layout.DDP
    assert "parallelism" not in a.candidate.to_dict()
    assert a.measurement.peak_bytes == b.measurement.peak_bytes
    assert [t.candidate for t in a.trials] == [t.candidate for t in b.trials]
    assert a.workload.fingerprint() == b.workload.fingerprint()
    space = build_space(a.workload)
    assert "parallelism" not in space.values
    spec = study_spec(a.workload, "estimate", a.candidate.method, _study_space(a), {})
    assert "num_gpus" not in spec
    eight = advisor.inputs.build_workload(tiny_config, gpu="H100-80GB", num_gpus=8)
    assert study_spec(eight, "estimate", a.candidate.method, _study_space(a), {})["num_gpus"] == 8
    assert "8xH100" in name_study(eight, "estimate", a.candidate.method, _study_space(a))


def _study_space(s):
    from advisor.search import RowTokens, StudySpace, default_space

    return StudySpace(s.workload, default_space(s.workload, s.candidate.method), 1000, RowTokens(s.workload.dataset))


def test_baseline_records_num_gpus_and_old_ones_read_as_one():
    from advisor.inputs import WorkloadRef

    old = {"model": "m", "gpu": "H100-80GB"}
    assert WorkloadRef.from_dict(old).num_gpus == 1
    ref = WorkloadRef.from_dict({**old, "num_gpus": 8, "num_machines": 2})
    assert ref.to_dict()["num_gpus"] == 8 and WorkloadRef.from_spec(ref.to_spec()).num_machines == 2
    assert "num_gpus" not in WorkloadRef.from_dict(old).to_spec()


def test_default_candidate_is_memory_neutral():
    assert Candidate().parallelism is Layout.DDP and Candidate.from_dict(Candidate().to_dict()) == Candidate()


def test_simulate_backend_measures_one_rank_of_two(tiny_config):
    """The simulate backend runs simulate_per_rank (FSDP2 on the fake process group) for num_gpus > 1: the pick's
    measurement is one rank's, its notes say so, and its throughput counts both ranks."""
    s = advisor.suggest(tiny_config, gpu="H100-80GB", backend="simulate", num_gpus=2, trials=3, cache=False,
                        method="full", jobs=1, fix={**_PINS, "parallelism": "fsdp2"})
    m = s.measurement
    assert m.source.value == "simulate" and m.fits(s.workload.limit_bytes)
    assert s.candidate.parallelism is Layout.FSDP2
    assert any("FSDP2 on 2 ranks" in n for n in m.notes)
    assert any("throughput counts all 2 ranks" in n for n in m.notes)
    one = advisor.simulate(s.workload.__class__(model=s.workload.model, gpu=s.workload.gpu,
                                                dataset=s.workload.dataset, goals=s.workload.goals),
                           s.candidate.replace(parallelism=Layout.DDP))
    assert m.trained_tokens_per_step == 2 * one.trained_tokens_per_step
    assert m.breakdown["parameters"] < one.breakdown["parameters"]  # half the parameters held locally
