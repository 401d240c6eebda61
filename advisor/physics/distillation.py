"""On-policy distillation's training pass in closed form (TRL 1.16, trl/trainer/distillation_trainer.py
`_compute_loss`, trl/kernels/chunked_divergence.py `ChunkedDivergenceFunction`): what the teacher and the divergence
over the vocabulary add to a micro-batch of the student's training. The generation and the rest of the online step
are online_rl.py's (which imports this); the estimate counts the step with both, the simulator runs it.

Per micro-batch of B completions (N = B x max_completion_length tokens, every completion at its bound):
- the student's backbone with grad (`base_model`: no LM head, no logits), then the teacher's under `no_grad`, each
  giving [B, T, H] hidden states (T = prompt + completion) of which the completion's are sliced;
- `_chunked_divergence_loss` flattens each model's completion states ([N, H]: a copy, the slice is not contiguous;
  on Triton devices the completion tokens are indexed again, `h[valid]`), and `ChunkedDivergenceFunction` projects
  them onto two float32 tiles of [min(N, 4096), 32768] (`s_buf`, `t_buf`, whatever the vocabulary: the [N, V] logits
  never exist), folding each tile into per-token statistics (nine float32 vectors of N), with a second pass over the
  vocabulary for 0 < beta < 1; it saves both flattened states and three vectors for the backward;
- the backward projects the tiles again and accumulates the hidden states' gradient [N, H_s] and, when the head
  is trained (not under LoRA), its weight's [V, H_s], both in float32, cast to the parameters' dtype at the end.
Each tile's projection casts the head's 32768-row slice to the compute dtype when the weights are in another,
and the hidden chunk likewise; on CUDA the product goes straight to the float32 tile (`torch.mm(...,
out_dtype=torch.float32)`), elsewhere through float32 copies of both operands and the torch fold's float32
temporaries (profiles/measurements/online_rl_constants.json cpu_divergence_fold_tiles).

No autocast reaches the training pass: `compute_loss` routes the backbones and the loss through TRL's
`_ForwardRedirection`, which swaps out the `forward` accelerate wrapped in autocast, so with `bf16=True` over float32
weights the student's saved activations, the teacher's forward and the divergence are float32 (generation alone runs
under autocast). Checked on the real CPU run: the student's MLP outputs float32 with grad, bfloat16 in generate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOKEN_CHUNK = 4096  # trl/kernels/chunked_divergence.py TOKEN_CHUNK_SIZE
VOCAB_CHUNK = 32768  # VOCAB_CHUNK_SIZE


@dataclass(frozen=True)
class Teacher:
    """The resident teacher, as plain numbers: its bytes on this rank and the shapes its forward and head need."""

    weights_bytes: int
    hidden: int
    layers: int
    intermediate: int
    weight_element_bytes: int  # its weights' element (the head slice's cast per tile when it differs)
    dense_params: int  # decoder linears + head: its forward's FLOPs per token (x2)


def teacher_of(arch: Any, *, weights_bytes: int, weight_element_bytes: int) -> Teacher:
    """A Teacher from its architecture (advisor/physics/shapes.py `Architecture`) and its bytes as the backend
    counts them."""
    return Teacher(weights_bytes=int(weights_bytes), hidden=arch.hidden, layers=arch.layers,
                   intermediate=arch.intermediate, weight_element_bytes=int(weight_element_bytes),
                   dense_params=arch.decoder_linear + arch.vocab * arch.hidden)


@dataclass(frozen=True)
class DivergenceBytes:
    """`ChunkedDivergenceFunction` on one micro-batch: what it holds at its forward's and its backward's peaks (the
    flattened states it saves included), and its vocabulary-sized parts named apart for the report."""

    tokens: int  # N
    tiles: int  # s_buf + t_buf: 2 x min(N, 4096) x 32768 float32
    weight_grad: int  # the student head's weight gradient [V, H_s] in float32 (0 when the head is not trained)
    forward_peak: int
    backward_peak: int


def tiles(tokens: int) -> tuple[int, int]:
    """(rows, bytes) of the divergence's two float32 tiles for a micro-batch of `tokens` completion tokens."""
    rows = min(tokens, TOKEN_CHUNK)
    return rows, 2 * rows * VOCAB_CHUNK * 4


