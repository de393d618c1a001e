"""Triton routed experts (`moe`) and shared expert (`shared_expert`); contracts in `ops/moe.py` and
`ops/shared_expert.py`.

Routing, one program per row (`route_kernel`): p = sqrt(softplus(router·x)) (the router product is the
batch-invariant Triton `qmatmul`), then the top_k of p + bias picked one at a time as the maximum with
the lowest expert id (the reference's stable sort), or the row's `tid2eid[id]` on hash layers. The
weights p_S are normalized and scaled as in the reference, and the chosen experts are written in
increasing id order, the order in which their outputs are summed.

Experts, as stored (uint8 stacks [E, rows, row_bytes]; an expert is its byte offset, read on the
device: no per-expert loop on the host, no read-back):
- decode and verify (M <= 16): `expert_swiglu_kernel`, grid (I tiles, M·top_k), computes for one
  (row, chosen expert) pair g = gate_e·x and u = up_e·x from the same activation loads, then
  h = silu(min(g, clamp)) · clamp(u, ±clamp) · weight; `expert_down_kernel`, grid (D tiles, M), adds
  down_e·h over the row's experts in increasing id order. Each program reads one row only, with a K
  order fixed by the tile constants (never by M): row r of any call with M <= 16 equals its 1-row call
  bit for bit. A row-expert pair is a GEMV (dequantized tile times the activation, summed along K);
  rows routed to the same expert read its weights again (from L2 on a GPU).
- prefill (M > 16): the M·top_k (row, expert) pairs are sorted by expert on the device, each expert's
  pairs cut into tiles of BLOCK_M; the grid's size is the host-known bound M·top_k // BLOCK_M +
  min(E, M·top_k) and each program finds its expert and pairs from the device offsets (surplus programs
  do nothing). A program gathers its rows of x and runs `tl.dot` GEMM tiles (tf32x3) over the expert's
  weights, so each expert's weights are read once per tile of rows; the down products land per pair
  and are summed per row in increasing expert id order.
`shared_expert` is the same pair of kernels with one expert of weight 1 for every row (clamp = inf
when None).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from backends.registry import register
from backends.triton.qmatmul import accumulate_w_xt
from backends.triton.qmatmul import qmatmul as triton_qmatmul
from backends.triton.quants import SUPPORTED, dequant, tables
from ds4.errors import BackendUnavailable
from ops.moe import Experts
from ops.qmatmul import SMALL_M
from ops.quants import QTensor

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Not timed on a GPU yet (none lent): chosen so that ptxas (sm_90a, Triton 3.9, compiled offline) reports
# no spills for IQ2_XXS, Q2_K, Q4_K and Q8_0 stacks. The interpreter's smaller tiles exercise partial tiles.
GEMV = {"BLOCK_N": 32 if INTERPRET else 8, "BLOCK_K": 64 if INTERPRET else 256, "num_warps": 4}
GEMM = {"BLOCK_M": 16 if INTERPRET else 64, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 8}


@triton.jit
def log1p(u):
    """log(1 + u) for u >= 0, accurate for tiny u (Goldberg's correction; no libdevice)."""
    v = 1.0 + u
    exact = v == 1.0
    return tl.where(exact, u, tl.log(v) * (u / tl.where(exact, 1.0, v - 1.0)))


@triton.jit(do_not_specialize=["route_scale"])
def route_kernel(logit_ptr, bias_ptr, tid_ptr, ids_ptr, chosen_ptr, weight_ptr, E, route_scale,
                 TOP_K: tl.constexpr, HASH: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    """chosen[m] (increasing expert id) and weight[m] of row m from its router logits [E]."""
    m = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    logit = tl.load(logit_ptr + m * E + experts, mask=experts < E, other=0.0)
    p = tl.sqrt_rn(tl.where(logit > 20.0, logit, log1p(tl.exp(tl.minimum(logit, 20.0)))))  # torch softplus
    score = p
    if HAS_BIAS:
        score = p + tl.load(bias_ptr + experts, mask=experts < E, other=0.0).to(tl.float32)
    score = tl.where(experts < E, score, float("-inf"))
    slots = tl.arange(0, BLOCK_T)
    chosen = tl.full((BLOCK_T,), 2147483647, tl.int32)
    weight = tl.zeros((BLOCK_T,), tl.float32)
    for j in tl.static_range(TOP_K):
        if HASH:
            token = tl.load(ids_ptr + m)
            e = tl.load(tid_ptr + token * TOP_K + j).to(tl.int32)
        else:
            best = tl.max(score, axis=0)
            e = tl.min(tl.where(score == best, experts, BLOCK_E), axis=0).to(tl.int32)
            score = tl.where(experts == e, float("-inf"), score)
        chosen = tl.where(slots == j, e, chosen)
        weight = tl.where(slots == j, tl.sum(tl.where(experts == e, p, 0.0), axis=0), weight)
    if NORMALIZE:
        weight = weight / tl.maximum(tl.sum(weight, axis=0), 6.1035e-5)
    weight = weight * route_scale
    # slot of each pick in increasing expert id order (earlier pick first among equal ids)
    before = (chosen[None, :] < chosen[:, None]) | ((chosen[None, :] == chosen[:, None])
                                                    & (slots[None, :] < slots[:, None]))
    rank = tl.sum(before.to(tl.int32), axis=1)
    keep = slots < TOP_K
    tl.store(chosen_ptr + m * TOP_K + rank, chosen, mask=keep)
    tl.store(weight_ptr + m * TOP_K + rank, weight, mask=keep)


@triton.jit
def gemv(row_ptrs, n_mask, x_ptr, K, grid_ptr, signs_ptr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_K: tl.constexpr):
    """[BLOCK_N] = W[rows, :K] · x[:K] for uint8 row pointers [BLOCK_N, 1], one K tile at a time."""
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = dequant(QTYPE, row_ptrs, k[None, :], n_mask & (k[None, :] < K), grid_ptr, signs_ptr)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    return acc


@triton.jit
def swiglu(g, u, weight, clamp):
    """silu(min(g, clamp)) · clamp(u, ±clamp) · weight, in the reference's order."""
    g = tl.minimum(g, clamp)
    u = tl.minimum(tl.maximum(u, -clamp), clamp)
    return g * tl.sigmoid(g) * u * weight


@triton.jit(do_not_specialize=["clamp"])
def expert_swiglu_kernel(x_ptr, gate_ptr, up_ptr, chosen_ptr, weight_ptr, h_ptr, grid_ptr, signs_ptr,
                         inter, D, stride_xm, gate_expert, gate_row, up_expert, up_row, clamp,
                         TOP_K: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[pair, I tile] of one (row, chosen expert) pair = program_id(1)."""
    pair = tl.program_id(1).to(tl.int64)
    m = pair // TOP_K
    e = tl.load(chosen_ptr + pair).to(tl.int64)
    weight = tl.load(weight_ptr + pair)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n[:, None] < inter
    x = x_ptr + m * stride_xm
    g = gemv(gate_ptr + e * gate_expert + n[:, None].to(tl.int64) * gate_row, n_mask, x, D, grid_ptr, signs_ptr,
             GATE, BLOCK_N, BLOCK_K)
    u = gemv(up_ptr + e * up_expert + n[:, None].to(tl.int64) * up_row, n_mask, x, D, grid_ptr, signs_ptr,
             UP, BLOCK_N, BLOCK_K)
    tl.store(h_ptr + pair * inter + n, swiglu(g, u, weight, clamp), mask=n < inter)


@triton.jit
def expert_down_kernel(h_ptr, down_ptr, chosen_ptr, out_ptr, grid_ptr, signs_ptr, inter, D, down_expert, down_row,
                       TOP_K: tl.constexpr, DOWN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, D tile] = Σ_j down_{e_j} · h[m, j], j in increasing expert id order, m = program_id(1)."""
    m = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n[:, None] < D
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(chosen_ptr + m * TOP_K + j).to(tl.int64)
        acc += gemv(down_ptr + e * down_expert + n[:, None].to(tl.int64) * down_row, n_mask,
                    h_ptr + (m * TOP_K + j) * inter, inter, grid_ptr, signs_ptr, DOWN, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + m * D + n, acc, mask=n < D)


@triton.jit
def tile_pairs(tile_start_ptr, offset_ptr, order_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Expert of tile program_id(1), its (row, expert) pairs [BLOCK_M] (indices into M·top_k) and their mask."""
    t = tl.program_id(1)
    experts = tl.arange(0, BLOCK_E)
    ends = tl.load(tile_start_ptr + 1 + experts, mask=experts < E, other=2147483647)
    e = tl.sum((ends <= t).to(tl.int32), axis=0)     # tiles of experts before e end at or before t
    e_safe = tl.minimum(e, E - 1)
    first_tile = tl.load(tile_start_ptr + e_safe)
    start = tl.load(offset_ptr + e_safe) + (t - first_tile) * BLOCK_M
    slots = start + tl.arange(0, BLOCK_M)
    end = tl.where(e < E, tl.load(offset_ptr + e_safe + 1), 0)   # surplus programs: no pairs
    valid = slots < end
    pairs = tl.load(order_ptr + slots, mask=valid, other=0).to(tl.int64)
    return e_safe.to(tl.int64), pairs, valid


@triton.jit(do_not_specialize=["clamp"])
def grouped_swiglu_kernel(x_ptr, gate_ptr, up_ptr, weight_ptr, h_ptr, grid_ptr, signs_ptr,
                          tile_start_ptr, offset_ptr, order_ptr, E, inter, D, stride_xm,
                          gate_expert, gate_row, up_expert, up_row, clamp,
                          TOP_K: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[pairs of one expert tile, I tile] as GEMM tiles over the gathered rows of x."""
    e, pairs, valid = tile_pairs(tile_start_ptr, offset_ptr, order_ptr, E, BLOCK_M, BLOCK_E)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n[:, None] < inter
    x_cols = x_ptr + (pairs // TOP_K)[None, :] * stride_xm
    rows = n[:, None].to(tl.int64)
    g = accumulate_w_xt(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), gate_ptr + e * gate_expert + rows * gate_row,
                        n_mask, x_cols, valid[None, :], 0, D, D, grid_ptr, signs_ptr, GATE, BLOCK_K)
    u = accumulate_w_xt(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), up_ptr + e * up_expert + rows * up_row,
                        n_mask, x_cols, valid[None, :], 0, D, D, grid_ptr, signs_ptr, UP, BLOCK_K)
    weight = tl.load(weight_ptr + pairs, mask=valid, other=0.0)
    h = swiglu(g, u, weight[None, :], clamp)
    tl.store(h_ptr + pairs[None, :] * inter + n[:, None], h, mask=n_mask & valid[None, :])


@triton.jit
def grouped_down_kernel(h_ptr, down_ptr, part_ptr, grid_ptr, signs_ptr, tile_start_ptr, offset_ptr, order_ptr,
                        E, inter, D, down_expert, down_row, DOWN: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """part[pairs of one expert tile, D tile] = down_e · h[pair]."""
    e, pairs, valid = tile_pairs(tile_start_ptr, offset_ptr, order_ptr, E, BLOCK_M, BLOCK_E)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n[:, None] < D
    y = accumulate_w_xt(tl.zeros((BLOCK_N, BLOCK_M), tl.float32),
                        down_ptr + e * down_expert + n[:, None].to(tl.int64) * down_row, n_mask,
                        h_ptr + pairs[None, :] * inter, valid[None, :], 0, inter, inter, grid_ptr, signs_ptr,
                        DOWN, BLOCK_K)
    tl.store(part_ptr + pairs[None, :] * D + n[:, None], y, mask=n_mask & valid[None, :])


def check(op: str, x: torch.Tensor, *weights: QTensor) -> None:
    """Shapes, dtypes, quant types and device as the kernels need them."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16):
        raise TypeError(f"{op}: x must be float32/float16 [M, D], got {x.dtype} {tuple(x.shape)}")
    for w in weights:
        if w.qtype.name not in SUPPORTED:
            raise BackendUnavailable(f"triton {op} has no kernel for quant type {w.qtype.name} (tensor "
                                     f"{w.name or '?'}); supported: {', '.join(SUPPORTED)}; use DS4_OPS={op}:torch")
        if w.data.device != x.device:
            raise ValueError(f"{op}: x is on {x.device} but weight {w.name or '?'} is on {w.data.device}")
    if x.device.type != "cuda" and not INTERPRET:
        raise BackendUnavailable(f"triton {op} needs CUDA tensors, got {x.device}; use DS4_OPS={op}:torch")


def stack(w: QTensor) -> tuple[torch.Tensor, int, int]:
    """Raw bytes of a [E, rows, in] (or single [rows, in]) weight, bytes per expert and bytes per row."""
    data = w.data.contiguous()
    if data.dim() == 2:
        return data, 0, data.stride(0)
    return data, data.stride(0), data.stride(1)


def route(x: torch.Tensor, ids: torch.Tensor, ex: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen experts [M, top_k] int32 in increasing id order and their routing weights [M, top_k]."""
    M, E = x.shape[0], ex.router.shape[0]
    logits = triton_qmatmul(x, ex.router)
    chosen = torch.empty((M, ex.top_k), dtype=torch.int32, device=x.device)
    weight = torch.empty((M, ex.top_k), dtype=torch.float32, device=x.device)
    if M == 0:
        return chosen, weight
    hashed, biased = ex.tid2eid is not None, ex.bias is not None and ex.tid2eid is None
    route_kernel[(M,)](logits, ex.bias if biased else logits, ex.tid2eid if hashed else logits,
                       ids if hashed else logits, chosen, weight, E, float(ex.route_scale),
                       TOP_K=ex.top_k, HASH=hashed, HAS_BIAS=biased, NORMALIZE=bool(ex.normalize),
                       BLOCK_E=max(16, triton.next_power_of_2(E)), BLOCK_T=max(16, triton.next_power_of_2(ex.top_k)))
    return chosen, weight


def experts_ffn(x: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor, gate: QTensor, up: QTensor,
                down: QTensor, clamp: float) -> torch.Tensor:
    """Σ over each row's chosen experts of down_e · swiglu(gate_e·x, up_e·x) · weight, [M, D] float32."""
    M, D = x.shape
    top_k, n_experts = chosen.shape[1], (gate.shape[0] if len(gate.shape) == 3 else 1)
    inter = gate.shape[-2]
    x = x.contiguous()
    (g, g_e, g_r), (u, u_e, u_r), (d, d_e, d_r) = stack(gate), stack(up), stack(down)
    lookup = tables(x.device)
    types = {"GATE": gate.qtype.name, "UP": up.qtype.name}
    out = torch.empty((M, D), dtype=torch.float32, device=x.device)
    if M == 0:
        return out
    h = torch.empty((M * top_k, inter), dtype=torch.float32, device=x.device)
    if M <= SMALL_M:
        bn, bk, warps = GEMV["BLOCK_N"], GEMV["BLOCK_K"], GEMV["num_warps"]
        expert_swiglu_kernel[(triton.cdiv(inter, bn), M * top_k)](
            x, g, u, chosen, weight, h, *lookup, inter, D, x.stride(0), g_e, g_r, u_e, u_r, clamp,
            TOP_K=top_k, **types, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
        expert_down_kernel[(triton.cdiv(D, bn), M)](
            h, d, chosen, out, *lookup, inter, D, d_e, d_r,
            TOP_K=top_k, DOWN=down.qtype.name, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
        return out
    bm, bn, bk, warps = GEMM["BLOCK_M"], GEMM["BLOCK_N"], GEMM["BLOCK_K"], GEMM["num_warps"]
    pairs = M * top_k
    sorted_ids, order = torch.sort(chosen.reshape(-1), stable=True)
    offsets = torch.searchsorted(sorted_ids, torch.arange(n_experts + 1, dtype=torch.int32, device=x.device))
    tiles = (offsets[1:] - offsets[:-1] + bm - 1) // bm
    tile_start = torch.cat([tiles.new_zeros(1), torch.cumsum(tiles, 0)]).to(torch.int32)
    offsets, order = offsets.to(torch.int32), order.to(torch.int32)
    grid_tiles = pairs // bm + min(n_experts, pairs)   # bound on Σ_e ceil(pairs_e / bm), known on the host
    groups = (tile_start, offsets, order, n_experts)
    block_e = max(16, triton.next_power_of_2(n_experts))
    grouped_swiglu_kernel[(triton.cdiv(inter, bn), grid_tiles)](
        x, g, u, weight, h, *lookup, *groups, inter, D, x.stride(0), g_e, g_r, u_e, u_r, clamp,
        TOP_K=top_k, **types, BLOCK_E=block_e, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    part = torch.empty((M, top_k, D), dtype=torch.float32, device=x.device)
    grouped_down_kernel[(triton.cdiv(D, bn), grid_tiles)](
        h, d, part, *lookup, *groups, inter, D, d_e, d_r, DOWN=down.qtype.name,
        BLOCK_E=block_e, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return part.sum(1)


@register("moe", "triton", batch_invariant=True)
def moe(x: torch.Tensor, ids: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Routed-expert output of each row of `x` (shared expert not included)."""
    check("moe", x, experts.router, experts.gate, experts.up, experts.down)
    chosen, weight = route(x, ids, experts)
    return experts_ffn(x, chosen, weight, experts.gate, experts.up, experts.down, float(experts.clamp))


@register("shared_expert", "triton", batch_invariant=True)
def shared_expert(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, clamp: float | None) -> torch.Tensor:
    """SwiGLU of every row of `x` through the shared expert's weights: one expert of weight 1 per row."""
    check("shared_expert", x, gate, up, down)
    M = x.shape[0]
    chosen = torch.zeros((M, 1), dtype=torch.int32, device=x.device)
    weight = torch.ones((M, 1), dtype=torch.float32, device=x.device)
    return experts_ffn(x, chosen, weight, gate, up, down, float("inf") if clamp is None else float(clamp))
