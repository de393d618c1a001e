"""IQ1_M (GGUF type 29): 256 values = `qs[32]`, `qh[16]`, u16 `sc[4]`; 16 sub-blocks of 16, chunks of 8.

`d` is the f16 whose 4-bit pieces are the top nibbles of `sc[0..3]` (lowest first). Sub-block j (16 values):
`dl = d*(2*((sc[j // 4] >> 3(j % 4)) & 7) + 1)`. Chunk c (8 values) uses nibble `c % 2` of `qh[c // 2]`: grid
index `qs[c] | (nibble & 7) << 8`, `delta = -1/8` if bit 3 of the nibble is set else `+1/8`; it is
`dl * (grid[index] + delta)`, grid as IQ1_S. Quantizer: nearest point of grid ± delta over a few scales
(ops/quants/_codebook.py).
"""
import torch

from . import QuantType
from ._blocks import f16_bytes, le_bytes, pack_planes, u16_fields
from ._codebook import codebook_quantize, groups, in_chunks
from .iq1_s import DELTA, GRID, MULT

BLOCK, BYTES = 256, 56
_POINTS = torch.cat([GRID + DELTA, GRID - DELTA])  # index p: grid point p % 2048, delta negative for p >= 2048


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 56]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    sc = u16_fields(b, 48, 4)
    d_bits = ((sc >> 12) << (4 * torch.arange(4, device=b.device))).sum(-1, keepdim=True)
    d = d_bits.to(torch.int16).view(torch.float16).to(torch.float32)
    ls = ((sc[..., None] >> (3 * torch.arange(4, device=b.device))) & 7).reshape(-1, 16)
    dl = (d * (2 * ls + 1).to(torch.float32)).reshape(-1, 16, 1, 1)
    nib = torch.stack([b[:, 32:48] & 15, b[:, 32:48] >> 4], -1).reshape(-1, 32).to(torch.int64)
    grid = GRID.to(b.device)[b[:, :32].to(torch.int64) | ((nib & 7) << 8)].reshape(-1, 16, 2, 8)
    delta = torch.where((nib & 8) == 0, DELTA, -DELTA).reshape(-1, 16, 2, 1)
    return (dl * (grid + delta)).reshape(*blocks.shape[:-1], BLOCK)


def _quantize_blocks(v: torch.Tensor, imp: torch.Tensor | None) -> torch.Tensor:
    """float32 `[n, 256]` and importance `[n, 256]` or None -> uint8 `[n, 56]`."""
    d, ls, p = codebook_quantize(v.reshape(-1, 16, 2, 8), _POINTS, MULT, lambda d, ls: d[:, None] * (1 + 2 * ls),
                                 groups(imp, 16, 2, 8))
    p = p.reshape(-1, 32)
    nib = ((p % 2048) >> 8) | ((p >= 2048).to(torch.int64) << 3)
    qh = pack_planes(nib.reshape(-1, 16, 2).transpose(1, 2), [0, 4])
    d_bits = f16_bytes(d).view(torch.int16).to(torch.int64) & 0xFFFF  # [n, 1]
    d_nibbles = (d_bits >> (4 * torch.arange(4))) & 15
    sc = (ls.reshape(-1, 4, 4) << (3 * torch.arange(4))).sum(-1) | (d_nibbles << 12)
    return torch.cat([(p % 256).to(torch.uint8), qh, le_bytes(sc, 2)], -1)


def quantize(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 56]` (deterministic; computed on the CPU).

    `weights` `[..., 256]`: an importance per value (an imatrix column), turned into llama.cpp's error weights.
    """
    return in_chunks(_quantize_blocks, x, BLOCK, BYTES, weights)


QTYPE = QuantType("IQ1_M", 29, BLOCK, BYTES, dequantize, quantize, error_bound=0.54)  # measured 0.412
