"""GRPO and RLOO: the simulator's fake run of TRL's own `train()` (advisor.simulator.run_online_fake) against the
peak of a real CPU `train()` measured from the allocator's own events (scripts/grpo_cpu_peak.py: torch.profiler
replayed by advisor.probing.meters.cpu_peak, plus the policy's and the reference's weights live before).

Both runs are TRL's GRPOTrainer / RLOOTrainer with the same config, data, tokenizer and reward function; the real
one forces every completion to `max_completion_length` with `generation_kwargs={"min_new_tokens": N}`, the fake one
runs every completion to its maximum length (the bound). The fake policy and the reference TRL builds from the
policy's name are built on `meta` (online_construction): no real weight is allocated for them.

The model is scripts/grpo_cpu_peak.py's "medium" Qwen2 (11.6 M parameters): its training state outweighs TRL's
20.4 MB fused LM-head buffer, so the cases differ in their peaks (a reference, LoRA, the generation batch). Each
case's fake `generate` runs its decode loop to 5 and 7 tokens and extrapolates the full length's peak (16 tokens);
test_decode_extrapolation_equals_the_full_decode_loop checks that extrapolation against the full decode loop on a
case where the decode, not the prefill, sets generate's peak and where a steeper moment of a decode step overtakes
the others after the short runs' steps.

Measured (advisor/simulator/online_rl.py's docstring has the table): the tiny model's six cases are exact to the byte;
at this size four are exact and the two with gradient checkpointing 4 B under the real peak (of 205.7 MB); the
reward-model and vLLM cases (beside the six, against this file's _real_peak) are exact.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import grpo_cpu_peak as real  # noqa: E402

from advisor.physics import online_PhaseKind as PhaseKind  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SIZE = "medium"


def _reward(completions, **_):
    return [float(i % 3) for i in range(len(completions))]  # as the real run's: varied, so advantages are not zero


def _run_inputs(case: real.Case) -> tuple[dict, object, object, object]:
    """What the fake and the real run are both given: the config's keyword arguments (scripts/grpo_cpu_peak.py's
    BASE with the case's, on the CPU, quiet), the LoRA config (None without LoRA), the tokenizer, the prompts."""
    import datasets

    kwargs = dict(real.BASE, **case.args)
    kwargs.update(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none", save_strategy="no",
                  logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0)
    peft_config = None
    if case.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    tok = real._tokenizer(real.TINY_QWEN2["vocab_size"], real.TINY_QWEN2["pad_token_id"],
                          real.TINY_QWEN2["eos_token_id"])
    data = datasets.Dataset.from_dict({"prompt": real._prompts(case, real.TINY_QWEN2["vocab_size"])})
    return kwargs, peft_config, tok, data


def _reward_model(config, device: str):
    """A one-label sequence classifier on the policy's architecture: a reward model given as a model (resident)."""
    import copy

    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(config)
    config.num_labels = 1
    with torch.device(device):
        return AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)


