"""SPIKE (issue 23, not product code): can the fake-tensor simulator run TRL's GRPOTrainer/RLOOTrainer `train()`
including `model.generate`? Kept under docs/ because it reaches into advisor._sim's insides (StorageTracker,
IntegerShadow, the scalar oracle), which tests/test_privacy.py forbids under scripts/ and tests/.

It builds the trainer on a meta model (as the simulator does), materialises the policy (and the reference TRL loads
from the policy's saved directory) as fake tensors, and runs `trainer.train()` under FakeTensorMode with every storage
tracked. Three things break without the fixes below, in this order (each found by running without it):

1. `generate` stops after ONE token: transformers' `StopCheck.__call__` (generation/utils.py) returns
   `bool(unfinished_sequences.max() == 0)`; on a fake tensor that `.item()` goes to the tracker's ScalarOracle, which
   answers True for every bool, so the loop ends after the first decode step ((4, 25) instead of (4, 40)).
   Fix (`_GenerationOracle`): inside StopCheck, answer `length >= stopping_criteria.max_length` (read from the
   `_sample` frame): the run the bound describes, every completion at max_completion_length, which is what the real
   run does with min_new_tokens = max_new_tokens.
2. TRL's EOS mask after generate (grpo_trainer.py `_generate_single_turn`: `eos_idx[is_eos.any(dim=1)] = ...`, then
   `c[m].tolist()`) needs the generated ids' values: `nonzero` raises DynamicOutputShapeException, `.tolist()`
   DataDependentOutputException. Fix (`_GenerationShadow` + the generate wrapper): the IntegerShadow also knows
   real CPU tensors lifted into the mode (torch.tensor of the tokenized prompts) as themselves and computes factory
   ops (full, zeros, arange; never empty*) for real, and the wrapper around the policy's `generate` registers its
   output as [the real prompt ids | max_completion_length filler ids that are not EOS]. Then isin/argmax/boolean
   indexing/tolist get the real run's answers, TRL decodes real lists, the real reward functions run on text.
3. `_calculate_rewards`' NaN check (`torch.isnan(rewards_per_func).all(dim=1).any()`) is a float tensor built from
   the rewards; the oracle's True sent it into the all-NaN branch (`nonzero`). Fix: the shadow also carries float
   tensors derived only from real data (the rewards, the advantages); the model's weights never become known
   (materialised by `empty_like`, which the shadow leaves fake, from meta tensors, which it ignores). A first
   attempt that treated meta tensors as known fed uninitialised memory to multinomial ("probability tensor contains
   inf/nan").

Result (TRL 1.16.0, transformers 5.24.0, torch 2.13 CPU; real = scripts/grpo_cpu_peak.py, the allocator's events):

    case                          tiny: fake / real (B)        medium: fake / real (B)
    grpo-full                     28,595,080 / 28,595,080      170,449,832 / 170,449,832
    grpo-beta-ref-ckpt            27,836,680 / 27,846,792      205,698,540 / 205,698,552
    grpo-steps-per-generation-2   28,598,168 / 28,598,168      170,452,920 / 170,452,920
    grpo-num-iterations-2         28,595,336 / 28,595,336      170,450,088 / 170,450,088
    grpo-lora-beta                27,235,088 / 27,235,200       88,601,920 /  88,602,144
    rloo-defaults                 27,836,432 / 27,846,544      205,698,292 / 205,698,304

The cost that remains: every decode step is a forward on fake tensors through the tracker. Tiny model, 4
completions, one step: generate took 4.5 s at max_completion_length 16 and 42.7 s at 128 (0.34 s a decode step on
2 shared cores), so 512-1024 completion tokens would take minutes per simulated step. A decode step's allocations
should be affine in the step's index (DynamicCache grows by one position a step), so two short generations could be
extrapolated to max_completion_length as depths are, while the rest of the step runs at the full length: NOT yet
verified. Measured so far: the real `generate` peak (4 x 24-token prompts, sampling) did not move at all from 8 to 40
new tokens (tiny: 309,560 B; medium: 2,804,024 B): the prefill binds there; a run at 64-320 tokens did not finish in
10 minutes on the shared cores.

    python docs/spikes/grpo_fake_generate.py grpo-full [--size medium]
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
warnings.simplefilter("ignore")

import datasets  # noqa: E402
import grpo_cpu_peak as real  # noqa: E402
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import advisor._sim.shadow as shadow_module  # noqa: E402
from advisor._sim.fake_step import BatchFacts, ScalarOracle, _materialise, real_path_patches  # noqa: E402
from advisor._sim.tracker import StorageTracker, tensors_in  # noqa: E402
from advisor.measurement import Category  # noqa: E402

_EMPTY = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default, torch.ops.aten.empty_strided.default,
          torch.ops.aten.new_empty.default)


def _shadowable(t: object) -> bool:  # fix 3: floats too (only data-derived ones ever become known)
    return isinstance(t, torch.Tensor) and not t.dtype.is_complex and t.numel() <= shadow_module._LIMIT


class _GenerationOracle(ScalarOracle):
    """Fix 1: the decode loop's stop check answers from the length, not 'True'."""

    def __call__(self, t: torch.Tensor) -> object:
        if t.dtype is torch.bool:
            frame = sys._getframe(1)
            while frame is not None:
                loc = frame.f_locals
                if frame.f_code.co_name == "__call__" and "length" in loc \
                        and type(loc.get("self")).__name__.endswith("StopCheck"):
                    outer = frame
                    while outer is not None and "stopping_criteria" not in outer.f_locals:
                        outer = outer.f_back
                    return loc["length"] >= outer.f_locals["stopping_criteria"].max_length
                frame = frame.f_back
        return super().__call__(t)


