"""Q4_0 (GGUF type 2): 32 values = f16 `d` + 16 bytes of nibbles; `y = d*(q - 8)`.

Byte j holds element j in its low nibble and element j+16 in its high nibble. The quantizer is ggml's
reference one (as gguf-py's): `d = v/-8` for the value v of largest magnitude, `q = trunc(x/d + 8.5)`.
"""
import torch

from . import QuantType
from ._blocks import f16_bytes, f16_field

BLOCK, BYTES = 32, 18


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes `[n, 16]` -> 32 codes `[n, 32]`: the low nibbles, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], -1)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Inverse of `nibbles`: codes `[n, 32]` in 0..15 -> uint8 `[n, 16]`."""
    q = q.to(torch.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def signed_max(v: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude of each row, sign kept (the first one on ties), as `[n, 1]`."""
    return v.gather(-1, v.abs().argmax(-1, keepdim=True))


def inverse(d: torch.Tensor) -> torch.Tensor:
    """1/d, and 0 where d is 0."""
    return torch.where(d == 0, 0, 1 / torch.where(d == 0, 1, d))


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 18]` -> float32 `[..., 32]`."""
    b = blocks.reshape(-1, BYTES)
    q = nibbles(b[:, 2:]).to(torch.float32) - 8
    return (f16_field(b, 0) * q).reshape(*blocks.shape[:-1], BLOCK)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float32 `[..., 32]` -> uint8 `[..., 18]` (bit-exact with gguf-py's quantizer)."""
    v = x.reshape(-1, BLOCK).to(torch.float32)
    d = signed_max(v) / -8
    q = torch.trunc(v * inverse(d) + 8.5).clamp(0, 15)
    return torch.cat([f16_bytes(d), pack_nibbles(q)], -1).reshape(*x.shape[:-1], BYTES)


QTYPE = QuantType("Q4_0", 2, BLOCK, BYTES, dequantize, quantize, error_bound=0.11)  # measured 0.0862
