"""A run on this machine uses only what is installed here (advisor/packages.py): the search leaves out, and never
measures or picks, a candidate needing a missing package, and says what installing it would unlock with the
predicted gain; for another machine the candidates stay, and the answer says what that machine must have."""

from __future__ import annotations

import dataclasses

import pytest

from advisor import packages
from advisor.errors import ConfigError, UsageError
from advisor.events import EventKind, render
from advisor.search import suggest
from advisor.space import Attention, Candidate, Optimizer, Quantization
from advisor.workload import Goals, Method, Workload

MISSING = {"bitsandbytes", "kernels", "vllm"}


@pytest.fixture
def without(monkeypatch):
    """This machine lacks bitsandbytes, kernels and vllm (whatever is really installed)."""
    monkeypatch.setattr(packages, "installed", lambda pip: pip not in MISSING)


@pytest.fixture
def h100_workload(tiny_model, h100_target, tiny_data):
    return Workload(model=tiny_model, gpu=h100_target, dataset=tiny_data, goals=Goals(tokens_per_step=2048))


def test_each_knob_value_names_the_package_it_needs():
    from advisor.search import value_requirements

    assert value_requirements("optim", Optimizer.ADAMW_8BIT) == ("bitsandbytes",)
    assert value_requirements("optim", Optimizer.ADAMW_TORCH_FUSED) == ()
    assert value_requirements("quantization", Quantization.NF4) == ("bitsandbytes",)
    assert value_requirements("attn_implementation", Attention.FLASH_ATTENTION_2) == ("kernels",)
    assert value_requirements("attn_implementation", Attention.SDPA) == ()
    assert value_requirements("use_kernels", True) == ("kernels",)
    # the same package twice (Hub kernels and a Hub attention kernel) is named once
    assert Candidate(use_kernels=True, attn_implementation=Attention.FLASH_ATTENTION_2).requirements() == ("kernels",)


@pytest.fixture(scope="module")
def qwen_h100():
    """Qwen2.5-0.5B (profiles/models) on an H100 over the synthetic chat set: FlashAttention pays there."""
    from advisor.inputs import build_workload

    return build_workload("Qwen/Qwen2.5-0.5B", gpu="H100-80GB")


def test_a_local_search_neither_measures_nor_picks_what_needs_a_missing_package_and_says_what_it_unlocks(
        qwen_h100, without):
    h100_workload = qwen_h100
    here = dataclasses.replace(h100_workload, local_gpu=True)
    s = suggest(here, backend="estimate", cache=False)
    assert not packages.missing(s.candidate.requirements())
    measured = [t.candidate for t in s.trials]
    assert measured and not any(set(c.requirements()) & MISSING for c in measured)
    said = {e.package: e for e in s.events if e.kind is EventKind.NOT_INSTALLED}
    assert set(said) == {"bitsandbytes", "kernels"}, said  # vllm: SFT has no generation engine to leave out
    assert said["bitsandbytes"].values == ("optim=adamw_bnb_8bit", "optim=paged_adamw_8bit")
    assert said["kernels"].values == ("attn_implementation=kernels-community/flash-attn2",)
    flash = said["kernels"]
    assert flash.gain is not None and flash.gain > 0, "FlashAttention's padding-free rows are faster on an H100"
    line = render(flash)
    assert "pip install kernels" in line and f"{flash.gain:.1%} faster" in line

    # the same search for a target that is not this machine keeps them: its pick needs kernels, flagged
    there = suggest(h100_workload, backend="estimate", cache=False)
    assert "kernels" in there.candidate.requirements()
    assert not any(e.kind is EventKind.NOT_INSTALLED for e in there.events)
    assert "kernels not installed on this machine: the target must have it" in there.requirements_note
    # the gain said is the estimate's own ratio of the two picks (no correction: the estimate measured both)
    assert there.measurement.tokens_per_second == pytest.approx(
        s.measurement.tokens_per_second * (1 + flash.gain), rel=1e-9)


def test_a_probe_backend_runs_here_whatever_the_target(h100_workload, without):
    from advisor.backends import get_backend

    assert get_backend("cuda").runs_here and get_backend("cpu").runs_here
    assert not get_backend("simulate").runs_here and not get_backend("estimate").runs_here
    assert not h100_workload.runs_here
    assert dataclasses.replace(h100_workload, local_gpu=True).runs_here


def test_a_fix_that_needs_a_missing_package_is_refused_for_a_run_here(h100_workload, without):
    here = dataclasses.replace(h100_workload, local_gpu=True)
    with pytest.raises(UsageError, match=r"--fix optim=adamw_bnb_8bit: needs bitsandbytes, which is not installed "
                                         r"here.*pip install bitsandbytes, or drop the --fix"):
        suggest(here, backend="estimate", cache=False, fix={"optim": "adamw_bnb_8bit"})
    # QLoRA needs bitsandbytes whatever its values: no admissible candidate, and why
    with pytest.raises(UsageError, match=r"every value of quantization needs bitsandbytes.*pip install bitsandbytes"):
        suggest(here, backend="estimate", cache=False, method=Method.QLORA)
    # for another machine both are searched
    assert suggest(h100_workload, backend="estimate", cache=False,
                   fix={"optim": "adamw_bnb_8bit"}).candidate.optim is Optimizer.ADAMW_8BIT


def test_the_probe_refuses_a_configuration_needing_a_missing_package(small_workload, without):
    from advisor.probing import probe

    with pytest.raises(ConfigError, match=r"needs kernels, which is not installed here; pip install kernels"):
        probe(small_workload, Candidate(max_length=128, use_kernels=True), backend="cpu")


def test_build_workload_says_whether_the_target_is_the_local_gpu(monkeypatch, h100_target):
    import advisor.inputs as inputs

    monkeypatch.setattr(inputs, "detect_gpu", lambda: h100_target)
    assert inputs.build_workload("Qwen/Qwen2.5-0.5B", gpu="H100-80GB").local_gpu  # the alias names the local one
    assert inputs.build_workload("Qwen/Qwen2.5-0.5B").local_gpu  # no --gpu: the local one
    assert not inputs.build_workload("Qwen/Qwen2.5-0.5B", gpu="L4").local_gpu
    assert inputs.build_workload("Qwen/Qwen2.5-0.5B", gpu="cpu").runs_here
    monkeypatch.setattr(inputs, "detect_gpu", lambda: None)
    assert not inputs.build_workload("Qwen/Qwen2.5-0.5B").runs_here  # the assumed default GPU is not this machine
