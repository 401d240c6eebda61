"""Online RL's closed form (advisor/physics/online_costs.py) and the estimate's (advisor/estimator/online_step.py)
against vLLM's own rules, a real transformers DynamicCache and TRL's real GRPOTrainer / RLOOTrainer.train() on the CPU.

Expected numbers are worked out by hand in the comments from the rule each term names (vLLM's file and function,
transformers' cache, TRL's chunked log-prob head), not by calling the function under test."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import yaml

from advisor import estimator
from advisor import physics as costs
from advisor.errors import ConfigError
from advisor.measurement import Category, Status

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles"
GiB = 2**30

OnlineStep = costs.online_OnlineStep
VllmSide = costs.online_VllmSide
Reference = costs.online_Reference
Mode = costs.vllm_Mode
Sleep = costs.vllm_Sleep
Refusal = costs.vllm_Refusal


def _config(name: str) -> dict:
    return json.loads((PROFILES / "models" / name / "config.json").read_text())


H100 = int(yaml.safe_load((PROFILES / "gpus" / "h100-sxm.yaml").read_text())["memory"])  # 85,520,809,984
QWEN05 = _config("Qwen/Qwen2.5-0.5B")
QWEN05_PARAMS = 494_032_768  # tests/test_vllm_memory.py works the count out layer by layer


def _step(**changes) -> OnlineStep:
    """A Qwen2.5-0.5B-shaped step with round byte counts, so the arithmetic below is checkable by hand."""
    layout = costs.vllm_kv_layout(QWEN05)
    base = dict(
        parameters=QWEN05_PARAMS, trainable=QWEN05_PARAMS, layers=24, hidden=896, intermediate=4864, kv_heads=2,
        head_dim=64, vocab=151_936, weights_bytes=4 * GiB, gradient_bytes=2 * GiB, optimizer_bytes=8 * GiB,
        kv_dtype_bytes=2, compute_bytes=2, head_weight_bytes=2, prompt_length=512, max_completion_length=1024,
        per_device_train_batch_size=8, steps_per_generation=8, num_generations=8, card_bytes=H100,
        vllm=VllmSide(weights_bytes=QWEN05_PARAMS * 2, layout=layout, max_model_len=2048, activation_bytes=GiB,
                      non_torch_bytes=GiB // 2, context_bytes=GiB // 2),
    )
    base.update(changes)
    return OnlineStep(**base)


# ---- vLLM's pool on the training GPU -------------------------------------------------------------------------------
def test_the_pool_is_utilization_times_total():
    terms = costs.online_vllm_terms(_step(engine=Mode.COLOCATE, vllm_gpu_memory_utilization=0.3))
    # Worker.init_device: requested_memory = 85,520,809,984 x 0.3 = 25,656,242,995.2 -> 25,656,242,996 bytes
    assert terms.split.pool_bytes == 25_656_242_996 == math.ceil(H100 * 0.3)
    # without sleep it is held outside the allocator in every phase
    assert [terms.held_bytes(p) for p in ("generate", "score", "train")] == [25_656_242_996] * 3
    # the generation batch: 64 sequences of 1,536 tokens, 96 pages of 16 x 12,288 bytes each, plus the null block
    assert terms.batch_kv_bytes == 64 * 96 * 196_608 + 196_608
    assert terms.waves == 1


def test_free_memory_after_the_training_state_under_the_pool_is_a_typed_oom():
    # at vLLM's snapshot the training process holds its context (0.5 GiB), the policy (4 GiB) and a separate
    # reference (4 GiB), no optimizer state yet: 85,520,809,984 - 9,126,805,504 = 76,394,004,480 free; 0.9 asks
    # ceil(76,968,728,985.6)
    step = _step(engine=Mode.COLOCATE, vllm_gpu_memory_utilization=0.9, beta=0.04, reference=Reference.SEPARATE,
                 reference_bytes=4 * GiB)
    out = costs.online_vllm_terms(step)
    assert isinstance(out, costs.online_VllmRefusal)
    assert out.cause is Refusal.POOL_EXCEEDS_FREE
    assert out.refused.needed_bytes == 76_968_728_986
    assert out.refused.available_bytes == 76_394_004_480
    assert "Worker.init_device" in out.message and "free memory at startup" in out.message
    # the fix: at least the pool that holds the generation batch (weights 988,065,536 + 1 GiB + 0.5 GiB + 64 x 96
    # pages + the null block = 3,806,834,432 bytes, 0.0445 of the card -> 0.05), at most
    # floor(76,394,004,480 / 85,520,809,984, 2 decimals) = 0.89
    assert "lower vllm_gpu_memory_utilization to between 0.05" in out.message and "and 0.89" in out.message
    started = costs.online_vllm_terms(_step(engine=Mode.COLOCATE, vllm_gpu_memory_utilization=0.89, beta=0.04,
                                            reference=Reference.SEPARATE, reference_bytes=4 * GiB))
    assert isinstance(started, costs.online_VllmTerms)


def test_a_pool_that_cannot_hold_one_full_length_sequence_is_a_typed_oom():
    # max_model_len 32,768 (the model's own): one request is 2,048 pages of 196,608 bytes = 402,653,184.
    # At 0.04 the pool is ceil(3,420,832,399.36) = 3,420,832,400 bytes; less the weights (988,065,536), the profile
    # run's 1.5 GiB and 0.5 GiB of non-torch memory, the KV cache gets 285,283,216 bytes, 285,086,608 after the null
    # block: under one request.
    side = VllmSide(weights_bytes=QWEN05_PARAMS * 2, layout=costs.vllm_kv_layout(QWEN05), max_model_len=32_768,
                    activation_bytes=3 * GiB // 2, non_torch_bytes=GiB // 2, context_bytes=GiB // 2)
    out = costs.online_vllm_terms(_step(engine=Mode.COLOCATE, vllm_gpu_memory_utilization=0.04, vllm=side))
    assert isinstance(out, costs.online_VllmRefusal)
    assert out.cause is Refusal.SEQUENCE_DOES_NOT_FIT
    assert out.refused.needed_bytes == 402_653_184
    assert out.refused.available_bytes == 285_086_608
    assert "max_model_len=32768" in out.message and "check_enough_kv_cache_memory" in out.message
    # the fix: the pool for one 32,768 sequence (weights + 1.5 + 0.5 GiB + 402,653,184 + 196,608 = 3,538,398,976
    # bytes: 0.0414 of the card -> 0.05), and vllm_max_model_length = prompt 512 + completion 1,024
    assert "raise vllm_gpu_memory_utilization to 0.05" in out.message
    assert "vllm_max_model_length=1536" in out.message
    fixed = costs.online_vllm_terms(_step(engine=Mode.COLOCATE, vllm_gpu_memory_utilization=0.05, vllm=side))
    assert isinstance(fixed, costs.online_VllmTerms)


def test_sleep_lowers_the_peak_by_the_smaller_of_pool_and_training_activations():
    split = costs.vllm_PoolSplit(pool_bytes=20 * GiB, weights_bytes=GiB, activation_bytes=GiB, non_torch_bytes=0)
    state = 10 * GiB
    for activations in (4 * GiB, 30 * GiB):  # under the pool, and over it
        phases = {"generate": state, "score": state + GiB // 4, "train": state + activations}
        awake = costs.online_device_peak(phases, costs.online_VllmTerms(Mode.COLOCATE, Sleep.OFF, split, 0, 1))
        slept = costs.online_device_peak(phases, costs.online_VllmTerms(Mode.COLOCATE, Sleep.LEVEL_2, split, 0, 1))
        # awake: 10 + A + 20 GiB in the train phase; asleep (level 2 keeps nothing here): max(10 + 20, 10 + A)
        assert awake.peak_bytes == 30 * GiB + activations
        assert slept.peak_bytes == max(30 * GiB, 10 * GiB + activations)
        assert awake.peak_bytes - slept.peak_bytes == min(20 * GiB, activations)
    # what sleep keeps (non-torch memory) stays in every phase: 2 GiB in score and train
    kept = costs.vllm_PoolSplit(pool_bytes=20 * GiB, weights_bytes=GiB, activation_bytes=GiB,
                                non_torch_bytes=2 * GiB)
    slept = costs.online_device_peak({"generate": state, "train": state + 30 * GiB},
                                     costs.online_VllmTerms(Mode.COLOCATE, Sleep.LEVEL_2, kept, 0, 1))
    assert slept.outside_allocator == {"generate": 20 * GiB, "train": 2 * GiB}
    assert slept.peak_bytes == 42 * GiB and slept.peak_phase == "train"


def test_server_mode_counts_no_pool_on_the_training_gpus():
    terms = costs.online_vllm_terms(_step(engine=Mode.SERVER, vllm_gpu_memory_utilization=0.9))
    assert terms.split is None
    peak = costs.online_device_peak({"generate": 5 * GiB, "train": 9 * GiB}, terms)
    assert peak.outside_allocator == {"generate": 0, "train": 0}
    assert peak.peak_bytes == 9 * GiB
    # transformers' generate: no vLLM at all
    assert costs.online_vllm_terms(_step()) is None
    with pytest.raises(ConfigError, match="unknown phase"):
        costs.online_device_peak({"sample": 1})


def test_phase_keys_accept_the_trainers_phase_kinds():
    from advisor.physics import online_PhaseKind as PhaseKind

    peak = costs.online_device_peak({PhaseKind.GENERATE: 3, PhaseKind.SCORE: 2, PhaseKind.TRAIN: 5})
    assert peak.allocator == {"generate": 3, "score": 2, "train": 5} and peak.peak_bytes == 5


def test_bad_step_shapes_name_the_setting():
    with pytest.raises(ConfigError, match="num_generations=3 does not divide the generation batch"):
        _step(num_generations=3)
    with pytest.raises(ConfigError, match="beta=0.04 needs a reference"):
        _step(beta=0.04)
    with pytest.raises(ConfigError, match="colocate needs vLLM's side"):
        _step(engine=Mode.COLOCATE, vllm=None)


# ---- the scoring forward and the reference, TRL's rules --------------------------------------------------------------
def test_old_policy_forward_follows_trls_condition():
    # GRPOTrainer._generate_and_score_completions: GA % (steps_per_generation x num_iterations) != 0, or vLLM's
    # importance-sampling correction
    assert not _step(gradient_accumulation_steps=8, steps_per_generation=8).old_logps_forward
    assert _step(gradient_accumulation_steps=1, steps_per_generation=2, num_generations=8,
                 per_device_train_batch_size=4).old_logps_forward
    assert _step(gradient_accumulation_steps=8, steps_per_generation=8, num_iterations=2).old_logps_forward
    assert _step(gradient_accumulation_steps=8, steps_per_generation=8, engine=Mode.SERVER).old_logps_forward
    assert not _step(gradient_accumulation_steps=8, steps_per_generation=8, engine=Mode.SERVER,
                     vllm_importance_sampling_correction=False).old_logps_forward
    # RLOOTrainer._generate_and_score_completions runs the old policy's forward unconditionally
    rloo = _step(gradient_accumulation_steps=8, steps_per_generation=8, old_logps_always=True)
    assert rloo.old_logps_forward and rloo.scoring_forwards == 1
    assert "scoring_forward" in costs.online_phase_allocator_bytes(rloo)["score"].parts


# ---- transformers' DynamicCache, real ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_kv_cache_of_generate_is_a_real_dynamic_cache(dtype_name):
    import torch
    from conftest import TINY_QWEN2
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_QWEN2), dtype=dtype).eval()
    rows, prompt, new = 3, 7, 5
    ids = torch.randint(10, 1000, (rows, prompt))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=True, return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    real = sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values))
    assert out.sequences.shape == (rows, prompt + new)
    formula = costs.online_hf_kv_cache_bytes(rows, prompt, new, layers=2, kv_heads=2, head_dim=16,
                                             dtype_bytes=torch.finfo(dtype).bits // 8)
    # 2 (K, V) x 2 layers x 3 rows x 2 heads x (7 + 5 - 1) positions x 16 x element size
    assert real == formula == 2 * 2 * 3 * 2 * 11 * 16 * (torch.finfo(dtype).bits // 8)


def test_kv_cache_under_autocast_over_float32_weights_keeps_float32_keys():
    """What GRPOTrainer's generate runs with bf16=True over float32 weights: accelerate's forward wrapper autocasts
    (accelerator.py prepare_model: `autocast_context(model.forward)`), v_proj's output is bf16, but rotary's cos/sin
    are in the float32 residual's dtype, so the keys are promoted back to float32."""
    import torch
    from conftest import TINY_QWEN2
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_QWEN2), dtype=torch.float32).eval()
    ids = torch.randint(10, 1000, (4, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                             do_sample=True, return_dict_in_generate=True, pad_token_id=0)
    layers = out.past_key_values.layers
    assert {(layer.keys.dtype, layer.values.dtype) for layer in layers} == {(torch.float32, torch.bfloat16)}
    real = sum(t.untyped_storage().nbytes() for layer in layers for t in (layer.keys, layer.values))
    # 2 layers x 4 rows x 2 heads x (9 + 6 - 1) positions x 16 x (4 + 2) bytes
    assert real == costs.online_hf_kv_cache_bytes(4, 9, 6, layers=2, kv_heads=2, head_dim=16, dtype_bytes=2,
                                                  key_dtype_bytes=4) == 2 * 4 * 2 * 14 * 16 * 6


# ---- the estimate's closed form ------------------------------------------------------------------------------------
def _prompts(n: int, length: int):
    from advisor.trainers.prompts import PromptDataset

    return PromptDataset(name="prompts", source="synthetic", rows=tuple((10,) * length for _ in range(n)))


def _workload(model, gpu, prompts):
    from advisor.workload import Goals, Workload

    return Workload(model=model, gpu=gpu, dataset=prompts, goals=Goals(), trainer="grpo")


def _qwen05():
    from advisor.workload import ModelSpec

    return ModelSpec(name="Qwen/Qwen2.5-0.5B", config=dict(QWEN05), source="local")


def test_estimate_is_a_typed_oom_when_colocated_vllm_would_not_start(h100_target):
    from advisor.space import Candidate

    w = _workload(_qwen05(), h100_target, _prompts(64, 256))
    c = Candidate(per_device_train_batch_size=8, gradient_accumulation_steps=8, precision="bf16",
                  weights_dtype="float32", optim="adamw_torch",
                  base={"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.99,
                        "num_generations": 8, "max_completion_length": 512})
    m = estimator.estimate(w, c)
    assert m.status is Status.OOM
    assert "Worker.init_device" in m.message and "vllm_gpu_memory_utilization" in m.message
    # the card is 80e9 bytes: the training process holds the memory outside the allocator and the Python thread's
    # cuBLAS workspace (sm90, cuda_constants.json; no backward has run yet) and the float32 policy (494,032,768 x 4 +
    # its rotary buffers, 256 bytes)
    startup = costs.context_bytes("9.0") + costs.cublas_workspace_bytes("9.0", threads=1) + QWEN05_PARAMS * 4 + 256
    assert f"({(80 * 10**9 - startup) / GiB:.2f} GiB" in m.message
    assert f"({math.ceil(80 * 10**9 * 0.99) / GiB:.2f} GiB)" in m.message


def test_estimate_holds_the_pool_outside_the_allocator_and_sleep_gives_it_back(h100_target):
    from advisor.space import Candidate

    w = _workload(_qwen05(), h100_target, _prompts(64, 256))
    knobs = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3, "num_generations": 8,
             "max_completion_length": 512, "vllm_max_model_length": 1024}
    c = Candidate(per_device_train_batch_size=8, gradient_accumulation_steps=8, precision="bf16",
                  weights_dtype="float32", optim="adamw_torch", base=knobs)
    awake = estimator.estimate(w, c)
    asleep = estimator.estimate(w, c.replace(base={**knobs, "vllm_enable_sleep_mode": True}))
    server = estimator.estimate(w, c.replace(base={**knobs, "vllm_mode": "server"}))
    assert awake.ok and asleep.ok and server.ok
    pool = math.ceil(80 * 10**9 * 0.3)  # utilization x the card's total
    assert awake.outside_allocator_bytes == pool == awake.breakdown[Category.OUTSIDE_ALLOCATOR.value]
    # asleep (level 2): the peak is the train phase's with only the non-torch memory kept (0.5 GiB,
    # online_rl_constants.json), or the generate phase's with the pool, whichever is larger
    kept = json.loads((PROFILES / "measurements" / "online_rl_constants.json").read_text())[
        "vllm_non_torch_bytes"]["value"]
    assert asleep.outside_allocator_bytes in (kept, pool)
    assert asleep.device_bytes < awake.device_bytes
    # the same allocator bytes; the device's drop is the pool less what sleep keeps, at most
    assert asleep.peak_bytes == awake.peak_bytes
    assert awake.device_bytes - asleep.device_bytes <= pool - kept
    # the awake estimate says what sleep mode would save, with the asleep estimate's own number
    assert any(f"device peak {asleep.device_bytes / GiB:.2f} GiB instead of {awake.device_bytes / GiB:.2f} GiB" in n
               for n in awake.notes)
    assert server.outside_allocator_bytes == 0 and Category.OUTSIDE_ALLOCATOR.value not in server.breakdown
    for m in (awake, asleep, server):
        assert m.tokens_per_second and m.tokens_per_second > 0
        assert {"generation", "weight_sync", "scoring_forwards"} <= set(m.time_breakdown)
        assert abs(sum(m.time_breakdown.values()) - m.step_time_s) < 1e-9 * m.step_time_s


