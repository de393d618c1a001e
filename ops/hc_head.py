"""Hyper-connection head: collapse the S streams of the final HC state into one row before the LM head.

Contract: `hc_head(X [M, S, D], fn QTensor [S, S·D], scale [1], base [S], rms_eps, hc_eps) -> [M, D]`
with `w = σ(fn · RMS(flat X) · scale + base) + hc_eps` and `x = Σ_h w_h X_h`, summed in stream order
(docs/model.md §3.8). Row-wise; the sigmoid runs one row at a time for M <= SMALL_M (see
`ops.hc_pre.sigmoid_rows`), so batch-invariant.
"""
from __future__ import annotations

import torch

from ops.exp_poly import sigmoid_poly
from ops.hc_pre import sigmoid_rows
from ops.qmatmul import qmatmul
from ops.quants import QTensor
from ops.rms_norm import rms_norm

BATCH_INVARIANT = True


def hc_head(X: torch.Tensor, fn: QTensor, scale: torch.Tensor, base: torch.Tensor, rms_eps: float,
            hc_eps: float) -> torch.Tensor:
    """One row per HC state: the streams weighted by the head's sigmoid gates."""
    m = qmatmul(rms_norm(X.flatten(1), None, rms_eps), fn)
    w = sigmoid_rows(m * scale + base) + hc_eps
    x = w[:, 0, None] * X[:, 0]
    for h in range(1, X.shape[1]):
        x = x + w[:, h, None] * X[:, h]
    return x


def head_streams_poly(X: torch.Tensor, mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                      hc_eps: float) -> torch.Tensor:
    """The HC head after its product `mixes` [M, S]: gates sigmoid_poly(mixes·scale + base) + hc_eps and the streams
    they weight, summed in stream order (the bits of the cpu backend's C kernel, backends/cpu/glue.c)."""
    w = sigmoid_poly(mixes.to(torch.float32) * scale + base) + hc_eps
    x = w[:, 0, None] * X[:, 0]
    for h in range(1, X.shape[1]):
        x = x + w[:, h, None] * X[:, h]
    return x
