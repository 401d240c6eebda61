"""The simulate backend for online RL (advisor/simulator/online_simulate.py): `advisor.simulator.simulate` of a GRPO /
RLOO workload runs TRL's own train() on fake tensors (advisor/simulator/online_rl.py run_online_fake, checked against
real CPU train() peaks in tests/test_simulate_accuracy_grpo.py) built through the trainer seam, and combines its
per-phase allocator peaks with colocated vLLM's side (advisor/physics/online_costs.py).

Here: the glue's construction against a trainer built by hand with TRL's own GRPOConfig (the same peak to the byte on
the CPU), vLLM's refusals as typed OOM outcomes naming the cause, sleep mode and server mode, and the CLI."""

from __future__ import annotations

import dataclasses
import re
import tempfile
import warnings

import pytest
import torch
import yaml

from advisor.cli import main
from advisor.measurement import Category, Status
from advisor.space import Candidate, Optimizer, Precision, with_knobs

C = 8  # max_completion_length: the decode loop runs to 5 and 7 tokens, 8 extrapolated


def _workload(model, gpu, trainer="grpo"):
    from advisor.trainers.prompts import synthetic_prompts
    from advisor.workload import Goals, Workload

    return Workload(model=model, gpu=gpu, dataset=synthetic_prompts(1024, rows=16, median=32, max_len=64),
                    goals=Goals(), trainer=trainer)


def _candidate(**knobs):
    from advisor.trainers import get_trainer

    get_trainer("grpo")  # the online knobs are declared by the trainer modules
    base = Candidate(per_device_train_batch_size=4, expandable_segments=False, activation_checkpointing=False,
                     precision=Precision.FP32, optim=Optimizer.ADAMW_TORCH)
    return with_knobs(base, **{"num_generations": 2, "max_completion_length": C, **knobs})


def _by_hand(workload, candidate):
    """GRPOTrainer built without the trainer seam: TRL's GRPOConfig written out, the policy from transformers'
    config on meta, the longest prompts as advisor.modeling's placeholder text, TRL's soft-overlong reward."""
    import datasets
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    from trl.rewards import get_soft_overlong_punishment

    from advisor.modeling import placeholder_tokenizer
    from advisor.simulator import make_online_trainer_class, online_construction, run_online_fake

    cfg = dict(workload.model.config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    lengths = workload.dataset.lengths
    longest = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:2]  # 4 completions / 2 per prompt
    prompts = [" ".join(f"<t{t}>" for t in workload.dataset.rows[i]) for i in longest]
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      num_generations=2, max_completion_length=C, generation_kwargs={"min_new_tokens": C},
                      shuffle_dataset=False, bf16=False, gradient_checkpointing=False, optim="adamw_torch",
                      use_cpu=True, max_steps=2, report_to="none", save_strategy="no", logging_strategy="no",
                      disable_tqdm=True, seed=0, dataloader_num_workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with online_construction(config):
            trainer = make_online_trainer_class(GRPOTrainer)(
                model=model, args=args, processing_class=placeholder_tokenizer(workload.model),
                train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                reward_funcs=[get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)])
        return run_online_fake(trainer, steps=2, cuda=False)


def test_simulate_equals_the_fake_train_peak_on_the_cpu(tiny_model, cpu_target):
    from advisor.simulator import simulate

    wl = _workload(tiny_model, cpu_target)
    cand = _candidate()
    m = simulate(wl, cand)
    fake = _by_hand(wl, cand)
    assert m.status is Status.OK, m.message
    assert m.peak_bytes == m.device_bytes == fake.peak_bytes  # exact through the glue: nothing added on a CPU
    assert sum(m.breakdown.values()) == m.peak_bytes
    assert Category.OUTSIDE_ALLOCATOR.value not in m.breakdown
    assert m.trained_tokens_per_step == 4 * C
    assert m.step_time_s and m.step_time_s > m.time_breakdown["training"] > 0
    assert m.tokens_per_second == pytest.approx(4 * C / m.step_time_s)
    assert any("every completion at max_completion_length" in n for n in m.notes)
    assert any("extrapolated affinely" in n for n in m.notes)
    assert any(n.startswith("time: the training passes") and " ops in 1)" in n for n in m.notes)


def test_rloo_keeps_its_reference_at_its_default_beta(tiny_model, cpu_target):
    from advisor.simulator import simulate

    cand = _candidate()
    grpo, rloo = simulate(_workload(tiny_model, cpu_target), cand), \
        simulate(_workload(tiny_model, cpu_target, "rloo"), cand)
    assert rloo.status is Status.OK and grpo.status is Status.OK
    # RLOO's beta 0.05 keeps a separate reference: one more copy of the weights
    assert rloo.breakdown[Category.PARAMETERS.value] > grpo.breakdown[Category.PARAMETERS.value]


