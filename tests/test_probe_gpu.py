"""The cuda backend on a small model (skipped without CUDA; run by scripts/gpu_validate.sh on a GPU machine).

- the child's peak is within 3% of torch.cuda.max_memory_allocated of the same steps run inline;
- a candidate capped below its need comes back as oom, and no process of the probe survives.
"""

from __future__ import annotations

import gc

import pytest

from advisor.measurement import Source, Status
from advisor.probing import plan_batches, probe
from advisor.probing import runner as runner_mod
from advisor.space import Candidate
from tests.conftest import TINY_QWEN2

pytestmark = pytest.mark.gpu

# The tiny test architecture, scaled up so a probe's peak is well above the CUDA context.
SMALL_QWEN2 = {**TINY_QWEN2, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
               "num_attention_heads": 8, "vocab_size": 32000}
CAND = Candidate(max_length=512, per_device_train_batch_size=4, optim="adamw_torch_fused", precision="bf16",
                 activation_checkpointing=True, expandable_segments=False)
STEPS, WARMUP = 2, 1


@pytest.fixture
def gpu_workload(h100_target):
    from advisor.data import synthetic
    from advisor.workload import Goals, ModelSpec, Workload

    spec = ModelSpec(name="small-qwen2", config=dict(SMALL_QWEN2), source="local")
    data = synthetic(vocab_size=32000, rows=64, seed=0, median=256, max_len=1024)
    return Workload(model=spec, gpu=h100_target, dataset=data, goals=Goals())


def _inline_peak(workload, candidate, tmp_path) -> int:
    """max_memory_allocated of the same planned rows and steps, trained in this process with plain SFTTrainer."""
    import torch
    from trl import SFTTrainer

    from advisor.emit import build_config, peft_config
    from advisor.modeling import placeholder_tokenizer, save_random_model

    plan = plan_batches(workload, candidate, STEPS, WARMUP)
    path = save_random_model(workload.model, tmp_path / "model", candidate)
    config = build_config(
        candidate, workload, output_dir=str(tmp_path / "out"), max_steps=STEPS + WARMUP, report_to="none",
        save_strategy="no", logging_steps=STEPS + WARMUP, train_sampling_strategy="sequential",
        dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer = SFTTrainer(
        model=str(path), args=config, train_dataset=workload.dataset.to_hf(list(plan.rows)),
        processing_class=placeholder_tokenizer(workload.model), peft_config=peft_config(candidate, workload.model),
    )
    trainer.train()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def test_cuda_probe_peak_matches_inline_run(gpu_workload, tmp_path, children):
    m = probe(gpu_workload, CAND, "cuda", steps=STEPS, warmup=WARMUP, timeout_s=300)
    assert m.status is Status.OK, m.message
    assert m.source is Source.PROBE_CUDA
    assert m.peak_bytes <= m.reserved_bytes <= m.device_bytes
    assert m.tokens_per_second > 0 and m.step_time_s > 0
    assert m.peak_batch and "rows" in m.peak_batch
    inline = _inline_peak(gpu_workload, CAND, tmp_path)
    assert abs(m.peak_bytes - inline) <= 0.03 * inline, (m.peak_bytes, inline)
    for exit_ in children:
        assert not runner_mod.group_alive(exit_.pgid)


def test_cuda_probe_capped_below_its_need_is_oom(gpu_workload, children):
    ok = probe(gpu_workload, CAND, "cuda", steps=1, warmup=1, timeout_s=300)
    assert ok.status is Status.OK, ok.message
    budget = ok.device_bytes // 2
    m = probe(gpu_workload, CAND, "cuda", steps=1, warmup=1, timeout_s=300, memory_budget_bytes=budget)
    assert m.status is Status.OOM, m.message
    assert "allocating" in m.message
    for exit_ in children:
        assert not runner_mod.group_alive(exit_.pgid)


def test_cuda_probe_releases_the_device(gpu_workload, children):
    """After the probe no process of ours holds device memory (the child and its context are gone)."""
    pynvml = pytest.importorskip("pynvml")
    m = probe(gpu_workload, CAND.replace(use_lora=True), "cuda", steps=1, warmup=1, timeout_s=300)
    assert m.status is Status.OK, m.message
    pynvml.nvmlInit()
    pids = {exit_.pgid for exit_ in children}
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        running = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        assert not (running & pids)
