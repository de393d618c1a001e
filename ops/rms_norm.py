"""RMS normalisation over the last dim, with an optional learned weight.

Contract: `rms_norm(x [..., n], weight [n] | None, eps=1e-6) -> [..., n]` float32
= `x / sqrt(mean(x²) + eps) (* weight)`. Row-wise, so batch-invariant.
"""
from __future__ import annotations

import torch

BATCH_INVARIANT = True


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Normalise each row of the last dim to unit RMS, then scale by `weight` if given."""
    x = x.to(torch.float32)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight
