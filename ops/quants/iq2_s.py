"""IQ2_S (GGUF type 22): 256 values = f16 `d`, `qs[32]`, `signs[32]`, `qh[8]`, `scales[8]`; 32 chunks of 8.

Chunk c is `d*(0.5 + ls)/4 * grid[qs[c] | ((qh[c // 4] >> 2(c % 4)) & 3) << 8]`, element i negated when bit i
of `signs[c]` is set; `ls` as in IQ2_XS (one 4-bit scale per 16 values); the grid is 1024 points of
{8, 25, 43}^8. Quantizer: nearest grid point over a few scales (ops/quants/_codebook.py).
"""
import torch

from . import QuantType
from ._blocks import bit_planes, f16_bytes, f16_field, gguf_grid, pack_planes
from ._codebook import codebook_quantize, groups, in_chunks
from .iq2_xs import MULT, sign_values, sub_scales

BLOCK, BYTES = 256, 82
GRID = gguf_grid("IQ2_S")
_BITS = torch.arange(8)
_PAIRS = [0, 2, 4, 6]


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 82]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    high = bit_planes(b[:, 66:74, None], _PAIRS, 3).reshape(-1, 32)
    idx = b[:, 2:34].to(torch.int64) | (high.to(torch.int64) << 8)
    db = sub_scales(f16_field(b, 0), b[:, 74:82]).reshape(-1, 16, 1, 1)
    grid = GRID.to(b.device)[idx].reshape(-1, 16, 2, 8)
    signs = sign_values(b[:, 34:66]).reshape(-1, 16, 2, 8)
    return (db * grid * signs).reshape(*blocks.shape[:-1], BLOCK)


def _quantize_blocks(v: torch.Tensor, imp: torch.Tensor | None) -> torch.Tensor:
    """float32 `[n, 256]` and importance `[n, 256]` or None -> uint8 `[n, 82]`."""
    g = v.reshape(-1, 16, 2, 8)
    d, ls, idx = codebook_quantize(g.abs(), GRID, MULT, lambda d, ls: d[:, None] * (0.5 + ls) * 0.25,
                                   groups(imp, 16, 2, 8))
    idx = idx.reshape(-1, 32)
    signs = ((g < 0).to(torch.int64) << _BITS).sum(-1).reshape(-1, 32).to(torch.uint8)
    qh = pack_planes((idx >> 8).reshape(-1, 8, 4).transpose(1, 2), _PAIRS)
    scales = pack_planes(ls.reshape(-1, 8, 2).transpose(1, 2), [0, 4])
    return torch.cat([f16_bytes(d), (idx & 255).to(torch.uint8), signs, qh, scales], -1)


def quantize(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 82]` (deterministic; computed on the CPU).

    `weights` `[..., 256]`: an importance per value (an imatrix column), turned into llama.cpp's error weights.
    """
    return in_chunks(_quantize_blocks, x, BLOCK, BYTES, weights)


QTYPE = QuantType("IQ2_S", 22, BLOCK, BYTES, dequantize, quantize, error_bound=0.31)  # measured 0.24
