"""Hyper-connection steps on the CPU (contracts: ops/hc_pre.py, ops/hc_head.py): the sigmoids run on rows
padded to whole vectors (`rows.rowwise`) instead of one row at a time, an eager step's Sinkhorn rounds are
one call into the kernel library (backends/cpu/sinkhorn.c; a compiled step, which fuses them, and machines
where the library cannot be built keep in-place torch ops), the stream sums of hc_pre/hc_head and hc_post's
mix are one C call each (backends/cpu/glue.c: the references' sums in their order, so their bits; a compiled step and
machines without the library take one batched product each, `bmm`, the same kernel for every row whatever M is),
and the HC head uses the CPU qmatmul. Row-wise, so batch-invariant."""
from __future__ import annotations

import torch

from backends.cpu.qmatmul import qmatmul
from backends.cpu.rowops import rms_norm
from backends.cpu.rows import rowwise
from backends.registry import register
from ops.quants import QTensor

from . import glue, kernels


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, a column normalisation, then iters-1 rounds of row then column normalisation."""
    if kernels.built() and not torch.compiler.is_compiling():   # a compiled step fuses the torch ops instead
        return kernels.sinkhorn(torch.softmax(logits, dim=-1), iters, eps)
    c = torch.softmax(logits, dim=-1).add_(eps)
    c.div_(c.sum(-2, keepdim=True).add_(eps))
    for _ in range(iters - 1):
        c.div_(c.sum(-1, keepdim=True).add_(eps))
        c.div_(c.sum(-2, keepdim=True).add_(eps))
    return c


def streams(w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Σ_h w[:, h] · X[:, h]: one C call, or one [1, S] x [S, D] product per row (one op instead of 2S)."""
    if glue.ready():
        return glue.streams(w, X)
    return torch.bmm(w[:, None, :], X.to(torch.float32))[:, 0]


@register("hc_pre", "cpu", batch_invariant=True)
def hc_pre(X: torch.Tensor, mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sub-layer input, post weights and Sinkhorn combination matrix from the HC state `X`: one C call (the bits of
    ops.hc_pre.hc_pre_poly), else torch ops."""
    if glue.ready():
        return glue.hc_pre(X, mixes, scale, base, iters, eps)
    S = X.shape[1]
    pre = rowwise(torch.sigmoid, mixes[:, :S] * scale[0] + base[:S]) + eps
    post = 2 * rowwise(torch.sigmoid, mixes[:, S:2 * S] * scale[1] + base[S:2 * S])
    comb = sinkhorn((mixes[:, 2 * S:] * scale[2] + base[2 * S:]).reshape(-1, S, S), iters, eps)
    return streams(pre, X), post, comb


@register("hc_post", "cpu", batch_invariant=True)
def hc_post(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New HC state `post ⊗ y + combᵀ · X` per row: one C call or one batched product instead of 2S + 1 small ops."""
    if glue.ready():
        return glue.hc_post(X, y, post, comb)
    return torch.baddbmm(post[:, :, None] * y[:, None, :], comb.transpose(1, 2), X)


@register("hc_head", "cpu", batch_invariant=True)
def hc_head(X: torch.Tensor, fn: QTensor, scale: torch.Tensor, base: torch.Tensor, rms_eps: float,
            hc_eps: float) -> torch.Tensor:
    """One row per HC state: the streams weighted by the head's sigmoid gates (where the kernels serve the product, the
    calls below in one C call: `glue.hc_head`, their bits)."""
    out = glue.hc_head(X, fn, scale, base, rms_eps, hc_eps)
    if out is not None:
        return out
    m = qmatmul(rms_norm(X.flatten(1), None, rms_eps), fn)
    if glue.ready() and X.shape[1] <= 64:        # the gates and the stream sum in one C call (head_streams_poly)
        return glue.head_streams(X, m, scale, base, hc_eps)
    return streams(rowwise(torch.sigmoid, m * scale + base) + hc_eps, X)
