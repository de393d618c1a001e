"""Multi-query attention over a gathered set of shared KV rows, with a per-head sink logit.

Contract: `sparse_attention(q [M, H, D], kv [N, D], rows [M, K] int64, sinks [H], scale) -> [M, H, D]`.
Query m attends to `kv[rows[m, k]]` for every `rows[m, k] >= 0` (−1 = no row); the same row is key and
value for all heads. `o_h = Σ_k e^{s_k−M}·kv_k / (e^{sink_h−M} + Σ_k e^{s_k−M})` with `s_k = scale·q_h·kv_k`
(model-spec §3.4 step 7).
Batch-invariant for M <= SMALL_M (`BATCH_INVARIANT`, the decode and speculative-verify regime): each
query is computed alone over exactly its listed rows, in listed order, so neither the other queries nor
−1 padding (e.g. to another query's longer row list) change its reductions. Larger M is processed in
blocks of 64 queries over the padded row lists, whose rounding may depend on the block.
"""
from __future__ import annotations

import torch

from ops.qmatmul import SMALL_M

BATCH_INVARIANT = True
QUERY_BLOCK = 64


def attend_one(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, sinks: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Output [H, D] of one query q [H, D] over the rows >= 0 of `rows` [K] (sink included)."""
    keys = kv[rows[rows >= 0]].to(torch.float32)                         # [n, D]
    s = (q @ keys.T) * scale                                            # [H, n]
    sink = sinks[:, None]
    m = torch.cat((s, sink), dim=1).amax(-1, keepdim=True)
    p = torch.exp(s - m)
    return (p @ keys) / (torch.exp(sink - m) + p.sum(-1, keepdim=True))


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, sinks: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention output of each query head over its listed rows plus the sink."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    sinks = sinks.to(torch.float32)
    if q.shape[0] <= SMALL_M:
        for m in range(q.shape[0]):
            out[m] = attend_one(q[m].to(torch.float32), kv, rows[m], sinks, scale)
        return out
    for start in range(0, q.shape[0], QUERY_BLOCK):
        qb, rb = q[start:start + QUERY_BLOCK].to(torch.float32), rows[start:start + QUERY_BLOCK]
        keys = kv[rb.clamp(min=0)].to(torch.float32)                       # [m, K, D]
        s = torch.einsum("mhd,mkd->mhk", qb, keys) * scale
        s = s.masked_fill((rb < 0)[:, None, :], float("-inf"))
        sink = sinks[None, :, None].expand(s.shape[0], -1, 1)
        m = torch.maximum(s.amax(-1, keepdim=True), sink)
        p = torch.exp(s - m)
        denom = torch.exp(sink - m) + p.sum(-1, keepdim=True)
        out[start:start + QUERY_BLOCK] = torch.einsum("mhk,mkd->mhd", p, keys) / denom
    return out
