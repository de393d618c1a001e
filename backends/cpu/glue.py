"""Python side of glue.c: the small ops of a decode step as one C call each (rms_norm, hc_pre, hc_post, the HC
stream sums, rope_tail's rotation, sparse_attention, store_rows, the routed experts' selection; the fused hc_pre_norm,
hc_post_pre_norm, qmatmul_norm_rope, attention_output and compressor_store), each the bits of its reference in ops/
(docs/cpu.md, "Per-step overhead"). `ready()` is False where the kernel library cannot be built and inside a compiled
step (Inductor fuses the torch ops instead); the callers then take their torch paths."""
from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ops.moe import Experts
from ops.quants import QTensor

from . import kernels
from .repack import REPACKED, Repacked, groups_of, layout_of, repacked_rows
from .scratch import SCRATCH

_bound: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    """The kernel library with glue.c's entry points declared (once)."""
    global _bound
    if _bound is None:
        k, i64, ptr = kernels.lib(), ctypes.c_int64, ctypes.c_void_p
        k.glue_rms_norm.restype = k.glue_hc_post.restype = k.glue_streams.restype = k.glue_rope.restype = None
        k.glue_rms_norm.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr]
        k.glue_hc_post.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ptr]
        k.glue_streams.argtypes = [ptr, ptr, i64, i64, i64, ptr]
        k.glue_rope.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ctypes.c_int, ptr]
        k.glue_hc_pre.restype = k.glue_store_rows.restype = ctypes.c_int
        k.glue_swiglu.restype = k.glue_sum_rows.restype = k.glue_index_total.restype = None
        k.glue_index_total.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ptr]
        k.glue_swiglu.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_int, ctypes.c_float, ptr]
        k.glue_sum_rows.argtypes = [ptr, i64, i64, i64, ptr]
        k.glue_head_streams.restype = None
        k.glue_embed.restype = ctypes.c_int
        k.glue_embed.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr]
        k.glue_head_streams.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_float, i64, i64, i64, ptr]
        k.glue_store_rows.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]
        k.glue_hc_pre.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_float, ptr, ptr, ptr]
        k.glue_products.restype = k.glue_route.restype = k.glue_moe_rows.restype = ctypes.c_int
        k.glue_moe_rows.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int, ptr, ctypes.c_int,
                                    ctypes.c_float, ptr, i64, i64, ptr, ctypes.c_int]
        k.glue_ffn.restype = ctypes.c_int
        k.glue_ffn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int, ptr, ctypes.c_int,
                               ctypes.c_float, ptr, i64, i64, ptr, ctypes.c_int, ctypes.c_int, ptr, ctypes.c_int,
                               ctypes.c_float, ptr, ptr, ptr, ctypes.c_int]
        k.glue_route.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, ctypes.c_int, ctypes.c_float, ptr, ptr]
        k.glue_products.argtypes = [ptr, i64, ctypes.c_int]
        k.glue_hc_pre_norm.restype = k.glue_qmatmul_norm_rope.restype = ctypes.c_int
        k.glue_hc_head.restype = ctypes.c_int
        k.glue_hc_head.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_float, ctypes.c_float, ptr,
                                   ctypes.c_int]
        k.glue_hc_pre_norm.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_float,
                                       ctypes.c_float, ptr, ptr, ptr, ctypes.c_int]
        k.glue_qmatmul_norm_rope.argtypes = [ptr, ctypes.c_int, ptr, ctypes.c_int, ptr, i64, ctypes.c_float, ptr, ptr,
                                             i64, ptr]
        k.glue_attention_output.restype = k.glue_compressor_store.restype = ctypes.c_int
        k.glue_attention_output.argtypes = [ptr, ctypes.c_int, ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, i64, i64,
                                            ptr, ptr, ptr, ctypes.c_int]
        k.glue_compressor_store.argtypes = [ptr, ctypes.c_int, ctypes.c_int, ptr, ctypes.c_int, ptr, i64, ptr, ptr, i64,
                                            ptr, ptr]
        k.attention_rows = ctypes.cast(k.glue_attention_rows, ctypes.c_void_p)
        k.glue_attention_input.restype = ctypes.c_int
        k.glue_attention_input.argtypes = [ptr, ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr, ctypes.c_int, ptr, ptr,
                                           ctypes.c_float, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64,
                                           ctypes.c_int]
        k.glue_indexer_query.restype = ctypes.c_int
        k.glue_indexer_query.argtypes = [ptr, ctypes.c_int, ctypes.c_int, ptr, ptr, ctypes.c_int, i64, ptr, ptr, i64,
                                         ctypes.c_int, ctypes.c_float, ctypes.c_float, ptr, ptr]
        k.glue_hc_post_pre_norm.restype = ctypes.c_int
        k.glue_hc_post_pre_norm.argtypes = [ptr, ctypes.c_int, *[ptr] * 9, i64, i64, i64, i64, ctypes.c_float,
                                            ctypes.c_float, ptr, ptr, ptr, ctypes.c_int]
        _bound = k
    return _bound


def ready() -> bool:
    """Whether the glue kernels serve this call (built library, eager mode)."""
    return kernels.built() and not torch.compiler.is_compiling()


def f32(x: torch.Tensor) -> torch.Tensor:
    """`x` as a contiguous float32 tensor (no copy when it is one)."""
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """ops.rms_norm.rms_norm_lanes' bits for float32 `x` [..., n]."""
    x = f32(x)
    out = torch.empty_like(x)
    w = None if weight is None else f32(weight)
    n = x.shape[-1]
    _lib().glue_rms_norm(x.data_ptr(), x.numel() // n if n else 0, n, None if w is None else w.data_ptr(), eps,
                         out.data_ptr())
    return out