def vocabulary_note(div: DivergenceBytes, *, vocab: int, beta: float) -> str:
    """What a distillation step's vocabulary-sized parts are, in words and bytes (both backends' notes)."""
    gib = 2**30
    rows, tile_bytes = tiles(div.tokens)
    return (f"vocabulary logits: TRL's chunked divergence (trl/kernels/chunked_divergence.py, beta {beta:g}) "
            f"projects the {div.tokens:,} completion tokens of a micro-batch through both heads onto two float32 "
            f"tiles of {rows:,} x {VOCAB_CHUNK:,} = {tile_bytes / gib:.2f} GiB, never the [N, V] logits (both "
            f"models' would be {2 * div.tokens * vocab * 4 / gib:.2f} GiB at vocabulary {vocab:,}); the student "
            f"head's float32 weight gradient [V, H] adds {div.weight_grad / gib:.2f} GiB in its backward")


def divergence_bytes(*, rows: int, completion: int, vocab: int, student_hidden: int, teacher_hidden: int,
                     student_state_bytes: int, teacher_state_bytes: int, compute_bytes: int, teacher_compute_bytes: int,
                     head_weight_bytes: int, teacher_head_weight_bytes: int, beta: float, trained_head: bool,
                     cuda: bool, cpu_fold_tiles: int) -> DivergenceBytes:
    """The chunked divergence on `rows` completions of `completion` tokens. `*_state_bytes`: the element of each
    backbone's output (its weights' dtype: the residual stream's); `*compute_bytes`: the projection's dtype (autocast's,
    else the states'); `cpu_fold_tiles`: float32 tiles the torch fold holds at once (no Triton)."""
    n = rows * completion
    t, tile_bytes = tiles(n)
    vc = min(vocab, VOCAB_CHUNK)
    flat = n * (student_hidden * student_state_bytes + teacher_hidden * teacher_state_bytes)
    vectors = 10 * n * 4  # the nine running statistics (and the -inf start's temporary)

    def chunk_casts(s_bytes: int, t_bytes: int) -> int:
        return (t * student_hidden * s_bytes if s_bytes != student_state_bytes else 0) + \
            (t * teacher_hidden * t_bytes if t_bytes != teacher_state_bytes else 0)

    chunks = chunk_casts(compute_bytes, teacher_compute_bytes)
    slice_cast = max(vc * student_hidden * compute_bytes if head_weight_bytes != compute_bytes else 0,
                     vc * teacher_hidden * teacher_compute_bytes if teacher_head_weight_bytes != teacher_compute_bytes
                     else 0)
    if not cuda:  # the float32 copies of both operands, and the torch fold's tiles
        chunks += (t * student_hidden * 4 if compute_bytes != 4 else 0) + (
            t * teacher_hidden * 4 if teacher_compute_bytes != 4 else 0)
        slice_cast += max(vc * student_hidden * 4, vc * teacher_hidden * 4) if min(compute_bytes,
                                                                                 teacher_compute_bytes) != 4 else 0
        slice_cast += cpu_fold_tiles * t * vc * 4
    forward = flat + vectors + tile_bytes + chunks + slice_cast
    saved = flat + 3 * n * 4
    grad_hidden = n * student_hidden * 4
    weight_grad = vocab * student_hidden * 4 if trained_head else 0
    grad_tile = t * vc * compute_bytes if compute_bytes != 4 else 0
    backward = saved + 2 * n * 4 + grad_hidden + weight_grad + tile_bytes + chunks + slice_cast + grad_tile
    if trained_head and head_weight_bytes != 4:  # grad_weight.to(weight dtype) while the float32 one lives
        backward += vocab * student_hidden * head_weight_bytes
    del beta  # the JSD's second pass reuses the same tiles: the same bytes as either KL
    return DivergenceBytes(tokens=n, tiles=tile_bytes, weight_grad=weight_grad, forward_peak=forward,
                           backward_peak=backward)


