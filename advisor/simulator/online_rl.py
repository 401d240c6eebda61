"""TRL's own `GRPOTrainer.train()` / `RLOOTrainer.train()` on fake tensors (online RL).

The trainer is built by the caller from `make_online_trainer_class(trl.GRPOTrainer | trl.RLOOTrainer)` on a policy
built on the `meta` device, inside `online_construction(...)`, so that the reference TRL builds from the policy's name
(`beta > 0` without PEFT: `create_model_from_path(get_config_model_id(model.config))`) is built on `meta` too and no
real weight is ever allocated. `run_online_fake(trainer, steps=..., ...)` materialises the policy and the reference
as fake tensors and runs the trainer's real `train()` loop: its dataloader, `_tokenize_prompts`, generation, the
reward functions on the decoded text, the old-policy and reference log-probs, the loss, the backward and the optimizer
step, with every storage tracked (advisor/simulator/tracker.py).

Generation (`engine="generate"`): transformers' `generate` runs on fake tensors with every completion at
`max_completion_length` (the bound; `full_length_generate`'s rules, advisor/simulator/generation.py). A decode step
costs a forward through every layer on fake tensors, so the decode loop is not run to its full length: `generate` runs
to two short lengths, the allocator's peak in each decode step (from one forward of the model to the next) is recorded,
and the full length's peak is extrapolated affinely in the decode step (the DynamicCache, the ids and the attention
mask grow by one position a step; every other allocation of a step is the same). The extrapolation is checked on the
runs themselves (the steps both short runs share are equal, the steps between are affine, the last step of each run
lies on its own line): where a check fails, the full decode loop runs instead (slow, exact) and the notes say why.
Its output is the full length's: [the real prompt ids | filler ids], known to the DataShadow, so everything after
`generate` (TRL's EOS mask, the rewards, the scoring forwards, the training passes) runs at the full completion
length.
tests/test_simulate_accuracy_grpo.py checks the extrapolated peak against a full-length fake generate, byte for byte.

vLLM (`engine="vllm"`): no `model.generate` runs in the training process. TRL's `VLLMGeneration` is constructed for
real with its `_init_vllm` replaced (no engine, no server: vLLM's own memory, its weights, KV pool and activations,
lies outside PyTorch's allocator of the training process and is modelled in closed form by advisor/physics), its
`generate` returns known full-length filler completions (and log-probs for the importance-sampling correction), and
its `sync_weights` runs for real up to the hand-over: `_iter_named_params` walks the policy as TRL does (PEFT's
`merge_adapter` / `unmerge_adapter` on fake tensors: the delta weights it allocates are counted), and the hand-over
(`load_weights` into vLLM's model, the server's `update_named_params`) takes the tensors and allocates nothing in the
training process's allocator. Sleep mode's wake-up and sleep are vLLM's (outside the allocator).

Distillation: the teacher the simulator builds on `meta` (a model input, advisor/modeling.py `input_model`, in the
trainer's `input_dtype`) is given to DistillationTrainer as a model, materialised and tracked beside the student
(`beside`); the divergence runs in the training phase. tests/test_simulate_accuracy_distillation.py: the fake peak is
4 B under the real CPU train()'s (which loads the teacher from a path with `teacher_model_init_kwargs`) in each of
six cases (beta 1 / 0 / 0.5, LoRA, bf16 with a bf16 teacher, a wider teacher; 22.5-26.7 MB).

Phases (advisor/physics/online_step.py `PhaseKind`): GENERATE is TRL's `_generate` (weight sync, the generate call, the
EOS mask and decoding); SCORE the rest of `_generate_and_score_completions` (the no-grad forwards for the old-policy
and reference log-probs, the rewards, the advantages); TRAIN everything else (`compute_loss`, backward, optimizer).

On a CPU target (`cuda=False`) three kinds of host allocation that no op's output shows are counted: the CPU
generator state gradient checkpointing saves per layer, the wrapped numbers autograd saves for a tensor times a
Python number (LoRA's scaling) (`_host_tensors_counted`), and the wrapped number an op's Python-number operand
becomes while the op runs (`_wrapped_bytes`). On a CUDA target all three are host memory.

Measured (TRL 1.16.0, transformers 5.24.0, torch 2.13 CPU; real = scripts/grpo_cpu_peak.py, the CPU allocator's
events of the real train(); fake = this module, decode run to 5 and 7 tokens, 16 extrapolated; 2 optimizer steps):

    case                          tiny: fake - real (B)    medium: fake / real (B)
    grpo-full                     0                        170,449,832 / 170,449,832
    grpo-beta-ref-ckpt            0                        205,698,548 / 205,698,552  (-4)
    grpo-steps-per-generation-2   0                        170,452,920 / 170,452,920
    grpo-num-iterations-2         0                        170,450,088 / 170,450,088
    grpo-lora-beta                0                         88,602,144 /  88,602,144
    rloo-defaults                 0                        205,698,300 / 205,698,304  (-4)

Beside them (tests/test_simulate_accuracy_grpo.py): bf16=True autocast over float32 weights (medium grpo-full
173,755,304 B, grpo-lora-beta 91,942,432 B, fake = real), a reward model given as a model (grpo-full plus a one-label
Qwen2 classifier: tiny 29,154,760 B, medium 210,332,840 B, fake = real), and `engine="vllm"` against a real CPU
train() around the same absent vLLM (grpo-lora-beta, colocate: the weight sync's merge and the importance-sampling
forward real; tiny 27,235,728 B, medium 88,602,672 B, fake = real; the train phase binds there, so the sync's own
transient is inside the check only as far as it is below that peak).

The -4 B left at medium under checkpointing (-12 before `_wrapped_bytes`: at the real peak, inside AdamW's step on
the largest parameter, the allocator held an 8-byte block allocated outside any op, the wrapped number of
`exp_avg_sq.sqrt() / bias_correction2_sqrt`): one 0-dim float32 block the real run holds there (`torch.tensor` of a
Python number outside any op, by its profile) that the fake run does not; not found further.

The extrapolated generate equals the full decode loop to the byte: medium, 4-token prompts, 32 and 40 tokens (the
decode sets generate's peak, and a steeper moment of a decode step overtakes the others at step 8, which fitting each
step's peak instead of each moment missed by 131,072 B); Qwen2.5-0.5B's shapes with 2 layers, 8 x 64 tokens of
16-token prompts, CUDA path (700,551,528 B both).

Speed: Qwen2.5-0.5B's config (24 layers, vocabulary 151,936), 8 completions x 512 tokens of 64-token prompts, one
optimizer step at full depth, CUDA path: 14-33 s for `run_online_fake` on 2 shared cores, plus 2-5 s to build the
trainer (the decode loop to 512 would be 512 forwards of 24 layers). The full depth runs, so the layer-by-layer
extrapolation of advisor/simulator/depth.py is not needed here.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import UsageError
from ..measurement import Category
from ..physics import online_PhaseKind as PhaseKind
from .decode_extrapolation import GenerateExtrapolation, generate_extrapolated
from .fake_step import (
    BatchFacts,
    ScalarOracle,
    SyncWatch,
    _frozen_heap,
    _label_training_state,
    _materialise,
    real_path_patches,
)
from .generation import filler_token
from .shadow import DataShadow
from .tracker import StorageTracker

ENGINES = ("generate", "vllm")
# Decode steps `generate` runs on fake tensors (two short lengths; the full length is extrapolated from them).
SHORT_DECODES = (5, 7)


@dataclass(frozen=True)
class OnlineRunResult:
    """One fake `train()` of an online RL trainer."""

    peak_bytes: int
    phase_peaks: dict[PhaseKind, int]  # the allocator's peak within each phase (bytes live, all of them)
    breakdown: dict[Category, int]  # by category, at the peak
    generated_tokens: int  # completion tokens generated, all generation calls
    generations: int  # generation calls (one per `steps_per_generation` x `num_iterations` optimizer steps)
    notes: tuple[str, ...]
    extrapolations: tuple[GenerateExtrapolation, ...] = field(default=())
    synced_tensors: int = 0  # vLLM: tensors the weight syncs handed to vLLM (every sync of the run)


# ---- construction ------------------------------------------------------------------------------------------------

def make_online_trainer_class(base_cls: type) -> type:
    """`base_cls` (trl.GRPOTrainer, trl.RLOOTrainer or a subclass) that leaves device placement alone: the models are
    built on `meta` and materialised as fake tensors by `run_online_fake` (`model.to()` cannot swap them)."""

    def _move_model_to_device(self, model, device):
        return None

    return type(f"FakeOnline{base_cls.__name__}", (base_cls,), {
        "__doc__": f"{base_cls.__name__} whose models stay where the fake run puts them.",
        "_move_model_to_device": _move_model_to_device,
    })


@contextlib.contextmanager
def online_construction(config: Any = None, *, engine: str = "generate", trainer_class: type | None = None
                        ) -> Iterator[None]:
    """Wrap the trainer's construction. The reference TRL builds from the policy's name (`create_model_from_path`
    in grpo_trainer.py and rloo_trainer.py, and in `trainer_class`'s module) is built on `meta` from `config` (the
    policy's transformers config; None: read from the name with AutoConfig), with TRL's dtype and attention
    implementation, so no weight is allocated. `engine="vllm"`: TRL's `VLLMGeneration` starts no vLLM (see the
    module's docstring); a trainer module that asks `is_vllm_available` before building it (DistillationTrainer)
    is told yes."""
    _check_engine(engine)

    import trl.generation.vllm_generation as vg  # lazy: loads trl
    import trl.trainer.grpo_trainer as grpo  # lazy: loads trl
    import trl.trainer.rloo_trainer as rloo  # lazy: loads trl

    builders = [grpo, rloo]
    own = sys.modules[trainer_class.__module__] if trainer_class is not None else None
    if own is not None and own not in builders and hasattr(own, "create_model_from_path"):
        builders.append(own)

    def meta_model_from_path(model_id: str, architecture: Any = None, **kwargs: Any):
        import transformers  # lazy: loads transformers
        from transformers import AutoConfig  # lazy: loads transformers

        if kwargs.get("quantization_config") is not None:
            raise UsageError(f"the reference of {model_id!r} is quantized (quantization_config): a quantized "
                               "reference is not built on fake tensors; quantize with PEFT (the adapters disabled "
                               "are the reference) or simulate without quantization")
        cfg = copy.deepcopy(config) if config is not None else AutoConfig.from_pretrained(
            model_id, trust_remote_code=kwargs.get("trust_remote_code", False))
        if architecture is None:
            architecture = getattr(transformers, (cfg.architectures or ["AutoModelForCausalLM"])[0], None) \
                or transformers.AutoModelForCausalLM
        dtype = kwargs.get("dtype", torch.float32)
        if isinstance(dtype, str):
            dtype = cfg.dtype if dtype == "auto" else getattr(torch, dtype)
        extra = {k: kwargs[k] for k in ("attn_implementation",) if kwargs.get(k) is not None}
        with torch.device("meta"):
            model = architecture.from_config(cfg, dtype=dtype, **extra) if hasattr(architecture, "from_config") \
                else architecture._from_config(cfg, dtype=dtype, **extra)
        model.config._name_or_path = model_id
        return model

    from accelerate import Accelerator  # lazy: loads accelerate

    prepare_model = Accelerator.prepare_model

    def prepare_model_in_place(self: Any, model: Any, device_placement: Any = None, evaluation_mode: bool = False):
        # the reference is prepared in evaluation mode with device placement: a meta model stays where it is
        if any(p.is_meta for p in model.parameters()):
            device_placement = False
        return prepare_model(self, model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    saved: list[tuple[Any, str, Any]] = [(m, "create_model_from_path", m.create_model_from_path) for m in builders]
    saved.append((Accelerator, "prepare_model", prepare_model))
    for m in builders:
        m.create_model_from_path = meta_model_from_path
    Accelerator.prepare_model = prepare_model_in_place
    if engine == "vllm":
        saved.append((vg.VLLMGeneration, "_init_vllm", vg.VLLMGeneration._init_vllm))
        vg.VLLMGeneration._init_vllm = _no_vllm_init
        if own is not None and hasattr(own, "is_vllm_available"):  # no vLLM is started either way
            saved.append((own, "is_vllm_available", own.is_vllm_available))
            own.is_vllm_available = lambda: True
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise UsageError(f"engine={engine!r}: one of {', '.join(ENGINES)}")


class _VLLMStandIn:
    """What TRL's VLLMGeneration reaches of vLLM (colocate: `llm`; server: `vllm_client`): the hand-over of weights
    takes the tensors and allocates nothing in the training process's allocator; sleep and wake are vLLM's."""

    def __init__(self) -> None:
        self.handed_over = 0  # tensors handed to vLLM by sync_weights (a check that the sync ran)
        self.llm_engine = self  # llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights
        self.model_executor = self.driver_worker = self.model_runner = self.model = self

    def load_weights(self, weights: Any) -> None:
        for _name, tensor in weights:
            self.handed_over += isinstance(tensor, torch.Tensor)

    def update_named_params(self, metadata: Any, params: Any) -> None:
        self.load_weights(params)

    def reset_prefix_cache(self) -> None:
        return None

    def wake_up(self, tags: Any = None) -> None:
        return None

    def sleep(self, level: int = 1) -> None:
        return None

    def get_server_info(self) -> dict:
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}


def _no_vllm_init(self: Any) -> None:
    stand_in = _VLLMStandIn()
    if self.mode == "server":
        self.vllm_client = stand_in
    else:
        self.llm = stand_in
    self._llm_weights_sleeping = False


class _OnlineShadow(DataShadow):
    """DataShadow that answers `bool()` of a known tensor from its value and also computes `randperm` for real: TRL
    shuffles the generation batch's rows (`shuffle_sequence_dict`) before splitting it into micro-batches, and the
    CUDA path of its fused LM head then indexes the hidden states by the labels' mask. Any permutation gives the same
    shapes: every completion has max_completion_length tokens, so each micro-batch holds the same count of scored
    positions."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.is_nonzero.default and self._known(args[0]):
            # `bool(t)` of a known tensor (transformers' `fast_all(padding_mask)` in a reward model's forward)
            with _disable_current_modes():
                return bool(self._value(args[0]).item())
        if func is torch.ops.aten.randperm.default:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            with _disable_current_modes():
                self._carry(out, torch.randperm(*args, **self._real_kwargs(kwargs)))
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)


