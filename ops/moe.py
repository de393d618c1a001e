"""Routed mixture of experts: sqrt-softplus router, bias-only or hash selection, clamped SwiGLU experts.

Contract: `moe(x [M, D], router QTensor [E, D], bias [E] | None, hash_experts [M, k] int64 | None,
gate QTensor [E, I, D], up QTensor [E, I, D], down QTensor [E, D, I], top_k, route_scale, normalize,
clamp, ops) -> [M, D]` float32 (model-spec §3.7 steps 2-5).
- `p = sqrt(softplus(router·x))`; experts = `hash_experts` (hash layers) or the top_k of `p + bias`
  (bias only selects; exact ties go to the lower expert id).
- weights `w = p_S / max(Σ p_S, 6.1035e-5) · route_scale` (no division when `normalize` is False).
- each expert adds `down · (silu(min(g, clamp)) · clamp(u, ±clamp) · w)` with `g = gate·x`, `u = up·x`.
Matmuls go through `ops.qmatmul` on per-expert views of the stored blocks (nothing is dequantized
whole).
Batch-invariant for M <= SMALL_M (`BATCH_INVARIANT`, the decode and speculative-verify regime): such
calls run each row as its own 1-row call, so neither the rows routed to the same expert nor the length
of elementwise ops (torch's vectorized and scalar-tail softplus/silu round differently) depend on the
other rows. Larger M groups each expert's rows into one matmul, whose rounding may depend on M.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.qmatmul import SMALL_M
from ops.quants import QTensor

BATCH_INVARIANT = True


def expert(w: QTensor, e: int) -> QTensor:
    """Zero-copy view of expert `e` of a stacked `[E, out, in]` weight."""
    return QTensor(w.qtype, tuple(w.shape[1:]), w.data[e], f"{w.name}[{e}]")


def select_experts(p: torch.Tensor, bias: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """Top-k experts of `p + bias` per row, lower id first on exact ties."""
    score = p if bias is None else p + bias
    return torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :top_k]


def moe(x: torch.Tensor, router: QTensor, bias: torch.Tensor | None, hash_experts: torch.Tensor | None,
        gate: QTensor, up: QTensor, down: QTensor, top_k: int, route_scale: float, normalize: bool,
        clamp: float, ops) -> torch.Tensor:
    """Routed-expert output of each row of `x` (shared expert not included)."""
    if 1 < x.shape[0] <= SMALL_M:
        return torch.cat([moe(x[r:r + 1], router, bias, None if hash_experts is None else hash_experts[r:r + 1],
                              gate, up, down, top_k, route_scale, normalize, clamp, ops)
                          for r in range(x.shape[0])])
    p = torch.sqrt(F.softplus(ops.qmatmul(x, router)))
    chosen = hash_experts if hash_experts is not None else select_experts(p, bias, top_k)
    w = p.gather(1, chosen)
    if normalize:
        w = w / w.sum(-1, keepdim=True).clamp(min=6.1035e-5)
    w = w * route_scale
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(chosen).tolist():
        rows, slots = torch.nonzero(chosen == e, as_tuple=True)
        xe = x[rows]
        g = ops.qmatmul(xe, expert(gate, e)).clamp(max=clamp)
        u = ops.qmatmul(xe, expert(up, e)).clamp(-clamp, clamp)
        h = F.silu(g) * u * w[rows, slots, None]
        out.index_add_(0, rows, ops.qmatmul(h, expert(down, e)))
    return out
