"""Q5_1 (GGUF type 7): 32 values = f16 `d`, f16 `m`, u32 `qh`, 16 bytes of nibbles (as Q5_0); `y = d*q + m`.

The quantizer is ggml's reference one (as gguf-py's): `d = (max - min)/31`, `q = trunc((x - min)/d + 0.5)`.
"""
import torch

from . import QuantType
from ._blocks import f16_bytes, f16_field
from .q4_0 import inverse
from .q5_0 import codes, pack_codes

BLOCK, BYTES = 32, 24


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 24]` -> float32 `[..., 32]`."""
    b = blocks.reshape(-1, BYTES)
    q = codes(b, 4).to(torch.float32)
    return (f16_field(b, 0) * q + f16_field(b, 2)).reshape(*blocks.shape[:-1], BLOCK)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float32 `[..., 32]` -> uint8 `[..., 24]` (bit-exact with gguf-py's quantizer)."""
    v = x.reshape(-1, BLOCK).to(torch.float32)
    lo, hi = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    d = (hi - lo) / 31
    q = torch.trunc((v - lo) * inverse(d) + 0.5).clamp(0, 31)
    return torch.cat([f16_bytes(d), f16_bytes(lo), pack_codes(q)], -1).reshape(*x.shape[:-1], BYTES)


QTYPE = QuantType("Q5_1", 7, BLOCK, BYTES, dequantize, quantize, error_bound=0.049)  # measured 0.0379