# ---- the tracker with phases and windows --------------------------------------------------------------------------

class _PhaseTracker(StorageTracker):
    """StorageTracker that also keeps the peak of each phase (with its breakdown) and, while a window is open (a
    decode step), the total live after each allocation in it (with its breakdown): the moments a peak can be at.
    While `suspended`, allocations count as live but set no phase peak."""

    def __init__(self, answer_scalar: Any) -> None:
        super().__init__(answer_scalar=answer_scalar)
        self.phase = PhaseKind.TRAIN
        self.phase_peak: dict[PhaseKind, int] = {}
        self.phase_breakdown: dict[PhaseKind, dict[Category, int]] = {}
        self.suspended = 0
        self.series: list[tuple[int, dict[Category, int]]] | None = None

    def enter(self, phase: PhaseKind) -> PhaseKind:
        before, self.phase = self.phase, phase
        self._note()
        return before

    def open_window(self) -> None:
        self.series = [(self.current, self.live_by_category())]

    def close_window(self) -> list[tuple[int, dict[Category, int]]]:
        out, self.series = self.series or [], None
        return out

    def _note(self) -> None:
        if self.series is not None:
            self.series.append((self.current, self.live_by_category()))
        if not self.suspended and self.current > self.phase_peak.get(self.phase, -1):
            self.phase_peak[self.phase] = self.current
            self.phase_breakdown[self.phase] = self.live_by_category()

    def _add(self, storage: torch.UntypedStorage, category: Category | None) -> None:
        before = self.current
        super()._add(storage, category)
        if self.current > before:
            self._note()

    count_wrapped = False  # a CPU target: count the wrapped numbers an op's Python-number operands become

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        n = _wrapped_bytes(func, args, kwargs) if self.count_wrapped else 0
        if not n:
            return super().__torch_dispatch__(func, types, args, kwargs)
        cat = self.default_category
        self.current += n
        self._by_category[cat] = self._by_category.get(cat, 0) + n
        self._note()
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.current -= n
            self._by_category[cat] -= n

    def note_bytes(self, phase: PhaseKind, total: int, cats: dict[Category, int]) -> None:
        """A peak computed, not run (the extrapolated generate)."""
        if total > self.phase_peak.get(phase, -1):
            self.phase_peak[phase] = total
            self.phase_breakdown[phase] = dict(cats)


