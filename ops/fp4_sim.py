"""FP4 (E2M1) simulation of an indexer row: per 32-value block, a power-of-two scale and round to e2m1.

Contract: `fp4_sim(x [..., n], block=32) -> [..., n]` float32, n a multiple of `block`.
Per block: `s = 2^ceil(log2(max(amax, 6·2^-126) / 6))`, `x <- e2m1(clamp(x / s, ±6)) * s` on the grid
{0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even grid index (model-spec §3.6). Batch-invariant.
"""
from __future__ import annotations

import torch

BATCH_INVARIANT = True
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to the nearest E2M1 value (ties to the even grid index); |x| must be <= 6."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
    ax = x.abs()
    lo = (torch.bucketize(ax, grid, right=True) - 1).clamp(0, len(grid) - 1)
    hi = (lo + 1).clamp(max=len(grid) - 1)
    d_lo, d_hi = ax - grid[lo], grid[hi] - ax
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.copysign(torch.where(pick_hi, grid[hi], grid[lo]), x)


def fp4_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Quantize-dequantize `x` to e2m1 with one power-of-two scale per `block` values of the last dim."""
    shape = x.shape
    b = x.to(torch.float32).reshape(*shape[:-1], shape[-1] // block, block)
    amax = b.abs().amax(-1, keepdim=True).clamp(min=E2M1_MAX * 2.0**-126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E2M1_MAX)))
    return (round_e2m1((b / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale).reshape(shape)
