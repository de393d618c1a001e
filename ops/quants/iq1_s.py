"""IQ1_S (GGUF type 19): 256 values = f16 `d`, `qs[32]`, u16 `qh[8]`; 8 sub-blocks of 32, chunks of 8.

Sub-block s: `dl = d*(2*((qh[s] >> 12) & 7) + 1)`, `delta = -1/8` if bit 15 of `qh[s]` is set else `+1/8`; its
chunk k is `dl * (grid[qs[4s + k] | ((qh[s] >> 3k) & 7) << 8] + delta)`. The grid is 2048 points of {-1, 0, 1}^8.
Quantizer: nearest grid point over a few scales, both deltas tried per sub-block (ops/quants/_codebook.py).
"""
import torch

from . import QuantType
from ._blocks import f16_bytes, f16_field, gguf_grid, le_bytes, u16_fields
from ._codebook import error_weights, fit, groups, in_chunks, nearest, super_scale

BLOCK, BYTES = 256, 50
GRID = gguf_grid("IQ1_S")
DELTA = 0.125
MULT = 1 + 2 * torch.arange(8, dtype=torch.float32)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 50]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    qh = u16_fields(b, 34, 8)
    dl = (f16_field(b, 0) * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)).reshape(-1, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, DELTA, -DELTA).reshape(-1, 8, 1, 1)
    high = (qh[..., None] >> (3 * torch.arange(4, device=b.device))) & 7
    grid = GRID.to(b.device)[b[:, 2:34].to(torch.int64) | (high.reshape(-1, 32) << 8)].reshape(-1, 8, 4, 8)
    return (dl * (grid + delta)).reshape(*blocks.shape[:-1], BLOCK)


def _quantize_blocks(v: torch.Tensor, imp: torch.Tensor | None) -> torch.Tensor:
    """float32 `[n, 256]` and importance `[n, 256]` or None -> uint8 `[n, 50]`."""
    g = v.reshape(-1, 8, 4, 8)
    w = error_weights(g, groups(imp, 8, 4, 8))
    grids = (GRID + DELTA, GRID - DELTA)
    (s_pos, e_pos), (s_neg, e_neg) = fit(g, grids[0], w), fit(g, grids[1], w)
    neg = e_neg < e_pos
    d, ls = super_scale(torch.where(neg, s_neg, s_pos), MULT)
    dl = d[:, None] * (1 + 2 * ls)
    idx = torch.where(neg[..., None], nearest(g, grids[1], dl, w), nearest(g, grids[0], dl, w))
    high = ((idx >> 8) << (3 * torch.arange(4))).sum(-1)
    qh = high | (ls << 12) | (neg.to(torch.int64) << 15)
    return torch.cat([f16_bytes(d), (idx.reshape(-1, 32) & 255).to(torch.uint8), le_bytes(qh, 2)], -1)


def quantize(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 50]` (deterministic; computed on the CPU).

    `weights` `[..., 256]`: an importance per value (an imatrix column), turned into llama.cpp's error weights.
    """
    return in_chunks(_quantize_blocks, x, BLOCK, BYTES, weights)


QTYPE = QuantType("IQ1_S", 19, BLOCK, BYTES, dequantize, quantize, error_bound=0.58)  # measured 0.446