_TENSOR_ARGS: dict[Any, tuple[tuple[int, str], ...]] = {}


def _wrapped_bytes(func: Any, args: tuple, kwargs: dict | None) -> int:
    """Bytes of the 0-dim "wrapped number" tensors a Python number passed for a Tensor argument becomes (torch's
    argument parser allocates one before the op: 8 bytes for a float or an int, 1 for a bool); the dispatch mode sees
    the number back. They are live while the op allocates its output (AdamW's `exp_avg_sq.sqrt() /
    bias_correction2_sqrt` on the largest parameter: an 8-byte block at the real CPU peak, allocated outside any op)."""
    slots = _TENSOR_ARGS.get(func)
    if slots is None:
        slots = tuple((i, a.name) for i, a in enumerate(func._schema.arguments) if str(a.type) == "Tensor")
        _TENSOR_ARGS[func] = slots
    total = 0
    for i, name in slots:
        value = args[i] if i < len(args) else (kwargs or {}).get(name)
        if isinstance(value, bool):
            total += 1
        elif isinstance(value, (int, float)):
            total += 8
    return total


# ---- vLLM: filler completions, the weight sync run --------------------------------------------------------------

def _vllm_filler(trainer: Any, record: list) -> None:
    """Replace the trainer's VLLMGeneration.generate with full-length filler completions (the instance attribute)."""
    vllm = trainer.vllm_generation
    token = filler_token(trainer.model)
    n = int(trainer.max_completion_length)

    def generate(prompts: list, images: Any, num_generations: int, profiler: Any = None) -> tuple:
        # Sleep level 2 discards vLLM's weights: TRL re-pushes them before generating (its own generate does this)
        if vllm.mode == "colocate" and vllm.enable_sleep_mode and vllm._llm_weights_sleeping:
            vllm.sync_weights()
        # one completion per row in both modes: TRL hands each prompt in num_generations times (the server generates
        # n per unique prompt and TRL repeats the prompts to match; colocate generates one per row)
        completion_ids = [[token] * n for _ in prompts]
        logprobs = [[[0.0] for _ in range(n)] for _ in prompts]
        if vllm.mode == "colocate" and vllm.enable_sleep_mode:
            vllm._llm_weights_sleeping = True
        record.append(GenerateExtrapolation(n, (), 0, 0))
        return [list(p) for p in prompts], completion_ids, logprobs, None

    vllm.generate = generate


