"""Sparse attention, indexer scores and the indexer's top-k on the CPU (contracts: ops/sparse_attention.py,
ops/index_scores.py, ops/indexer_topk.py), batch-invariant for M <= SMALL_M without a loop over queries; the top-k
ranks each row's visible columns in one C call (step.c).

Attention is one C call (backends/cpu/glue.c) where the kernel library is built, outside a compiled step: each
(query, head) pair over its padded list in a fixed float order (`ops.sparse_attention.sparse_attention_lanes`' bits),
the pairs split across the kernel pool when the call is large enough (same bits for any thread count and any M).
Otherwise attention gathers each query's listed rows into a padded list cut into chunks of VEC entries (masked
entries get weight exactly 0); the scores, the softmax numerators and the weighted sums are batched
products over (query, chunk) with fixed shapes, and the chunks are summed one after another. Another
query's longer list only appends all-zero chunks, and adding an exact zero changes nothing, so each query's
result is the 1-row call's bit for bit. The indexer scores every query against the keys any of them sees
with a per-query batched product (`bmm`: each entry alone); relu, the head weights, the heads added in order and
the mask to its own visible count are one C call (`glue.index_total`).

Prefill (M > SMALL_M) runs both on chunks of SMALL_M queries, the chunks taken in turn by the kernel pool's
threads (`rows.row_chunks`): each query's result is its 1-row call's bits, so the output is the same for any
thread count and equals a token-by-token decode's.
"""
from __future__ import annotations

import torch

from backends.cpu.rows import VEC, row_chunks
from backends.registry import register
from ops.indexer_topk import indexer_topk as reference_indexer_topk
from ops.qmatmul import SMALL_M
from ops.sparse_attention import AttnRows

from . import glue, kernels


def query_rows(rows: AttnRows, start: int, stop: int) -> AttnRows:
    """The lists of queries start..stop-1."""
    comp = None if rows.comp is None else rows.comp[start:stop]
    return AttnRows(rows.raw[start:stop], rows.n_raw[start:stop], comp, rows.n_comp[start:stop])


def listed_rows(rows: AttnRows) -> int:
    """The length of each query's padded list (`rows.padded()`'s width)."""
    return rows.raw.shape[1] + (0 if rows.comp is None else rows.comp.shape[1])


@register("sparse_attention", "cpu", batch_invariant=True)
def sparse_attention(q: torch.Tensor, kv: torch.Tensor, rows: AttnRows, sinks: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention output of each query head over its listed rows plus the sink."""
    M, H, D = q.shape
    if glue.ready():
        return glue.attention(q, kv, rows.raw, sinks, scale, rows.comp)
    if M > SMALL_M:
        return row_chunks(lambda a, b: sparse_attention(q[a:b], kv, query_rows(rows, a, b), sinks, scale), M,
                          torch.empty((M, H, D), dtype=torch.float32), 2 * H * D * listed_rows(rows))
    listed = rows.padded()
    n = listed.shape[1]
    if n % VEC:
        listed = torch.nn.functional.pad(listed, (0, VEC - n % VEC), value=-1)
    C = listed.shape[1] // VEC
    keys = kv[listed.clamp(min=0)].to(torch.float32).reshape(M * C, VEC, D)           # [M*C, VEC, D]
    qc = q.to(torch.float32)[:, None].expand(M, C, H, D).reshape(M * C, H, D)
    s = (torch.bmm(qc, keys.transpose(1, 2)) * scale).reshape(M, C, H, VEC)
    s = s.masked_fill((listed < 0).reshape(M, C, 1, VEC), float("-inf"))
    sink = sinks.to(torch.float32)[None, :, None]                                     # [1, H, 1]
    m = torch.maximum(s.amax((1, 3))[..., None], sink)                                # [M, H, 1]
    p = torch.exp(s - m[:, None])                                                     # [M, C, H, VEC]
    o = torch.bmm(p.reshape(M * C, H, VEC), keys).reshape(M, C, H, D)
    total, acc = p.sum(-1), o[:, 0]                                                   # [M, C, H]
    denom = total[:, 0]
    for c in range(1, C):
        acc, denom = acc + o[:, c], denom + total[:, c]
    return acc / (torch.exp(sink - m) + denom[..., None])


@register("index_scores", "cpu", batch_invariant=True)
def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, visible: tuple[int, ...]) -> torch.Tensor:
    """Scores [M, n] of the keys each query sees, −inf for the keys it does not."""
    M = q.shape[0]
    if len(visible) != M:
        raise ValueError(f"index_scores: {len(visible)} visible counts for {M} queries")
    if M > SMALL_M:
        return row_chunks(lambda a, b: index_scores(q[a:b], keys, w[a:b], visible[a:b]), M,
                          torch.empty((M, keys.shape[0]), dtype=torch.float32), q.shape[1] * q.shape[2] * max(visible))
    n = max(visible)
    if n == 0:
        return torch.full((M, keys.shape[0]), float("-inf"))
    width = n + -n % VEC                      # whole chunks of keys, so the product's shape varies less
    k = keys[:width].to(torch.float32)
    if k.shape[0] < width:
        k = torch.constant_pad_nd(k, (0, 0, 0, width - k.shape[0]))      # F.pad's kernel without its Python
    s = torch.bmm(q.to(torch.float32), k.T.expand(M, -1, -1))      # [M, Hi, width]
    if glue.ready():        # relu, the head weights, the heads added in order and the mask, in one C call
        return glue.index_total(s, w, visible, keys.shape[0])
    s = s[..., :n].relu() * w[:, :, None]                     # [M, Hi, n]
    total = s[:, 0]
    for h in range(1, s.shape[1]):
        total = total + s[:, h]
    scores = torch.full((M, keys.shape[0]), float("-inf"))
    if min(visible) == n:                   # every query sees all n keys (a decode step): nothing to mask
        scores[:, :n] = total
        return scores
    seen = torch.arange(n)[None, :] < torch.tensor(visible)[:, None]
    scores[:, :n] = torch.where(seen, total, float("-inf"))
    return scores


@register("indexer_topk", "cpu", batch_invariant=True)
def indexer_topk(scores: torch.Tensor, k: int, visible: torch.Tensor) -> torch.Tensor:
    """The k best visible columns of each row (lower index first on ties), -1 padded: one C call ranking each row's
    visible columns (the reference's mask, stable sort and padding are ~10 torch calls)."""
    if glue.ready() and scores.dim() == 2 and visible.shape == scores.shape[:1] and k >= 0:
        return kernels.indexer_topk(scores, k, visible)
    return reference_indexer_topk(scores, k, visible)
