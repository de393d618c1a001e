"""Triton lightning indexer: `index_scores` and `indexer_topk`; contracts in `ops/index_scores.py` and
`ops/indexer_topk.py`.

index_scores: grid (key blocks of the whole row buffer, M). A program scores one query against BLOCK_N
keys: for each chunk of BLOCK_H heads it accumulates q·k over the head dim in BLOCK_D chunks with
`tl.dot` (tf32x3 on a GPU, about float32 accuracy), applies relu, weights by w and sums over heads.
Keys at or beyond the query's visible count (a device array built from the host tuple) are −inf; a
block wholly beyond it writes −inf without reading anything. The grid covers the whole buffer, so its
size does not depend on positions. Each (query, key block) program is independent of the other
queries, hence batch-invariant.

indexer_topk: two launches of one program per row.
1. select: each score becomes an order-preserving int32 key (−0.0 folded into +0.0). A radix select
   over 8 four-bit digits, most significant first, finds the k-th largest key T among the visible
   columns (each pass counts, per digit, the keys matching the digits chosen so far). A last pass
   keeps every key > T and, in index order, the first (k − #above) keys equal to T, so exact ties go
   to the lower index; it compacts them, as int64 composites `key << 32 | (2^32 − 1 − index)`, into
   a scratch row.
2. order: `tl.sort` of the scratch row, descending: by score, then lower index first; the index is
   recovered from the low 32 bits, and slots past min(k, visible) are −1.
Rows are independent, so the op is batch-invariant and its result exact (integers).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from backends.registry import register
from ds4.errors import BackendUnavailable

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SCORE_BLOCK_N = 32 if INTERPRET else 64   # with BLOCK_H <= 64, BLOCK_D <= 32: no spills (sm_90a, offline ptxas)
SELECT_BLOCK = 256 if INTERPRET else 1024
PAD = -(2 ** 63)  # composite of an empty slot: below every real one


def check_device(op: str, t: torch.Tensor) -> None:
    """Refuse CPU tensors outside the interpreter with the way out."""
    if t.device.type != "cuda" and not INTERPRET:
        raise BackendUnavailable(f"triton {op} needs CUDA tensors, got {t.device}; use DS4_OPS={op}:torch")


@triton.jit
def index_scores_kernel(q_ptr, k_ptr, w_ptr, vis_ptr, out_ptr, n, H, D,
                        stride_qm, stride_qh, stride_kn, stride_wm,
                        BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[m, keys of this block] = Σ_h w[m, h] · relu(q[m, h] · key), −inf at and beyond visible[m]."""
    m = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    vis = tl.load(vis_ptr + m)
    score = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    if tl.program_id(0) * BLOCK_N < vis:
        seen = cols < vis
        score = tl.zeros((BLOCK_N,), tl.float32)
        for h0 in range(0, H, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)
            dots = tl.zeros((BLOCK_H, BLOCK_N), tl.float32)
            for d0 in range(0, D, BLOCK_D):
                dims = d0 + tl.arange(0, BLOCK_D)
                q = tl.load(q_ptr + m * stride_qm + heads[:, None] * stride_qh + dims[None, :],
                            mask=(heads[:, None] < H) & (dims[None, :] < D), other=0.0).to(tl.float32)
                keys_t = tl.load(k_ptr + cols[None, :].to(tl.int64) * stride_kn + dims[:, None],
                                 mask=seen[None, :] & (dims[:, None] < D), other=0.0).to(tl.float32)
                dots = tl.dot(q, keys_t, dots, input_precision="tf32x3")
            w = tl.load(w_ptr + m * stride_wm + heads, mask=heads < H, other=0.0).to(tl.float32)
            score += tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
        score = tl.where(seen, score, float("-inf"))
    tl.store(out_ptr + m * n + cols, score, mask=cols < n)


@register("index_scores", "triton", batch_invariant=True)
def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, visible: tuple[int, ...]) -> torch.Tensor:
    """Scores [M, n] of the keys each query sees, −inf for the keys it does not."""
    M, H, D = q.shape
    if len(visible) != M:
        raise ValueError(f"index_scores: {len(visible)} visible counts for {M} queries")
    if keys.dim() != 2 or keys.shape[1] != D or tuple(w.shape) != (M, H):
        raise ValueError(f"index_scores: q {tuple(q.shape)}, keys {tuple(keys.shape)} and w {tuple(w.shape)} "
                         "do not fit [M, H, D], [n, D], [M, H]")
    check_device("index_scores", q)
    n = keys.shape[0]
    q = q if q.stride(2) == 1 else q.contiguous()
    keys = keys if keys.stride(1) == 1 else keys.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    out = torch.empty((M, n), dtype=torch.float32, device=q.device)
    if M == 0 or n == 0:
        return out
    if len(set(visible)) == 1:  # a fixed plan's counts: filled on the device, so a CUDA graph can record it
        vis = torch.full((M,), visible[0], dtype=torch.int32, device=q.device)
    else:
        vis = torch.tensor(visible, dtype=torch.int32).to(q.device, non_blocking=True)
    block_h = max(16, min(64, triton.next_power_of_2(H)))
    block_d = max(16, min(32, triton.next_power_of_2(D)))
    index_scores_kernel[(triton.cdiv(n, SCORE_BLOCK_N), M)](
        q, keys, w, vis, out, n, H, D, q.stride(0), q.stride(1), keys.stride(0), w.stride(0),
        BLOCK_N=SCORE_BLOCK_N, BLOCK_H=block_h, BLOCK_D=block_d)
    return out