# ---- the run ------------------------------------------------------------------------------------------------------

def run_online_fake(trainer: Any, *, steps: int, cuda: bool, engine: str = "generate",
                    decode_lengths: tuple[int, int] | None = SHORT_DECODES, beside: tuple = ()) -> OnlineRunResult:
    """Run `trainer.train()` for `steps` optimizer steps on fake tensors (see the module's docstring). `trainer`:
    built from `make_online_trainer_class(...)` inside `online_construction(...)` on a `meta` policy. `cuda`: the
    fused LM head's CUDA path (advisor/simulator/fake_step.py `real_path_patches`). `decode_lengths`: the two short
    generations the generate phase is extrapolated from (None: the full decode loop). `beside`: the other models
    the trainer runs (its `extra_models`: a teacher), materialised and tracked as the policy is."""
    _check_run(trainer, steps, engine, decode_lengths)
    trainer.args.max_steps = steps
    from transformers.trainer_callback import PrinterCallback, ProgressCallback  # lazy: loads transformers

    for callback in (PrinterCallback, ProgressCallback):  # the library never prints
        trainer.remove_callback(callback)
    tracker = _PhaseTracker(ScalarOracle(BatchFacts(unpadded=True, labelled=0, tokens=0, shape=(0, 0))))
    shadow = _OnlineShadow()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    record: list[GenerateExtrapolation] = []
    models = [trainer.model]
    if getattr(trainer, "ref_model", None) is not None:
        models.append(trainer.ref_model)
    reward_models = [f for f in getattr(trainer, "reward_funcs", ()) if isinstance(f, torch.nn.Module)]
    models += reward_models
    models += [m for m in beside if all(m is not known for known in models)]
    notes = [
        "online RL: TRL's own train() on fake tensors; every completion at max_completion_length (the bound: a "
        "completion that ends early at EOS holds less)",
    ]
    if reward_models:
        notes.append(f"{len(reward_models)} reward model(s) resident and run on every completion (their scores are "
                     "taken as zeros: the value changes no allocation)")
    with _frozen_heap(), real_path_patches(cuda), mode, tracker, contextlib.ExitStack() as stack:
        stack.enter_context(shadow)
        if tracker.on_sync is not None:  # above the shadow: it answers `.item()` on known values itself
            stack.enter_context(SyncWatch(tracker))
        for m in models:
            _materialise(m)
            tracker.set_category([*m.parameters(), *m.buffers()], Category.PARAMETERS)
        trainer.accelerator.device_placement = False
        if not cuda:
            stack.enter_context(_host_tensors_counted(tracker))
            tracker.count_wrapped = True
        _label_training_state(trainer, tracker, cuda=cuda)
        handles = [m.register_forward_hook(_known_scores(shadow)) for m in reward_models]
        _phase_wrap(trainer, "_generate_and_score_completions", PhaseKind.SCORE, tracker)
        _phase_wrap(trainer, "_generate", PhaseKind.GENERATE, tracker)
        if engine == "generate":
            stack.enter_context(generate_extrapolated(trainer.model, shadow, tracker, decode_lengths, record))
        else:
            _vllm_filler(trainer, record)
        trainer.train()
        for handle in handles:
            handle.remove()
    for name in ("_generate_and_score_completions", "_generate"):
        vars(trainer).pop(name, None)
    synced = _vllm_handed_over(trainer, notes) if engine == "vllm" else 0
    notes.extend(_generation_notes(record))
    phase_peaks = dict(tracker.phase_peak)
    top = max(phase_peaks, key=lambda k: phase_peaks[k])
    breakdown = tracker.phase_breakdown[top]
    generated = _generated_tokens(trainer, record)
    return OnlineRunResult(peak_bytes=phase_peaks[top], phase_peaks=phase_peaks, breakdown=dict(breakdown),
                           generated_tokens=generated, generations=len(record), notes=tuple(notes),
                           extrapolations=tuple(record), synced_tensors=synced)


