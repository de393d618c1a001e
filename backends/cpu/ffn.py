"""Routed experts and the shared expert on the CPU (contracts: ops/moe.py, ops/shared_expert.py).

In the verify regime (M <= SMALL_M) every (row, chosen expert) pair is one entry of a batched product:
the fused kernel (backends/cpu/qgemv.c) reads each pair's expert in its stored blocks, or for other types
the chosen experts' blocks are gathered (only those are dequantized) and `bmm` multiplies each pair on its
own (each entry goes through the same kernel whatever the batch count); the transcendental elementwise
ops run on rows padded to whole vectors (`rows.rowwise`), and each row sums its experts in increasing
expert id order (with the kernel library: the gated activation and the sum over experts are one C call each,
backends/cpu/glue.c, the bits of ops.exp_poly.swiglu_poly). So row r equals the 1-row call bit for bit with no loop
over rows. Prefill (larger M)
groups each expert's rows, all the experts of a layer in one kernel call per projection (qgemm.c). Expert stacks
repacked at load (`repack.RepackedQ4K`, `RepackedQ2K`, `RepackedIQ2XXS`, `--cpu-dot q8` with the weights in memory)
take their own kernels. `ffn` (ops/ffn.py) runs a decode's routed experts and shared expert in one C call
(`glue.route_moe_shared`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.cpu.qmatmul import BOUND, qmatmul
from backends.cpu.rows import VEC, rowwise
from backends.registry import register
from ops import moe as reference
from ops.moe import Experts, check_owned, owned_pairs, select
from ops.qmatmul import SMALL_M
from ops.quants import QTensor

from . import glue, kernels, repack


def gathered(w: QTensor, chosen: torch.Tensor) -> torch.Tensor:
    """Float32 [P, out, in] weights of the experts `chosen` [P] of a stacked [E, out, in] weight."""
    data = w.data[chosen]
    if w.qtype.name == "F32":
        return data.view(torch.float32).reshape(chosen.shape[0], *w.shape[1:])
    return QTensor(w.qtype, (chosen.shape[0], *w.shape[1:]), data).dequantize()


def pairs_product(x: torch.Tensor, w: QTensor, chosen: torch.Tensor, dot: str = "exact") -> torch.Tensor:
    """[P, out] products of rows x [P, in] with the experts `chosen` [P] of a stacked [E, out, in] weight; an
    expert -1 (another rank's) gives 0 from the kernel, and the last expert's products on the gathered path,
    which its routing weight 0 cancels; `dot="q8"`: 8-bit activations where qdot8.c reads the type."""
    if type(w) in repack.REPACKED:
        repack.require_q8(dot)
        rows_product = repack.product
    elif dot == "q8" and kernels.q8_available(w.qtype.name, w.shape[-1]):
        rows_product = kernels.qdot8
    elif kernels.available(w.qtype.name, w.shape[-1]):
        rows_product = kernels.qgemv
    else:
        return torch.bmm(x[:, None, :], gathered(w, chosen).transpose(1, 2))[:, 0]
    step = kernels.MAX_ROWS
    out = [rows_product(x[i:i + step], w, chosen[i:i + step]) for i in range(0, x.shape[0], step)]
    return out[0] if len(out) == 1 else torch.cat(out)


def gate_and_up(xs: torch.Tensor, ex: Experts, chosen: torch.Tensor, dot: str = "exact") -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """The gate and up products of the (row, expert) pairs: with the kernel library one pass of the kernel pool over
    both weights (`glue.products`, MAX_ROWS pairs per product), else `pairs_product` each."""
    step = kernels.MAX_ROWS
    pieces = [(xs[i:i + step], chosen[i:i + step]) for i in range(0, xs.shape[0], step)]
    out = glue.products([(x, w, c) for w in (ex.gate, ex.up) for x, c in pieces], dot)
    if out is None:
        return pairs_product(xs, ex.gate, chosen, dot), pairs_product(xs, ex.up, chosen, dot)
    if len(pieces) == 1:
        return out[0], out[1]
    return torch.cat(out[:len(pieces)]), torch.cat(out[len(pieces):])


def route(x: torch.Tensor, ids: torch.Tensor, ex: Experts, dot: str = "exact") -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen experts [M, top_k] in increasing id order and their routing weights [M, top_k]; with the kernel library
    the selection, weights and order are one C call (`glue.route`, the bits of `select`)."""
    return route_scores(router_scores(x, ex, dot), ids, ex)


def router_scores(x: torch.Tensor, ex: Experts, dot: str = "exact") -> torch.Tensor:
    """sqrt(softplus(router · x)) [M, E] (ops.moe's scores). One eager row through the router's bound product
    (qmatmul's) is written into a row padded as `rowwise` pads it and the softplus and root are taken there in place:
    rowwise's bits without its copies (~5 us of a layer's ~15)."""
    b = BOUND.get(ex.router, dot) if x.shape[0] == 1 and type(ex.router) is QTensor and glue.ready() else None
    if b is None or x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != b.k or ex.router.shape[0] != b.n:
        return rowwise(sqrt_softplus, qmatmul(x, ex.router, dot))
    row = kernels.bound_product(b, x, out=torch.zeros((1, b.n + -b.n % VEC)))
    return torch.sqrt_(torch._C._nn.softplus(row, 1.0, 20.0, out=row))[:, :b.n]    # F.softplus's kernel, in place


def sqrt_softplus(v: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(v)), the root taken in place (the same bits)."""
    return torch.sqrt_(F.softplus(v))


def route_scores(p: torch.Tensor, ids: torch.Tensor, ex: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` from the router's scores p [M, E]."""
    routed = glue.route(p, ids, ex.bias, ex.tid2eid, ex.top_k, ex.normalize, ex.route_scale) if glue.ready() else None
    if routed is not None:
        return routed
    chosen, w = select(p, ids, ex)
    chosen, order = torch.sort(chosen, dim=-1, stable=True)
    return chosen, w.gather(1, order)


@register("moe", "cpu", batch_invariant=True)
def moe(x: torch.Tensor, ids: torch.Tensor, experts: Experts, dot: str = "exact") -> torch.Tensor:
    """Routed-expert output of each row of `x` (shared expert not included); `dot`: as in qmatmul. A decode's rows are
    routed and run through their experts in one C call where the kernels serve it (`glue.route_moe_rows`)."""
    x = x.to(torch.float32)
    return routed_experts(x, router_scores(x, experts, dot), ids, experts, dot)


def routed_experts(x: torch.Tensor, p: torch.Tensor, ids: torch.Tensor, experts: Experts,
                   dot: str = "exact") -> torch.Tensor:
    """`moe` of float32 rows x from their router scores p (`router_scores`)."""
    M, D = x.shape
    if M <= SMALL_M:
        fused = glue.route_moe_rows(x, p, ids, experts, dot)
        if fused is not None:     # decode: route, then the calls below, in one C call: the same bits
            return fused
    chosen, w = route_scores(p, ids, experts)
    if M > SMALL_M:
        return grouped(x, chosen, w, experts, dot)
    chosen, w = owned_pairs(chosen, w, experts, missing=-1)   # expert parallelism: the kernel skips the others
    fused = glue.moe_rows(x, experts.gate, experts.up, experts.down, chosen, w, experts.clamp, dot)
    if fused is not None:     # decode: the calls below in one C call, the same bits
        return fused
    k, flat = chosen.shape[1], chosen.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)                                      # [M*k, D]
    g, u = gate_and_up(xs, experts, flat, dot)
    if glue.ready():     # one C call each (the bits of ops.exp_poly.swiglu_poly; the experts added in order)
        y = pairs_product(glue.swiglu(g, u, experts.clamp, w), experts.down, flat, dot)
        return glue.sum_rows(y.reshape(M, k, D))
    h = rowwise(F.silu, g.clamp(max=experts.clamp)) * u.clamp(-experts.clamp, experts.clamp) * w.reshape(-1, 1)
    y = pairs_product(h, experts.down, flat, dot).reshape(M, k, D)
    out = y[:, 0]
    for j in range(1, k):
        out = out + y[:, j]
    return out


