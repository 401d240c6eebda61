"""Online RL's search space (issue 23, "The space"): the generation engine as one searched dimension of a CUDA target
(model.generate, vLLM colocate, vLLM colocate + sleep with expandable_segments off, vLLM server on k of --num-gpus),
vllm_gpu_memory_utilization derived by vLLM's own rule (checked here against the rule computed from the model's
config.json), ds3_gather_for_generation only under ZeRO-3, cast_lm_head_to_fp32 never searched, the effective-batch
line's unit, and `advisor lengths --trainer grpo --max-length`. Fast: the space's candidates only, no measurement."""

from __future__ import annotations

import math

import pytest

from advisor.profiles import resolve_gpu, resolve_model
from advisor.search import RowTokens, StudySpace, apply_pins, default_space, default_tokens_per_step, parse_fix
from advisor.space import Candidate, knob_value
from advisor.trainers import get_trainer
from advisor.trainers.prompts import synthetic_prompts
from advisor.workload import Goals, Method, Workload

MODEL = "Qwen/Qwen2.5-0.5B"
ENGINE = "generation_engine"


@pytest.fixture(scope="module")
def model():
    get_trainer("grpo")
    return resolve_model(MODEL)


def study(model, gpu="H100-80GB", num_gpus=1, fix=None, trainer="grpo", rows=64):
    wl = Workload(model=model, gpu=resolve_gpu(gpu), dataset=synthetic_prompts(model.vocab_size, rows=rows),
                  goals=Goals(), trainer=trainer, num_gpus=num_gpus)
    space = apply_pins(default_space(wl, Method.FULL), parse_fix(fix, trainer))
    rt = RowTokens(wl.dataset)
    return wl, StudySpace(wl, space, default_tokens_per_step(wl, rt), rt)


def by_engine(ss):
    out: dict[str, list[Candidate]] = {}
    for c in ss.candidates():
        out.setdefault(ss.params_of(c).get(ENGINE), []).append(c)
    return out


def test_one_cuda_gpu_searches_generate_colocate_and_colocate_with_sleep(model):
    _, ss = study(model)
    assert ss.params[ENGINE] == ("generate", "vllm-colocate", "vllm-colocate-sleep")
    # the knobs the engine sets are no dimensions of their own (no trial on a refused or a repeated combination)
    for name in ("use_vllm", "vllm_mode", "vllm_enable_sleep_mode", "vllm_server_gpus", "expandable_segments"):
        assert name not in ss.params, name
    groups = by_engine(ss)
    assert set(groups) == {"generate", "vllm-colocate", "vllm-colocate-sleep"}
    for c in groups["generate"]:
        assert knob_value(c, "use_vllm") is False and c.expandable_segments is True
    for c in groups["vllm-colocate"]:
        assert (knob_value(c, "use_vllm"), knob_value(c, "vllm_mode"), knob_value(c, "vllm_enable_sleep_mode")) == \
            (True, "colocate", False)
        assert c.expandable_segments is True
    for c in groups["vllm-colocate-sleep"]:  # one decision: sleep mode with expandable segments off
        assert knob_value(c, "vllm_enable_sleep_mode") is True and c.expandable_segments is False
    t = get_trainer("grpo")
    assert all(t.problems(c) == [] for cs in groups.values() for c in cs)
    # no candidate of the grid is refused for sleep mode with expandable segments
    assert not any("expandable" in out for out in ss._walk() if isinstance(out, str))


def test_server_mode_on_k_of_num_gpus_and_the_effective_batch_counts_the_training_ranks(model):
    wl, ss = study(model, num_gpus=4)
    assert ss.params[ENGINE] == ("generate", "vllm-colocate", "vllm-colocate-sleep", "vllm-server-1",
                                 "vllm-server-2", "vllm-server-3")
    groups = by_engine(ss)
    t = get_trainer("grpo")
    for k in (1, 2, 3):
        cands = groups[f"vllm-server-{k}"]
        assert cands
        for c in cands:
            assert (knob_value(c, "vllm_mode"), knob_value(c, "vllm_server_gpus")) == ("server", k)
            assert "vllm_gpu_memory_utilization" not in c.base.as_dict()  # server mode: not the training config's
            completions = c.per_device_train_batch_size * c.gradient_accumulation_steps * (4 - k)
            assert abs(completions * 512 / ss.tokens_per_step - 1) <= 0.25 + 1e-9
            assert t.check_world(c, 4) == []
            split = t.gpu_split(c, MODEL, 4)
            assert split.train_gpus == 4 - k and f"--tensor-parallel-size {k}" in split.server_command
    # the other engines never set GPUs aside
    for name in ("generate", "vllm-colocate", "vllm-colocate-sleep"):
        assert all(knob_value(c, "vllm_server_gpus") == 0 for c in groups[name])