def _check_run(trainer: Any, steps: int, engine: str, decode_lengths: tuple[int, int] | None) -> None:
    """UsageError for a run that cannot be what it says: an unknown engine, no step, a trainer built for the other
    engine, short decode lengths that cannot show the slope."""
    _check_engine(engine)
    if steps < 1:
        raise UsageError(f"steps={steps!r}: at least 1 optimizer step")
    if bool(getattr(trainer, "use_vllm", False)) != (engine == "vllm"):
        raise UsageError(f"engine={engine!r} but the trainer's use_vllm is {getattr(trainer, 'use_vllm', None)}: "
                         "build the trainer with use_vllm=True (inside online_construction(engine='vllm')) for "
                         "vLLM, use_vllm=False for generate")
    if decode_lengths is not None:
        lo, hi = sorted(decode_lengths)
        if lo < 3 or hi < lo + 2:
            raise UsageError(f"decode_lengths={decode_lengths!r}: two lengths, the shorter at least 3, the longer "
                             "at least 2 more (the middle decode steps must show the slope)")


def _vllm_handed_over(trainer: Any, notes: list[str]) -> int:
    """vLLM's stand-in after the run: its generate unpatched, the tensors the weight sync handed it (noted)."""
    vars(trainer.vllm_generation).pop("generate", None)
    stand_in = getattr(trainer.vllm_generation, "llm", None) or trainer.vllm_generation.vllm_client
    notes.append(f"vLLM: no generate in the training process; completions are full-length filler ids; the "
                 f"weight sync ran up to the hand-over ({stand_in.handed_over} tensors handed to vLLM, which "
                 f"allocates them outside this allocator); vLLM's pool, weights, KV cache and sleep/wake are "
                 f"modelled in closed form (advisor/physics)")
    return stand_in.handed_over


