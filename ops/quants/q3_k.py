"""Q3_K (GGUF type 11): 256 values = `hmask[32]`, `qs[64]` (2-bit lows), 12 bytes of 6-bit scales x 16, f16 `d`.

Sub-block j (16 values) has `y = d*(s[j] - 32)*(q - 4*(1 - h))` with q in 0..3 and h the high-mask bit.
Element `128c + 32s + l` has q in bits 2s of `qs[32c + l]`; element `32b + l` has h in bit b of `hmask[l]`.
Scale j: low 4 bits in nibble `j // 8` of byte `j % 8`, high 2 bits in bits `2(j // 4)` of byte `8 + j % 4`.
Quantizer: round to nearest with the sub-block scale set by its largest magnitude, or with an importance
matrix the best of 19 scales around it (a short form of llama.cpp's search).
"""
import torch

from . import QuantType
from ._blocks import bit_planes, f16_bytes, f16_field, importance_weights, pack_planes
from .q6_k import symmetric_scales

BLOCK, BYTES = 256, 110
_PAIRS = [0, 2, 4, 6]


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 110]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    low = bit_planes(b[:, 96:104], [0, 4], 15).reshape(-1, 16)
    high = bit_planes(b[:, 104:108], _PAIRS, 3).reshape(-1, 16)
    scale = (f16_field(b, 108) * ((low | (high << 4)).to(torch.int32) - 32).to(torch.float32))[:, :, None]
    ql = bit_planes(b[:, 32:96].reshape(-1, 2, 32), _PAIRS, 3).reshape(-1, 256)
    h = bit_planes(b[:, :32], list(range(8)), 1).reshape(-1, 256)
    q = (ql.to(torch.int32) - 4 * (1 - h.to(torch.int32))).to(torch.float32).reshape(-1, 16, 16)
    return (scale * q).reshape(*blocks.shape[:-1], BLOCK)


def quantize(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 110]`: per-16 scales from the largest magnitude, round to nearest.

    `weights` `[..., 256]`: an importance per value (an imatrix column); each 16's scale is then the best of
    a few for llama.cpp's error weights (`q6_k.weighted_scale`).
    """
    v = x.reshape(-1, 16, 16).to(torch.float32)
    w = None if weights is None else importance_weights(v, weights.reshape(-1, 16, 16).to(torch.float32))
    d, sc, q = symmetric_scales(v, -4, 32, w)
    q = (q + 4).to(torch.int64).reshape(-1, 256)
    hmask = pack_planes((q >> 2).reshape(-1, 8, 32), list(range(8)))
    qs = pack_planes((q & 3).reshape(-1, 2, 4, 32), _PAIRS).reshape(-1, 64)
    s = (sc + 32).to(torch.int64)
    lows = pack_planes((s & 15).reshape(-1, 2, 8), [0, 4])
    highs = pack_planes((s >> 4).reshape(-1, 4, 4), _PAIRS)
    return torch.cat([hmask, qs, lows, highs, f16_bytes(d)], -1).reshape(*x.shape[:-1], BYTES)


QTYPE = QuantType("Q3_K", 11, BLOCK, BYTES, dequantize, quantize, error_bound=0.2)  # measured 0.155
