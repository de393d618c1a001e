"""rms_norm and rope_tail on the CPU (contracts: ops/rms_norm.py, ops/rope_tail.py) in fewer torch calls than
the references: a decode step makes ~45 norms and ~20 rotations of a few hundred values each, where every
torch call costs microseconds of dispatch. Same math, row-wise, so batch-invariant."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.registry import register


@register("rms_norm", "cpu", batch_invariant=True)
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(mean(x²) + eps) (* weight)` over the last dim, through torch's fused rms_norm."""
    return F.rms_norm(x.to(torch.float32), (x.shape[-1],), weight, eps)


@register("rope_tail", "cpu", batch_invariant=True)
def rope_tail(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2·len(freqs) dims of `x` in adjacent pairs, written into one copy of `x`."""
    r = 2 * freqs.shape[0]
    angle = torch.outer(positions.to(torch.float32), freqs).reshape(x.shape[0], *([1] * (x.dim() - 2)), r // 2)
    cos, sin = torch.cos(angle), torch.sin(angle)
    if inverse:
        sin = sin.neg_()
    out = x.to(torch.float32, copy=True)
    x0, x1 = x[..., -r::2].to(torch.float32), x[..., -r + 1::2].to(torch.float32)
    out[..., -r::2] = x0 * cos - x1 * sin
    out[..., -r + 1::2] = x0 * sin + x1 * cos
    return out
