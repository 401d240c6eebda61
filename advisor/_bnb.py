"""How bitsandbytes stores a quantized base weight: the one place these sizes live (estimate and simulate).

Sources (bitsandbytes 0.4x, as transformers' `BitsAndBytesConfig` drives it):
- 4-bit (`load_in_4bit`, nf4 or fp4): `functional.quantize_4bit` packs two codes per uint8 byte and keeps one
  float32 absmax per block of 64 weights (`blocksize=64`, the default transformers leaves). With
  `bnb_4bit_use_double_quant` (TRL's `use_bnb_nested_quant`) the absmax are themselves quantized blockwise
  (`quantize_blockwise`, blocks of 256) to one uint8 each, plus one float32 absmax per 256 blocks.
- 8-bit (`load_in_8bit`): `Int8Params` holds the int8 weight (CB) and one float32 scale per output row (SCB).
"""

from __future__ import annotations

NF4_BLOCK = 64
NESTED_BLOCK = 256
_FP32 = 4


def weight_bytes(in_features: int, out_features: int, quantization: str, *, double_quant: bool = False) -> float:
    """Bytes one `in_features x out_features` linear weight occupies quantized (`quantization`: "4bit" or "8bit")."""
    n = in_features * out_features
    if quantization == "4bit":
        blocks = n / NF4_BLOCK
        absmax = blocks * (1 + _FP32 / NESTED_BLOCK) if double_quant else blocks * _FP32
        return n / 2 + absmax
    if quantization == "8bit":
        return n + out_features * _FP32
    raise ValueError(f"quantization={quantization!r}: not a bitsandbytes weight format (4bit, 8bit)")


def bits_per_weight(in_features: int, out_features: int, quantization: str, *, double_quant: bool = False) -> float:
    return 8 * weight_bytes(in_features, out_features, quantization, double_quant=double_quant) / (
        in_features * out_features)