@pytest.mark.parametrize(("knobs", "cause"), [
    ({"vllm_gpu_memory_utilization": 0.0001}, "no memory left for the KV cache"),
    ({"vllm_gpu_memory_utilization": 0.999}, "free"),
])
def test_colocated_vllm_whose_pool_does_not_fit_is_oom_naming_the_cause(tiny_model, h100_target, knobs, cause):
    from advisor.simulator import simulate

    m = simulate(_workload(tiny_model, h100_target), _candidate(use_vllm=True, **knobs))
    assert m.status is Status.OOM
    assert "vLLM refuses to start" in m.message and cause in m.message and "vllm_gpu_memory_utilization" in m.message
    assert any("colocated vLLM refused" in n for n in m.notes)


def test_vllm_sleep_and_server_modes(tiny_model, h100_target):
    from advisor.simulator import simulate

    wl = _workload(tiny_model, h100_target)
    plain = simulate(wl, _candidate())
    awake = simulate(wl, _candidate(use_vllm=True))
    asleep = simulate(wl, _candidate(use_vllm=True, vllm_enable_sleep_mode=True))
    served = simulate(wl, _candidate(use_vllm=True, vllm_mode="server", vllm_server_gpus=1))
    for m in (plain, awake, asleep, served):
        assert m.status is Status.OK, m.message
    pool = int(0.3 * h100_target.memory_bytes)  # vLLM's pool: utilization x the card's total
    assert awake.breakdown[Category.OUTSIDE_ALLOCATOR.value] == awake.outside_allocator_bytes == pool
    assert awake.device_bytes > pool
    assert asleep.device_bytes < awake.device_bytes  # the pool given back while scoring and training
    assert Category.OUTSIDE_ALLOCATOR.value not in served.breakdown and served.outside_allocator_bytes == 0
    assert served.device_bytes < awake.device_bytes
    assert any("server mode" in n for n in served.notes)
    assert plain.time_breakdown["weight_sync"] == 0 and awake.time_breakdown["weight_sync"] > 0


def test_use_vllm_on_a_cpu_target_is_an_error_naming_the_key(tiny_model, cpu_target):
    from advisor.simulator import simulate_online
    from advisor.trainers import get_trainer

    wl = _workload(tiny_model, cpu_target)
    m = simulate_online(wl, _candidate(use_vllm=True), cpu_target, get_trainer("grpo"))
    assert m.status is Status.ERROR and "use_vllm=True" in m.message and "use_vllm=False" in m.message


