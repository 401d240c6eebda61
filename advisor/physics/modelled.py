"""Knobs modelled in closed form: what fake tensors cannot run (Hub kernels' RMSNorm, the offloaded checkpoints),
their device bytes saved and their time; the simulator takes the same numbers (advisor/simulator/modelled.py
`_modelled_knobs`)."""

from __future__ import annotations

import importlib
import inspect
import math
from functools import lru_cache
from typing import TYPE_CHECKING

from ..space import Candidate, Precision, WeightsDtype
from .shapes import architecture

if TYPE_CHECKING:
    from ..workload import GPUSpec, ModelSpec


def knob_memory_savings(model: ModelSpec, c: Candidate, tokens: int, cuda: bool) -> dict[str, int]:
    """Device bytes each modelled knob frees at the peak of a step, for a micro-batch of `tokens` positions."""
    out = {"use_kernels": _kernels_saved_bytes(model, c, tokens, cuda),
           "checkpoint_offload": _checkpoint_offload_saved_bytes(model, c, tokens, cuda)}
    return {k: v for k, v in out.items() if v}


def knob_time(cost, model: ModelSpec, c: Candidate, gpu: GPUSpec):
    """The step-time model's cost with the modelled knobs' terms: the offloaded checkpoints' copies on the compute
    stream, Liger's fused RMSNorm in place of torch's elementwise ops."""
    from . import timing as tm  # lazy: loads numpy

    tc = tm.time_constants(gpu)
    dev = cost.device.copy()
    terms = list(tm.Term)
    off, mem, tok = terms.index(tm.Term.OFFLOAD), terms.index(tm.Term.MEMORY), int(tm.Basis.TOKENS)
    dev[off, tok] += _checkpoint_offload_s_per_token(model, c, gpu.is_cuda, tc.pcie_bw)
    saved = _kernels_s_per_token(model, c, gpu.is_cuda, tc.mem_bw)
    dev[mem, tok] = max(0.5 * dev[mem, tok], dev[mem, tok] - saved)  # never below half: the rest is not RMSNorm
    return cost.with_(device=dev)


def _residual_bytes(c: Candidate) -> int:
    """The residual stream's element size: float32 under autocast over float32 weights, else the compute dtype."""
    mixed = c.precision is not Precision.FP32
    low = mixed or c.weights_dtype is not WeightsDtype.FLOAT32
    return 4 if (mixed and c.weights_dtype is WeightsDtype.FLOAT32) else (2 if low else 4)


def _checkpointed_layers(model: ModelSpec, c: Candidate) -> int:
    """transformers checkpoints layer i when i % every_n_layers == 0 (PreTrainedModel._set_gradient_checkpointing)."""
    return math.ceil(model.num_layers / c.checkpoint_every_n_layers) if c.activation_checkpointing else 0


def _checkpoint_offload_saved_bytes(model: ModelSpec, c: Candidate, tokens: int, cuda: bool) -> int:
    """activation_checkpointing_kwargs offload: transformers wraps torch's checkpoint in save_on_cpu, so what the
    checkpoint saves for the recompute (each checkpointed layer's input hidden states, rows x seq x hidden in the
    residual dtype) waits in pinned host memory. During the backward the layer being recomputed has its input back
    on the device, so the saving at the peak is one layer fewer than the checkpointed layers (the others' inputs
    stay on the host). Nothing on the CPU: there the host is the device."""
    if not (c.activation_checkpointing and c.checkpoint_offload and cuda):
        return 0
    n = _checkpointed_layers(model, c)
    return max(0, n - 1) * tokens * model.hidden_size * _residual_bytes(c)


def _checkpoint_offload_s_per_token(model: ModelSpec, c: Candidate, cuda: bool, pcie_bw: float) -> float:
    """The device-to-host copy of every checkpointed input in the forward and its way back in the backward, both
    on the compute stream (transformers' docstring of activation_checkpointing_enable), over PCIe."""
    if not (c.activation_checkpointing and c.checkpoint_offload and cuda):
        return 0.0
    per_token = _checkpointed_layers(model, c) * model.hidden_size * _residual_bytes(c)
    return 2.0 * per_token / pcie_bw