def teacher_forward_bytes(teacher: Teacher, tokens: int, compute_bytes: int) -> int:
    """The teacher's no-grad forward over `tokens` positions: its residual stream and one decoder layer's largest
    temporaries (the MLP's gate, up projection and their product, the normed input), the last hidden states kept.
    A closed-form approximation, not counted from a run."""
    return tokens * (3 * teacher.intermediate + 4 * teacher.hidden) * compute_bytes + \
        tokens * teacher.hidden * teacher.weight_element_bytes


def teacher_train_flops(teacher: Teacher, *, rows: int, sequence: int, completion: int, vocab: int,
                        student_hidden: int, beta: float) -> float:
    """FLOPs a micro-batch adds for the teacher and the divergence's projections beyond an SFT step's LM head: the
    teacher's backbone (2 x its decoder linears per position), its head on the completion tokens once per vocabulary
    pass (two for 0 < beta < 1) and again in the backward, and the student's head likewise (the SFT step counts it
    once forward and once backward)."""
    passes = 2 if 0.0 < beta < 1.0 else 1
    n = rows * completion
    backbone = 2.0 * (teacher.dense_params - vocab * teacher.hidden) * rows * sequence
    heads = 2.0 * n * vocab * (teacher.hidden * (passes + 1) + student_hidden * passes)
    return backbone + heads


def step_divergence(step: Any, rows: int, *, cpu_fold_tiles: int) -> DivergenceBytes:
    """The divergence's bytes on `rows` completions of an online step (online_rl.py `OnlineStep` with a teacher).
    No autocast reaches it: DistillationTrainer.compute_loss runs the student's and the teacher's backbones and the
    loss through `_ForwardRedirection`, which replaces the `forward` accelerate wrapped in autocast (trl/models/
    utils.py), so each model computes in its own weights' dtype (bf16=True over float32 weights trains in float32;
    only generation runs under autocast)."""
    teacher = step.teacher
    return divergence_bytes(
        rows=rows, completion=step.max_completion_length, vocab=step.vocab, student_hidden=step.hidden,
        teacher_hidden=teacher.hidden, student_state_bytes=step.head_weight_bytes,
        teacher_state_bytes=teacher.weight_element_bytes, compute_bytes=step.head_weight_bytes,
        teacher_compute_bytes=teacher.weight_element_bytes, head_weight_bytes=step.head_weight_bytes,
        teacher_head_weight_bytes=teacher.weight_element_bytes, beta=step.divergence_beta,
        trained_head=not step.lora, cuda=step.cuda, cpu_fold_tiles=cpu_fold_tiles)


def train_moments(step: Any, rows: int, acts: int, before: int, *, cpu_fold_tiles: int) -> dict[str, dict[str, int]]:
    """Distillation's training micro-batch of an online step, by moment: the student's saved activations (`acts`,
    the backend's count, in the weights' dtype: see `step_divergence`) and earlier micro-steps' gradients
    (`before`), then the teacher's no-grad forward, the divergence's forward and backward over the vocabulary
    ("lm_head": its float32 tiles, the flattened states, the head's float32 weight gradient), the start of the
    student's backward and the optimizer step."""
    teacher = step.teacher
    tokens = rows * step.sequence_length
    div = step_divergence(step, rows, cpu_fold_tiles=cpu_fold_tiles)
    teacher_states = tokens * teacher.hidden * teacher.weight_element_bytes  # its last hidden states, kept
    return {
        "teacher's forward": {"gradients": before, "activations": acts, "teacher_forward": teacher_forward_bytes(
            teacher, tokens, teacher.weight_element_bytes)},
        "divergence's forward": {"gradients": before, "activations": acts, "teacher_forward": teacher_states,
                                 "lm_head": div.forward_peak},
        "divergence's backward": {"gradients": before, "activations": acts, "teacher_forward": teacher_states,
                                  "lm_head": div.backward_peak},
        "start of the backward": {"gradients": before, "activations": acts + step.train_recompute_bytes,
                                  "lm_head": 2 * tokens * step.hidden * step.head_weight_bytes},
        "optimizer step": {"gradients": step.gradient_bytes, "temporaries": step.optimizer_temporary_bytes},
    }
