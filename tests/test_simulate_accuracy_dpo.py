"""DPO: the simulated CPU peak equals the peak of a real CPU run of TRL's DPOTrainer, within 1%.

The real run is DPOTrainer itself, built as `trl dpo` builds it: the reference of full fine-tuning loaded by TRL
from the policy's saved directory (`create_model_from_path`, the policy's dtype), none under LoRA (adapters
disabled) or with `precompute_ref_log_probs` (TRL's own precompute pass, run by its __init__, is measured too).
Its peak comes from the CPU allocator's own events (torch.profiler, as tests/test_simulate_accuracy.py), plus
the bytes live before: parameters and buffers of the policy and the reference, and the fed batches. Only the
batch is shared with the simulator: the longest pairs, through TRL's own collator.
"""

from __future__ import annotations

import gc
import tempfile
import uuid
from collections import deque
from pathlib import Path

import pytest
import torch
from test_simulate_accuracy import _allocator_peak

from advisor.errors import ConfigError
from advisor.space import Candidate
from advisor.trainers import get_trainer
from advisor.trainers.dpo import DPOKnobs, Reference, prepared_as_is
from advisor.workload import Workload


def _live(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _profiled(fn) -> tuple[object, int]:
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return out, _allocator_peak(prof)


def _real_dpo_peak(workload: Workload, candidate: Candidate, steps: int = 2) -> int:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import DPOTrainer

    from advisor.emit import peft_config
    from advisor.modeling import BatchFeed as _BatchFeed
    from advisor.modeling import build_model, placeholder_tokenizer

    dpo = get_trainer("dpo")
    knobs = DPOKnobs.of(candidate)

    class RealTrainer(DPOTrainer):
        feed: deque = deque()
        _prepare_dataset = prepared_as_is  # the rows are DPOTrainer._prepare_dataset's output already

        def get_train_dataloader(self):
            return _BatchFeed(self.feed)

    torch.manual_seed(0)
    spec = workload.model
    model = build_model(spec, candidate, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        if knobs.reference(candidate) is Reference.SEPARATE_COPY:  # TRL loads the reference from the policy's path
            model.save_pretrained(Path(tmp) / "policy")
            model.config._name_or_path = str(Path(tmp) / "policy")
        args = dpo.build_config(
            candidate, workload, use_cpu=True, output_dir=str(Path(tmp) / "out"), max_steps=steps, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True, dataset_num_proc=None, seed=0,
            model_init_kwargs=None,
        )
        dataset = workload.dataset.to_hf(dpo.worst_rows(workload, candidate))
        dataset._fingerprint = uuid.uuid4().hex  # no precompute cache of an earlier run is reused

        def build():
            return RealTrainer(model=model, args=args, train_dataset=dataset,
                               processing_class=placeholder_tokenizer(spec), peft_config=peft_config(candidate, spec))

        init_peak = 0
        if knobs.precompute_ref_log_probs:  # the precompute pass runs in __init__: measured with it
            before = _live([*model.parameters(), *model.buffers()])
            trainer, peak = _profiled(build)
            init_peak = sum(before.values()) + peak
        else:
            trainer = build()
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        batch = dpo.worst_batch(trainer, candidate.per_device_train_batch_size)
        n = steps * candidate.gradient_accumulation_steps
        trainer.feed = deque(
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()} for _ in range(n)
        )
        trainer.train_dataset = list(range(n))
        models = [trainer.model] + ([trainer.ref_model] if trainer.ref_model is not None else [])
        tensors = [t for m in models for t in (*m.parameters(), *m.buffers())]
        tensors += [v for b in trainer.feed for v in b.values() if isinstance(v, torch.Tensor)]
        before = _live(tensors)
        _, peak = _profiled(trainer.train)
        return max(init_peak, sum(before.values()) + peak)


BASE = dict(max_length=128, per_device_train_batch_size=2, precision="fp32", optim="adamw_torch")
MATRIX = {
    "full-ckpt": ({}, {}),
    "full-no-ckpt": (dict(activation_checkpointing=False), {}),
    "lora-adapters-disabled": (dict(use_lora=True, lora_r=8), {}),
    "lora-no-ckpt": (dict(use_lora=True, activation_checkpointing=False), {}),
    "precompute": ({}, dict(precompute_ref_log_probs=True)),
    "precompute-batch4-no-ckpt": (dict(activation_checkpointing=False),
                                  dict(precompute_ref_log_probs=True, precompute_ref_batch_size=4)),
    "padding-free": (dict(padding_free=True), {}),
    "truncated-max-length-48": (dict(max_length=48), {}),
    "batch1": (dict(per_device_train_batch_size=1, activation_checkpointing=False), {}),
    "batch4": (dict(per_device_train_batch_size=4), {}),
}


def _candidate(name: str) -> Candidate:
    fields, knobs = MATRIX[name]
    return DPOKnobs(**knobs).apply(Candidate(**{**BASE, **fields}))


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_simulated_dpo_peak_matches_real_train(name, dpo_workload):
    from advisor.simulator import simulate

    cand = _candidate(name)
    real = _real_dpo_peak(dpo_workload, cand)
    sim = simulate(dpo_workload, cand, "cpu", layers=None, trainer="dpo")
    print(f"accuracy dpo {name}: simulated {sim.peak_bytes} real {real} ratio {sim.peak_bytes / real:.5f}")
    assert sim.peak_bytes == pytest.approx(real, rel=0.01), (name, sim.peak_bytes, real)


def test_the_reference_is_what_dpo_adds(dpo_workload):
    """Physics of the prediction: a separate reference copy costs its weights; precomputing drops them."""
    from advisor.simulator import simulate

    full = simulate(dpo_workload, _candidate("full-ckpt"), "cpu", layers=None, trainer="dpo")
    pre = simulate(dpo_workload, _candidate("precompute"), "cpu", layers=None, trainer="dpo")
    from advisor.modeling import build_model

    params = sum(p.numel() * 4 for p in build_model(dpo_workload.model, Candidate(), device="meta").parameters())
    assert full.breakdown["parameters"] == pytest.approx(2 * params, rel=0.01)  # policy + reference
    assert pre.breakdown["parameters"] == pytest.approx(params, rel=0.01)


# ---- bad input ---------------------------------------------------------------------------------------------------

def test_an_sft_dataset_is_refused_naming_the_missing_columns(small_workload):
    from advisor.simulator import simulate

    wl = small_workload
    with pytest.raises(ConfigError, match=r"lack the column\(s\) 'chosen', 'rejected'"):
        simulate(wl, Candidate(**BASE), "cpu", layers=None, trainer="dpo")


def test_an_sft_file_is_refused_by_the_preference_loader(tiny_model, tmp_path):
    import json

    from advisor.trainers.preference import load_preferences

    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": "a b", "completion": "c"}) + "\n" for _ in range(3)))
    with pytest.raises(ConfigError, match=r"'chosen', 'rejected'.*row 0 has \['completion', 'prompt'\]"):
        load_preferences(str(path), tiny_model)


def test_an_sft_only_key_in_a_dpo_config_is_refused_by_name():
    dpo = get_trainer("dpo")
    with pytest.raises(ConfigError, match=r"packing=False: an SFT-only key"):
        dpo.candidate_from_run_dict({"max_length": 512, "packing": False})
    problems = dpo.problems(Candidate(packing=True))
    assert any(p.startswith("packing=True: `packing` is an SFT-only key") for p in problems)
    assert dpo.problems(Candidate(padding_free=True)) == []  # SFT's padding-free rule is not DPO's


# ---- Reward models -----------------------------------------------------------------------------------------------
# The real run is built from the emitted YAML as `trl reward --config` builds it: TRL's own parser, the model an
# AutoModelForSequenceClassification with one label in the YAML's dtype, trl.get_peft_config's LoraConfig.

REWARD = {
    "reward-full-ckpt-pad64": Candidate(max_length=256, pad_to_multiple_of=64, per_device_train_batch_size=2,
                                        precision="fp32", optim="adamw_torch"),
    "reward-lora-no-ckpt-batch4": Candidate(max_length=128, per_device_train_batch_size=4, precision="fp32",
                                            optim="adamw_torch", use_lora=True, lora_r=8,
                                            activation_checkpointing=False),
}


def _real_reward_peak(workload: Workload, candidate: Candidate, tmp_path, steps: int = 2) -> int:
    import yaml
    from transformers import AutoModelForSequenceClassification
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import RewardTrainer, get_peft_config

    from advisor.modeling import BatchFeed as _BatchFeed
    from advisor.modeling import placeholder_tokenizer

    reward = get_trainer("reward")
    path = tmp_path / "reward.yaml"
    path.write_text(yaml.safe_dump(reward.run_config_dict(candidate, model_name_or_path="m", dataset_name="d")))
    parsed = reward.make_parser().parse_args_and_config(
        ["--config", str(path), "--use_cpu", "True"], return_remaining_strings=True, separate_remaining_strings=True)
    assert parsed[4] == [] and parsed[5] == [], parsed[4:]
    training, model_args = parsed[1], parsed[2]
    training.max_steps, training.output_dir = steps, str(tmp_path / "out")
    training.report_to, training.save_strategy, training.logging_strategy = [], "no", "no"
    training.disable_tqdm = True

    class RealTrainer(RewardTrainer):
        feed: deque = deque()

        def get_train_dataloader(self):
            return _BatchFeed(self.feed)

    torch.manual_seed(0)
    config = workload.model.hf_config()
    config.num_labels = 1
    model = AutoModelForSequenceClassification.from_config(config, dtype=getattr(torch, model_args.dtype))
    trainer = RealTrainer(model=model, args=training,
                          train_dataset=reward.train_dataset(workload, reward.worst_rows(workload, candidate)),
                          processing_class=placeholder_tokenizer(workload.model),
                          peft_config=get_peft_config(model_args))
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    batch = reward.worst_batch(trainer, candidate.per_device_train_batch_size)
    trainer.feed = deque(
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()} for _ in range(steps)
    )
    trainer.train_dataset = list(range(steps))
    tensors = [*trainer.model.parameters(), *trainer.model.buffers()]
    tensors += [v for b in trainer.feed for v in b.values() if isinstance(v, torch.Tensor)]
    before = _live(tensors)
    _, peak = _profiled(trainer.train)
    return sum(before.values()) + peak


@pytest.mark.parametrize("name", sorted(REWARD))
def test_simulated_reward_peak_matches_real_train(name, dpo_workload, tmp_path):
    from advisor.simulator import simulate

    cand = REWARD[name]
    real = _real_reward_peak(dpo_workload, cand, tmp_path)
    sim = simulate(dpo_workload, cand, "cpu", layers=None, trainer="reward")
    print(f"accuracy {name}: simulated {sim.peak_bytes} real {real} ratio {sim.peak_bytes / real:.5f}")
    assert sim.peak_bytes == pytest.approx(real, rel=0.01), (name, sim.peak_bytes, real)
