"""Several GPUs without running anything (issue 16): the knobs' errors, ZeRO's closed form, the communication time,
and the accelerate config as accelerate's own loader reads it."""

from __future__ import annotations

import pytest

from advisor.errors import ConfigError
from advisor.parallelism import Parallelism, Strategy, accumulation_for, deepspeed_available
from advisor.space import Candidate


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_bad_num_gpus_names_the_flag(n, tiny_model, cpu_target, tiny_data):
    from advisor.workload import Workload

    with pytest.raises(ConfigError, match=r"--num-gpus .*at least 1"):
        Workload(model=tiny_model, gpu=cpu_target, dataset=tiny_data, num_gpus=n)


def test_machines_must_divide_gpus(tiny_model, cpu_target, tiny_data):
    from advisor.workload import Workload

    with pytest.raises(ConfigError, match=r"--num-machines 3 .*does not divide --num-gpus 8"):
        Workload(model=tiny_model, gpu=cpu_target, dataset=tiny_data, num_gpus=8, num_machines=3)
    assert Workload(model=tiny_model, gpu=cpu_target, dataset=tiny_data, num_gpus=8, num_machines=2).num_gpus == 8


def test_world_changes_the_fingerprint_only_when_set(tiny_model, cpu_target, tiny_data):
    from advisor.workload import Workload

    one = Workload(model=tiny_model, gpu=cpu_target, dataset=tiny_data)
    eight = Workload(model=tiny_model, gpu=cpu_target, dataset=tiny_data, num_gpus=8)
    assert one.fingerprint() != eight.fingerprint()
    assert one.fingerprint() == Workload(model=tiny_model, gpu=cpu_target, dataset=tiny_data, num_gpus=1).fingerprint()


@pytest.mark.skipif(deepspeed_available(), reason="deepspeed is installed here")
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_zero_without_deepspeed_names_the_knob_and_the_fix(strategy):
    with pytest.raises(ConfigError, match=r"parallelism=zero.*pip install advisor\[deepspeed\]"):
        Parallelism(strategy=strategy).check(8)


def test_unknown_strategy_and_contradictions():
    with pytest.raises(ConfigError, match="--parallelism"):
        Parallelism(strategy="zero4")
    problems = Parallelism(strategy="ddp", offload_params=True, offload_optimizer=True).problems(2)
    assert any("DDP offloads nothing" in p for p in problems)
    assert Parallelism(strategy="fsdp2", offload_params=True).problems(2)  # FSDP2 offloads both or neither
    assert not Parallelism(strategy="fsdp2", offload_params=True, offload_optimizer=True).problems(2)


def test_effective_batch_split_over_ranks():
    assert accumulation_for(64, 2, 8) == 4
    with pytest.raises(ConfigError, match=r"cannot be split over --num-gpus 6 .*multiple of 12"):
        accumulation_for(64, 2, 6)


def test_zero_closed_form_terms():
    """The ZeRO paper's Figure 1 example: 7.5B parameters, N=64, mixed-precision Adam (K=12): stage 2 holds
    2Ψ + (2+12)Ψ/N, stage 3 (2+2+12)Ψ/N (buffers apart)."""
    from advisor.physics import zero_bytes

    psi, n = 7_500_000_000, 64
    z2 = zero_bytes(2, psi, psi, n)
    assert z2.parameters == 2 * psi
    assert z2.gradients + z2.optimizer_state == pytest.approx((2 + 12) * psi / n, rel=1e-9)
    z3 = zero_bytes(3, psi, psi, n)
    assert z3.parameters + z3.gradients + z3.optimizer_state == pytest.approx(16 * psi / n, rel=1e-9)
    assert z3.total < z2.total
    assert zero_bytes(3, psi, psi, n, offload_optimizer=True).optimizer_state == 0
    assert zero_bytes(3, psi, psi, n, offload_params=True).parameters == 0