def test_cli_simulate_and_suggest(tmp_path, tiny_config, capsys):
    from advisor.trainers import get_trainer

    run = tmp_path / "run.yaml"
    run.write_text(get_trainer("grpo").to_yaml(_candidate(), model_name_or_path="m"))
    rc = main(["simulate", "--trainer", "grpo", "--model", tiny_config, "--gpu", "cpu", "--config", str(run),
               "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert '"status": "ok"' in captured.out
    out = tmp_path / "pick.yaml"
    rc = main(["suggest", "--trainer", "rloo", "--model", tiny_config, "--gpu", "cpu", "--backend", "simulate",
               "--trials", "2", "--fix", f"max_completion_length={C}", "--format", "yaml", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert yaml.safe_load(out.read_text())["max_completion_length"] == C


def test_several_gpus_under_ddp_add_the_buckets_and_count_every_rank(tiny_model, h100_target):
    """One rank under DDP: the single-GPU step at the per-device settings plus DDP's gradient buckets (one more copy
    of the trainable gradients); throughput counts every rank. (Against a real 2-rank gloo run:
    tests/test_grpo_probe.py.)"""
    from advisor.parallelism import Parallelism, Strategy
    from advisor.simulator import simulate, simulate_per_rank

    wl, cand = _workload(tiny_model, h100_target), _candidate()
    one = simulate(wl, cand)
    two = simulate_per_rank(wl, cand, num_gpus=2, parallelism=Parallelism(strategy=Strategy.DDP))
    assert one.status is Status.OK and two.status is Status.OK, (one.message, two.message)
    grads = two.breakdown[Category.GRADIENTS.value] - one.breakdown.get(Category.GRADIENTS.value, 0)
    assert grads > 0 and two.peak_bytes == one.peak_bytes + grads
    assert two.trained_tokens_per_step == 2 * one.trained_tokens_per_step
    assert any("online RL on 2 ranks under DDP" in n for n in two.notes)


@pytest.mark.parametrize("strategy,knobs,says", [
    ("fsdp2", {}, "fsdp2: the fake run of GRPOTrainer.train() on several GPUs is DDP's only"),
    ("ddp", {"num_generations": 8}, "a rank's generation batch of 4 completions is not a multiple of "
                                    "num_generations=8"),
])
def test_what_several_gpus_do_not_simulate_is_the_estimate_saying_so(tiny_model, h100_target, strategy, knobs, says):
    """Never a crash nor a silent stand-in: what the fake run does not do on several GPUs (a sharded layout, a group
    spanning ranks) is a typed NotSimulated from simulate, which the simulate backend answers with the estimate's
    closed form, its source `estimate` and a note naming why."""
    from advisor.errors import NotSimulated
    from advisor.estimator import estimate
    from advisor.measurement import Source
    from advisor.search import get_backend
    from advisor.simulator import simulate_per_rank

    wl = dataclasses.replace(_workload(tiny_model, h100_target), num_gpus=2)
    cand = _candidate(**knobs).replace(parallelism=strategy)
    with pytest.raises(NotSimulated, match=re.escape(says)):  # simulate itself: a typed refusal naming why
        simulate_per_rank(wl, cand, parallelism=cand.parallelism.parallelism)
    m = get_backend("simulate").measure(wl, cand)  # the search's backend: the estimate, saying so
    assert m.source is Source.ESTIMATE and m.status is Status.OK
    assert any(n.startswith("not simulated, the estimate's closed form instead: ") and says in n for n in m.notes)
    assert m.peak_bytes == estimate(wl, cand).peak_bytes


def test_a_reward_model_given_as_a_model_is_resident(tiny_model, cpu_target):
    import dataclasses

    from advisor.simulator import simulate
    from advisor.trainers.prompts import synthetic_prompts
    from advisor.workload import Goals, Workload

    cand = _candidate()
    plain = simulate(_workload(tiny_model, cpu_target), cand)
    wl = Workload(model=tiny_model, gpu=cpu_target, dataset=synthetic_prompts(1024, rows=16, median=32, max_len=64),
                  goals=Goals(), trainer="grpo",
                  models={"reward_model": dataclasses.replace(tiny_model, name="org/rm")})
    scored = simulate(wl, cand)
    params = Category.PARAMETERS.value
    # the tied-embedding policy's weights again, plus the one-label score head (hidden x 1, float32)
    assert scored.breakdown[params] - plain.breakdown[params] == plain.breakdown[params] + 64 * 4
    assert scored.peak_bytes > plain.peak_bytes
    assert any("1 reward model(s) resident" in n for n in scored.notes)
    assert not any(n.startswith("reward: no reward function or model given") for n in scored.notes)


def test_what_fake_tensors_cannot_run_is_modelled_in_every_phase(tiny_model, h100_target):
    """QLoRA's 4-bit weights (run as 16-bit on fake tensors) and an 8-bit optimizer's state: the closed forms simulate()
    applies to SFT (advisor/simulator/modelled.py), held in every phase of the online step."""
    from advisor.simulator import simulate
    from advisor.space import Quantization

    wl = _workload(tiny_model, h100_target)
    lora = simulate(wl, _candidate().replace(use_lora=True, precision=Precision.BF16))
    qlora = simulate(wl, _candidate().replace(use_lora=True, precision=Precision.BF16,
                                              quantization=Quantization.NF4))
    assert qlora.status is Status.OK and lora.status is Status.OK
    assert qlora.breakdown[Category.PARAMETERS.value] < lora.breakdown[Category.PARAMETERS.value]
    assert any(n.startswith("bitsandbytes 4bit kernels cannot run on fake tensors") for n in qlora.notes)
    adam = simulate(wl, _candidate())
    eight = simulate(wl, _candidate().replace(optim=Optimizer.ADAMW_8BIT))
    state = adam.breakdown[Category.OPTIMIZER.value]
    assert eight.breakdown[Category.OPTIMIZER.value] == state - state * 3 // 4  # two uint8 moments for two fp32
    assert eight.device_bytes < adam.device_bytes


def test_flash_attention_is_a_typed_error_not_a_crash(tiny_model, h100_target):
    """FlashAttention in an online step is not simulated yet: an ERROR Measurement naming the key and the fix (the
    search skips it), where it raised transformers' KeyError from inside the fake run."""
    from advisor.measurement import Status
    from advisor.simulator import simulate
    from advisor.space import Candidate, with_knobs
    from advisor.trainers.prompts import synthetic_prompts
    from advisor.workload import Goals, Workload

    wl = Workload(model=tiny_model, gpu=h100_target, dataset=synthetic_prompts(1024, rows=8, median=16, max_len=32),
                  goals=Goals(), trainer="grpo")
    cand = with_knobs(Candidate(per_device_train_batch_size=2, attn_implementation="kernels-community/flash-attn2"),
                      num_generations=2, max_completion_length=8)
    m = simulate(wl, cand)
    assert m.status is Status.ERROR
    assert "attn_implementation=kernels-community/flash-attn2" in m.message and "sdpa" in m.message