def hc_post(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """ops.hc_post.hc_post's bits."""
    X, y, post, comb = f32(X), f32(y), f32(post), f32(comb)
    out = torch.empty_like(X)
    M, S, D = X.shape
    _lib().glue_hc_post(X.data_ptr(), y.data_ptr(), post.data_ptr(), comb.data_ptr(), M, S, D, out.data_ptr())
    return out


def streams(w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Σ_h w[:, h] · X[:, h] summed in stream order (the references' loop in hc_pre and hc_head)."""
    X, w = f32(X), f32(w)
    M, S, D = X.shape
    out = torch.empty(M, D, dtype=torch.float32)
    _lib().glue_streams(X.data_ptr(), w.data_ptr(), M, S, D, out.data_ptr())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """`x` [M, ..., d] with the tail pairs of each row rotated by cos/sin [M, P] (ops.rope_tail's rotation)."""
    x, cos, sin = f32(x), f32(cos), f32(sin)
    out = torch.empty_like(x)
    M, d = x.shape[0], x.shape[-1]
    groups = x.numel() // (M * d) if M and d else 0
    _lib().glue_rope(x.data_ptr(), M, groups, d, cos.data_ptr(), sin.data_ptr(), cos.shape[-1], int(inverse),
                     out.data_ptr())
    return out


class AttentionArgs(ctypes.Structure):
    """glue.c's attention_t."""

    _fields_ = [("q", ctypes.c_void_p), ("kv", ctypes.c_void_p), ("sinks", ctypes.c_void_p), ("rows", ctypes.c_void_p),
                ("H", ctypes.c_int64), ("D", ctypes.c_int64), ("L", ctypes.c_int64), ("scale", ctypes.c_float),
                ("comp", ctypes.c_void_p), ("Lc", ctypes.c_int64)]


ATTENTION_SPLIT = 1 << 20   # multiply-adds of a call worth splitting across the kernel pool


def int64(ids: torch.Tensor) -> torch.Tensor:
    """`ids` as a contiguous int64 tensor (no copy when it is one)."""
    return ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.to(torch.int64).contiguous()


def attention(q: torch.Tensor, kv: torch.Tensor, listed: torch.Tensor, sinks: torch.Tensor, scale: float,
              comp: torch.Tensor | None = None) -> torch.Tensor:
    """ops.sparse_attention.sparse_attention_lanes' bits for queries q [M, H, D] over their padded lists `listed`
    [M, L] (−1 = none) of rows of kv [N, D], each followed by its row of `comp` [M, Lc] when given (AttnRows' raw and
    compressed rows, not concatenated); the (query, head) pairs split across the kernel pool when the call is large
    enough (each pair computed by one thread: the same bits for any thread count)."""
    q, kv, sinks, listed = f32(q), f32(kv), f32(sinks), int64(listed)
    comp = None if comp is None else int64(comp)
    M, H, D = q.shape
    if listed.dim() != 2 or listed.shape[0] != M or comp is not None and (comp.dim() != 2 or comp.shape[0] != M):
        raise ValueError(f"sparse_attention: {M} queries, row lists {tuple(listed.shape)} and "
                         f"{None if comp is None else tuple(comp.shape)}")
    Lc = 0 if comp is None else comp.shape[1]
    L = listed.shape[1] + Lc
    out = torch.empty(M, H, D, dtype=torch.float32)
    args = AttentionArgs(q.data_ptr(), kv.data_ptr(), sinks.data_ptr(), listed.data_ptr(), H, D, listed.shape[1], scale,
                         None if comp is None else comp.data_ptr(), Lc)
    pairs = M * H
    parts = min(pairs, kernels.CHUNKS_PER_THREAD * kernels.threads()) if 2 * pairs * L * D >= ATTENTION_SPLIT else 1
    k = _lib()
    rc = k.pool_rows(k.attention_rows, 0, ctypes.addressof(args), 0, None, 0, 0,
                     None, M, out.data_ptr(), pairs, parts, kernels.threads())
    if rc:
        raise MemoryError(f"sparse_attention: no memory for the scores of {L} rows")
    return out


def hc_pre(X: torch.Tensor, mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ops.hc_pre.hc_pre_poly's bits: (x [M, D], post [M, S], comb [M, S, S])."""
    X, mixes, scale, base = f32(X), f32(mixes), f32(scale), f32(base)
    M, S, D = X.shape
    f = torch.float32
    x, post, comb = torch.empty(M, D, dtype=f), torch.empty(M, S, dtype=f), torch.empty(M, S, S, dtype=f)
    if _lib().glue_hc_pre(X.data_ptr(), mixes.data_ptr(), scale.data_ptr(), base.data_ptr(), M, S, D, iters, eps,
                          x.data_ptr(), post.data_ptr(), comb.data_ptr()):
        raise MemoryError(f"hc_pre: no memory for the gates of {M} rows")
    return x, post, comb


def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fp8_dims: int, f16: bool) -> torch.Tensor:
    """ops.store_rows.store_rows into a contiguous float32 `cache` (updated in place and returned)."""
    rows, ids = f32(rows), int64(slots)
    M, d = rows.shape
    if cache.dtype != torch.float32 or not cache.is_contiguous() or cache.shape[1] != d or ids.shape != (M,) \
            or fp8_dims % 64 or fp8_dims > d:
        raise ValueError(f"store_rows: cache {tuple(cache.shape)} {cache.dtype}, slots {tuple(slots.shape)}, rows "
                         f"{tuple(rows.shape)}, fp8_dims {fp8_dims} (a multiple of 64)")
    if _lib().glue_store_rows(cache.data_ptr(), cache.shape[0], d, ids.data_ptr(), M, rows.data_ptr(), fp8_dims,
                              int(f16)):
        raise ValueError(f"store_rows: a slot is outside the cache's {cache.shape[0]} rows")
    return cache


def embed(table: QTensor, ids: torch.Tensor) -> torch.Tensor | None:
    """ops.embed's rows `ids` of `table` (a type the library dequantizes) read at their addresses in one C call (no
    torch gather of the raw rows); None where an id is outside the table (torch's indexing then says so, or takes a
    negative id from the end) or the table's blocks are not one contiguous [V, row bytes] array."""
    data, ids = table.data, int64(ids)
    if data.dim() != 2 or not data.is_contiguous() or data.dtype != torch.uint8 or ids.dim() != 1:
        return None
    M, K = ids.shape[0], table.shape[1]
    out = torch.empty(M, K, dtype=torch.float32)
    if _lib().glue_embed(kernels.GGML_TYPE[table.qtype.name], data.data_ptr(), data.shape[0], data.shape[1],
                         ids.data_ptr(), M, K, out.data_ptr()):
        return None
    return out


class ProductArgs(ctypes.Structure):
    """glue.c's product_t: one product of a `glue_products` call."""

    _fields_ = [("fn", ctypes.c_void_p), ("type", ctypes.c_int64), ("w", ctypes.c_void_p),
                ("expert_bytes", ctypes.c_int64), ("experts", ctypes.c_void_p), ("N", ctypes.c_int64),
                ("K", ctypes.c_int64), ("x", ctypes.c_void_p), ("M", ctypes.c_int64), ("y", ctypes.c_void_p),
                ("parts", ctypes.c_int64)]


def type_name(w: QTensor | Repacked) -> str:
    """The quant type of w's values (a repacked weight's: its layout's stored type, e.g. Q4_K)."""
    return layout_of(w).qtype if type(w) in REPACKED else w.qtype.name


def row_kernel(w: QTensor | Repacked, dot: str) -> tuple[int, int]:
    """The address of w's row kernel under `dot` and the type code it takes (a repacked weight: its own, q8 only)."""
    if type(w) in REPACKED:
        return repacked_rows(dot, w)
    return kernels.row_kernel(dot == "q8"), kernels.GGML_TYPE[w.qtype.name]


def served(x: torch.Tensor, w: QTensor | Repacked, experts: torch.Tensor | None, dot: str) -> bool:
    """Whether `products` serves rows x with the quantized weight w (2-D, or stacked [E, N, K] with `experts`)."""
    stacked = experts is not None
    return (not stacked or experts.shape == x.shape[:1]) and serves(x.shape[0], x.shape[-1], w, stacked, dot)


def serves(M: int, K: int, w: QTensor | Repacked, stacked: bool, dot: str) -> bool:
    """Whether `products` serves M rows of K values with the quantized weight w (2-D, or `stacked` [E, N, K])."""
    name = type_name(w)
    kernel = kernels.q8_available(name, K) if dot == "q8" else kernels.available(name, K)
    return kernel and len(w.shape) == 2 + stacked and name != "F32" and M <= kernels.MAX_ROWS and w.shape[-1] == K


def product_args(kernel: int | None, w: QTensor | Repacked, experts: torch.Tensor | None, M: int, rows: int,
                 y: int, alive: list, dot: str = "exact") -> ProductArgs:
    """One product of a `glue_products` call: M prepared rows at address `rows` (float32, or q8's rounded blocks)
    times the weight `w` (row m: expert experts[m] of a stack) into float32 [M, N] at address `y`, through `kernel`
    (None: w's row kernel under `dot`); the tensors whose pointers it holds are appended to `alive`."""
    data = w.data.contiguous()
    ids = None if experts is None else int64(experts)
    N, K = w.shape[-2], w.shape[-1]
    expert_bytes = 0 if ids is None else data.numel() // data.shape[0]
    read = expert_bytes * M if ids is not None else data.numel()     # at most this much weight
    alive += [data, ids]
    kernel, code = row_kernel(w, dot) if kernel is None else (kernel, kernels.GGML_TYPE[w.qtype.name])
    return ProductArgs(kernel, code, data.data_ptr(), expert_bytes,
                       None if ids is None else ids.data_ptr(), N, K, rows, M, y,
                       1 if kernels.threads() == 1 else max(1, min(N, kernels.pool_parts(read))))


def products(calls: list[tuple[torch.Tensor, QTensor | Repacked, torch.Tensor | None]],
             dot: str = "exact") -> list[torch.Tensor] | None:
    """[x @ W.T for each (x [M, K], W, experts)] in one pass of the kernel pool (glue.c's glue_products): a thread
    that finishes its chunks of one weight goes on to the next, and the pool's threads are handed work once. With
    `experts` [M] row m uses expert experts[m] of a stacked [E, N, K] weight W (as kernels.qgemv). Each output is the
    bits of that product's own kernel call (`qmatmul`, `pairs_product`), for any thread count; activations used by
    several products are rounded once (`dot="q8"`). On several threads each product is cut into
    `kernels.pool_parts` of the weight bytes it reads, all chunks taken in turn from one queue. None where the kernels
    do not serve one of them (F32 weights, more than MAX_ROWS rows)."""
    if not ready() or not all(served(x, w, experts, dot) for x, w, experts in calls):
        return None
    k, kernel = _lib(), kernels.row_kernel(dot == "q8")
    prepared: dict[tuple[int, int | None], torch.Tensor] = {}
    alive, outs = [], []    # the tensors whose pointers the call reads
    args = (ProductArgs * len(calls))()
    for i, (x, w, experts) in enumerate(calls):
        name = type_name(w)
        key = (id(x), kernels.Q8_TYPES[name] if dot == "q8" else None)    # q8: one rounding per kind
        if key not in prepared:
            prepared[key] = kernels.q8_quantize(f32(x), name) if dot == "q8" else f32(x)
        y = torch.empty(x.shape[0], w.shape[-2], dtype=torch.float32)
        args[i] = product_args(None if type(w) in REPACKED else kernel, w, experts, x.shape[0],
                               prepared[key].data_ptr(), y.data_ptr(), alive, dot)
        outs.append(y)
    if k.glue_products(args, len(calls), kernels.threads()):
        raise ValueError(f"products: unsupported call ({', '.join(type_name(w) for _, w, _ in calls)}, dot={dot})")
    return outs


def swiglu(g: torch.Tensor, u: torch.Tensor, clamp: float | None, weight: torch.Tensor | None = None) -> torch.Tensor:
    """ops.exp_poly.swiglu_poly's bits for g, u [M, N] (weight [M] or [M, 1])."""
    g, u = f32(g), f32(u)
    w = None if weight is None else f32(weight.reshape(-1))
    h = torch.empty_like(g)
    M, N = g.shape
    _lib().glue_swiglu(g.data_ptr(), u.data_ptr(), None if w is None else w.data_ptr(), M, N, clamp is not None,
                       0.0 if clamp is None else clamp, h.data_ptr())
    return h


def sum_rows(y: torch.Tensor) -> torch.Tensor:
    """y [M, K, D] summed over K in order: y[:, 0] + y[:, 1] + ..."""
    y = f32(y)
    M, K, D = y.shape
    out = torch.empty(M, D, dtype=torch.float32)
    _lib().glue_sum_rows(y.data_ptr(), M, K, D, out.data_ptr())
    return out


def index_total(s: torch.Tensor, w: torch.Tensor, visible: tuple[int, ...], n: int) -> torch.Tensor:
    """The indexer's scores [M, n] from its heads' products s [M, H, width]: Σ_h relu(s[:, h, j]) · w[:, h] in head
    order for the j < visible[m] of each query m, −inf elsewhere (index_scores' torch ops' bits)."""
    s, w = f32(s), f32(w)
    M, H, width = s.shape
    if w.shape != (M, H) or len(visible) != M or max(visible, default=0) > width:
        raise ValueError(f"index_scores: products {tuple(s.shape)}, head weights {tuple(w.shape)}, visible {visible}")
    out = torch.empty(M, n, dtype=torch.float32)
    _lib().glue_index_total(s.data_ptr(), w.data_ptr(), (ctypes.c_int64 * M)(*visible), M, H, width, n,
                            out.data_ptr())
    return out


def head_streams(X: torch.Tensor, mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """ops.hc_head.head_streams_poly's bits (X [M, S, D] with S <= 64, mixes [M, S], scale [1], base [S])."""
    X, mixes, scale, base = f32(X), f32(mixes), f32(scale), f32(base)
    M, S, D = X.shape
    if S > 64:
        raise ValueError(f"hc_head: at most 64 streams, got {S}")
    out = torch.empty(M, D, dtype=torch.float32)
    _lib().glue_head_streams(X.data_ptr(), mixes.data_ptr(), scale.data_ptr(), base.data_ptr(), eps, M, S, D,
                             out.data_ptr())
    return out


ROUTE_MAX_K = 7     # glue_route sums the weights as torch sums fewer than 8 floats (its scalar row sum)


def route(p: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor | None, table: torch.Tensor | None, top_k: int,
          normalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """ops.moe.select's bits from router scores p [M, E], then both sorted by increasing expert id (stable): chosen
    [M, k] int64 and weights [M, k]; None where k > ROUTE_MAX_K (the caller takes the torch path)."""
    k = top_k if table is None else table.shape[1]
    if k > ROUTE_MAX_K:
        return None
    p = f32(p)
    M, E = p.shape
    b = None if bias is None else f32(bias)
    t = None if table is None else int64(table)
    ids = int64(ids)
    if ids.shape != (M,) or (b is not None and b.shape != (E,)) or k > E:
        raise ValueError(f"moe: scores {tuple(p.shape)}, ids {tuple(ids.shape)}, top_k {k}, bias "
                         f"{None if b is None else tuple(b.shape)}")
    chosen, w = torch.empty(M, k, dtype=torch.int64), torch.empty(M, k, dtype=torch.float32)
    if _lib().glue_route(p.data_ptr(), M, E, None if b is None else b.data_ptr(), None if t is None else t.data_ptr(),
                         0 if t is None else t.shape[0], ids.data_ptr(), k, int(normalize), scale, chosen.data_ptr(),
                         w.data_ptr()):
        raise ValueError(f"moe: a token id outside the {t.shape[0]}-row expert table or an expert outside {E}")
    return chosen, w


@dataclass
class BoundExpert:
    """The three weights of an expert call (routed stacks, or the shared expert's 2-D weights) bound to glue_moe_rows'
    arguments once: `args` holds each product's kernel, type, weight pointer and sizes, and a call fills in only its
    rows, experts and outputs."""

    args: ctypes.Array      # ProductArgs * 3: gate, up, down
    data: tuple[torch.Tensor, ...]      # the contiguous raw blocks `args` points into (kept alive)
    reads: tuple[int, ...]  # weight bytes a row reads of each (one expert's of a stack)
    q8_rows: int            # the rounding kind of the gate and up products' rows (`dot="q8"`), else -1
    q8_down: int            # the rounding kind of the down product's rows (`dot="q8"`), else -1
    xq_row_bytes: int       # bytes of one rounded row of the gate and up products' input (`dot="q8"`), else 0
    hq_row_bytes: int       # bytes of one rounded row of the down product's input (`dot="q8"`), else 0
    filled: tuple | None = None     # what `fill` last wrote into `args` (the next call's are mostly the same)


def bind_expert(gate: QTensor | Repacked, up: QTensor | Repacked, down: QTensor | Repacked, dot: str,
                routed: bool) -> BoundExpert | None:
    """glue_moe_rows' arguments of the three weights (`routed`: stacks [E, N, K] of experts, else 2-D; a repacked
    Q4_K stack takes its own row kernel), or None where the kernels do not serve them."""
    served = kernels.q8_available if dot == "q8" else kernels.available
    K, inner = gate.shape[-1], gate.shape[-2]
    names = tuple(type_name(t) for t in (gate, up, down))
    if not all(type(t) in (QTensor, *REPACKED) and len(t.shape) == (3 if routed else 2) and name != "F32"
               for t, name in zip((gate, up, down), names, strict=True)):
        return None
    if up.shape != gate.shape or down.shape[-1] != inner or down.shape[:-2] != gate.shape[:-2]:
        return None
    if not (served(names[0], K) and served(names[1], K) and served(names[2], inner)):
        return None
    if dot == "q8" and kernels.Q8_TYPES[names[1]] != kernels.Q8_TYPES[names[0]]:
        return None
    args, data, reads = bound_args((gate, up, down), (routed,) * 3, dot)
    q8_rows, q8_down = (q8_kind(gate, dot), q8_kind(down, dot))
    return BoundExpert(args, data, reads, q8_rows, q8_down,
                       kernels.q8_row_bytes(q8_rows, K) if dot == "q8" else 0,
                       kernels.q8_row_bytes(q8_down, inner) if dot == "q8" else 0)


EXPERTS = kernels.PerWeight()   # the bound expert calls, per (gate, up, down) and (dot, routed, thread)
FLOAT_BYTES = 4     # of a float32


class RouteArgs(ctypes.Structure):
    """glue.c's route_t: glue_route's arguments for a glue_moe_rows call that routes its rows first."""

    _fields_ = [("p", ctypes.c_void_p), ("E", ctypes.c_int64), ("bias", ctypes.c_void_p), ("table", ctypes.c_void_p),
                ("table_rows", ctypes.c_int64), ("ids", ctypes.c_void_p), ("normalize", ctypes.c_int64),
                ("scale", ctypes.c_float)]


def moe_rows(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, chosen: torch.Tensor | None,
             w: torch.Tensor | None, clamp: float | None, dot: str = "exact") -> torch.Tensor | None:
    """The routed experts of rows x [M, D] over their chosen experts [M, k] (stack indices, -1 = not held here) with
    routing weights w [M, k] in one C call (glue.c's glue_moe_rows): each row repeated for its k experts and (q8)
    rounded, the gate and up products of the M * k (row, expert) pairs in one pool pass, the weighted swiglu, the down
    product, each row's experts added in order; the bits of the separate calls (`products`, `swiglu`, the down
    product's kernel call, `sum_rows`). `chosen` None: the shared expert's 2-D weights, no routing weight. None where
    the kernels do not serve the three weights or the pairs are more than MAX_ROWS."""
    M, k = (x.shape[0], 1) if chosen is None else chosen.shape
    flat = None if chosen is None else int64(chosen.reshape(-1))
    weights = None if w is None else f32(w.reshape(-1))
    return expert_rows(x, (gate, up, down), M, k, clamp, dot, flat, weights)


@dataclass
class Routing:
    """glue_route's arguments for routing rows before their experts (`routing`): `args` points into `scores` and
    `ids` (kept alive here) and into the bias and table of `experts` (`routable`); k experts a row."""

    args: RouteArgs
    experts: Experts
    k: int
    scores: torch.Tensor
    ids: torch.Tensor


def routing(p: torch.Tensor, ids: torch.Tensor, ex: Experts) -> Routing | None:
    """The routing of rows by scores p [M, E] and token ids [M] before their experts in one C call; None where
    glue_route would not serve it or the stacks do not hold every expert (expert parallelism)."""
    p, ids = f32(p), int64(ids)
    ex = routable(ex)
    table = ex.tid2eid
    k = ex.top_k if table is None else table.shape[1]
    M, E = p.shape
    if k > ROUTE_MAX_K or not ex.holds_all() or not ready():
        return None
    b = ex.bias
    if ids.shape != (M,) or (b is not None and b.shape != (E,)) or k > E:
        raise ValueError(f"moe: scores {tuple(p.shape)}, ids {tuple(ids.shape)}, top_k {k}, bias "
                         f"{None if b is None else tuple(b.shape)}")
    args = RouteArgs(p.data_ptr(), E, None if b is None else b.data_ptr(), None if table is None else table.data_ptr(),
                     0 if table is None else table.shape[0], ids.data_ptr(), int(ex.normalize), ex.route_scale)
    return Routing(args, ex, k, p, ids)


def route_moe_rows(x: torch.Tensor, p: torch.Tensor, ids: torch.Tensor, ex: Experts,
                   dot: str = "exact") -> torch.Tensor | None:
    """`route`, then `moe_rows` over the experts it chose, in one C call (the routing's ids and weights in the thread's
    scratch): the bits of the two calls. None where either would not serve the call, or the stacks do not hold every
    expert (expert parallelism)."""
    r = routing(p, ids, ex)
    if r is None:
        return None
    ex = r.experts
    return expert_rows(x, (ex.gate, ex.up, ex.down), x.shape[0], r.k, ex.clamp, dot, route=r.args)


def routable(ex: Experts) -> Experts:
    """`ex` with its bias float32 and its table int64, both contiguous (what glue_route reads)."""
    bias = None if ex.bias is None else f32(ex.bias)
    table = None if ex.tid2eid is None else int64(ex.tid2eid)
    return ex if bias is ex.bias and table is ex.tid2eid else replace(ex, bias=bias, tid2eid=table)


def route_moe_shared(x: torch.Tensor, p: torch.Tensor, ids: torch.Tensor, ex: Experts,
                     shared: tuple[QTensor, QTensor, QTensor], clamp: float | None,
                     dot: str = "exact") -> torch.Tensor | None:
    """`route_moe_rows` then `moe_rows` of the shared expert's weights `shared` on the same rows, added, in one C call
    (glue.c's glue_ffn: both experts' gate and up products in one pool pass, both down products in the next): the bits
    of the cpu ops moe + shared_expert. None where either call would not serve."""
    r = routing(p, ids, ex)
    gate, up, down = shared
    if r is None or x.dim() != 2 or x.shape[1] != gate.shape[-1] or down.shape[-2] != ex.down.shape[-2]:
        return None
    ex, k, M = r.experts, r.k, x.shape[0]
    routed, own = bound_ffn(x, (ex.gate, ex.up, ex.down), shared, M * k, dot)
    if routed is None or own is None:
        return None
    x = f32(x)
    P, K, inner, si, n = M * k, x.shape[1], ex.gate.shape[-2], gate.shape[-2], down.shape[-2]
    out = torch.empty(M, n, dtype=torch.float32)
    threads = kernels.threads()
    f, fm = FLOAT_BYTES * P, FLOAT_BYTES * M
    with SCRATCH(8 * P, f, f * K if k > 1 else 0, P * routed.xq_row_bytes, f * inner, P * routed.hq_row_bytes,
                 f * inner, f * inner, f * n, M * own.xq_row_bytes, fm * si, M * own.hq_row_bytes, fm * si, fm * si,
                 fm * n, fm * n) as (picked, picked_w, xs, xq, h, hq, g, u, y, s_xq, s_h, s_hq, s_g, s_u, s_y, s_out):
        src = xs if k > 1 else x.data_ptr()
        fill(routed, src, xq, h, hq, (g, u, y), P, picked, True, dot, threads)
        fill(own, x.data_ptr(), s_xq, s_h, s_hq, (s_g, s_u, s_y), M, None, False, dot, threads)
        rc = _lib().glue_ffn(routed.args, ctypes.byref(r.args), picked, picked_w, x.data_ptr(), src, routed.q8_rows,
                             routed.q8_down, hq, 1, ex.clamp, h, M, k, own.args, own.q8_rows, own.q8_down, s_hq,
                             clamp is not None, 0.0 if clamp is None else clamp, s_h, s_out, out.data_ptr(), threads)
    check_rc(rc, r.args, (ex.gate, ex.up, ex.down), dot)
    return out


def serves_pairs(x: torch.Tensor, weights: tuple[QTensor, ...], P: int) -> bool:
    """Whether the library can take P (row, expert) pairs of x [M, K] on weights of K inputs (P <= MAX_ROWS)."""
    return ready() and x.dim() == 2 and x.shape[1] == weights[0].shape[-1] and P <= kernels.MAX_ROWS


def bound_experts(x: torch.Tensor, weights: tuple[QTensor, QTensor, QTensor], M: int, k: int, dot: str,
                  routed: bool) -> BoundExpert | None:
    """The weights' glue_moe_rows arguments (`EXPERTS`, bound on first use) for M rows of x, k experts a row; None
    where the library or the kernels do not serve them, or the pairs are more than MAX_ROWS."""
    if not serves_pairs(x, weights, M * k):
        return None
    return EXPERTS.value(weights, (dot, routed, threading.get_ident()), lambda: bind_expert(*weights, dot, routed))


def bound_ffn(x: torch.Tensor, weights: tuple[QTensor, QTensor, QTensor], shared: tuple[QTensor, QTensor, QTensor],
              P: int, dot: str) -> tuple[BoundExpert | None, BoundExpert | None]:
    """`bound_experts` of a layer's routed stacks and shared expert for P pairs, in one lookup (`EXPERTS`, keyed by
    all six weights); (None, None) where the library does not serve x or the pairs are more than MAX_ROWS."""
    if not serves_pairs(x, weights, P):
        return None, None
    return EXPERTS.value((*weights, *shared), (dot, "ffn", threading.get_ident()),
                         lambda: (bind_expert(*weights, dot, True), bind_expert(*shared, dot, False)))


def fill(bound: BoundExpert, src: int, xq: int, h: int, hq: int, ys: tuple[int, int, int], P: int, experts: int | None,
         routed: bool, dot: str, threads: int) -> None:
    """A call's rows (src, or under q8 their rounded copy xq; the down product's h or hq), outputs ys, pair count P and
    experts in the bound arguments, each product's pool split by the bytes it reads. Only what changed since the last
    call is written (the scratch addresses stay the same from call to call; the rows of an unrepeated input move)."""
    rows = (src, src, h) if dot != "q8" else (xq, xq, hq)
    state = (rows, ys, P, experts, threads, kernels.SPLIT_BYTES)
    if state == bound.filled:
        return
    if bound.filled is not None and state[1:] == bound.filled[1:]:
        for arg, x in zip(bound.args, rows, strict=True):
            arg.x = x
    else:
        for arg, x, y, read in zip(bound.args, rows, ys, bound.reads, strict=True):
            arg.x, arg.M, arg.y, arg.experts = x, P, y, experts
            arg.parts = 1 if threads == 1 else max(1, min(arg.N, kernels.pool_parts(read * P if routed else read)))
    bound.filled = state


def check_rc(rc: int, route: RouteArgs | None, weights: tuple[QTensor, QTensor, QTensor], dot: str) -> None:
    """glue_moe_rows' or glue_ffn's return code as the error it stands for."""
    if rc == 1:
        raise ValueError(f"moe: a token id outside the {route.table_rows}-row expert table or an expert outside "
                         f"{route.E}")
    if rc:
        raise ValueError(f"moe: unsupported call ({', '.join(type_name(t) for t in weights)}, dot={dot})")


def expert_rows(x: torch.Tensor, weights: tuple[QTensor, QTensor, QTensor], M: int, k: int, clamp: float | None,
                dot: str, chosen: torch.Tensor | None = None, w: torch.Tensor | None = None,
                route: RouteArgs | None = None) -> torch.Tensor | None:
    """glue_moe_rows on rows x [M, D], k experts a row: chosen [M * k] and w [M * k] given (contiguous int64 and
    float32), or written by the call's routing (`route`), or neither (the shared expert's 2-D weights). The weights'
    arguments are bound on first use (`EXPERTS`); the temporaries are the thread's scratch (`SCRATCH`)."""
    gate, up, down = weights
    routed = chosen is not None or route is not None
    bound = bound_experts(x, weights, M, k, dot, routed)
    if bound is None:
        return None
    x = f32(x)
    P, K, inner, n = M * k, x.shape[1], gate.shape[-2], down.shape[-2]
    out = torch.empty(M, n, dtype=torch.float32)
    threads = kernels.threads()
    f = FLOAT_BYTES * P
    with SCRATCH(8 * P if route else 0, f if route else 0, f * K if k > 1 else 0, P * bound.xq_row_bytes, f * inner,
                 P * bound.hq_row_bytes, f * inner, f * inner, f * n) as (picked, picked_w, xs, xq, h, hq, *ys):
        src = xs if k > 1 else x.data_ptr()
        experts = picked if route else None if chosen is None else chosen.data_ptr()
        fill(bound, src, xq, h, hq, tuple(ys), P, experts, routed, dot, threads)
        rc = _lib().glue_moe_rows(bound.args, None if route is None else ctypes.byref(route), picked,
                                  picked_w if route else None if w is None else w.data_ptr(), x.data_ptr(), src,
                                  bound.q8_rows, bound.q8_down, hq, clamp is not None, 0.0 if clamp is None else clamp,
                                  h, M, k, out.data_ptr(), threads)
    check_rc(rc, route, weights, dot)
    return out


def q8_kind(w: QTensor | Repacked, dot: str) -> int:
    """The rounding kind of the rows of a product with weight `w` under q8 (qdot8.c's q8_quantize), else -1."""
    return kernels.Q8_TYPES[type_name(w)] if dot == "q8" else -1


@dataclass
class BoundProducts:
    """The products of a fused op's weights bound to glue_products' arguments once (kernel, type, weight pointer,
    sizes): a call fills in only its rows, outputs and row count (`rows`). One per thread (`FUSED`'s key), since a
    call writes into it."""

    args: ctypes.Array      # ProductArgs * n
    data: tuple[torch.Tensor, ...]      # the contiguous raw blocks `args` points into (kept alive)
    kinds: tuple[int, ...]  # each product's rounding kind of its rows (`dot="q8"`), else -1
    row_bytes: tuple[int, ...]  # bytes of one rounded row of each product's input (`dot="q8"`), else 0
    reads: tuple[int, ...]  # weight bytes of each product (of a stack: one expert's, read once per row)
    stacked: tuple[bool, ...]
    filled: tuple | None = None     # what `rows` last wrote into `args` (a decode's scratch addresses repeat)

    def rows(self, counts: tuple[int, ...], rows: tuple[int, ...], outs: tuple[int, ...]) -> None:
        """Product i takes counts[i] rows at address rows[i] into outs[i]; on several threads each is cut into
        `kernels.pool_parts` of the weight bytes it reads (as `product_args`). Nothing is written when that is what
        the last call wrote."""
        threads = kernels.threads()
        state = (counts, rows, outs, threads, kernels.SPLIT_BYTES)
        if state == self.filled:
            return
        for arg, M, x, y, read, stacked in zip(self.args, counts, rows, outs, self.reads, self.stacked, strict=True):
            arg.x, arg.M, arg.y = x, M, y
            arg.parts = 1 if threads == 1 else max(1, min(arg.N, kernels.pool_parts(read * M if stacked else read)))
        self.filled = state


def bind_products(weights: tuple[QTensor, ...], stacked: tuple[bool, ...], dot: str) -> BoundProducts | None:
    """`weights`' products (2-D, or stacked [E, N, K] experts) bound once, or None where `products` would not serve one
    of them."""
    if not all(serves(1, w.shape[-1], w, s, dot) for w, s in zip(weights, stacked, strict=True)):
        return None
    args, data, reads = bound_args(weights, stacked, dot)
    kinds = tuple(q8_kind(w, dot) for w in weights)
    return BoundProducts(args, data, kinds,
                         tuple(kernels.q8_row_bytes(k, w.shape[-1]) if k >= 0 else 0 for k, w in zip(kinds, weights,
                                                                                                     strict=True)),
                         reads, stacked)


def bound_args(weights: tuple[QTensor | Repacked, ...], stacked: tuple[bool, ...],
               dot: str) -> tuple[ctypes.Array, tuple[torch.Tensor, ...], tuple[int, ...]]:
    """glue_products' arguments of `weights` (2-D, or `stacked` [E, N, K] experts) with their row kernels under `dot`
    and no rows yet, the contiguous raw blocks they point into, and the weight bytes each product reads a row (of a
    stack: one expert's)."""
    data = tuple(w.data.contiguous() for w in weights)
    per_expert = tuple(d.numel() // d.shape[0] if s else 0 for d, s in zip(data, stacked, strict=True))
    args = (ProductArgs * len(weights))(*(ProductArgs(*row_kernel(w, dot), d.data_ptr(), e, None, w.shape[-2],
                                                      w.shape[-1], None, 0, None, 1)
                                          for w, d, e in zip(weights, data, per_expert, strict=True)))
    return args, data, tuple(e or d.numel() for d, e in zip(data, per_expert, strict=True))


FUSED = kernels.PerWeight()     # the fused ops' bound products, per weights and (op, dot, ..., thread)


def fused_binding(weights: tuple[QTensor, ...], key: tuple, make: Callable[[], BoundProducts | None]) -> \
        BoundProducts | None:
    """The calling thread's bound products of a fused op's `weights` under `key` (made by `make()` once)."""
    return FUSED.value(weights, (*key, threading.get_ident()), make)


def hc_pre_norm(X: torch.Tensor, fn: QTensor, scale: torch.Tensor, base: torch.Tensor, norm: torch.Tensor,
                iters: int, hc_eps: float, rms_eps: float, dot: str = "exact",
                after: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...] | None:
    """ops.hc_pre_norm's sequence as the cpu backend runs it op by op (rms_norm, the product, hc_pre, rms_norm), in
    one C call (glue.c's glue_hc_pre_norm) and with its bits; None where `products` would not serve the product.
    `after` = (y, post, comb): hc_post(X, y, post, comb) first, in the same call (glue_hc_post_pre_norm), and its
    state returned first (ops.hc_post_pre_norm). The product is bound once (`FUSED`); the flat state, its rounding
    and the mixes are the thread's scratch."""
    M, S, D = X.shape
    if not ready() or M > kernels.MAX_ROWS or fn.shape[-1] != S * D:
        return None
    bound = fused_binding((fn,), ("hc_pre_norm", dot), lambda: bind_products((fn,), (False,), dot))
    if bound is None:
        return None
    X, scale, base, norm = f32(X), f32(scale), f32(base), f32(norm)
    kind = bound.kinds[0]
    f = torch.float32
    x, post, comb = torch.empty(M, D, dtype=f), torch.empty(M, S, dtype=f), torch.empty(M, S, S, dtype=f)
    with SCRATCH(FLOAT_BYTES * M * S * D, M * bound.row_bytes[0], FLOAT_BYTES * M * fn.shape[0]) as (flat, xq, mixes):
        bound.rows((M,), (flat if kind < 0 else xq,), (mixes,))
        tail = (scale.data_ptr(), base.data_ptr(), norm.data_ptr(), M, S, D, iters, hc_eps, rms_eps, x.data_ptr(),
                post.data_ptr(), comb.data_ptr(), kernels.threads())
        if after is None:
            rc = _lib().glue_hc_pre_norm(bound.args, kind, X.data_ptr(), flat, *tail)
            out = (x, post, comb)
        else:
            y, post_in, comb_in = f32(after[0]), f32(after[1]), f32(after[2])
            Xn = torch.empty_like(X)
            rc = _lib().glue_hc_post_pre_norm(bound.args, kind, X.data_ptr(), y.data_ptr(), post_in.data_ptr(),
                                              comb_in.data_ptr(), Xn.data_ptr(), flat, *tail)
            out = (Xn, x, post, comb)
    if rc == -2:
        raise MemoryError(f"hc_pre_norm: no memory for the gates of {M} rows")
    if rc:
        raise ValueError(f"hc_pre_norm: unsupported call ({fn.qtype.name}, dot={dot})")
    return out


def hc_head(X: torch.Tensor, fn: QTensor, scale: torch.Tensor, base: torch.Tensor, rms_eps: float,
            hc_eps: float) -> torch.Tensor | None:
    """The cpu hc_head's calls (rms_norm, the exact product, head_streams) in one C call (glue.c's glue_hc_head) and
    with their bits; None where `products` would not serve the product or the streams are more than 64. The product is
    bound once (`FUSED`); the flat state and the mixes are the thread's scratch."""
    M, S, D = X.shape
    if not ready() or M > kernels.MAX_ROWS or S > 64 or fn.shape[-1] != S * D or scale.numel() < 1 \
            or base.shape != (S,):
        return None
    bound = fused_binding((fn,), ("hc_head",), lambda: bind_products((fn,), (False,), "exact"))
    if bound is None:
        return None
    X, scale, base = f32(X), f32(scale), f32(base)
    out = torch.empty(M, D, dtype=torch.float32)
    with SCRATCH(FLOAT_BYTES * M * S * D, FLOAT_BYTES * M * fn.shape[0]) as (flat, mixes):
        bound.rows((M,), (flat,), (mixes,))
        rc = _lib().glue_hc_head(bound.args, X.data_ptr(), flat, scale.data_ptr(), base.data_ptr(), M, S, D, rms_eps,
                                 hc_eps, out.data_ptr(), kernels.threads())
    if rc:
        raise ValueError(f"hc_head: unsupported call ({type_name(fn)})")
    return out


def qmatmul_norm_rope(x: torch.Tensor, w: QTensor, norm: torch.Tensor | None, eps: float, width: int,
                      cos_sin: tuple[torch.Tensor, torch.Tensor] | None, dot: str = "exact") -> torch.Tensor | None:
    """ops.qmatmul_norm_rope's sequence as the cpu backend runs it op by op (the product, rms_norm per group of
    `width`, the rotation by `cos_sin` [M, P] each), in one C call (glue.c's glue_qmatmul_norm_rope, which also rounds
    the rows under q8) and with its bits; None where `products` would not serve the product. The product is bound
    once (`FUSED`); its output and rounded rows are the thread's scratch."""
    if not ready() or x.dim() != 2 or x.shape[0] > kernels.MAX_ROWS or x.shape[1] != w.shape[-1]:
        return None
    bound = fused_binding((w,), ("qmatmul_norm_rope", dot), lambda: bind_products((w,), (False,), dot))
    if bound is None:
        return None
    x = f32(x)
    M, N, kind = x.shape[0], w.shape[0], bound.kinds[0]
    out = torch.empty(M, N, dtype=torch.float32)
    w_norm = None if norm is None else f32(norm)
    cos, sin = (None, None) if cos_sin is None else (f32(cos_sin[0]), f32(cos_sin[1]))
    angles = (None, None, 0) if cos is None else (cos.data_ptr(), sin.data_ptr(), cos.shape[-1])
    with SCRATCH(FLOAT_BYTES * M * N, M * bound.row_bytes[0]) as (y, xq):
        bound.rows((M,), (x.data_ptr() if kind < 0 else xq,), (y,))
        rc = _lib().glue_qmatmul_norm_rope(bound.args, kind, x.data_ptr(), kernels.threads(),
                                           None if w_norm is None else w_norm.data_ptr(), width, eps, *angles,
                                           out.data_ptr())
    if rc:
        raise ValueError(f"qmatmul_norm_rope: unsupported call ({type_name(w)}, dot={dot})")
    return out


def attention_input(x: torch.Tensor, q_a: QTensor, q_a_norm: torch.Tensor | None, q_b: QTensor, kv: QTensor,
                    kv_norm: torch.Tensor | None, eps: float, hd: int, cos_sin: tuple[torch.Tensor, torch.Tensor],
                    cache: torch.Tensor, slots: torch.Tensor, fp8_dims: int, f16: bool,
                    dot: str = "exact") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """ops.attention_input's sequence as the cpu backend runs it op by op (qmatmul_norm_rope for q_a, q_b and kv, the
    rotations by `cos_sin` [M, P] each, store_rows of the kv rows), in one C call (glue.c's glue_attention_input: q_a
    and kv in one pool pass, the rows rounded once per rounding kind under q8) and with its bits; None where
    `products` would not serve the three products, or the cache is not contiguous float32 rows of `hd`, or the
    arguments do not fit (the separate ops then say what is wrong). The products are bound once (`FUSED`); their
    outputs, the kv rows and the rounded rows are the thread's scratch."""
    M, K = x.shape if x.dim() == 2 else (0, 0)
    r, n = q_a.shape[0], q_b.shape[0]
    if not 0 < M <= kernels.MAX_ROWS or not ready() or K != q_a.shape[-1] or kv.shape != (hd, K) \
            or q_b.shape[-1] != r or n % hd or cache.dtype != torch.float32 or not cache.is_contiguous() \
            or cache.dim() != 2 or cache.shape[1] != hd or fp8_dims % 64 or not 0 <= fp8_dims <= hd \
            or slots.shape != (M,):
        return None
    weights = (q_a, kv, q_b)
    bound = fused_binding(weights, ("attention_input", dot), lambda: bind_products(weights, (False,) * 3, dot))
    if bound is None:
        return None
    x = f32(x)
    ids = int64(slots)
    (kind_a, kind_kv, kind_b), (bytes_a, bytes_kv, bytes_b) = bound.kinds, bound.row_bytes
    shared = kind_kv == kind_a      # one rounding of x for both products
    q_lat, q = torch.empty(M, r, dtype=torch.float32), torch.empty(M, n, dtype=torch.float32)
    norm_a, norm_kv = (None if w is None else f32(w) for w in (q_a_norm, kv_norm))
    cos, sin = f32(cos_sin[0]), f32(cos_sin[1])
    f = FLOAT_BYTES * M
    with SCRATCH(f * r, f * hd, f * hd, f * n, M * bytes_a, 0 if shared else M * bytes_kv,
                 M * bytes_b) as (y_a, y_kv, kv_row, y_b, xq_a, xq_kv, xq_b):
        rows_a = x.data_ptr() if kind_a < 0 else xq_a
        bound.rows((M, M, M), (rows_a, rows_a if shared else xq_kv, q_lat.data_ptr() if kind_b < 0 else xq_b),
                   (y_a, y_kv, y_b))
        rc = _lib().glue_attention_input(bound.args, kind_a, kind_kv, kind_b, x.data_ptr(), kernels.threads(),
                                         None if norm_a is None else norm_a.data_ptr(),
                                         None if norm_kv is None else norm_kv.data_ptr(), eps, hd, cos.data_ptr(),
                                         sin.data_ptr(), cos.shape[-1], q_lat.data_ptr(), q.data_ptr(), kv_row,
                                         cache.data_ptr(), cache.shape[0], ids.data_ptr(), fp8_dims, int(f16))
    if rc == 1:
        raise ValueError(f"attention_input: a slot is outside the cache's {cache.shape[0]} rows")
    if rc:
        raise ValueError(f"attention_input: unsupported call ({type_name(q_a)}, {type_name(kv)}, {type_name(q_b)}, "
                         f"dot={dot})")
    return q_lat, q, cache


def indexer_query(q_lat: torch.Tensor, x: torch.Tensor, q_b: QTensor, proj: QTensor, di: int,
                  cos_sin: tuple[torch.Tensor, torch.Tensor], sim: bool, root: float,
                  dot: str = "exact") -> tuple[torch.Tensor, torch.Tensor] | None:
    """ops.indexer_query's sequence as the cpu backend runs it op by op (the two products, rope_tail by `cos_sin`
    [M, P], hadamard and fp4_sim with `sim`, the float32 division by `root`), in one C call (glue.c's
    glue_indexer_query: both products in one pool pass) and with its bits; None where `products` would not serve both
    products or the arguments do not fit (the separate ops then say what is wrong). The products are bound once
    (`FUSED`); their outputs and rounded rows are the thread's scratch."""
    M = q_lat.shape[0]
    n, h = q_b.shape[0], proj.shape[0]
    if not 0 < M <= kernels.MAX_ROWS or not ready() or q_lat.dim() != 2 or x.dim() != 2 or x.shape[0] != M \
            or q_lat.shape[1] != q_b.shape[-1] or x.shape[1] != proj.shape[-1] or n != h * di \
            or sim and (di & (di - 1) or di % 32):
        return None
    weights = (q_b, proj)
    bound = fused_binding(weights, ("indexer_query", dot), lambda: bind_products(weights, (False, False), dot))
    if bound is None:
        return None
    q_lat, x = f32(q_lat), f32(x)
    (kind_q, kind_w), (bytes_q, bytes_w) = bound.kinds, bound.row_bytes
    q, w = torch.empty(M, h, di, dtype=torch.float32), torch.empty(M, h, dtype=torch.float32)
    cos, sin = f32(cos_sin[0]), f32(cos_sin[1])
    with SCRATCH(FLOAT_BYTES * M * n, FLOAT_BYTES * M * h, M * bytes_q, M * bytes_w) as (y_q, y_w, xq_q, xq_w):
        bound.rows((M, M), (q_lat.data_ptr() if kind_q < 0 else xq_q, x.data_ptr() if kind_w < 0 else xq_w),
                   (y_q, y_w))
        rc = _lib().glue_indexer_query(bound.args, kind_q, kind_w, q_lat.data_ptr(), x.data_ptr(), kernels.threads(),
                                       di, cos.data_ptr(), sin.data_ptr(), cos.shape[-1], int(sim), math.sqrt(di),
                                       root, q.data_ptr(), w.data_ptr())
    if rc:
        raise ValueError(f"indexer_query: unsupported call ({q_b.qtype.name}, {proj.qtype.name}, dot={dot})")
    return q, w


GROUP_IDS: dict[tuple[int, int], torch.Tensor] = {}     # (groups, M) -> each grouped row's group (read only)


def group_ids(groups: int, M: int) -> torch.Tensor:
    """[0]*M + [1]*M + ... + [groups-1]*M as int64, made once per (groups, M) (M <= MAX_ROWS, so few)."""
    ids = GROUP_IDS.get((groups, M))
    if ids is None:
        ids = GROUP_IDS[groups, M] = torch.arange(groups).repeat_interleave(M)
    return ids


def bind_output(wa: QTensor | Repacked, wb: QTensor | Repacked, groups: int, dot: str) -> BoundProducts | None:
    """attention_output's two products bound: the groups of `wa` as a stack of experts, then `wb`."""
    n, K = wa.shape[0] // groups, wa.shape[1]
    stack = groups_of(wa, groups) if type(wa) in REPACKED else QTensor(wa.qtype, (groups, n, K),
                                                                       wa.data.reshape(groups, n, -1), wa.name)
    return None if stack is None else bind_products((stack, wb), (True, False), dot)


def attention_output(o: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], wa: QTensor, wb: QTensor,
                     groups: int, dot: str = "exact") -> torch.Tensor | None:
    """ops.attention_output's sequence as the cpu backend runs it op by op (the inverse rotation by `cos_sin`, the
    grouped product over the groups as a stack of experts, the output product), in one C call (glue.c's
    glue_attention_output) and with its bits; None where `products` would not serve both products as that. The
    products are bound once (`FUSED`); the rotated, regrouped and rounded rows and the grouped product's output are
    the thread's scratch."""
    M, H, hd = o.shape
    K, n = H * hd // groups, wa.shape[0] // groups
    if M * groups > kernels.MAX_ROWS or not ready() or wa.shape[1] != K or wb.shape[-1] != groups * n:
        return None
    bound = fused_binding((wa, wb), ("attention_output", groups, dot), lambda: bind_output(wa, wb, groups, dot))
    if bound is None:
        return None
    o = f32(o)
    (kind_a, kind_b), (bytes_a, bytes_b) = bound.kinds, bound.row_bytes
    out = torch.empty(M, wb.shape[0], dtype=torch.float32)
    cos, sin = f32(cos_sin[0]), f32(cos_sin[1])
    f = FLOAT_BYTES * groups * M
    with SCRATCH(FLOAT_BYTES * o.numel(), f * K, f * n, f * n, groups * M * bytes_a, M * bytes_b) as (rot, xs, u, y,
                                                                                                     xq, uq):
        bound.rows((groups * M, M), (xs if kind_a < 0 else xq, u if kind_b < 0 else uq), (y, out.data_ptr()))
        bound.args[0].experts = group_ids(groups, M).data_ptr()
        rc = _lib().glue_attention_output(bound.args, kind_a, kind_b, o.data_ptr(), M, H, hd, cos.data_ptr(),
                                          sin.data_ptr(), cos.shape[-1], groups, rot, xs, u, kernels.threads())
    if rc:
        raise ValueError(f"attention_output: unsupported call ({type_name(wa)}, {type_name(wb)}, dot={dot})")
    return out


def compressor_store(x: torch.Tensor, kv: QTensor, gate: QTensor, ape: torch.Tensor, ape_rows: torch.Tensor,
                     slots: torch.Tensor, kv_ring: torch.Tensor, score_ring: torch.Tensor,
                     dot: str = "exact") -> tuple[torch.Tensor, torch.Tensor] | None:
    """ops.compressor_store's sequence as the cpu backend runs it op by op (both products, the position bias added,
    the two ring writes), in one C call (glue.c's glue_compressor_store, the rows rounded once per rounding kind under
    q8, the products in one pool pass) and with its bits; None where `products` would not serve both products or the
    rings are not contiguous float32. The products are bound once (`FUSED`); their outputs and rounded rows are the
    thread's scratch."""
    rings = (kv_ring, score_ring)
    if not ready() or x.dim() != 2 or x.shape[0] > kernels.MAX_ROWS or kv.shape != gate.shape \
            or x.shape[1] != kv.shape[-1] \
            or any(r.dtype != torch.float32 or not r.is_contiguous() or r.shape[1:] != kv.shape[:1] for r in rings):
        return None
    bound = fused_binding((kv, gate), ("compressor_store", dot), lambda: bind_products((kv, gate), (False, False), dot))
    if bound is None:
        return None
    x, ape = f32(x), f32(ape)
    ids, at = int64(ape_rows), int64(slots)
    if ids.shape != (x.shape[0],) or at.shape != ids.shape or ape.shape[1:] != kv.shape[:1]:
        raise ValueError(f"compressor_store: ape {tuple(ape.shape)}, ape_rows {tuple(ape_rows.shape)}, slots "
                         f"{tuple(slots.shape)} for {x.shape[0]} rows of {kv.shape[0]} values")
    M, c = x.shape[0], kv.shape[0]
    (kind_kv, kind_gate), (bytes_kv, bytes_gate) = bound.kinds, bound.row_bytes
    shared = kind_gate == kind_kv       # one rounding for both products
    with SCRATCH(FLOAT_BYTES * M * c, FLOAT_BYTES * M * c, M * bytes_kv,
                 0 if shared else M * bytes_gate) as (y_kv, y_gate, xq_kv, xq_gate):
        rows_kv = x.data_ptr() if kind_kv < 0 else xq_kv
        bound.rows((M, M), (rows_kv, rows_kv if shared else xq_gate), (y_kv, y_gate))
        rc = _lib().glue_compressor_store(bound.args, kind_kv, kind_gate, x.data_ptr(), kernels.threads(),
                                          ape.data_ptr(), ape.shape[0], ids.data_ptr(), at.data_ptr(),
                                          kv_ring.shape[0], kv_ring.data_ptr(), score_ring.data_ptr())
    if rc == 1:
        raise ValueError(f"compressor_store: a slot outside the rings' {kv_ring.shape[0]} rows or an ape row outside "
                         f"its {ape.shape[0]}")
    if rc:
        raise ValueError(f"compressor_store: unsupported call ({kv.qtype.name}, {gate.qtype.name}, dot={dot})")
    return kv_ring, score_ring
