"""IQ2_XXS (GGUF type 16): 256 values = f16 `d` + 8 groups of 32, each 4 grid indices (u8) and a u32 `w`.

In group g, chunk l (8 values) is `d*(0.5 + ls)/4 * grid[a_l] * signs`, with `ls = w >> 28` and the signs the
7-bit index `(w >> 7l) & 127` extended to 8 bits of even parity. The grid holds 256 points of {8, 25, 43}^8.
"""
import gguf
import torch

from . import QuantType
from ._blocks import f16_bytes, f16_field
from ._codebook import error_weights, groups, in_chunks

BLOCK, BYTES = 256, 66

# The 256x8 grid is data, taken from gguf-py (gguf.quants.IQ2_XXS) rather than retyped.
gguf.quants.IQ2_XXS.init_grid()
GRID = torch.from_numpy(gguf.quants.IQ2_XXS.grid.reshape(256, 8).copy())
_GRID_SQ = (GRID * GRID).sum(-1)
_BITS = torch.arange(8)
# ksigns: a 7-bit index with its parity bit on top, so every pattern has an even number of minus signs
KSIGNS = torch.arange(128) | ((torch.arange(128)[:, None] >> _BITS[:7]).sum(-1) & 1) << 7
_SCALE_FACTORS = torch.linspace(0.6, 1.2, 10)  # candidate group scales, as multiples of amax/43


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 66]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    grid, ksigns, bits = GRID.to(b.device), KSIGNS.to(b.device), _BITS.to(b.device)
    g = b[:, 2:].reshape(-1, 8, 8).to(torch.int64)
    w = g[:, :, 4] | (g[:, :, 5] << 8) | (g[:, :, 6] << 16) | (g[:, :, 7] << 24)
    db = (f16_field(b, 0) * (0.5 + (w >> 28).to(torch.float32)) * 0.25)[:, :, None, None]
    signs = ksigns[(w[:, :, None] >> (7 * torch.arange(4, device=b.device))) & 127]
    sign = 1 - 2 * ((signs[..., None] >> bits) & 1).to(torch.float32)
    return (db * grid[g[:, :, :4]] * sign).reshape(*blocks.shape[:-1], BLOCK)


def _nearest(v_dot_grid: torch.Tensor, scale: torch.Tensor, grid_sq: torch.Tensor) -> torch.Tensor:
    """Grid index minimizing |v - scale*grid|^2 per chunk; v_dot_grid `[..., 4, 256]` (<w*v, p> when weighted),
    scale `[...]`, grid_sq |p|^2 `[256]` (or <w, p*p> `[..., 4, 256]`)."""
    return (scale[..., None, None] * grid_sq - 2 * v_dot_grid).argmin(-1)


def _quantize_chunk(x: torch.Tensor, imp: torch.Tensor | None) -> torch.Tensor:
    """float32 `[n, 256]` and importance `[n, 256]` or None -> uint8 `[n, 66]`: even-parity signs, grid search of
    the group scales (minimising the importance-weighted error when given)."""
    v = x.reshape(-1, 8, 4, 8)
    mag = v.abs()
    neg = v < 0
    # odd number of minus signs: flip the sign of the smallest magnitude (it then costs 2|x| there)
    odd = (neg.sum(-1, keepdim=True) & 1).bool()
    flip = odd & (_BITS == mag.argmin(-1, keepdim=True))
    neg ^= flip
    target = torch.where(flip, -mag, mag)
    w = error_weights(target, groups(imp, 8, 4, 8))
    vg = (target if w is None else w * target) @ GRID.T  # [n, 8, 4, 256]
    grid_sq = _GRID_SQ if w is None else w @ (GRID * GRID).T

    best_err = torch.full(v.shape[:2], float("inf"))
    best_scale = torch.zeros(v.shape[:2])
    base = mag.amax((-1, -2)) / 43
    for f in _SCALE_FACTORS:
        idx = _nearest(vg, base * f, grid_sq)
        dot = vg.gather(-1, idx[..., None]).sum((-1, -2))
        sq = _GRID_SQ[idx].sum(-1) if w is None else grid_sq.gather(-1, idx[..., None]).sum((-1, -2)).clamp(min=1e-30)
        err = torch.where(dot > 0, -dot * dot / sq, 0)  # residual at the least-squares scale, minus |v|^2
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, (dot / sq).clamp(min=0), best_scale)

    d = (best_scale.amax(-1) * 4 / 15.5).to(torch.float16).to(torch.float32)
    ls = torch.round(best_scale * 4 / torch.where(d > 0, d, 1)[:, None] - 0.5).clamp(0, 15)
    db = d[:, None] * (0.5 + ls) * 0.25
    idx = _nearest(vg, db, grid_sq)

    sign_idx = ((neg[..., :7].to(torch.int64) << _BITS[:7]).sum(-1) << (7 * torch.arange(4))).sum(-1)
    w = sign_idx | (ls.to(torch.int64) << 28)
    w_bytes = (w[..., None] >> (8 * torch.arange(4))) & 255
    packed = torch.cat([idx, w_bytes], -1).to(torch.uint8).reshape(-1, 64)
    return torch.cat([f16_bytes(d), packed], -1)


def quantize(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 66]` (deterministic; computed on the CPU).

    `weights` `[..., 256]`: an importance per value (an imatrix column), turned into llama.cpp's error weights.
    """
    return in_chunks(_quantize_chunk, x, BLOCK, BYTES, weights)


QTYPE = QuantType("IQ2_XXS", 16, BLOCK, BYTES, dequantize, quantize, error_bound=0.43)  # measured 0.327
