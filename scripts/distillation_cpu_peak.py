"""The independent measurement distillation's accuracy tests compare with: TRL's real `DistillationTrainer.train()`
on the CPU, and its peak from the CPU allocator's own events (torch.profiler with profile_memory, replayed by
advisor.probing.meters.cpu_peak, as every CPU peak of the project is measured).

The run is TRL's own, end to end: the prompts through the trainer's dataloader and `_tokenize_prompts`, the
completions through the student's `model.generate` (transformers; no vLLM on the CPU), the teacher loaded by TRL
from a saved directory with `teacher_model_init_kwargs` (as `trl distillation` loads teacher_model_name_or_path),
its backbone under no_grad on every micro-batch, the chunked generalized JSD over the vocabulary
(trl/kernels/chunked_divergence.py, the torch fold: no Triton on the CPU), the backward and the optimizer step
through Trainer. Every completion is forced to `max_completion_length` with `generation_kwargs={"min_new_tokens":
max_completion_length}`: the bound the simulator computes. The student is a tiny Qwen2 built from a config on the
spot (scripts/grpo_cpu_peak.py's TINY_QWEN2); the teacher another Qwen2 of the same vocabulary, wider and deeper.

The peak is what the allocator reported while `train()` ran plus the bytes live before it (the student's and the
teacher's parameters and buffers): the accounting of tests/test_simulate_accuracy_grpo.py.

    python scripts/distillation_cpu_peak.py              # every case
    python scripts/distillation_cpu_peak.py beta-half    # one case
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_cpu_peak as _grpo  # noqa: E402  (the tiny Qwen2, its word-level tokenizer, the prompts)

STUDENT = dict(_grpo.TINY_QWEN2)
# a teacher of another width and depth, the student's vocabulary (DistillationTrainer requires it)
TEACHER = dict(_grpo.TINY_QWEN2, hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
               num_key_value_heads=2)


@dataclass(frozen=True)
class Case:
    """One real run: DistillationConfig's memory-relevant fields, LoRA or not."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)
    lora: bool = False
    prompt_tokens: int = 24
    prompts: int = 16


# Shared by every case: 4 completions a micro-batch, 16 completion tokens, float32 (DistillationConfig's bf16 default
# is set apart explicitly), AdamW, the prompts in order.
BASE = dict(per_device_train_batch_size=4, max_completion_length=16, learning_rate=1e-5, max_steps=2,
            optim="adamw_torch", bf16=False, shuffle_dataset=False)
NO_CKPT = dict(gradient_checkpointing=False)

CASES = {c.name: c for c in (
    Case("beta-reverse", args=dict(beta=1.0, **NO_CKPT)),  # DistillationConfig's default: reverse KL
    Case("beta-forward", args=dict(beta=0.0, **NO_CKPT)),
    Case("beta-half", args=dict(beta=0.5, **NO_CKPT)),  # the generalized JSD: a second pass over the vocabulary
    Case("lora-half", args=dict(beta=0.5, **NO_CKPT), lora=True),
    # bf16 autocast, the teacher loaded in bfloat16, gradient checkpointing and two micro-steps a generation
    Case("bf16-teacher-ckpt-ga2", args=dict(beta=1.0, bf16=True, gradient_checkpointing=True,
                                            gradient_accumulation_steps=2,
                                            teacher_model_init_kwargs={"dtype": "bfloat16"})),
)}


def config_kwargs(case: Case, output_dir: str) -> dict[str, Any]:
    """The DistillationConfig keyword arguments of `case` on the CPU, quiet, every completion at full length."""
    kwargs = dict(BASE, **case.args)
    kwargs.update(output_dir=output_dir, use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
                  disable_tqdm=True, seed=0, dataloader_num_workers=0,
                  generation_kwargs={"min_new_tokens": kwargs["max_completion_length"]})
    return kwargs


def lora_config(case: Case):
    if not case.lora:
        return None
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"], task_type="CAUSAL_LM")


def tokenizer():
    return _grpo._tokenizer(STUDENT["vocab_size"], STUDENT["pad_token_id"], STUDENT["eos_token_id"])


def prompts(case: Case) -> list[str]:
    return _grpo._prompts(_grpo.Case(case.name, prompt_tokens=case.prompt_tokens, prompts=case.prompts),
                          STUDENT["vocab_size"])


def run_case(case: Case, teacher: dict | None = None) -> _grpo.Peak:
    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import DistillationConfig, DistillationTrainer

    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_config(AutoConfig.for_model(**STUDENT), dtype=torch.float32)
    data = datasets.Dataset.from_dict({"prompt": prompts(case)})
    lengths: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "teacher"
        AutoModelForCausalLM.from_config(AutoConfig.for_model(**(teacher or TEACHER))).save_pretrained(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = DistillationTrainer(model=student, teacher_model=str(path),
                                          args=DistillationConfig(**config_kwargs(case, str(Path(tmp) / "out"))),
                                          train_dataset=data, processing_class=tokenizer(),
                                          peft_config=lora_config(case))
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        generate = trainer._generate

        def counted(prompts_: list):
            out = generate(prompts_)
            lengths.extend(len(c) for c in out[1])
            return out

        trainer._generate = counted
        return _grpo.measure_train(case.name, trainer, [trainer.model, trainer.teacher_model], lengths)


def main(argv: list[str]) -> int:
    names = argv or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    for name in names:
        p = run_case(CASES[name])
        forced = set(p.completion_lengths) == {CASES[name].args.get("max_completion_length",
                                                                  BASE["max_completion_length"])}
        print(f"{p.case:24s} peak {p.peak_bytes:>11,d} B = before {p.before_bytes:>10,d} + train() "
              f"{p.train_peak_bytes:>11,d} ({p.events} events, {p.seconds:.1f} s; every completion at full "
              f"length: {forced})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