@lru_cache(maxsize=64)
def _rmsnorm_is_hub_kernel(model_type: str) -> bool:
    """Whether transformers marks this architecture's RMSNorm for Hub kernels (`@use_kernel_forward_from_hub
    ("RMSNorm")` in its modeling file): what `kernelize` swaps for Liger's RMSNorm when training on CUDA."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name  # lazy: loads transformers

    try:
        module = importlib.import_module(f"transformers.models.{model_type_to_module_name(model_type)}."
                                         f"modeling_{model_type_to_module_name(model_type)}")
        return '@use_kernel_forward_from_hub("RMSNorm")' in inspect.getsource(module)
    except (ImportError, OSError, TypeError):
        return False


def _rmsnorm_elements(model: ModelSpec) -> int:
    """Elements each token's RMSNorm calls normalise in one decoder layer: the two layer norms (four in Gemma 2/3)
    and, where the architecture has them, q_norm / k_norm over every query and key head."""
    arch = architecture(model)
    mt = str(model.config.get("model_type", ""))
    out = (4 if mt in ("gemma2", "gemma3", "gemma3_text") else 2) * arch.hidden
    if mt in ("qwen3", "gemma3", "gemma3_text", "olmo2"):
        out += arch.q_dim + arch.kv_dim
    return out


def _kernels_saved_bytes(model: ModelSpec, c: Candidate, tokens: int, cuda: bool) -> int:
    """use_kernels: Liger's fused RMSNorm saves its input and one fp32 rstd per row; torch's LlamaRMSNorm also
    saves the fp32 normalised product (float32 input) or the fp32 upcast and the low-precision product (16-bit
    input): 4 bytes more per normalised element either way (counted with saved_tensors_hooks on the CPU; see
    tests/test_knobs.py). Counted for the layers whose activations stay saved (not checkpointed); the final norm
    and a recomputed layer are left out, since the peak may fall after their backward. Nothing on the CPU
    (transformers' mapping has no CPU training kernel) or where the architecture's RMSNorm is not a Hub layer."""
    if not (c.use_kernels and cuda and _rmsnorm_is_hub_kernel(str(model.config.get("model_type", "")))):
        return 0
    kept = model.num_layers - _checkpointed_layers(model, c)
    return 4 * tokens * _rmsnorm_elements(model) * kept


# torch's eager LlamaRMSNorm, bytes read + written per normalised element in its forward: pow (4 + 4), mean (4),
# the multiply by rsqrt (4 + 4) and by the weight (4 + 4) in float32, plus the casts in and out of a 16-bit input
_TORCH_RMSNORM_FWD = {4: 28, 2: 36}


def _kernels_s_per_token(model: ModelSpec, c: Candidate, cuda: bool, mem_bw: float) -> float:
    """use_kernels: Liger's RMSNorm reads its input and writes its output once in the forward (2 passes) and reads
    the output gradient and input, writes the input gradient in the backward (3); torch's elementwise chain moves
    _TORCH_RMSNORM_FWD bytes an element in the forward and about twice that in the backward. The forward runs again
    for checkpointed layers. Kernel launches saved are not counted."""
    if not (c.use_kernels and cuda and _rmsnorm_is_hub_kernel(str(model.config.get("model_type", "")))):
        return 0.0
    r = _residual_bytes(c)
    f = _checkpointed_layers(model, c) / max(1, model.num_layers)
    torch_b = _TORCH_RMSNORM_FWD[r] * (1 + f) + 2 * _TORCH_RMSNORM_FWD[r]
    liger_b = 2 * r * (1 + f) + 3 * r
    return model.num_layers * _rmsnorm_elements(model) * (torch_b - liger_b) / mem_bw