@triton.jit
def ordered_key(x):
    """int32 key with the order of the float32 scores x (−0.0 and +0.0 equal)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def topk_select_kernel(s_ptr, vis_ptr, sel_ptr, n, k, stride_m, BLOCK: tl.constexpr, SLOTS: tl.constexpr):
    """sel[m, :min(k, visible)] = composites of row m's k best visible columns, in column order."""
    m = tl.program_id(0).to(tl.int64)
    row = s_ptr + m * stride_m
    vis = tl.minimum(tl.load(vis_ptr + m), n).to(tl.int32)
    want = tl.minimum(vis, k)
    offs = tl.arange(0, BLOCK)
    digits = tl.arange(0, 16)
    # radix select of the want-th largest key, on the unsigned image u = key ^ 0x80000000
    prefix = tl.zeros((), tl.int32)   # chosen high digits of u
    known = tl.zeros((), tl.int32)    # mask of the digits chosen so far
    remaining = want
    for p in tl.static_range(8):
        shift = 28 - 4 * p   # a compile-time constant
        counts = tl.zeros((16,), tl.int32)
        for start in range(0, vis, BLOCK):
            cols = start + offs
            x = tl.load(row + cols, mask=cols < vis, other=0.0)
            u = ordered_key(x) ^ (-2147483648)
            match = (cols < vis) & ((u & known) == prefix)
            digit = (u >> shift) & 15
            hit = match[:, None] & (digit[:, None] == digits[None, :])
            counts += tl.sum(hit.to(tl.int32), axis=0)
        above = tl.sum(tl.where(digits[None, :] >= digits[:, None], counts[None, :], 0), axis=1)  # Σ d' >= d
        chosen = tl.max(tl.where(above >= remaining, digits, 0), axis=0)
        remaining -= tl.sum(tl.where(digits > chosen, counts, 0), axis=0)
        prefix = prefix | (chosen << shift)
        known = known | (tl.full((), 15, tl.int32) << shift)  # wraps into the sign bit
    threshold = prefix ^ (-2147483648)   # the want-th largest key (signed image)
    # compaction: keys above the threshold, then the first `remaining` equal ones in column order
    taken = tl.zeros((), tl.int32)
    ties = tl.zeros((), tl.int32)
    for start in range(0, vis, BLOCK):
        cols = start + offs
        valid = (cols < vis) & (want > 0)
        key = ordered_key(tl.load(row + cols, mask=cols < vis, other=0.0))
        equal = valid & (key == threshold)
        tie_rank = ties + tl.cumsum(equal.to(tl.int32), axis=0) - 1
        keeps = ((valid & (key > threshold)) | (equal & (tie_rank < remaining))).to(tl.int32)
        keep = keeps != 0  # a comparison: the interpreter's store rejects the mask `|` builds
        slot = taken + tl.cumsum(keeps, axis=0) - 1
        composite = (key.to(tl.int64) << 32) | (4294967295 - cols.to(tl.int64))
        tl.store(sel_ptr + m * SLOTS + slot, composite, mask=keep)
        taken += tl.sum(keeps, axis=0)
        ties += tl.sum(equal.to(tl.int32), axis=0)


@triton.jit
def topk_order_kernel(sel_ptr, vis_ptr, out_ptr, n, k, SLOTS: tl.constexpr):
    """out[m] = row m's selected columns by descending score, lower index first on ties, −1 padded."""
    m = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, SLOTS)
    composite = tl.sort(tl.load(sel_ptr + m * SLOTS + slots), descending=True)
    index = 4294967295 - (composite & 4294967295)
    want = tl.minimum(tl.minimum(tl.load(vis_ptr + m), n), k)
    tl.store(out_ptr + m * k + slots, tl.where(slots < want, index, -1), mask=slots < k)


@register("indexer_topk", "triton", batch_invariant=True)
def indexer_topk(scores: torch.Tensor, k: int, visible: torch.Tensor) -> torch.Tensor:
    """Indices of the k best visible columns of each row (lower index first on ties), −1 padded."""
    if scores.dim() != 2 or visible.shape != (scores.shape[0],):
        raise ValueError(f"indexer_topk: scores {tuple(scores.shape)} and visible {tuple(visible.shape)} "
                         "must be [M, n] and [M]")
    check_device("indexer_topk", scores)
    M, n = scores.shape
    scores = scores.to(torch.float32)
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    out = torch.empty((M, k), dtype=torch.int64, device=scores.device)
    if M == 0 or k == 0:
        return out
    slots = max(16, triton.next_power_of_2(k))
    sel = torch.full((M, slots), PAD, dtype=torch.int64, device=scores.device)
    visible = visible.to(torch.int64)
    topk_select_kernel[(M,)](scores, visible, sel, n, k, scores.stride(0), BLOCK=SELECT_BLOCK, SLOTS=slots)
    topk_order_kernel[(M,)](sel, visible, out, n, k, SLOTS=slots)
    return out