def _generation_notes(record: list[GenerateExtrapolation]) -> list[str]:
    """What the notes say of the generate calls: a failed extrapolation check (the full loop ran), else the short
    decode runs the peak was extrapolated from."""
    out = []
    for r in record:
        if r.fallback:
            out.append(f"generate: the decode extrapolation's check failed ({r.fallback}); the full decode loop of "
                       f"{r.max_new_tokens} tokens ran instead")
            break
    extrapolated = [r for r in record if r.short_lengths]
    if extrapolated:
        r = extrapolated[0]
        out.append(f"generate: decode run to {r.short_lengths[0]} and {r.short_lengths[1]} tokens, the peak at "
                   f"{r.max_new_tokens} extrapolated affinely ({r.bytes_per_step:,d} B a decode step; checked on "
                   f"the short runs)")
    return out


@contextlib.contextmanager
def _host_tensors_counted(tracker: StorageTracker) -> Iterator[None]:
    """On a CPU target, the CPU generator's state torch.utils.checkpoint saves per checkpointed layer
    (`preserve_rng_state`: `torch.get_rng_state()`, 5,056 bytes each) is held by the CPU allocator, and no op's output
    shows it to the tracker (the spike's -10,112 B under gradient checkpointing, tiny model: 2 layers x 5,056). On a
    CUDA target it lives in host memory (the CUDA generator's state is a CPU tensor too): not counted."""
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        tracker.track([state], Category.OTHER)
        return state

    torch.get_rng_state = get_rng_state
    try:
        with _SavedNumbers():
            yield
    finally:
        torch.get_rng_state = original


