"""Compressor pooling: a per-channel softmax over candidate tokens weights their kv values.

Contract: `compress(kv [B, n, d], score [B, n, d]) -> [B, d]` float32 with
`out[b, j] = Σ_t softmax_t(score[b, :, j])·kv[b, t, j]` (model-spec §3.5). Absent candidates carry
score −inf (each channel needs one finite score). Row-wise, so batch-invariant.
"""
from __future__ import annotations

import torch

BATCH_INVARIANT = True


def compress(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Pool `n` candidate rows into one row per batch entry."""
    return (torch.softmax(score.to(torch.float32), dim=1) * kv).sum(1)