def _fake_trainer(case: real.Case, size: str | dict = SIZE, *, engine: str = "generate", reward_model: bool = False):
    """The trainer the real run builds, on a meta policy (as the simulator builds models). `size`: a size of
    scripts/grpo_cpu_peak.py or a transformers config as a dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from advisor.simulator import make_online_trainer_class, online_construction

    config = AutoConfig.for_model(**(real.SIZES[size] if isinstance(size, str) else size))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config._name_or_path = "policy-built-on-meta"  # TRL's reference is built from this name: on meta too
    kwargs, peft_config, tok, data = _run_inputs(case)
    n = kwargs["max_completion_length"]
    kwargs["generation_kwargs"] = {"min_new_tokens": n}
    if engine == "vllm":
        kwargs.update(use_vllm=True, vllm_mode=kwargs.get("vllm_mode", "colocate"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if case.trainer == "grpo":
            from trl import GRPOConfig as Config
            from trl import GRPOTrainer as Base
        else:
            from trl import RLOOConfig as Config
            from trl import RLOOTrainer as Base
        with online_construction(config, engine=engine):
            rewards = [_reward, _reward_model(config, "meta")] if reward_model else _reward
            trainer = make_online_trainer_class(Base)(model=model, reward_funcs=rewards, args=Config(**kwargs),
                                                      train_dataset=data, processing_class=tok,
                                                      peft_config=peft_config,
                                                      reward_processing_classes=[None, tok] if reward_model else None)
    return trainer


def _fake(case: real.Case, size: str = SIZE, **kwargs):
    from advisor.simulator import run_online_fake

    engine = kwargs.pop("engine", "generate")
    trainer = _fake_trainer(case, size, engine=engine, reward_model=kwargs.pop("reward_model", False))
    assert all(p.is_meta for p in trainer.model.parameters())
    if getattr(trainer, "ref_model", None) is not None:
        assert all(p.is_meta for p in trainer.ref_model.parameters())  # never a real weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_online_fake(trainer, steps=real.BASE["max_steps"], cuda=False, engine=engine, **kwargs)


@pytest.mark.parametrize("name", list(real.CASES))
def test_fake_train_peak_matches_the_real_cpu_train_peak(name):
    case = real.CASES[name]
    fake = _fake(case)
    measured = real.run_case(case, SIZE)
    n = case.args.get("max_completion_length", real.BASE["max_completion_length"])
    assert set(measured.completion_lengths) == {n}  # the real run did generate every completion at full length
    assert abs(fake.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes, (
        f"{name}: fake {fake.peak_bytes:,d} B vs real {measured.peak_bytes:,d} B")
    # what the fake run reports beside the peak
    assert set(fake.phase_peaks) == set(PhaseKind)
    assert fake.peak_bytes == max(fake.phase_peaks.values())
    assert sum(fake.breakdown.values()) == fake.peak_bytes
    ex = fake.extrapolations[0]
    assert ex.max_new_tokens == n and ex.short_lengths == (5, 7)  # the decode loop was not run to full length
    rows = real.BASE["per_device_train_batch_size"] * case.args.get("steps_per_generation", 1)
    assert fake.generated_tokens == fake.generations * rows * n


def test_bf16_autocast_matches_the_real_cpu_train_peak():
    """bf16=True (GRPOConfig's default) over float32 weights: TRL's passes and generate run under autocast (the KV
    cache's keys float32, its values bf16), fake and real alike."""
    case = real.CASES["grpo-full"]
    case = dataclasses.replace(case, args={**case.args, "bf16": True})
    fake = _fake(case)
    measured = real.run_case(case, SIZE)
    assert abs(fake.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes, (
        f"fake {fake.peak_bytes:,d} B vs real {measured.peak_bytes:,d} B")


def test_decode_extrapolation_equals_the_full_decode_loop():
    """The generate phase's peak extrapolated from 5 and 7 decode steps equals the full decode loop's, to the byte:
    4-token prompts, so the decode (the KV cache growing a position a step), not the prefill, sets generate's peak,
    and 32 tokens, past step 8 where a steeper moment of a decode step overtakes the others (fitting each step's
    peak instead of each moment was 131,072 B low at 40 tokens)."""
    case = dataclasses.replace(real.CASES["grpo-full"], prompt_tokens=4,
                               args={**real.CASES["grpo-full"].args, "max_completion_length": 32})
    short = _fake(case, decode_lengths=(5, 7))
    full = _fake(case, decode_lengths=None)
    assert short.extrapolations[0].short_lengths == (5, 7) and full.extrapolations[0].short_lengths == ()
    assert short.extrapolations[0].peak_bytes == full.extrapolations[0].peak_bytes
    assert short.phase_peaks == full.phase_peaks
    assert short.peak_bytes == full.peak_bytes
    # the decode bound generate's peak: more than a one-token generate holds
    one = _fake(dataclasses.replace(case, args={**case.args, "max_completion_length": 1}), decode_lengths=None)
    assert full.extrapolations[0].peak_bytes > one.extrapolations[0].peak_bytes


def _real_peak(case: real.Case, size: str = SIZE, *, engine: str = "generate", reward_model: bool = False) -> int:
    """scripts/grpo_cpu_peak.py's real CPU train() (GRPO), with what it does not build: a reward model given as a
    model (`reward_model`: resident, scored on every completion, beside the reward function), or `use_vllm=True`
    (colocate) with vLLM itself absent (`engine="vllm"`): TRL's VLLMGeneration built inside
    online_construction(engine="vllm") (no engine started), its `generate` answering every prompt with
    max_completion_length filler ids (3: no special token) and zero log-probs, as a vLLM that never stops early
    would. Everything the training process does around it is TRL's own and real: the weight sync (PEFT's
    merge_adapter / unmerge_adapter on real weights), the importance-sampling correction's old-policy forward, the
    training passes. The peak: the allocator's events (advisor.probing.meters.cpu_peak) plus the weights live
    before. No reference is loaded here: the cases run have none (beta 0, or LoRA's adapters disabled)."""
    import gc

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from advisor.probing.meters import cpu_peak, memory_profiler
    from advisor.simulator import online_construction

    assert case.trainer == "grpo" and (case.lora or case.args.get("beta", 0.0) == 0.0)
    torch.manual_seed(0)
    config = AutoConfig.for_model(**real.SIZES[size])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kwargs, peft_config, tok, data = _run_inputs(case)
    n = kwargs["max_completion_length"]
    if engine == "vllm":
        kwargs.update(use_vllm=True, vllm_mode="colocate")
    else:
        kwargs["generation_kwargs"] = {"min_new_tokens": n}
    rewards = [_reward, _reward_model(config, "cpu")] if reward_model else _reward
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with online_construction(config, engine=engine):
            trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=GRPOConfig(**kwargs), train_dataset=data,
                                  processing_class=tok, peft_config=peft_config,
                                  reward_processing_classes=[None, tok] if reward_model else None)
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    if engine == "vllm":
        def generate(prompts, images, num_generations, profiler=None):
            return [list(p) for p in prompts], [[3] * n for _ in prompts], [[[0.0]] * n for _ in prompts], None

        trainer.vllm_generation.generate = generate
    resident = [trainer.model] + ([trainer.reward_funcs[1]] if reward_model else [])
    before = real._live([t for m in resident for t in (*m.parameters(), *m.buffers())])
    gc.collect()
    prof = memory_profiler()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    finally:
        prof.__exit__(None, None, None)
    return before + cpu_peak(prof).peak_bytes


def test_a_failed_extrapolation_check_runs_the_full_decode_loop():
    """Decode steps that are not alike (here every other forward allocates one temporary more) fail the
    extrapolation's checks: the full decode loop runs instead and the notes say why, never a guessed peak."""
    from advisor.simulator import run_online_fake

    trainer = _fake_trainer(real.CASES["grpo-full"], "tiny")
    calls = []

    def every_other(module, args, kwargs):
        calls.append(1)
        if len(calls) % 2:
            torch.empty(16 * len(calls))

    trainer.model.register_forward_pre_hook(every_other, with_kwargs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_online_fake(trainer, steps=1, cuda=False)
    ex = result.extrapolations[0]
    assert ex.short_lengths == () and ex.fallback and ex.max_new_tokens == real.BASE["max_completion_length"]
    assert any("full decode loop" in note for note in result.notes)


def test_vllm_training_side_matches_a_real_run_and_generates_nothing_here():
    """engine="vllm": no `model.generate` in the training process; what the training process itself allocates
    (TRL's weight sync with PEFT's merge on fake tensors, the importance-sampling forward, the training passes)
    equals a real CPU train() around the same absent vLLM (_real_vllm_peak), within 1%."""
    case = real.CASES["grpo-lora-beta"]
    trainer = _fake_trainer(case, engine="vllm")

    def no_generate(*a, **k):
        raise AssertionError("model.generate ran in the training process under vLLM")

    trainer.model.generate = no_generate
    from advisor.simulator import run_online_fake

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_online_fake(trainer, steps=2, cuda=False, engine="vllm")
    base_params = sum(1 for n, _ in trainer.model.named_parameters() if "lora_" not in n)
    assert result.synced_tensors == 2 * base_params  # one sync per optimizer step, every base weight
    assert result.generations == 2 and result.generated_tokens == 2 * 4 * 16
    assert any("vLLM" in note for note in result.notes)
    measured = _real_peak(case, engine="vllm")
    assert abs(result.peak_bytes - measured) <= 0.01 * measured, f"fake {result.peak_bytes:,d} vs real {measured:,d}"


@pytest.mark.parametrize("name, extra", [("grpo-full", {"vllm_mode": "server"}),
                                         ("grpo-lora-beta", {"vllm_enable_sleep_mode": True}),
                                         ("rloo-defaults", {})])
def test_vllm_modes_sync_every_step_and_train_at_full_length(name, extra):
    """Server mode (the walk for the server's metadata, then the stream), colocate with sleep mode (TRL's wake-up
    before the sync) and RLOO under vLLM: one sync per optimizer step of every weight vLLM holds, full-length
    completions (tiny model)."""
    case = dataclasses.replace(real.CASES[name], args={**real.CASES[name].args, **extra})
    result = _fake(case, "tiny", engine="vllm")
    trainer = _fake_trainer(case, "tiny", engine="vllm")
    weights = sum(1 for n, _ in trainer.model.named_parameters() if "lora_" not in n)
    assert result.synced_tensors == 2 * weights
    per_generation = real.BASE["per_device_train_batch_size"] * case.args.get("steps_per_generation", 1)
    assert result.generated_tokens == result.generations * per_generation * real.BASE["max_completion_length"]
    assert result.phase_peaks[PhaseKind.TRAIN] == result.peak_bytes


def test_reward_model_is_resident_and_scored():
    """A reward model given as a model (built on meta like the policy) is materialised, resident and run on every
    completion in the score phase: the fake peak against the real CPU train() with the same reward model."""
    case = real.CASES["grpo-full"]
    fake = _fake(case, reward_model=True)
    without = _fake(case)
    measured = _real_peak(case, reward_model=True)
    assert abs(fake.peak_bytes - measured) <= 0.01 * measured, f"fake {fake.peak_bytes:,d} vs real {measured:,d}"
    assert fake.phase_peaks[PhaseKind.SCORE] > without.phase_peaks[PhaseKind.SCORE]  # its weights and forward
    assert any("reward model" in note for note in fake.notes)


def test_bad_arguments_are_refused_by_name():
    from advisor.errors import AdvisorError
    from advisor.simulator import online_construction, run_online_fake

    with pytest.raises(AdvisorError, match="engine='sglang'"):
        with online_construction(engine="sglang"):
            pass
    trainer = _fake_trainer(real.CASES["grpo-full"])
    with pytest.raises(AdvisorError, match="use_vllm"):
        run_online_fake(trainer, steps=1, cuda=False, engine="vllm")
    with pytest.raises(AdvisorError, match="decode_lengths"):
        run_online_fake(trainer, steps=1, cuda=False, decode_lengths=(5, 6))


@pytest.mark.slow
def test_decode_extrapolation_at_a_real_architecture():
    """The same equality at Qwen2.5-0.5B's shapes (profiles/models: vocabulary 151,936, 14 heads over 2 KV heads;
    2 of its 24 layers), 8 completions x 64 tokens of 16-token prompts, on the CUDA path (fused LM head on the
    labelled rows): the extrapolated generate equals the full decode loop to the byte."""
    import json

    cfg = json.loads((Path(__file__).resolve().parent.parent / "profiles" / "models" / "Qwen" / "Qwen2.5-0.5B"
                      / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("transformers_version", "torch_dtype")}
    cfg["num_hidden_layers"] = 2
    case = real.Case("qwen-shape", args=dict(beta=0.0, num_generations=8, per_device_train_batch_size=8,
                                             gradient_checkpointing=True, max_completion_length=64, max_steps=1),
                     prompts=64, prompt_tokens=16)
    from advisor.simulator import run_online_fake

    peaks = []
    for lengths in ((5, 7), None):
        trainer = _fake_trainer(case, cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = run_online_fake(trainer, steps=1, cuda=True, decode_lengths=lengths)
        peaks.append((result.extrapolations[0].peak_bytes, result.phase_peaks))
    assert peaks[0] == peaks[1]
