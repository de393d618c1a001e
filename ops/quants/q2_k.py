"""Q2_K (GGUF type 10): 256 values = 16 bytes of 4-bit (scale, min) pairs, 64 bytes of 2-bit q, f16 `d`, `dmin`.

Sub-block j (16 values) has `y = d*(s[j] & 15)*q - dmin*(s[j] >> 4)`, q in 0..3. Element `128k + 32i + l`
is bits `2i..2i+1` of byte `32k + l`.
"""
import torch

from . import QuantType
from ._blocks import affine_codes, f16_bytes, f16_field, fit_affine, importance_weights, quantize_superblock

BLOCK, BYTES = 256, 84
_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 84]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    s = b[:, :16]
    scale = (f16_field(b, 80) * (s & 15).to(torch.float32))[:, :, None]
    low = (f16_field(b, 82) * (s >> 4).to(torch.float32))[:, :, None]
    q = ((b[:, 16:80].reshape(-1, 2, 1, 32) >> _SHIFTS.to(b.device)) & 3).reshape(-1, 16, 16).to(torch.float32)
    return (scale * q - low).reshape(*blocks.shape[:-1], BLOCK)


def quantize(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 84]`: affine fit per 16 (weighted: see `weights`), 4-bit scales.

    `weights` `[..., 256]`: an importance per value (an imatrix column), turned into llama.cpp's error weights.
    """
    v = x.reshape(-1, 16, 16).to(torch.float32)
    w = None if weights is None else importance_weights(v, weights.reshape(-1, 16, 16).to(torch.float32))
    d, dmin, sc, m = quantize_superblock(*fit_affine(v, 3, weights=w), 15)
    q = affine_codes(v, d[:, None] * sc, -dmin[:, None] * m, 3).to(torch.uint8).reshape(-1, 2, 4, 32)
    qs = (q << _SHIFTS.to(q.device)).sum(2, dtype=torch.uint8).reshape(-1, 64)
    scales = sc.to(torch.uint8) | (m.to(torch.uint8) << 4)
    return torch.cat([scales, qs, f16_bytes(d), f16_bytes(dmin)], -1).reshape(*x.shape[:-1], BYTES)


QTYPE = QuantType("Q2_K", 10, BLOCK, BYTES, dequantize, quantize, error_bound=0.35)  # measured 0.269