def test_no_vllm_off_cuda(model):
    _, ss = study(model, gpu="cpu")
    assert ENGINE not in ss.params
    assert all(knob_value(c, "use_vllm") is False for c in ss.candidates())


def test_the_users_pins_hold(model):
    # use_vllm pinned off: only model.generate
    _, ss = study(model, fix={"use_vllm": "false"})
    assert ENGINE not in ss.params and all(knob_value(c, "use_vllm") is False for c in ss.candidates())
    # expandable_segments pinned on: sleep mode stays a choice and is refused with the rule's fix (not turned off)
    _, ss = study(model, fix={"expandable_segments": "true"})
    assert all(c.expandable_segments is True for c in ss.candidates())
    assert "vllm-colocate-sleep" not in by_engine(ss)
    assert any("expandable_segments" in out for out in ss._walk() if isinstance(out, str))
    # a --fix of the utilization is kept as given
    _, ss = study(model, fix={"vllm_gpu_memory_utilization": "0.5"})
    colocated = [c for c in ss.candidates() if knob_value(c, "vllm_mode") == "colocate" and
                 knob_value(c, "use_vllm")]
    assert colocated and {knob_value(c, "vllm_gpu_memory_utilization") for c in colocated} == {0.5}


def _vllm_rule(model, gpu, *, sequences: int, prompt: int, completion: int) -> float:
    """vLLM's smallest utilization, from config.json: KV bytes per token = 2 (K and V) x layers x KV heads x head
    size x 2 (bfloat16); vLLM pages of 16 tokens; the batch all at once or one max_model_len sequence (what vLLM
    needs to start, gpu_worker's check), plus the null block; plus vLLM's weights (the checkpoint's parameters at
    bfloat16), its profile run's activations and non-torch memory (the physics' modelled constants); rounded up to
    0.01 of the card."""
    from advisor.physics import architecture, online_vllm_side

    cfg = model.config
    heads = cfg["num_attention_heads"]
    head = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head * 2
    page = 16 * per_token
    max_model_len = cfg["max_position_embeddings"]
    length = min(prompt + completion, max_model_len)
    batch = sequences * math.ceil(length / 16) * page + page
    one = math.ceil(max_model_len / 16) * page + page
    side = online_vllm_side(cfg, parameters=architecture(model).total, generation_batch=sequences)
    assert side.weights_bytes == architecture(model).total * 2
    pool = side.weights_bytes + side.activation_bytes + side.non_torch_bytes + max(batch, one)
    return math.ceil(pool / gpu.memory_bytes * 100 - 1e-9) / 100


@pytest.mark.parametrize("completion", [512, 16384])
def test_the_derived_utilization_is_vllms_rule(model, completion):
    """Each colocated candidate's utilization is the smallest that holds its generation batch (per_device_train_batch
    x steps_per_generation, all at prompt + max_completion_length) and one max_model_len sequence."""
    # num_generations 2: steps_per_generation 1 admits generation batches of 2, 4 and 8 completions
    wl, ss = study(model, fix={"max_completion_length": str(completion), "num_generations": "2"})
    prompt = int(max(wl.dataset.lengths))
    colocated = [c for c in ss.candidates() if knob_value(c, "use_vllm") and knob_value(c, "vllm_mode") == "colocate"]
    assert colocated
    t = get_trainer("grpo")
    seen_batch_binding = False
    for c in colocated:
        spg = knob_value(c, "steps_per_generation") or c.gradient_accumulation_steps
        g = c.per_device_train_batch_size * spg
        want = _vllm_rule(model, wl.gpu, sequences=g, prompt=prompt, completion=completion)
        got = t.knobs(c).vllm_gpu_memory_utilization
        assert got == pytest.approx(want), (c.per_device_train_batch_size, spg)
        seen_batch_binding |= g * (prompt + completion) > model.config["max_position_embeddings"]
    assert len({t.knobs(c).vllm_gpu_memory_utilization for c in colocated}) > 1 or completion == 512
    if completion == 16384:
        assert seen_batch_binding  # the generation batch, not one sequence, decides some of them
    # the pick's note says how it was derived
    note = " ".join(ss.derivation_notes(colocated[-1]))
    assert "derived, not searched" in note and "min_utilization" in note
    assert ss.derivation_notes(next(c for c in ss.candidates() if not knob_value(c, "use_vllm"))) == []


