"""Multi-query attention over gathered shared KV rows (a raw window part and a compressed part), with a
per-head sink logit.

Contract: `sparse_attention(q [M, H, D], kv [N, D], rows: AttnRows, sinks [H], scale) -> [M, H, D]`.
Query m attends to the entries of `rows.raw[m, :rows.n_raw[m]]` then of `rows.comp[m, :rows.n_comp[m]]`
that are not −1, in that order; every entry past the counts is −1 too (a fixed-capacity plan, used
by compiled steps, sets the counts to the full widths and marks unused entries −1). The same row is
key and value for all heads: `o_h = Σ_k e^{s_k−M}·kv_k / (e^{sink_h−M} + Σ_k e^{s_k−M})` with
`s_k = scale·q_h·kv_k` (docs/model.md §3.4 step 7). The counts are planned on the host (they depend
only on positions, the window and the indexer's k), so no implementation reads the index arrays back.
Batch-invariant for M <= SMALL_M (`BATCH_INVARIANT`, the decode and speculative-verify regime): each
query is computed alone over its listed rows (−1 entries weigh exactly 0), so neither the other
queries nor the −1 padding change its reductions. Larger M is processed in blocks of 64 queries over
the padded lists, whose rounding may depend on the block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.exp_poly import exp_poly
from ops.qmatmul import SMALL_M

BATCH_INVARIANT = True
QUERY_BLOCK = 64


@dataclass(frozen=True)
class AttnRows:
    """The KV rows each query attends to: raw window rows, then compressed rows (−1 = none)."""

    raw: torch.Tensor              # [M, window] int64
    n_raw: tuple[int, ...]         # valid leading entries of each row of `raw`
    comp: torch.Tensor | None = None   # [M, K] int64, or None for a layer without compressed rows
    n_comp: tuple[int, ...] = ()   # valid leading entries of each row of `comp`

    def padded(self) -> torch.Tensor:
        """All rows of each query as one [M, window + K] array (−1 = none)."""
        return self.raw if self.comp is None else torch.cat((self.raw, self.comp), dim=1)


def attend_one(q: torch.Tensor, keys: torch.Tensor, sinks: torch.Tensor, scale: float,
               unused: torch.Tensor) -> torch.Tensor:
    """Output [H, D] of one query q [H, D] over its rows `keys` [n, D] (sink included; rows flagged in
    `unused` [n] weigh exactly 0)."""
    s = ((q @ keys.T) * scale).masked_fill(unused, float("-inf"))     # [H, n]
    sink = sinks[:, None]
    m = torch.cat((s, sink), dim=1).amax(-1, keepdim=True)
    p = torch.exp(s - m)
    return (p @ keys) / (torch.exp(sink - m) + p.sum(-1, keepdim=True))


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, rows: AttnRows, sinks: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention output of each query head over its listed rows plus the sink."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    sinks = sinks.to(torch.float32)
    if q.shape[0] <= SMALL_M:
        for m in range(q.shape[0]):
            listed = rows.raw[m, :rows.n_raw[m]]
            if rows.comp is not None:
                listed = torch.cat((listed, rows.comp[m, :rows.n_comp[m]]))
            out[m] = attend_one(q[m].to(torch.float32), kv[listed.clamp(min=0)].to(torch.float32), sinks, scale,
                                listed < 0)
        return out
    padded = rows.padded()
    for start in range(0, q.shape[0], QUERY_BLOCK):
        qb, rb = q[start:start + QUERY_BLOCK].to(torch.float32), padded[start:start + QUERY_BLOCK]
        keys = kv[rb.clamp(min=0)].to(torch.float32)                       # [m, K, D]
        s = torch.einsum("mhd,mkd->mhk", qb, keys) * scale
        s = s.masked_fill((rb < 0)[:, None, :], float("-inf"))
        sink = sinks[None, :, None].expand(s.shape[0], -1, 1)
        m = torch.maximum(s.amax(-1, keepdim=True), sink)
        p = torch.exp(s - m)
        denom = torch.exp(sink - m) + p.sum(-1, keepdim=True)
        out[start:start + QUERY_BLOCK] = torch.einsum("mhk,mkd->mhd", p, keys) / denom
    return out


LANES = 16          # sparse_attention_lanes: the partial sums of a dot product


def dot_lanes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_k a[..., k]·b[..., k] (broadcast) with element k added to partial sum k % LANES in order, then the partial
    sums in order."""
    products = a * b
    n = products.shape[-1]
    products = torch.nn.functional.pad(products, (0, -n % LANES)).reshape(*products.shape[:-1], -1, LANES)
    acc = torch.zeros(products.shape[:-2] + (LANES,))
    for r in range(products.shape[-2]):
        acc = acc + products[..., r, :]
    total = acc[..., 0]
    for lane in range(1, LANES):
        total = total + acc[..., lane]
    return total


def sparse_attention_lanes(q: torch.Tensor, kv: torch.Tensor, rows: AttnRows, sinks: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """`sparse_attention` in a fixed float order (the bits of the cpu backend's C kernel, backends/cpu/glue.c): per
    query and head over its padded list, scores `dot_lanes(q, row)·scale`, weights `exp_poly(s − m)`, and the
    weighted rows and the weights summed in list order; −1 entries weigh exactly 0."""
    q, kv, sinks = q.to(torch.float32), kv.to(torch.float32), sinks.to(torch.float32)
    listed = rows.padded()
    out = torch.empty(q.shape, dtype=torch.float32)
    for m in range(q.shape[0]):
        keys = kv[listed[m].clamp(min=0)]                                        # [L, D]
        s = dot_lanes(q[m][:, None, :], keys[None]) * scale                       # [H, L]
        s = s.masked_fill(listed[m] < 0, float("-inf"))
        top = torch.maximum(s.amax(-1), sinks) if s.shape[-1] else sinks
        p = exp_poly(s - top[:, None])
        o, total = torch.zeros(q.shape[1:]), torch.zeros(q.shape[1])
        for k in range(p.shape[-1]):
            total = total + p[:, k]
            o = o + p[:, k, None] * keys[k]
        out[m] = o / (exp_poly(sinks - top) + total)[:, None]
    return out
