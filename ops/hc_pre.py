"""Hyper-connection pre step: split the 24 control values, Sinkhorn the 4x4 mix, collapse the streams.

Contract: `hc_pre(X [M, S, D], mixes [M, 2S + S²], scale [3], base [2S + S²], iters, eps)
-> (x [M, D], post [M, S], comb [M, S, S])`, where `mixes = fn · RMS(flat X)` (docs/model.md §3.2):
`pre = σ(m[:S]·s0 + b) + eps`, `post = 2σ(m[S:2S]·s1 + b)`, `comb = sinkhorn(m[2S:]·s2 + b)` and
`x = Σ_h pre_h X_h` (summed in stream order). Row-wise, so batch-invariant; for M <= SMALL_M the
sigmoids run one row at a time (`sigmoid_rows`) because torch's vectorized and scalar-tail sigmoid
round differently, so a [M, S] sigmoid would depend on M.
"""
from __future__ import annotations

import torch

from ops.exp_poly import exp_poly, sigmoid_poly
from ops.qmatmul import SMALL_M

BATCH_INVARIANT = True


def sigmoid_rows(x: torch.Tensor) -> torch.Tensor:
    """Sigmoid computed as 1-row calls would compute it when x has <= SMALL_M rows (batch-invariant)."""
    if x.shape[0] > SMALL_M:
        return torch.sigmoid(x)
    return torch.cat([torch.sigmoid(row) for row in x.split(1)])


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, a column normalisation, then iters-1 rounds of row then column normalisation."""
    c = torch.softmax(logits, dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def hc_pre(X: torch.Tensor, mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sub-layer input, post weights and Sinkhorn combination matrix from the HC state `X`."""
    S = X.shape[1]
    pre = sigmoid_rows(mixes[:, :S] * scale[0] + base[:S]) + eps
    post = 2 * sigmoid_rows(mixes[:, S:2 * S] * scale[1] + base[S:2 * S])
    comb = sinkhorn((mixes[:, 2 * S:] * scale[2] + base[2 * S:]).reshape(-1, S, S), iters, eps)
    x = pre[:, 0, None] * X[:, 0]
    for h in range(1, S):
        x = x + pre[:, h, None] * X[:, h]
    return x, post, comb


def ordered_sum(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over `dim` (kept) added in index order, starting from 0."""
    total = torch.zeros_like(t.select(dim, 0))
    for i in range(t.shape[dim]):
        total = total + t.select(dim, i)
    return total.unsqueeze(dim)


def hc_pre_poly(X: torch.Tensor, mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_pre` with its sigmoids and softmax through ops.exp_poly and every sum in index order (the bits of the
    cpu backend's C kernel, backends/cpu/glue.c)."""
    S = X.shape[1]
    X, mixes = X.to(torch.float32), mixes.to(torch.float32)
    pre = sigmoid_poly(mixes[:, :S] * scale[0] + base[:S]) + eps
    post = 2 * sigmoid_poly(mixes[:, S:2 * S] * scale[1] + base[S:2 * S])
    z = (mixes[:, 2 * S:] * scale[2] + base[2 * S:]).reshape(-1, S, S)
    e = exp_poly(z - z.amax(-1, keepdim=True))
    c = e / ordered_sum(e, -1) + eps
    c = c / (ordered_sum(c, -2) + eps)
    for _ in range(iters - 1):
        c = c / (ordered_sum(c, -1) + eps)
        c = c / (ordered_sum(c, -2) + eps)
    x = pre[:, 0, None] * X[:, 0]
    for h in range(1, S):
        x = x + pre[:, h, None] * X[:, h]
    return x, post, c