def test_communication_time_orders():
    """More ranks over a slower link take longer; resharding gathers twice; InfiniBand between machines is slower
    than NVLink inside one; one GPU communicates nothing."""
    from advisor.physics import comm_time_s

    kw = dict(param_bytes=16 * 10**9, grad_bytes=16 * 10**9, intra_gbs=450.0, inter_gbs=400.0, compute_s=0.0)
    one = comm_time_s(strategy=Strategy.FSDP2, num_gpus=1, num_machines=1, **kw)
    assert one.exposed_s == 0.0
    reshard = comm_time_s(strategy=Strategy.FSDP2, num_gpus=8, num_machines=1, **kw)
    keep = comm_time_s(strategy=Strategy.FSDP2, num_gpus=8, num_machines=1, reshard_after_forward=False, **kw)
    assert reshard.all_gather_s == pytest.approx(2 * keep.all_gather_s)
    two_nodes = comm_time_s(strategy=Strategy.FSDP2, num_gpus=16, num_machines=2, **kw)
    assert two_nodes.link == "inter" and two_nodes.all_gather_s > reshard.all_gather_s
    ddp = comm_time_s(strategy=Strategy.DDP, num_gpus=8, num_machines=1, **kw)
    assert ddp.all_gather_s == 0 and ddp.reduce_s == pytest.approx(2 * keep.reduce_s)
    hidden = comm_time_s(strategy=Strategy.FSDP2, num_gpus=8, num_machines=1, **{**kw, "compute_s": 100.0})
    assert hidden.exposed_s == 0.0


def test_every_cuda_profile_has_its_interconnect():
    from advisor.physics import interconnect
    from advisor.profiles import list_gpus, resolve_gpu

    for name in list_gpus():
        gpu = resolve_gpu(name)
        if gpu.is_cuda:
            ic = interconnect(gpu)
            assert ic.pcie_gbs > 0 and ic.intra_gbs >= ic.pcie_gbs


@pytest.mark.parametrize("par, stage_key, expected", [
    (Parallelism(), "fsdp_config", {"fsdp_version": 2, "fsdp_reshard_after_forward": True,
                                    "fsdp_offload_params": False}),
    (Parallelism(reshard_after_forward=False), "fsdp_config", {"fsdp_version": 2,
                                                               "fsdp_reshard_after_forward": False}),
    (Parallelism(offload_params=True, offload_optimizer=True), "fsdp_config", {"fsdp_offload_params": True}),
    (Parallelism(strategy="ddp"), None, {}),
])
def test_accelerate_config_loads_with_accelerates_own_loader(par, stage_key, expected, tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    from advisor.accelerate_config import accelerate_config

    cand = Candidate(precision="bf16", gradient_accumulation_steps=4)
    out = accelerate_config(cand, par, 8, 1)
    path = tmp_path / "accelerate.yaml"
    path.write_text(out.yaml)
    loaded = load_config_from_file(str(path))
    assert isinstance(loaded, ClusterConfig)
    assert loaded.num_processes == 8 and loaded.mixed_precision == "bf16"
    if stage_key:
        assert loaded.distributed_type.value == "FSDP"
        assert {k: loaded.fsdp_config[k] for k in expected} == expected
    else:
        assert loaded.distributed_type.value == "MULTI_GPU"
    assert out.command.startswith("accelerate launch --config_file accelerate.yaml")
    assert "--accelerate_config accelerate.yaml" in out.trl_command


def test_accelerate_config_deepspeed_stage(monkeypatch, tmp_path):
    """DeepSpeed's section as accelerate reads it (deepspeed itself is not needed to load the file)."""
    from accelerate.commands.config.config_args import load_config_from_file

    import advisor.parallelism as par_mod
    from advisor.accelerate_config import accelerate_config

    monkeypatch.setattr(par_mod, "deepspeed_available", lambda: True)
    out = accelerate_config(Candidate(precision="bf16", gradient_accumulation_steps=2),
                            Parallelism(strategy="zero3", offload_optimizer=True), 16, 2)
    path = tmp_path / "accelerate.yaml"
    path.write_text(out.yaml)
    loaded = load_config_from_file(str(path))
    assert loaded.distributed_type.value == "DEEPSPEED" and loaded.num_machines == 2
    assert loaded.deepspeed_config["zero_stage"] == 3
    assert loaded.deepspeed_config["offload_optimizer_device"] == "cpu"
    assert loaded.deepspeed_config["gradient_accumulation_steps"] == 2
    assert "--machine_rank $MACHINE_RANK" in out.command and "ZeRO-3" in out.chosen