_NUMBER_OPS = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.div,
                         torch.Tensor.div, torch.Tensor.__truediv__})


def _known_scores(shadow: DataShadow) -> Any:
    """A reward model's scores are known zeros: TRL checks the rewards for NaN (`torch.isnan(rewards_per_func)
    .all(dim=1).any()`) and normalises them into advantages; the value changes no shape or allocation (its forward
    on fake weights is run and counted as it is)."""

    def hook(module: Any, args: Any, output: Any) -> None:
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor):
            with _disable_current_modes():
                shadow.know(logits, torch.zeros(tuple(logits.shape), dtype=logits.dtype))

    return hook


def _release_saved_number(metadata: dict) -> Any:
    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        metadata.pop("advisor_saved_number", None)

    return hook


class _SavedNumbers(torch.overrides.TorchFunctionMode):
    """A product (or quotient) of a tensor that requires grad and a Python number: autograd saves the number as a
    0-dim "wrapped number" tensor (8 bytes, double or int64) for the backward, allocated by the CPU allocator outside
    any op, and keeps it until the node runs; no dispatch mode or saved-tensor hook sees it (PEFT's LoRA
    `lora_B(lora_A(x)) * scaling`, one per adapted module: the spike's -112 B under LoRA, tiny model, 2 layers x 7
    modules x 8 B, found in the real run's allocator events as 8-byte blocks allocated outside any op). Counted as
    an 8-byte tracked tensor held by the node and freed when the node has run."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _NUMBER_OPS and len(args) == 2 and not kwargs and torch.is_grad_enabled() \
                and isinstance(args[0], torch.Tensor) and args[0].requires_grad \
                and isinstance(args[1], (int, float)) and not isinstance(args[1], bool) \
                and isinstance(out, torch.Tensor) and out.grad_fn is not None:
            node = out.grad_fn
            node.metadata["advisor_saved_number"] = torch.empty((), dtype=torch.float64)
            node.register_hook(_release_saved_number(node.metadata))
        return out


def _generated_tokens(trainer: Any, record: list) -> int:
    # GRPOConfig / RLOOConfig: steps_per_generation; a config without it (DistillationConfig) generates every
    # gradient_accumulation_steps
    steps = getattr(trainer.args, "steps_per_generation", None) or trainer.args.gradient_accumulation_steps
    rows = trainer.args.per_device_train_batch_size * steps
    return sum(r.max_new_tokens for r in record) * rows


def _phase_wrap(trainer: Any, name: str, phase: PhaseKind, tracker: _PhaseTracker) -> None:
    original = getattr(trainer, name)

    def wrapped(*args: Any, **kwargs: Any):
        before = tracker.enter(phase)
        try:
            return original(*args, **kwargs)
        finally:
            tracker.enter(before)

    setattr(trainer, name, wrapped)