def grouped(x: torch.Tensor, chosen: torch.Tensor, w: torch.Tensor, ex: Experts, dot: str = "exact") -> torch.Tensor:
    """Prefill: the (row, expert) pairs sorted by expert, every expert of the layer in one kernel call per
    projection (`kernels.experts_product`: each expert's weight read once per 16 of its rows, whole experts
    split across the kernel pool); each row adds its experts in increasing id order. Types the library does
    not read take `grouped_loop`. Rounding may depend on M; `dot="q8"`: 8-bit activations where qdot8.c reads
    the type."""
    check_owned(ex)
    if not all(type(t) in repack.REPACKED or kernels.available(t.qtype.name, t.shape[-1])
               for t in (ex.gate, ex.up, ex.down)):
        return grouped_loop(x, chosen, w, ex, dot)
    k = chosen.shape[1]
    local = chosen.reshape(-1) - ex.first
    order = torch.argsort(local, stable=True)      # pairs by expert; a row's pairs stay in expert id order
    order = order[(local[order] >= 0) & (local[order] < ex.gate.shape[0])]    # expert parallelism: owned only
    ids, counts = torch.unique_consecutive(local[order], return_counts=True)
    first = torch.zeros(ids.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=first[1:])
    rows = order // k
    xs = x[rows]
    g = experts_product(xs, ex.gate, ids, first, dot).clamp(max=ex.clamp)
    u = experts_product(xs, ex.up, ids, first, dot).clamp(-ex.clamp, ex.clamp)
    h = F.silu(g) * u * w.reshape(-1)[order, None]
    return torch.zeros(x.shape, dtype=torch.float32).index_add_(0, rows, experts_product(h, ex.down, ids, first, dot))


