"""IQ3_S (GGUF type 21): 256 values = f16 `d`, `qs[64]`, `qh[8]`, `signs[32]`, `scales[4]`; 8 sub-blocks of 32.

Sub-block s: `db = d*(1 + 2*ls)`, `ls` nibble `s % 2` of `scales[s // 2]`. Its 4-value chunk c (of 64 in the
block) is `db * grid[qs[c] | ((qh[c // 8] >> (c % 8)) & 1) << 8]`; value i of the block is negated when bit
`i % 8` of `signs[i // 8]` is set. The grid is 512 points of {1, 3, ..., 15}^4. Quantizer: nearest grid point
over a few scales (ops/quants/_codebook.py).
"""
import torch

from . import QuantType
from ._blocks import bit_planes, f16_bytes, f16_field, gguf_grid, pack_planes
from ._codebook import codebook_quantize, groups, in_chunks
from .iq2_xs import sign_values

BLOCK, BYTES = 256, 110
GRID = gguf_grid("IQ3_S")
_BITS = torch.arange(8)
MULT = 1 + 2 * torch.arange(16, dtype=torch.float32)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 110]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    ls = torch.stack([b[:, 106:110] & 15, b[:, 106:110] >> 4], -1).flatten(1).to(torch.float32)
    db = (f16_field(b, 0) * (1 + 2 * ls)).reshape(-1, 8, 1, 1)
    high = bit_planes(b[:, 66:74, None], list(range(8)), 1).reshape(-1, 64)
    grid = GRID.to(b.device)[b[:, 2:66].to(torch.int64) | (high.to(torch.int64) << 8)].reshape(-1, 8, 8, 4)
    signs = sign_values(b[:, 74:106]).reshape(-1, 8, 8, 4)
    return (db * grid * signs).reshape(*blocks.shape[:-1], BLOCK)


def _quantize_blocks(v: torch.Tensor, imp: torch.Tensor | None) -> torch.Tensor:
    """float32 `[n, 256]` and importance `[n, 256]` or None -> uint8 `[n, 110]`."""
    g = v.reshape(-1, 8, 8, 4)
    d, ls, idx = codebook_quantize(g.abs(), GRID, MULT, lambda d, ls: d[:, None] * (1 + 2 * ls),
                                   groups(imp, 8, 8, 4))
    idx = idx.reshape(-1, 64)
    qh = pack_planes((idx >> 8).reshape(-1, 8, 8).transpose(1, 2), list(range(8)))
    signs = ((v.reshape(-1, 32, 8) < 0).to(torch.int64) << _BITS).sum(-1).to(torch.uint8)
    scales = pack_planes(ls.reshape(-1, 4, 2).transpose(1, 2), [0, 4])
    return torch.cat([f16_bytes(d), (idx & 255).to(torch.uint8), qh, signs, scales], -1)


def quantize(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 110]` (deterministic; computed on the CPU).

    `weights` `[..., 256]`: an importance per value (an imatrix column), turned into llama.cpp's error weights.
    """
    return in_chunks(_quantize_blocks, x, BLOCK, BYTES, weights)


QTYPE = QuantType("IQ3_S", 21, BLOCK, BYTES, dequantize, quantize, error_bound=0.17)  # measured 0.13