def test_ds3_gather_for_generation_only_under_zero3(model):
    t = get_trainer("grpo")
    plain = t.joint_dimensions({"use_vllm": (False, True), "vllm_enable_sleep_mode": (False, True),
                                "expandable_segments": (True, False), "parallelism": ("ddp", "fsdp2")})[ENGINE]
    assert "generate-layerwise" not in dict(plain)
    zero3 = dict(t.joint_dimensions({"use_vllm": (False, True), "vllm_enable_sleep_mode": (False, True),
                                     "expandable_segments": (True, False), "parallelism": ("ddp", "zero3")})[ENGINE])
    assert zero3["generate-layerwise"]["ds3_gather_for_generation"] is False
    # vLLM needs the weights gathered (GRPOConfig's help: "not compatible with vLLM generation")
    assert all(a["ds3_gather_for_generation"] is True for name, a in zero3.items() if name.startswith("vllm"))
    # off ZeRO-3 the knob has no effect (TRL reads it only there): the trainer's canonical form resets it
    from advisor.space import with_knobs

    c = t.canonical(with_knobs(Candidate(), ds3_gather_for_generation=False))
    assert knob_value(c, "ds3_gather_for_generation") is True and c == Candidate()
    z = t.canonical(with_knobs(Candidate(parallelism="zero3"), ds3_gather_for_generation=False))
    assert knob_value(z, "ds3_gather_for_generation") is False


def test_switching_engines_leaves_nothing_behind(model):
    """A neighbour on another engine carries none of the last one's knobs (a server's GPUs, sleep mode, a derived
    utilization): each is exactly the candidate the walk has for that engine."""
    _, ss = study(model, num_gpus=4)
    walked = set(ss.candidates())
    server = next(c for c in ss.candidates() if knob_value(c, "vllm_mode") == "server")
    sleep = next(c for c in ss.candidates() if knob_value(c, "vllm_enable_sleep_mode"))
    for start in (server, sleep):
        others = [n for n in ss.neighbours(start) if ss.params_of(n)[ENGINE] != ss.params_of(start)[ENGINE]]
        assert {ss.params_of(n)[ENGINE] for n in others} >= {"generate", "vllm-colocate"}
        for n in others:
            assert n in walked, ss.params_of(n)


def test_cast_lm_head_to_fp32_is_never_searched(model):
    for gpu, n in (("H100-80GB", 1), ("H100-80GB", 4), ("cpu", 1)):
        wl, ss = study(model, gpu=gpu, num_gpus=n)
        assert "cast_lm_head_to_fp32" not in ss.params
        assert all(knob_value(c, "cast_lm_head_to_fp32") is False for c in ss.candidates())
    from advisor.trainers.online_knobs import KNOBS

    assert {k.name: k for k in KNOBS}["cast_lm_head_to_fp32"].quality
    _, ss = study(model, fix={"cast_lm_head_to_fp32": "true"})
    assert all(knob_value(c, "cast_lm_head_to_fp32") is True for c in ss.candidates())


def test_the_effective_batch_line_names_what_the_micro_batch_counts():
    from advisor.events import EffectiveBatch, render

    assert "8 completions x mean trained tokens per completion" in render(EffectiveBatch(4096, "completions"))
    assert "8 rows x mean trained tokens per row" in render(EffectiveBatch(4096))
    assert get_trainer("grpo").batch_unit == get_trainer("rloo").batch_unit == "completions"


def test_lengths_max_length_is_refused_for_prompts(tiny_config, capsys):
    from advisor.cli import main

    rc = main(["lengths", "--trainer", "grpo", "--model", tiny_config, "--max-length", "300"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--max-length 300" in err and "--max-completion-length 300" in err and "max_completion_length=300" in err
    assert main(["lengths", "--trainer", "grpo", "--model", tiny_config, "--max-completion-length", "300"]) == 0
    assert "prompt + 300 completion tokens" in capsys.readouterr().out
    assert main(["lengths", "--model", tiny_config, "--max-completion-length", "300"]) == 2
    assert "--max-completion-length 300" in capsys.readouterr().err


def test_a_server_candidate_is_measured_on_the_ranks_that_train(model, tmp_path, monkeypatch):
    """vLLM server on 3 of 4 GPUs: the backend measures the training side, one rank (its peak, no gradient
    all-reduce, its trained tokens per second), not four training ranks."""
    import dataclasses

    from advisor import suggest
    from advisor.estimator import estimate

    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    s = suggest(MODEL, gpu="H100-80GB", num_gpus=4, trainer="grpo", backend="estimate", trials=4, cache=False,
                fix={"use_vllm": True, "vllm_mode": "server", "vllm_server_gpus": 3})
    pick, wl = s.candidate, s.workload
    assert (knob_value(pick, "vllm_mode"), knob_value(pick, "vllm_server_gpus")) == ("server", 3)
    assert wl.num_gpus == 4
    one = estimate(dataclasses.replace(wl, num_gpus=1), pick)
    four = estimate(wl, pick)
    assert s.measurement.tokens_per_second == pytest.approx(one.tokens_per_second)
    assert s.measurement.tokens_per_second != pytest.approx(four.tokens_per_second)
    assert pick.per_device_train_batch_size * pick.gradient_accumulation_steps == 32  # 8 x 4 GPUs' completions
    assert s.launch_command().startswith("CUDA_VISIBLE_DEVICES=0 ")
