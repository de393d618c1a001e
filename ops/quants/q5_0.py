"""Q5_0 (GGUF type 6): 32 values = f16 `d`, u32 `qh`, 16 bytes of nibbles; `y = d*(q - 16)`.

Element j's low 4 bits are nibbles as in Q4_0, its 5th bit is bit j of `qh`. The quantizer is ggml's
reference one (as gguf-py's): `d = v/-16` for the value v of largest magnitude, `q = trunc(x/d + 16.5)`.
"""
import torch

from . import QuantType
from ._blocks import bit_planes, f16_bytes, f16_field, le_bytes
from .q4_0 import inverse, nibbles, pack_nibbles, signed_max

BLOCK, BYTES = 32, 22
_BITS = torch.arange(32)


def codes(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    """The 5-bit codes (uint8 `[n, 32]`) of Q5_0/Q5_1 blocks whose `qh` is at byte `qh_at` (nibbles follow it)."""
    high = bit_planes(b[:, qh_at : qh_at + 4, None], list(range(8)), 1).reshape(-1, 32)  # bit j of qh: element j
    return nibbles(b[:, qh_at + 4 :]) | (high << 4)


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """5-bit codes `[n, 32]` -> `qh` and nibble bytes, uint8 `[n, 20]`."""
    q = q.to(torch.int64)
    qh = ((q >> 4) << _BITS.to(q.device)).sum(-1, keepdim=True)
    return torch.cat([le_bytes(qh, 4), pack_nibbles(q & 15)], -1)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 22]` -> float32 `[..., 32]`."""
    b = blocks.reshape(-1, BYTES)
    q = (codes(b, 2).to(torch.int32) - 16).to(torch.float32)
    return (f16_field(b, 0) * q).reshape(*blocks.shape[:-1], BLOCK)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float32 `[..., 32]` -> uint8 `[..., 22]` (bit-exact with gguf-py's quantizer)."""
    v = x.reshape(-1, BLOCK).to(torch.float32)
    d = signed_max(v) / -16
    q = torch.trunc(v * inverse(d) + 16.5).clamp(0, 31)
    return torch.cat([f16_bytes(d), pack_codes(q)], -1).reshape(*x.shape[:-1], BYTES)


QTYPE = QuantType("Q5_0", 6, BLOCK, BYTES, dequantize, quantize, error_bound=0.055)  # measured 0.0426
