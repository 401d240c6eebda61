"""The independent measurement GRPO's and RLOO's accuracy tests compare with: TRL's real `GRPOTrainer.train()` /
`RLOOTrainer.train()` on the CPU, and its peak from the CPU allocator's own events (torch.profiler with
profile_memory, replayed by advisor.probing.meters.cpu_peak, as every CPU peak of the project is measured).

The run is TRL's own, end to end: the prompts go through the trainer's dataloader and `_tokenize_prompts`, the
completions through `model.generate` (transformers; no vLLM on the CPU), the reward through a reward function, the
old-policy and reference log-probs through `_get_per_token_logps_and_entropies`, the loss and the optimizer step
through Trainer. Every completion is forced to `max_completion_length` with `generation_kwargs={"min_new_tokens":
max_completion_length}` (the EOS is suppressed until then, so `generate` runs exactly that many decode steps): the
bound the simulator computes. The model is a tiny Qwen2 built from a config on the spot (tests/conftest.py's
TINY_QWEN2); the reference of `beta > 0` without PEFT is loaded by TRL from the policy's saved directory, as
`trl grpo` does.

The peak is what the allocator reported while `train()` ran plus the bytes live before it (the parameters and
buffers of the policy and of the reference): the same accounting as tests/test_simulate_accuracy_dpo.py.

Measured (TRL 1.16.0, torch 2.13 CPU): at this size every case peaks at 27-28.6 MB, most of it one buffer of TRL's
fused LM head (trl/kernels/chunked_logprob.py, ChunkedLogProbFunction: `mm_buf = torch.empty((min(N,
TOKEN_CHUNK_SIZE), chunk_size))`, N the tokens of the batch (4 x 39), chunk_size 32,768 columns of float32 whatever
the vocabulary: 20,447,232 bytes, in the forward and again in the backward). The cases differ by less than that
buffer: an accuracy test that must tell them apart needs a model whose state outweighs it (`--size medium`: 170.4 MB
full, 205.7 MB with a reference, 88.6 MB with LoRA; 65-140 s a case on 2 shared cores).

    python scripts/grpo_cpu_peak.py            # every case
    python scripts/grpo_cpu_peak.py grpo-full  # one case
    python scripts/grpo_cpu_peak.py --size medium grpo-full
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_QWEN2 = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
    "max_position_embeddings": 4096, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
# A model whose training state (11.6 M parameters: 186 MB of weights, gradients and AdamW state in float32) outweighs
# the fused LM head's 32,768-column buffer, so the cases' differences show in the peak (`--size medium`).
MEDIUM_QWEN2 = dict(TINY_QWEN2, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4)
SIZES = {"tiny": TINY_QWEN2, "medium": MEDIUM_QWEN2}


@dataclass(frozen=True)
class Case:
    """One real run: the trainer, its config's memory-relevant fields, LoRA or not."""

    name: str
    trainer: str = "grpo"  # "grpo" | "rloo"
    args: dict[str, Any] = field(default_factory=dict)
    lora: bool = False
    prompt_tokens: int = 24
    prompts: int = 16


# Shared by every case: 4 completions per device step, 16 completion tokens, float32 (bf16 is GRPOConfig's and
# RLOOConfig's default: set apart explicitly), AdamW. Both configs default to gradient checkpointing on: each case
# says it.
BASE = dict(per_device_train_batch_size=4, max_completion_length=16, learning_rate=1e-5, max_steps=2,
            optim="adamw_torch", bf16=False)
NO_CKPT = dict(gradient_checkpointing=False)

CASES = {c.name: c for c in (
    Case("grpo-full", args=dict(beta=0.0, num_generations=4, **NO_CKPT)),
    Case("grpo-beta-ref-ckpt", args=dict(beta=0.04, num_generations=4, gradient_checkpointing=True)),
    Case("grpo-steps-per-generation-2", args=dict(beta=0.0, num_generations=4, steps_per_generation=2, **NO_CKPT)),
    Case("grpo-num-iterations-2", args=dict(beta=0.0, num_generations=4, num_iterations=2, **NO_CKPT)),
    Case("grpo-lora-beta", args=dict(beta=0.04, num_generations=4, **NO_CKPT), lora=True),
    # RLOO's own defaults: beta 0.05 (a separate reference), num_generations 2, gradient checkpointing on
    Case("rloo-defaults", trainer="rloo"),
)}