def experts_product(x: torch.Tensor, w: QTensor | repack.Repacked, ids: torch.Tensor, first: torch.Tensor,
                    dot: str) -> torch.Tensor:
    """`kernels.experts_product`, or a repacked stack's (q8 only: the same bits as the stored stack's)."""
    if type(w) in repack.REPACKED:
        repack.require_q8(dot)
        return repack.experts_product(x, w, ids, first)
    return kernels.experts_product(x, w, ids, first, dot)


def grouped_loop(x: torch.Tensor, chosen: torch.Tensor, w: torch.Tensor, ex: Experts,
                 dot: str = "exact") -> torch.Tensor:
    """Prefill of types the kernel library does not read (or without it): each chosen expert's rows in one qmatmul
    (reads the chosen ids back)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(chosen).tolist():
        if e not in ex.owned:  # expert parallelism: another rank adds it
            continue
        rows, slots = torch.nonzero(chosen == e, as_tuple=True)
        xe, local = x[rows], e - ex.first
        g = qmatmul(xe, reference.expert(ex.gate, local), dot).clamp(max=ex.clamp)
        u = qmatmul(xe, reference.expert(ex.up, local), dot).clamp(-ex.clamp, ex.clamp)
        h = F.silu(g) * u * w[rows, slots, None]
        out.index_add_(0, rows, qmatmul(h, reference.expert(ex.down, local), dot))
    return out


@register("shared_expert", "cpu", batch_invariant=True)
def shared_expert(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, clamp: float | None,
                  dot: str = "exact") -> torch.Tensor:
    """SwiGLU of every row of `x` through the shared expert's weights; `dot`: as in qmatmul. The gate and up products
    are one kernel call where the kernels serve them (`glue.products`: one pass of the pool over both); with up to
    MAX_ROWS rows the whole expert is one C call (`glue.moe_rows`, the same bits)."""
    fused = glue.moe_rows(x, gate, up, down, None, None, clamp, dot)
    if fused is not None:
        return fused
    both = glue.products([(x, gate, None), (x, up, None)], dot)
    g, u = both or (qmatmul(x, gate, dot), qmatmul(x, up, dot))
    if glue.ready():
        return qmatmul(glue.swiglu(g, u, clamp), down, dot)
    if clamp is not None:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return qmatmul(rowwise(F.silu, g) * u, down, dot)


@register("ffn", "cpu", batch_invariant=True)
def ffn(x: torch.Tensor, ids: torch.Tensor, experts: Experts, gate: QTensor, up: QTensor, down: QTensor,
        clamp: float | None, dot: str = "exact") -> torch.Tensor:
    """The routed experts' output of each row of `x` plus the shared expert's; `dot` as in qmatmul. A decode's rows are
    routed and run through the routed and the shared experts in one C call where the kernels serve both
    (`glue.route_moe_shared`, the bits of moe + shared_expert); else the two ops."""
    x32 = x.to(torch.float32)
    p = router_scores(x32, experts, dot)
    if x.shape[0] <= SMALL_M and glue.ready():
        fused = glue.route_moe_shared(x32, p, ids, experts, (gate, up, down), clamp, dot)
        if fused is not None:
            return fused
    # ops.ffn's sum of the two cpu ops, the router's scores made once
    return routed_experts(x32, p, ids, experts, dot) + shared_expert(x, gate, up, down, clamp, dot)
