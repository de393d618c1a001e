"""IQ3_XXS (GGUF type 18): 256 values = f16 `d`, `qs[64]` (grid indices), u32 `aux[8]`; 8 sub-blocks of 32.

Sub-block s: `db = d*(0.5 + (aux[s] >> 28))/2`; its 4-value chunk j is `db * grid[qs[8s + j]]`, and its 8-value
group k takes the even-parity signs `ksigns[(aux[s] >> 7k) & 127]` (as IQ2_XXS). The grid is 256 points of
{4, 12, ..., 62}^4. Quantizer: nearest grid point over a few scales (ops/quants/_codebook.py).
"""
import torch

from . import QuantType
from ._blocks import f16_bytes, f16_field, gguf_grid, le_bytes, u32_fields
from ._codebook import codebook_quantize, even_parity_signs, groups, in_chunks
from .iq2_xs import sign_values
from .iq2_xxs import KSIGNS

BLOCK, BYTES = 256, 98
GRID = gguf_grid("IQ3_XXS")
_BITS = torch.arange(8)
MULT = (0.5 + torch.arange(16, dtype=torch.float32)) * 0.5


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 98]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    aux = u32_fields(b, 66, 8)
    db = (f16_field(b, 0) * (0.5 + (aux >> 28).to(torch.float32)) * 0.5).reshape(-1, 8, 1, 1)
    signs = KSIGNS.to(b.device)[(aux[..., None] >> (7 * torch.arange(4, device=b.device))) & 127]
    grid = GRID.to(b.device)[b[:, 2:66].to(torch.int64)].reshape(-1, 8, 4, 8)
    return (db * grid * sign_values(signs)).reshape(*blocks.shape[:-1], BLOCK)


def _quantize_blocks(v: torch.Tensor, imp: torch.Tensor | None) -> torch.Tensor:
    """float32 `[n, 256]` and importance `[n, 256]` or None -> uint8 `[n, 98]`."""
    target, neg = even_parity_signs(v.reshape(-1, 8, 4, 8))
    d, ls, idx = codebook_quantize(target.reshape(-1, 8, 8, 4), GRID, MULT,
                                   lambda d, ls: d[:, None] * (0.5 + ls) * 0.5, groups(imp, 8, 8, 4))
    sign_index = (neg[..., :7].to(torch.int64) << _BITS[:7]).sum(-1)
    aux = (sign_index << (7 * torch.arange(4))).sum(-1) | (ls << 28)
    return torch.cat([f16_bytes(d), idx.reshape(-1, 64).to(torch.uint8), le_bytes(aux, 4)], -1)


def quantize(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 98]` (deterministic; computed on the CPU).

    `weights` `[..., 256]`: an importance per value (an imatrix column), turned into llama.cpp's error weights.
    """
    return in_chunks(_quantize_blocks, x, BLOCK, BYTES, weights)


QTYPE = QuantType("IQ3_XXS", 18, BLOCK, BYTES, dequantize, quantize, error_bound=0.23)  # measured 0.179
