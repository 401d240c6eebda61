"""KTO: the simulated CPU peak equals the peak of a real CPU run of TRL's KTOTrainer, within 0.1%.

The real run is KTOTrainer itself, built as `trl kto` builds it: the reference of full fine-tuning loaded by TRL from
the policy's saved directory (`create_model_from_path`, the policy's dtype), none under LoRA (adapters disabled) or
with `precompute_ref_log_probs` (TRL's own precompute pass, run by its __init__, is measured too). Each step runs the
policy on the KL batch under no_grad, the policy on the examples, and the reference on both. Its peak comes from the
CPU allocator's own events (torch.profiler), plus the bytes live before: parameters and buffers of the policy and the
reference; each micro-batch is collated when the loop asks for it, as a DataLoader does. Only the rows are shared
with the simulator (its worst rows); TRL's own preparation (the KL rotation) and collator build the batch.

What remains is the CPU generator's state torch's checkpoint keeps per checkpointed layer (`preserve_rng_state`:
`torch.get_rng_state()`, 5,056 bytes, not a fake tensor; host memory on a GPU target): 10,112 bytes with the tiny
model's two layers checkpointed.
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import pytest
import torch
from test_simulate_accuracy_dpo import _live, _profiled

from advisor.space import Candidate
from advisor.trainers import get_trainer
from advisor.trainers.dpo import Reference
from advisor.trainers.kto import KTOKnobs, prepared_as_is
from advisor.workload import Workload


@pytest.fixture
def kto_workload(tiny_model, cpu_target):
    """The tiny model on the CPU target over 48 unpaired examples (prompt + completion 16..256 tokens)."""
    from advisor.trainers.unpaired import synthetic_unpaired
    from advisor.workload import Goals

    data = synthetic_unpaired(vocab_size=1024, rows=48, seed=0, median=64, max_len=256)
    return Workload(model=tiny_model, gpu=cpu_target, dataset=data, goals=Goals(), trainer="kto")


class _Collated:
    """The trainer's dataloader: each micro-batch made when the loop asks for it (a copy of the collated batch), as
    a DataLoader collates it, so no later batch is resident early and a used one is freed with the step."""

    def __init__(self, batch: dict, n: int) -> None:
        self.batch, self.n = batch, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            yield {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.batch.items()}


def _real_kto_peak(workload: Workload, candidate: Candidate, steps: int = 2) -> int:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import KTOTrainer

    from advisor.emit import peft_config
    from advisor.modeling import build_model, placeholder_tokenizer

    kto = get_trainer("kto")
    knobs = KTOKnobs.of(candidate)

    class RealTrainer(KTOTrainer):
        batch: dict = {}
        steps: int = 0
        _prepare_dataset = prepared_as_is  # the rows are KTOTrainer._prepare_dataset's tokenized output already

        def get_train_dataloader(self):
            return _Collated(self.batch, self.steps)

    torch.manual_seed(0)
    spec = workload.model
    model = build_model(spec, candidate, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        if knobs.reference(candidate) is Reference.SEPARATE_COPY:  # TRL loads the reference from the policy's path
            model.save_pretrained(Path(tmp) / "policy")
            model.config._name_or_path = str(Path(tmp) / "policy")
        args = kto.build_config(
            candidate, workload, use_cpu=True, output_dir=str(Path(tmp) / "out"), max_steps=steps, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True, dataset_num_proc=None, seed=0,
            model_init_kwargs=None,
        )
        dataset = workload.dataset.to_hf(kto.worst_rows(workload, candidate))
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
        trainer.batch = kto.worst_batch(trainer, candidate.per_device_train_batch_size)
        trainer.steps = steps * candidate.gradient_accumulation_steps
        trainer.train_dataset = list(range(trainer.steps))
        models = [trainer.model] + ([trainer.ref_model] if trainer.ref_model is not None else [])
        before = _live([t for m in models for t in (*m.parameters(), *m.buffers())])
        _, peak = _profiled(trainer.train)
        return max(init_peak, sum(before.values()) + peak)


BASE = dict(max_length=128, per_device_train_batch_size=2, precision="fp32", optim="adamw_torch")
MATRIX = {
    "full-ckpt": ({}, {}),
    "lora-adapters-disabled": (dict(use_lora=True, lora_r=8), {}),
    "lora-no-ckpt-batch4": (dict(use_lora=True, activation_checkpointing=False, per_device_train_batch_size=4), {}),
    "precompute": ({}, dict(precompute_ref_log_probs=True)),
    "precompute-batch4-no-ckpt": (dict(activation_checkpointing=False),
                                  dict(precompute_ref_log_probs=True, precompute_ref_batch_size=4)),
    "apo-zero-unpaired-batch1": (dict(per_device_train_batch_size=1), dict(loss_type="apo_zero_unpaired")),
    "truncated-48-pad64-bf16": (dict(max_length=48, pad_to_multiple_of=64, precision="bf16"), {}),
}


def _candidate(name: str) -> Candidate:
    fields, knobs = MATRIX[name]
    return KTOKnobs(**knobs).apply(Candidate(**{**BASE, **fields}))


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_simulated_kto_peak_matches_real_train(name, kto_workload):
    from advisor.simulator import simulate

    cand = _candidate(name)
    assert get_trainer("kto").problems(cand) == []
    real = _real_kto_peak(kto_workload, cand)
    sim = simulate(kto_workload, cand, "cpu", layers=None, trainer="kto")
    print(f"accuracy kto {name}: simulated {sim.peak_bytes} real {real} ratio {sim.peak_bytes / real:.5f}")
    assert sim.peak_bytes == pytest.approx(real, rel=0.001), (name, sim.peak_bytes, real)


def test_what_kto_adds_is_its_reference_and_kl_batch(kto_workload):
    """Physics of the prediction: a separate reference copy costs its weights; precomputing drops them; the KL batch
    (loss_type kto) costs the no-grad forwards apo_zero_unpaired does not run."""
    from advisor.modeling import build_model
    from advisor.simulator import simulate

    full = simulate(kto_workload, _candidate("full-ckpt"), "cpu", layers=None, trainer="kto")
    pre = simulate(kto_workload, _candidate("precompute"), "cpu", layers=None, trainer="kto")
    params = sum(p.numel() * 4 for p in build_model(kto_workload.model, Candidate(), device="meta").parameters())
    assert full.breakdown["parameters"] == pytest.approx(2 * params, rel=0.01)  # policy + reference
    assert pre.breakdown["parameters"] == pytest.approx(params, rel=0.01)
    lora = Candidate(**{**BASE, "use_lora": True, "lora_r": 8})
    apo = KTOKnobs(loss_type="apo_zero_unpaired").apply(lora)
    kl = simulate(kto_workload, lora, "cpu", layers=None, trainer="kto")
    no_kl = simulate(kto_workload, apo, "cpu", layers=None, trainer="kto")
    assert kl.peak_bytes >= no_kl.peak_bytes
