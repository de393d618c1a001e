"""IQ2_XS (GGUF type 17): 256 values = f16 `d`, u16 `qs[32]`, `scales[8]`; 32 chunks of 8.

Chunk c is `d*(0.5 + ls)/4 * grid[qs[c] & 511] * ksigns[qs[c] >> 9]`, `ls` being nibble `(c // 2) % 2` of
`scales[c // 4]` (one scale per 16 values); the signs are IQ2_XXS's 7-bit even-parity patterns and the grid
512 points of {8, 25, 43}^8. Quantizer: nearest grid point over a few scales (ops/quants/_codebook.py).
"""
import torch

from . import QuantType
from ._blocks import f16_bytes, f16_field, gguf_grid, le_bytes, pack_planes, u16_fields
from ._codebook import codebook_quantize, even_parity_signs, groups, in_chunks
from .iq2_xxs import KSIGNS

BLOCK, BYTES = 256, 74
GRID = gguf_grid("IQ2_XS")
_BITS = torch.arange(8)
MULT = (0.5 + torch.arange(16, dtype=torch.float32)) * 0.25


def sub_scales(d: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """f16 `d` `[n, 1]` and 4-bit scale pairs `[n, k]` -> `d*(0.5 + ls)/4` `[n, 2k]` (as gguf-py orders it)."""
    ls = torch.stack([packed & 15, packed >> 4], -1).flatten(1).to(torch.float32)
    return d * (0.5 + ls) * 0.25


def sign_values(signs: torch.Tensor) -> torch.Tensor:
    """Sign bytes `[...]` -> ±1 `[..., 8]` (bit i set: element i negative)."""
    return 1 - 2 * ((signs[..., None].to(torch.int64) >> _BITS.to(signs.device)) & 1).to(torch.float32)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 74]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    qs = u16_fields(b, 2, 32)
    db = sub_scales(f16_field(b, 0), b[:, 66:74]).reshape(-1, 16, 1, 1)
    grid = GRID.to(b.device)[qs & 511].reshape(-1, 16, 2, 8)
    signs = sign_values(KSIGNS.to(b.device)[qs >> 9]).reshape(-1, 16, 2, 8)
    return (db * grid * signs).reshape(*blocks.shape[:-1], BLOCK)


def _quantize_blocks(v: torch.Tensor, imp: torch.Tensor | None) -> torch.Tensor:
    """float32 `[n, 256]` and importance `[n, 256]` or None -> uint8 `[n, 74]`."""
    target, neg = even_parity_signs(v.reshape(-1, 32, 8))
    d, ls, idx = codebook_quantize(target.reshape(-1, 16, 2, 8), GRID, MULT,
                                   lambda d, ls: d[:, None] * (0.5 + ls) * 0.25, groups(imp, 16, 2, 8))
    sign_index = (neg[..., :7].to(torch.int64) << _BITS[:7]).sum(-1)
    qs = le_bytes(idx.reshape(-1, 32) | (sign_index << 9), 2)
    scales = pack_planes(ls.reshape(-1, 8, 2).transpose(1, 2), [0, 4])
    return torch.cat([f16_bytes(d), qs, scales], -1)


def quantize(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 74]` (deterministic; computed on the CPU).

    `weights` `[..., 256]`: an importance per value (an imatrix column), turned into llama.cpp's error weights.
    """
    return in_chunks(_quantize_blocks, x, BLOCK, BYTES, weights)


QTYPE = QuantType("IQ2_XS", 17, BLOCK, BYTES, dequantize, quantize, error_bound=0.37)  # measured 0.287