def _grpo_cpu_peak():
    """scripts/grpo_cpu_peak.py as a module (registered first: its dataclasses look their module up)."""
    import sys

    if "grpo_cpu_peak" in sys.modules:
        return sys.modules["grpo_cpu_peak"]
    spec = importlib.util.spec_from_file_location("grpo_cpu_peak", ROOT / "scripts" / "grpo_cpu_peak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["grpo_cpu_peak"] = module
    spec.loader.exec_module(module)
    return module


# The estimate against TRL's real train() on the CPU (scripts/grpo_cpu_peak.py: the CPU allocator's own events).
# Measured (TRL 1.16.0, torch 2.13 CPU, tiny Qwen2): real / estimate = 0.9944 (grpo-full), 1.0004 (beta with a
# separate reference and checkpointing), 0.9944 (steps_per_generation 2, num_iterations 2), 0.9853 (LoRA with the
# adapters disabled as reference; 0.9624 while the SFT estimate counted a dropout copy of each adapter's input at
# lora_dropout=0), 1.0004 (RLOO's defaults). At this size the fused head's 32,768-column buffer is most of the peak;
# the tolerance the closed form meets honestly is 5%. At `--size medium` (the training state outweighs that buffer;
# 11-56 s a case, too slow for the suite) it measured 0.9850 (full), 1.0103 (reference and checkpointing), 0.9850
# (num_iterations 2) and 0.9378 (LoRA; 0.8441 with that dropout copy).
TOLERANCE = 0.05
_CASES = {  # the Candidate of each scripts/grpo_cpu_peak.py case
    "grpo-full": (dict(activation_checkpointing=False), {"beta": 0.0, "num_generations": 4}),
    "grpo-beta-ref-ckpt": (dict(activation_checkpointing=True), {"beta": 0.04, "num_generations": 4}),
    "grpo-num-iterations-2": (dict(activation_checkpointing=False),
                              {"beta": 0.0, "num_generations": 4, "num_iterations": 2}),
    "grpo-lora-beta": (dict(activation_checkpointing=False, use_lora=True, lora_r=8,
                            lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj")), {"beta": 0.04, "num_generations": 4}),
    "rloo-defaults": (dict(activation_checkpointing=True), {"beta": 0.05, "num_generations": 2}),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_estimate_peak_of_a_tiny_grpo_run_against_the_real_cpu_peak(case, tiny_model, cpu_target):
    from advisor.space import Candidate

    script = _grpo_cpu_peak()
    run = script.CASES[case]
    real = script.run_case(run)
    assert set(real.completion_lengths) == {script.BASE["max_completion_length"]}  # forced to the bound
    kw, knobs = _CASES[case]
    c = Candidate(per_device_train_batch_size=script.BASE["per_device_train_batch_size"],
                  gradient_accumulation_steps=1, precision="fp32", weights_dtype="float32", optim="adamw_torch",
                  **kw, base={**knobs, "max_completion_length": script.BASE["max_completion_length"]})
    m = estimator.estimate(_workload(tiny_model, cpu_target, _prompts(run.prompts, run.prompt_tokens)), c)
    ratio = real.peak_bytes / m.peak_bytes
    assert abs(ratio - 1) <= TOLERANCE, f"{case}: real {real.peak_bytes:,} / estimate {m.peak_bytes:,} = {ratio:.4f}"


def test_vllm_side_from_a_real_config():
    # Qwen2.5-0.5B: bf16 in its config, kept by vLLM's dtype="auto": 494,032,768 x 2 bytes of weights; KV 12,288
    # bytes a token (tests/test_vllm_memory.py); the profile run over 4,096 tokens of one layer's transients
    # (3 x 4,864 + 4 x 896 = 18,176 bf16 values a token: 148,897,792 bytes) plus the sampler's fp32 logits and
    # probabilities of 64 rows of 151,936 (77,791,232 bytes)
    side = costs.online_vllm_side(QWEN05, parameters=QWEN05_PARAMS, generation_batch=64, vllm_max_model_length=2048,
                                  context_bytes=GiB // 2)
    assert side.weights_bytes == 988_065_536
    assert side.layout.bytes_per_token == 12_288
    assert side.max_model_len == 2048
    assert side.activation_bytes == 148_897_792 + 77_791_232
    assert side.non_torch_bytes == 536_870_912  # online_rl_constants.json vllm_non_torch_bytes
    # what the simulator's glue calls with its own numbers is what the step's terms are
    step = _step(engine=Mode.COLOCATE, vllm=side, vllm_gpu_memory_utilization=0.3)
    direct = costs.online_colocated_vllm(side, card_bytes=H100, utilization=0.3, sleep=Sleep.OFF,
                                         startup_bytes=GiB // 2 + 4 * GiB, generation_batch=64, prompt_length=512,
                                         max_completion_length=1024)
    assert direct == costs.online_vllm_terms(step)


def test_estimate_refuses_vllm_on_a_cpu_target(tiny_model, cpu_target):
    from advisor.space import Candidate

    c = Candidate(per_device_train_batch_size=4, base={"use_vllm": True, "num_generations": 4,
                                                      "max_completion_length": 16})
    m = estimator.estimate(_workload(tiny_model, cpu_target, _prompts(8, 24)), c)
    assert m.status is Status.ERROR and "use_vllm=True" in m.message and "use_vllm=False" in m.message


def test_gradients_are_resident_while_generating_inside_an_accumulation():
    # GA 8, a generation every 2 micro-steps: generations at micro-steps 2, 4 and 6 find the earlier gradients
    inside = _step(gradient_accumulation_steps=8, steps_per_generation=2, per_device_train_batch_size=8)
    aligned = _step(gradient_accumulation_steps=8, steps_per_generation=8)
    assert inside.gradients_while_generating and not aligned.gradients_while_generating
    assert not _step(gradient_accumulation_steps=1, steps_per_generation=2).gradients_while_generating
    gen_inside = costs.online_phase_allocator_bytes(inside)["generate"]
    gen_aligned = costs.online_phase_allocator_bytes(aligned)["generate"]
    assert gen_inside.parts["gradients"] == 2 * GiB and "gradients" not in gen_aligned.parts


def test_the_generate_phase_holds_the_kv_cache_of_the_whole_generation_batch():
    step = _step()  # 64 completions (8 x 8) of 512 + 1,024 tokens, bf16 K/V of 24 layers x 2 heads x 64
    gen = costs.online_phase_allocator_bytes(step)["generate"]
    assert gen.parts["kv_cache"] == 2 * 24 * 64 * 2 * (512 + 1024 - 1) * 64 * 2
    # vLLM generates instead: no DynamicCache on the training side
    served = costs.online_phase_allocator_bytes(_step(engine=Mode.SERVER))["generate"]
    assert "kv_cache" not in served.parts


def test_zero3_gathers_the_whole_model_to_generate_and_peft_to_sync():
    # one rank of 4 holds a quarter of the 1 GiB of bf16 weights; gathered, the other three quarters join it
    shard = dict(world_size=4, zero3=True, weights_bytes=GiB // 4, full_weights_bytes=GiB, num_generations=8,
                 per_device_train_batch_size=8, steps_per_generation=1, gradient_accumulation_steps=1)
    gather = lambda **kw: costs.online_phase_allocator_bytes(_step(**shard, **kw))["generate"].parts["zero3_gather"]  # noqa: E731
    assert gather() == 3 * GiB // 4  # ds3_gather_for_generation (TRL's default): every parameter at once
    assert gather(ds3_gather_for_generation=False) == 3 * GiB // 4 // 24  # a layer at a time
    assert gather(engine=Mode.SERVER, lora=True) == 3 * GiB // 4  # PEFT: gathered whole to merge, then pushed
    assert gather(engine=Mode.SERVER) == 151_936 * 896 * 2  # one parameter at a time: the embedding
    assert costs.online_phase_allocator_bytes(_step())["generate"].parts["zero3_gather"] == 0


def test_estimate_names_trls_rule_a_candidate_breaks(tiny_model, cpu_target):
    from advisor.space import Candidate

    # 4 completions a micro-batch, one micro-batch a generation: num_generations 3 does not divide 4
    c = Candidate(per_device_train_batch_size=4, base={"num_generations": 3, "max_completion_length": 16})
    m = estimator.estimate(_workload(tiny_model, cpu_target, _prompts(8, 24)), c)
    assert m.status is Status.ERROR and "num_generations=3 does not divide the generation batch" in m.message


def test_estimate_on_several_gpus_counts_every_training_rank(tiny_model, h100_target):
    """As the SFT estimate: one rank's memory, every rank's completions over the step with the collectives' exposed
    time. (Per-rank throughput set against one GPU's made a search on 8 GPUs prefer vLLM server on 7 of them,
    training on 1: 11,409 against 7,801 tokens/s for DDP-like colocate on 8, which is 62,379 counted on every rank.)"""
    import dataclasses

    from advisor.space import Candidate

    c = Candidate(per_device_train_batch_size=4, parallelism="ddp",
                  base={"num_generations": 4, "max_completion_length": 16})
    one = estimator.estimate(_workload(tiny_model, h100_target, _prompts(8, 24)), c)
    wl = dataclasses.replace(_workload(tiny_model, h100_target, _prompts(8, 24)), num_gpus=2)
    two = estimator.estimate(wl, c)
    assert two.trained_tokens_per_step == 2 * one.trained_tokens_per_step
    assert two.step_time_s >= one.step_time_s and two.tokens_per_second > 1.5 * one.tokens_per_second
    assert any("throughput counts all 2 ranks" in n for n in two.notes)