class _GenerationShadow(shadow_module.IntegerShadow):
    """Fix 2: real CPU tensors are their own shadow; factories (not empty*) are computed for real."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tensors_in((args, kwargs))
        for t in inputs:
            if not isinstance(t, FakeTensor) and t.device.type == "cpu" and t not in self._real and _shadowable(t):
                self._real[t] = t
        if func in _EMPTY:
            return func(*args, **kwargs)
        if not inputs:
            out = func(*args, **kwargs)
            with _disable_current_modes():
                try:
                    real_out = func(*args, **kwargs)
                except Exception:
                    return out
            for fake, value in zip(tensors_in(out), tensors_in(real_out), strict=False):
                if _shadowable(value) and tuple(fake.shape) == tuple(value.shape):
                    self._real[fake] = value
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)


def run(case: real.Case, size: str = "tiny") -> tuple[int, float]:
    shadow_module._shadowable = _shadowable
    config = AutoConfig.for_model(**real.SIZES[size])
    policy_dir = tempfile.mkdtemp()
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(policy_dir)  # for TRL's reference
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config._name_or_path = policy_dir
    if case.trainer == "grpo":
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Base
    else:
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Base

    class Fake(Base):
        def _move_model_to_device(self, model, device):
            return None

    n = case.args.get("max_completion_length", real.BASE["max_completion_length"])
    kwargs = dict(real.BASE, **case.args)
    kwargs.update(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none", save_strategy="no",
                  logging_strategy="no", disable_tqdm=True, seed=0, generation_kwargs={"min_new_tokens": n})
    peft_config = None
    if case.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    tok = real._tokenizer(1024, 0, 2)
    data = datasets.Dataset.from_dict({"prompt": real._prompts(case, 1024)})
    trainer = Fake(model=model, reward_funcs=lambda completions, **_: [float(i % 3) for i in range(len(completions))],
                   args=Config(**kwargs), train_dataset=data, processing_class=tok, peft_config=peft_config)
    tracker = StorageTracker(answer_scalar=_GenerationOracle(BatchFacts(unpadded=True, labelled=0, tokens=0,
                                                                        shape=(0, 0))))
    shadow = _GenerationShadow()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with real_path_patches(False), mode, tracker, contextlib.ExitStack() as stack:
        stack.enter_context(shadow)
        models = [trainer.model] + ([trainer.ref_model] if getattr(trainer, "ref_model", None) is not None else [])
        for m in models:
            _materialise(m)
            tracker.set_category([*m.parameters(), *m.buffers()], Category.PARAMETERS)
        trainer.accelerator.device_placement = False
        generate = trainer.model.generate

        def generate_known(*args, **kw):  # fix 2: the generated ids' values, every completion at full length
            out = generate(*args, **kw)
            prompt = shadow.real(kw["input_ids"])
            with _disable_current_modes():
                filler = torch.full((out.shape[0], out.shape[1] - prompt.shape[1]), 10, dtype=prompt.dtype)
                shadow._real[out] = torch.cat([prompt, filler], dim=1)
            return out

        trainer.model.generate = generate_known
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    return tracker.peak.peak_bytes, seconds


if __name__ == "__main__":
    argv = sys.argv[1:]
    size = "tiny"
    if "--size" in argv:
        i = argv.index("--size")
        size = argv[i + 1]
        del argv[i:i + 2]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name in argv or list(real.CASES):
        peak, seconds = run(real.CASES[name], size)
        print(f"{name:30s} fake peak {peak:>12,d} B  ({seconds:.1f} s in train())", flush=True)
