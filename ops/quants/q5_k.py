"""Q5_K (GGUF type 13): 256 values = f16 `d`, f16 `dmin`, 12 bytes of 6-bit (scale, min) x 8 (as Q4_K),
`qh[32]`, `qs[128]`.

Sub-block j (32 values) has `y = d*sc[j]*q - dmin*m[j]`, q in 0..31. Low nibbles as Q4_K's; the 5th bit of
element `32j + l` is bit j of `qh[l]`. Quantizer: the least-squares affine fit of Q4_K with 31 levels,
weighted by an importance matrix when given (not llama.cpp's longer search).
"""
import torch

from . import QuantType
from ._blocks import (
    affine_codes,
    bit_planes,
    f16_bytes,
    f16_field,
    fit_affine,
    importance_weights,
    pack_planes,
    quantize_superblock,
)
from .q4_k import _pack_scales, _unpack_scales

BLOCK, BYTES = 256, 176
_EIGHT = list(range(8))


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 176]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    sc, m = _unpack_scales(b[:, 4:16])
    scale = (f16_field(b, 0) * sc.to(torch.float32))[:, :, None]
    low = (f16_field(b, 2) * m.to(torch.float32))[:, :, None]
    qs = b[:, 48:].reshape(-1, 4, 1, 32)
    ql = torch.cat([qs & 15, qs >> 4], 2).reshape(-1, 8, 32)
    qh = bit_planes(b[:, 16:48], _EIGHT, 1)
    q = (ql | (qh << 4)).to(torch.float32)
    return (scale * q - low).reshape(*blocks.shape[:-1], BLOCK)


def quantize(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 176]`: least-squares affine fit per 32 (weighted: see `weights`),
    6-bit sub-scales.

    `weights` `[..., 256]`: an importance per value (an imatrix column), turned into llama.cpp's error weights.
    """
    v = x.reshape(-1, 8, 32).to(torch.float32)
    w = None if weights is None else importance_weights(v, weights.reshape(-1, 8, 32).to(torch.float32))
    d, dmin, sc, m = quantize_superblock(*fit_affine(v, 31, weights=w), 63)
    q = affine_codes(v, d[:, None] * sc, -dmin[:, None] * m, 31).to(torch.uint8)
    low = (q & 15).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    qh = pack_planes(q >> 4, _EIGHT)
    scales = _pack_scales(sc.to(torch.uint8), m.to(torch.uint8))
    return torch.cat([f16_bytes(d), f16_bytes(dmin), scales, qh, qs], -1).reshape(*x.shape[:-1], BYTES)


QTYPE = QuantType("Q5_K", 13, BLOCK, BYTES, dequantize, quantize, error_bound=0.047)  # measured 0.036
