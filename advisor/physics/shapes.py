"""The model's shapes as the estimate counts them: parameter counts and the decoder's linear projections, read
from a transformers config (Llama-style decoders), and the adapters' and quantized weights' sizes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from .._bnb import weight_bytes
from ..space import Candidate, WeightsDtype

if TYPE_CHECKING:
    from ..workload import ModelSpec

DTYPE_BYTES = {WeightsDtype.FLOAT32: 4, WeightsDtype.BFLOAT16: 2, WeightsDtype.FLOAT16: 2}


@dataclass(frozen=True)
class Architecture:
    """Shapes that memory and FLOPs depend on, read from a transformers config."""

    layers: int
    hidden: int
    intermediate: int
    vocab: int
    q_dim: int
    kv_dim: int
    heads: int
    tied: bool
    # parameter counts
    embedding: int
    lm_head: int  # 0 when tied to the embedding
    per_layer: int
    final_norm: int
    # (module name, in_features, out_features) of each decoder layer's linear projections
    linears: tuple[tuple[str, int, int], ...]
    head_dim: int = 0

    @property
    def buffer_bytes(self) -> int:
        """The rotary embedding's inv_freq and original_inv_freq, float32 whatever the weights' dtype."""
        return 2 * (self.head_dim // 2) * 4

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.layers * self.per_layer + self.final_norm

    @property
    def decoder_linear(self) -> int:
        """Weights of all decoder linear projections (what autocast casts and what bitsandbytes quantizes)."""
        return self.layers * sum(i * o for _, i, o in self.linears)


def quantized_linear_bytes(arch: Architecture, c: Candidate) -> float:
    """The decoder's linear weights as bitsandbytes stores them (advisor/_bnb.py)."""
    double = bool(c.base.get("use_bnb_nested_quant", False))
    return arch.layers * sum(weight_bytes(i, o, c.quantization.value, double_quant=double) for _, i, o in arch.linears)


@lru_cache(maxsize=64)
def architecture(model: ModelSpec) -> Architecture:
    """From the config alone; Llama-style decoders (Llama, Qwen2/3, Mistral, Gemma 1/2/3 text)."""
    t = model.text_value
    h = int(t("hidden_size"))
    heads = int(t("num_attention_heads"))
    kv_heads = int(t("num_key_value_heads") or heads)
    head_dim = int(t("head_dim") or h // heads)
    inter = int(t("intermediate_size"))
    vocab = int(t("vocab_size"))
    layers = int(t("num_hidden_layers"))
    mt = str(model.config.get("model_type", ""))
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    qkv_bias = mt.startswith("qwen2") or bool(t("attention_bias", False))
    o_bias = bool(t("attention_bias", False))
    mlp_bias = bool(t("mlp_bias", False))
    linears = (
        ("q_proj", h, q_dim), ("k_proj", h, kv_dim), ("v_proj", h, kv_dim), ("o_proj", q_dim, h),
        ("gate_proj", h, inter), ("up_proj", h, inter), ("down_proj", inter, h),
    )
    biases = (q_dim + 2 * kv_dim if qkv_bias else 0) + (h if o_bias else 0) + (2 * inter + h if mlp_bias else 0)
    norms = 4 * h if mt in ("gemma2", "gemma3", "gemma3_text") else 2 * h
    if mt in ("qwen3", "gemma3", "gemma3_text", "olmo2"):
        norms += 2 * head_dim  # q_norm / k_norm
    per_layer = sum(i * o for _, i, o in linears) + biases + norms
    tied = bool(t("tie_word_embeddings", mt.startswith("gemma")))
    return Architecture(
        layers=layers, hidden=h, intermediate=inter, vocab=vocab, q_dim=q_dim, kv_dim=kv_dim, heads=heads,
        tied=tied, embedding=vocab * h, lm_head=0 if tied else vocab * h, per_layer=per_layer, final_norm=h,
        linears=linears, head_dim=head_dim,
    )


def lora_parameters(arch: Architecture, candidate: Candidate) -> int:
    """Adapter parameters: r x (in + out) for each targeted projection of every layer."""
    targets = set(candidate.lora_target_modules)
    return arch.layers * sum(candidate.lora_r * (i + o) for name, i, o in arch.linears if name in targets)



def resident_bytes(models: Iterable[ModelSpec], weight_bytes: int) -> int:
    """The weights and buffers of models held on the device beside the policy (a trainer's ModelInputs: online
    RL's reward model), each at `weight_bytes` per parameter."""
    total = 0
    for spec in models:
        arch = architecture(spec)
        total += arch.total * weight_bytes + arch.buffer_bytes
    return total
