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


LANES = 16   # rms_norm_lanes: the sum of squares is kept in this many partial sums


def rms_norm_lanes(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """`rms_norm` with its sum of squares in a fixed order: element k of a row added to partial sum k % LANES in
    order, then the partial sums in order (the bits of the cpu backend's C kernel, backends/cpu/glue.c)."""
    x = x.to(torch.float32)
    n = x.shape[-1]
    squares = torch.nn.functional.pad(x * x, (0, -n % LANES)).reshape(*x.shape[:-1], -1, LANES)
    acc = squares[..., 0, :]
    for r in range(1, squares.shape[-2]):
        acc = acc + squares[..., r, :]
    total = acc[..., 0]
    for lane in range(1, LANES):
        total = total + acc[..., lane]
    y = x * torch.rsqrt(total / n + eps)[..., None]
    return y if weight is None else y * weight