@dataclass(frozen=True)
class Peak:
    """A real run's peak: what was live before train() plus the allocator's highest total during it."""

    case: str
    peak_bytes: int
    before_bytes: int
    train_peak_bytes: int
    events: int
    seconds: float
    completion_lengths: tuple[int, ...]


def _tokenizer(vocab_size: int, pad_id: int, eos_id: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=f"<t{eos_id}>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=f"<t{pad_id}>", eos_token=f"<t{eos_id}>",
                                   unk_token=f"<t{eos_id}>")


def _prompts(case: Case, vocab_size: int) -> list[str]:
    """Plain-text prompts of exactly `prompt_tokens` tokens each (ids 10.. through the word-level tokenizer)."""
    import random

    rng = random.Random(0)
    return [" ".join(f"<t{rng.randrange(10, vocab_size)}>" for _ in range(case.prompt_tokens))
            for _ in range(case.prompts)]


def _live(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def run_case(case: Case, size: str = "tiny") -> Peak:
    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    lengths: list[int] = []

    def reward(completions, completion_ids, **_: Any) -> list[float]:
        lengths.extend(len(c) for c in completion_ids)
        return [float(i % 3) for i in range(len(completions))]  # varied, so the advantages are not all zero

    torch.manual_seed(0)
    config = AutoConfig.for_model(**SIZES[size])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tok = _tokenizer(TINY_QWEN2["vocab_size"], TINY_QWEN2["pad_token_id"], TINY_QWEN2["eos_token_id"])
    dataset = datasets.Dataset.from_dict({"prompt": _prompts(case, TINY_QWEN2["vocab_size"])})
    n = case.args.get("max_completion_length", BASE["max_completion_length"])
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(Path(tmp) / "policy")  # TRL loads a separate reference from the policy's path
        model.config._name_or_path = str(Path(tmp) / "policy")
        kwargs = dict(BASE, **case.args)
        kwargs.update(output_dir=str(Path(tmp) / "out"), use_cpu=True, report_to="none", save_strategy="no",
                      logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
                      generation_kwargs={"min_new_tokens": n})
        peft_config = None
        if case.lora:
            from peft import LoraConfig

            peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if case.trainer == "grpo":
                from trl import GRPOConfig as Config
                from trl import GRPOTrainer as Trainer
            else:
                from trl import RLOOConfig as Config
                from trl import RLOOTrainer as Trainer
            args = Config(**kwargs)
            trainer = Trainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=tok, peft_config=peft_config)
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        models = [trainer.model] + ([trainer.ref_model] if getattr(trainer, "ref_model", None) is not None else [])
        return measure_train(case.name, trainer, models, lengths)


def measure_train(name: str, trainer: Any, models: list, lengths: list[int]) -> Peak:
    """`trainer.train()` under the CPU allocator's profiler: the peak it reports plus the bytes of `models` live
    before (their parameters and buffers); `lengths`: the completion lengths the run generated (filled as it runs)."""
    from advisor.probing.meters import cpu_peak, memory_profiler

    before = _live([t for m in models for t in (*m.parameters(), *m.buffers())])
    gc.collect()
    start = time.perf_counter()
    prof = memory_profiler()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    finally:
        prof.__exit__(None, None, None)
    seconds = time.perf_counter() - start
    peak = cpu_peak(prof)
    return Peak(name, before + peak.peak_bytes, before, peak.peak_bytes, peak.events, seconds, tuple(lengths))


def main(argv: list[str]) -> int:
    size = "tiny"
    if argv[:1] == ["--size"]:
        size, argv = argv[1], argv[2:]
    if size not in SIZES:
        print(f"--size {size}: one of {', '.join(SIZES)}", file=sys.stderr)
        return 2
    names = argv or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    for name in names:
        p = run_case(CASES[name], size)
        forced = set(p.completion_lengths) == {CASES[name].args.get("max_completion_length",
                                                                  BASE["max_completion_length"])}
        print(f"{p.case:30s} peak {p.peak_bytes:>10,d} B = before {p.before_bytes:>9,d} + train() "
              f"{p.train_peak_bytes:>10,d}  ({p.events} events, {p.seconds:.1f} s, "
              f"{len(p.completion_lengths)} completions, all at max_completion_length: {forced})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
