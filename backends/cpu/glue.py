"""Python side of glue.c: the small ops of a decode step as one C call each (rms_norm, hc_pre, hc_post, the HC
stream sums, rope_tail's rotation, sparse_attention, store_rows, the routed experts' selection; the fused hc_pre_norm,
hc_post_pre_norm, qmatmul_norm_rope, attention_output and compressor_store), each the bits of its reference in ops/
(docs/cpu.md, "Per-step overhead"). `ready()` is False where the kernel library cannot be built and inside a compiled
step (Inductor fuses the torch ops instead); the callers then take their torch paths."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ops.quants import QTensor

from . import kernels
from .repack import RepackedQ4K, repacked_rows

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
        k.glue_swiglu.restype = k.glue_sum_rows.restype = None
        k.glue_swiglu.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_int, ctypes.c_float, ptr]
        k.glue_sum_rows.argtypes = [ptr, i64, i64, i64, ptr]
        k.glue_head_streams.restype = None
        k.glue_head_streams.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_float, i64, i64, i64, ptr]
        k.glue_store_rows.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]
        k.glue_hc_pre.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_float, ptr, ptr, ptr]
        k.glue_products.restype = k.glue_route.restype = k.glue_moe_rows.restype = ctypes.c_int
        k.glue_moe_rows.argtypes = [ptr, ctypes.c_int, ptr, ptr, ctypes.c_int, ctypes.c_float, ptr, i64, i64, ptr,
                                    ctypes.c_int]
        k.glue_route.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, ctypes.c_int, ctypes.c_float, ptr, ptr]
        k.glue_products.argtypes = [ptr, i64, ctypes.c_int]
        k.glue_hc_pre_norm.restype = k.glue_qmatmul_norm_rope.restype = ctypes.c_int
        k.glue_hc_pre_norm.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_float,
                                       ctypes.c_float, ptr, ptr, ptr, ctypes.c_int]
        k.glue_qmatmul_norm_rope.argtypes = [ptr, ctypes.c_int, ptr, i64, ctypes.c_float, ptr, ptr, i64, ptr]
        k.glue_attention_output.restype = k.glue_compressor_store.restype = ctypes.c_int
        k.glue_attention_output.argtypes = [ptr, ctypes.c_int, ctypes.c_int, ptr, i64, i64, i64, ptr, ptr, i64, i64,
                                            ptr, ptr, ptr, ctypes.c_int]
        k.glue_compressor_store.argtypes = [ptr, ctypes.c_int, ptr, i64, ptr, ptr, i64, ptr, ptr]
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
    out = torch.empty((M, D), dtype=torch.float32)
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
                ("H", ctypes.c_int64), ("D", ctypes.c_int64), ("L", ctypes.c_int64), ("scale", ctypes.c_float)]


ATTENTION_SPLIT = 1 << 20   # multiply-adds of a call worth splitting across the kernel pool


def attention(q: torch.Tensor, kv: torch.Tensor, listed: torch.Tensor, sinks: torch.Tensor,
              scale: float) -> torch.Tensor:
    """ops.sparse_attention.sparse_attention_lanes' bits for queries q [M, H, D] over their padded lists `listed`
    [M, L] (−1 = none) of rows of kv [N, D]; the (query, head) pairs split across the kernel pool when the call
    is large enough (each pair computed by one thread: the same bits for any thread count)."""
    q, kv, sinks, listed = f32(q), f32(kv), f32(sinks), listed.to(torch.int64).contiguous()
    M, H, D = q.shape
    L = listed.shape[1]
    out = torch.empty((M, H, D), dtype=torch.float32)
    args = AttentionArgs(q.data_ptr(), kv.data_ptr(), sinks.data_ptr(), listed.data_ptr(), H, D, L, scale)
    pairs = M * H
    parts = min(pairs, kernels.CHUNKS_PER_THREAD * kernels.threads()) if 2 * pairs * L * D >= ATTENTION_SPLIT else 1
    k = _lib()
    rc = k.pool_rows(ctypes.cast(k.glue_attention_rows, ctypes.c_void_p), 0, ctypes.addressof(args), 0, None, 0, 0,
                     None, M, out.data_ptr(), pairs, parts, kernels.threads())
    if rc:
        raise MemoryError(f"sparse_attention: no memory for the scores of {L} rows")
    return out


def hc_pre(X: torch.Tensor, mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ops.hc_pre.hc_pre_poly's bits: (x [M, D], post [M, S], comb [M, S, S])."""
    X, mixes, scale, base = f32(X), f32(mixes), f32(scale), f32(base)
    M, S, D = X.shape
    x, post, comb = torch.empty((M, D)), torch.empty((M, S)), torch.empty((M, S, S))
    if _lib().glue_hc_pre(X.data_ptr(), mixes.data_ptr(), scale.data_ptr(), base.data_ptr(), M, S, D, iters, eps,
                          x.data_ptr(), post.data_ptr(), comb.data_ptr()):
        raise MemoryError(f"hc_pre: no memory for the gates of {M} rows")
    return x, post, comb


def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fp8_dims: int, f16: bool) -> torch.Tensor:
    """ops.store_rows.store_rows into a contiguous float32 `cache` (updated in place and returned)."""
    rows, ids = f32(rows), slots.to(torch.int64).contiguous()
    M, d = rows.shape
    if cache.dtype != torch.float32 or not cache.is_contiguous() or cache.shape[1] != d or ids.shape != (M,) \
            or fp8_dims % 64 or fp8_dims > d:
        raise ValueError(f"store_rows: cache {tuple(cache.shape)} {cache.dtype}, slots {tuple(slots.shape)}, rows "
                         f"{tuple(rows.shape)}, fp8_dims {fp8_dims} (a multiple of 64)")
    if _lib().glue_store_rows(cache.data_ptr(), cache.shape[0], d, ids.data_ptr(), M, rows.data_ptr(), fp8_dims,
                              int(f16)):
        raise ValueError(f"store_rows: a slot is outside the cache's {cache.shape[0]} rows")
    return cache


class ProductArgs(ctypes.Structure):
    """glue.c's product_t: one product of a `glue_products` call."""

    _fields_ = [("fn", ctypes.c_void_p), ("type", ctypes.c_int64), ("w", ctypes.c_void_p),
                ("expert_bytes", ctypes.c_int64), ("experts", ctypes.c_void_p), ("N", ctypes.c_int64),
                ("K", ctypes.c_int64), ("x", ctypes.c_void_p), ("M", ctypes.c_int64), ("y", ctypes.c_void_p),
                ("parts", ctypes.c_int64)]


def type_name(w: QTensor | RepackedQ4K) -> str:
    """The quant type of w's values (a repacked Q4_K weight's is Q4_K)."""
    return "Q4_K" if type(w) is RepackedQ4K else w.qtype.name


def row_kernel(w: QTensor | RepackedQ4K, dot: str) -> tuple[int, int]:
    """The address of w's row kernel under `dot` and the type code it takes (a repacked weight: its own, q8 only)."""
    if type(w) is RepackedQ4K:
        return repacked_rows(dot)
    return kernels.row_kernel(dot == "q8"), kernels.GGML_TYPE[w.qtype.name]


def served(x: torch.Tensor, w: QTensor | RepackedQ4K, experts: torch.Tensor | None, dot: str) -> bool:
    """Whether `products` serves rows x with the quantized weight w (2-D, or stacked [E, N, K] with `experts`)."""
    K, name = w.shape[-1], type_name(w)
    kernel = kernels.q8_available(name, K) if dot == "q8" else kernels.available(name, K)
    shapes = len(w.shape) == 2 if experts is None else len(w.shape) == 3 and experts.shape == x.shape[:1]
    return kernel and shapes and name != "F32" and x.shape[0] <= kernels.MAX_ROWS and x.shape[-1] == K


def product_args(kernel: int | None, rows: torch.Tensor, w: QTensor | RepackedQ4K, experts: torch.Tensor | None,
                 y: torch.Tensor, alive: list, dot: str = "exact") -> ProductArgs:
    """One product of a `glue_products` call: the prepared `rows` (float32, or q8's rounded blocks) of y [M, N] times
    the weight `w` (row m: expert experts[m] of a stack) through `kernel` (None: w's row kernel under `dot`); the
    tensors whose pointers it holds are appended to `alive`."""
    data = w.data.contiguous()
    ids = None if experts is None else experts.to(torch.int64).contiguous()
    (M, N), K = y.shape, w.shape[-1]
    expert_bytes = 0 if ids is None else data[0].numel()
    read = expert_bytes * M if ids is not None else data.numel()     # at most this much weight
    alive += [rows, data, ids, y]
    kernel, code = row_kernel(w, dot) if kernel is None else (kernel, kernels.GGML_TYPE[w.qtype.name])
    return ProductArgs(kernel, code, data.data_ptr(), expert_bytes,
                       None if ids is None else ids.data_ptr(), N, K, rows.data_ptr(), M, y.data_ptr(),
                       1 if kernels.threads() == 1 else max(1, min(N, kernels.pool_parts(read))))


def products(calls: list[tuple[torch.Tensor, QTensor | RepackedQ4K, torch.Tensor | None]],
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
        y = torch.empty((x.shape[0], w.shape[-2]), dtype=torch.float32)
        args[i] = product_args(None if type(w) is RepackedQ4K else kernel, prepared[key], w, experts, y, alive, dot)
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
    out = torch.empty((M, D), dtype=torch.float32)
    _lib().glue_sum_rows(y.data_ptr(), M, K, D, out.data_ptr())
    return out


def head_streams(X: torch.Tensor, mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """ops.hc_head.head_streams_poly's bits (X [M, S, D] with S <= 64, mixes [M, S], scale [1], base [S])."""
    X, mixes, scale, base = f32(X), f32(mixes), f32(scale), f32(base)
    M, S, D = X.shape
    if S > 64:
        raise ValueError(f"hc_head: at most 64 streams, got {S}")
    out = torch.empty((M, D), dtype=torch.float32)
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
    t = None if table is None else table.to(torch.int64).contiguous()
    ids = ids.to(torch.int64).contiguous()
    if ids.shape != (M,) or (b is not None and b.shape != (E,)) or k > E:
        raise ValueError(f"moe: scores {tuple(p.shape)}, ids {tuple(ids.shape)}, top_k {k}, bias "
                         f"{None if b is None else tuple(b.shape)}")
    chosen, w = torch.empty((M, k), dtype=torch.int64), torch.empty((M, k), dtype=torch.float32)
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
    q8_rows: str | None     # the weight type whose rounding the rows take (`dot="q8"`), else None
    q8_down: int            # the rounding kind of the down product's rows (`dot="q8"`), else -1
    hq_row_bytes: int       # bytes of one rounded row of the down product's input


def bind_expert(gate: QTensor | RepackedQ4K, up: QTensor | RepackedQ4K, down: QTensor | RepackedQ4K, dot: str,
                routed: bool) -> BoundExpert | None:
    """glue_moe_rows' arguments of the three weights (`routed`: stacks [E, N, K] of experts, else 2-D; a repacked
    Q4_K stack takes its own row kernel), or None where the kernels do not serve them."""
    served = kernels.q8_available if dot == "q8" else kernels.available
    K, inner = gate.shape[-1], gate.shape[-2]
    names = tuple(type_name(t) for t in (gate, up, down))
    if not all(type(t) in (QTensor, RepackedQ4K) and len(t.shape) == (3 if routed else 2) and name != "F32"
               for t, name in zip((gate, up, down), names, strict=True)):
        return None
    if up.shape != gate.shape or down.shape[-1] != inner or down.shape[:-2] != gate.shape[:-2]:
        return None
    if not (served(names[0], K) and served(names[1], K) and served(names[2], inner)):
        return None
    if dot == "q8" and kernels.Q8_TYPES[names[1]] != kernels.Q8_TYPES[names[0]]:
        return None
    data = tuple(t.data.contiguous() for t in (gate, up, down))
    kernel_types = tuple(row_kernel(t, dot) for t in (gate, up, down))
    args = (ProductArgs * 3)(*(ProductArgs(kernel, code, d.data_ptr(), d[0].numel() if routed else 0, None,
                                           t.shape[-2], t.shape[-1], None, 0, None, 1)
                               for t, d, (kernel, code) in zip((gate, up, down), data, kernel_types, strict=True)))
    q8_down = kernels.Q8_TYPES[names[2]] if dot == "q8" else -1
    return BoundExpert(args, data, tuple(d[0].numel() if routed else d.numel() for d in data),
                       names[0] if dot == "q8" else None, q8_down,
                       kernels.q8_row_bytes(q8_down, inner) if dot == "q8" else 0)


EXPERTS = kernels.PerWeight()   # the bound expert calls, per (gate, up, down) and (dot, routed)


def moe_rows(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, chosen: torch.Tensor | None,
             w: torch.Tensor | None, clamp: float | None, dot: str = "exact") -> torch.Tensor | None:
    """The routed experts of rows x [M, D] over their chosen experts [M, k] (stack indices, -1 = not held here) with
    routing weights w [M, k] in one C call (glue.c's glue_moe_rows): the gate and up products of the M * k (row,
    expert) pairs in one pool pass, the weighted swiglu, the down product, each row's experts added in order; the
    bits of the separate calls (`products`, `swiglu`, the down product's kernel call, `sum_rows`). `chosen` None:
    the shared expert's 2-D weights, no routing weight. The weights' arguments are bound on first use (`EXPERTS`).
    None where the kernels do not serve the three weights or the pairs are more than MAX_ROWS."""
    M, k = (x.shape[0], 1) if chosen is None else chosen.shape
    if not ready() or x.dim() != 2 or x.shape[1] != gate.shape[-1] or M * k > kernels.MAX_ROWS:
        return None
    routed = chosen is not None
    bound = EXPERTS.value((gate, up, down), (dot, routed), lambda: bind_expert(gate, up, down, dot, routed))
    if bound is None:
        return None
    flat = None if chosen is None else chosen.reshape(-1).to(torch.int64).contiguous()
    xs = f32(x) if chosen is None else f32(x).repeat_interleave(k, dim=0)
    P, inner, n = xs.shape[0], gate.shape[-2], down.shape[-2]
    rows = xs if bound.q8_rows is None else kernels.q8_quantize(xs, bound.q8_rows)
    h = torch.empty((P, inner), dtype=torch.float32)
    hq = torch.empty(P * bound.hq_row_bytes, dtype=torch.uint8)
    ys = (torch.empty((P, inner), dtype=torch.float32), torch.empty((P, inner), dtype=torch.float32),
          torch.empty((P, n), dtype=torch.float32))
    threads, experts = kernels.threads(), None if flat is None else flat.data_ptr()
    for arg, src, y, read in zip(bound.args, (rows, rows, hq if bound.q8_down >= 0 else h), ys, bound.reads,
                                 strict=True):
        arg.x, arg.M, arg.y, arg.experts = src.data_ptr(), P, y.data_ptr(), experts
        arg.parts = 1 if threads == 1 else max(1, min(arg.N, kernels.pool_parts(read * P if flat is not None
                                                                                 else read)))
    weights = None if w is None else f32(w.reshape(-1))
    out = torch.empty((M, n), dtype=torch.float32)
    if _lib().glue_moe_rows(bound.args, bound.q8_down, hq.data_ptr(), None if weights is None else weights.data_ptr(),
                            clamp is not None, 0.0 if clamp is None else clamp, h.data_ptr(), M, k, out.data_ptr(),
                            threads):
        raise ValueError(f"moe: unsupported call ({type_name(gate)}, {type_name(up)}, {type_name(down)}, dot={dot})")
    return out


def hc_pre_norm(X: torch.Tensor, fn: QTensor, scale: torch.Tensor, base: torch.Tensor, norm: torch.Tensor,
                iters: int, hc_eps: float, rms_eps: float, dot: str = "exact",
                after: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...] | None:
    """ops.hc_pre_norm's sequence as the cpu backend runs it op by op (rms_norm, the product, hc_pre, rms_norm), in
    one C call (glue.c's glue_hc_pre_norm) and with its bits; None where `products` would not serve the product.
    `after` = (y, post, comb): hc_post(X, y, post, comb) first, in the same call (glue_hc_post_pre_norm), and its
    state returned first (ops.hc_post_pre_norm)."""
    X, scale, base, norm = f32(X), f32(scale), f32(base), f32(norm)
    M, S, D = X.shape
    flat = torch.empty((M, S * D), dtype=torch.float32)
    if not ready() or not served(flat, fn, None, dot):
        return None
    kind, rows = q8_rows(flat, fn, dot)
    alive: list = []
    mixes = torch.empty((M, fn.shape[0]), dtype=torch.float32)
    args = product_args(kernels.row_kernel(dot == "q8"), rows, fn, None, mixes, alive)
    x, post, comb = torch.empty((M, D)), torch.empty((M, S)), torch.empty((M, S, S))
    tail = (scale.data_ptr(), base.data_ptr(), norm.data_ptr(), M, S, D, iters, hc_eps, rms_eps, x.data_ptr(),
            post.data_ptr(), comb.data_ptr(), kernels.threads())
    if after is None:
        rc = _lib().glue_hc_pre_norm(ctypes.byref(args), kind, X.data_ptr(), flat.data_ptr(), *tail)
        out = (x, post, comb)
    else:
        y, post_in, comb_in = (f32(t) for t in after)
        Xn = torch.empty_like(X)
        rc = _lib().glue_hc_post_pre_norm(ctypes.byref(args), kind, X.data_ptr(), y.data_ptr(), post_in.data_ptr(),
                                          comb_in.data_ptr(), Xn.data_ptr(), flat.data_ptr(), *tail)
        out = (Xn, x, post, comb)
    if rc == -2:
        raise MemoryError(f"hc_pre_norm: no memory for the gates of {M} rows")
    if rc:
        raise ValueError(f"hc_pre_norm: unsupported call ({fn.qtype.name}, dot={dot})")
    return out


def qmatmul_norm_rope(x: torch.Tensor, w: QTensor, norm: torch.Tensor | None, eps: float, width: int,
                      cos_sin: tuple[torch.Tensor, torch.Tensor] | None, dot: str = "exact") -> torch.Tensor | None:
    """ops.qmatmul_norm_rope's sequence as the cpu backend runs it op by op (the product, rms_norm per group of
    `width`, the rotation by `cos_sin` [M, P] each), in one C call (glue.c's glue_qmatmul_norm_rope) and with its
    bits; None where `products` would not serve the product."""
    if not ready() or not served(x, w, None, dot):
        return None
    x = f32(x)
    rows = kernels.q8_quantize(x, w.qtype.name) if dot == "q8" else x
    M, N = x.shape[0], w.shape[0]
    alive: list = []
    y, out = torch.empty((M, N), dtype=torch.float32), torch.empty((M, N), dtype=torch.float32)
    args = product_args(kernels.row_kernel(dot == "q8"), rows, w, None, y, alive)
    w_norm = None if norm is None else f32(norm)
    cos, sin = (None, None) if cos_sin is None else (f32(cos_sin[0]), f32(cos_sin[1]))
    angles = (None, None, 0) if cos is None else (cos.data_ptr(), sin.data_ptr(), cos.shape[-1])
    norm_ptr = None if w_norm is None else w_norm.data_ptr()
    lib = _lib()
    if lib.glue_qmatmul_norm_rope(ctypes.byref(args), kernels.threads(), norm_ptr, width, eps, *angles, out.data_ptr()):
        raise ValueError(f"qmatmul_norm_rope: unsupported call ({w.qtype.name}, dot={dot})")
    return out


def q8_rows(x: torch.Tensor, w: QTensor, dot: str) -> tuple[int, torch.Tensor]:
    """The activation kind of weight `w` under q8 (-1 exact) and the buffer its rounded rows x [M, K] go to (x itself
    when exact), for a C call that rounds them."""
    if dot != "q8":
        return -1, x
    kind = kernels.Q8_TYPES[w.qtype.name]
    return kind, torch.empty(x.shape[0] * kernels.q8_row_bytes(kind, x.shape[1]), dtype=torch.uint8)


def attention_output(o: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], wa: QTensor, wb: QTensor,
                     groups: int, dot: str = "exact") -> torch.Tensor | None:
    """ops.attention_output's sequence as the cpu backend runs it op by op (the inverse rotation by `cos_sin`, the
    grouped product over the groups as a stack of experts, the output product), in one C call (glue.c's
    glue_attention_output) and with its bits; None where `products` would not serve both products as that."""
    o = f32(o)
    M, H, hd = o.shape
    K, n = H * hd // groups, wa.shape[0] // groups
    stack = QTensor(wa.qtype, (groups, n, K), wa.data.reshape(groups, n, -1), wa.name)
    experts = torch.arange(groups).repeat_interleave(M)
    xs, u = torch.empty((groups * M, K), dtype=torch.float32), torch.empty((M, groups * n), dtype=torch.float32)
    if not ready() or not served(xs, stack, experts, dot) or not served(u, wb, None, dot):
        return None
    (kind_a, rows_a), (kind_b, rows_b) = q8_rows(xs, stack, dot), q8_rows(u, wb, dot)
    alive: list = []
    y, out = torch.empty((groups * M, n), dtype=torch.float32), torch.empty((M, wb.shape[0]), dtype=torch.float32)
    kernel = kernels.row_kernel(dot == "q8")
    args = (ProductArgs * 2)(product_args(kernel, rows_a, stack, experts, y, alive),
                             product_args(kernel, rows_b, wb, None, out, alive))
    cos, sin = f32(cos_sin[0]), f32(cos_sin[1])
    rot = torch.empty_like(o)
    if _lib().glue_attention_output(args, kind_a, kind_b, o.data_ptr(), M, H, hd, cos.data_ptr(), sin.data_ptr(),
                                    cos.shape[-1], groups, rot.data_ptr(), xs.data_ptr(), u.data_ptr(),
                                    kernels.threads()):
        raise ValueError(f"attention_output: unsupported call ({wa.qtype.name}, {wb.qtype.name}, dot={dot})")
    return out


def compressor_store(x: torch.Tensor, kv: QTensor, gate: QTensor, ape: torch.Tensor, ape_rows: torch.Tensor,
                     slots: torch.Tensor, kv_ring: torch.Tensor, score_ring: torch.Tensor,
                     dot: str = "exact") -> tuple[torch.Tensor, torch.Tensor] | None:
    """ops.compressor_store's sequence as the cpu backend runs it op by op (both products, the position bias added,
    the two ring writes), in one C call (glue.c's glue_compressor_store, the products in one pool pass) and with its
    bits; None where `products` would not serve both products or the rings are not contiguous float32."""
    rings = (kv_ring, score_ring)
    if not ready() or not all(served(x, w, None, dot) for w in (kv, gate)) or kv.shape != gate.shape \
            or any(r.dtype != torch.float32 or not r.is_contiguous() or r.shape[1:] != kv.shape[:1] for r in rings):
        return None
    x, ape = f32(x), f32(ape)
    rows = {kind: kernels.q8_quantize(x, w.qtype.name) if dot == "q8" else x
            for kind, w in ((kernels.Q8_TYPES.get(w.qtype.name), w) for w in (gate, kv))}
    alive: list = []
    ys = [torch.empty((x.shape[0], kv.shape[0]), dtype=torch.float32) for _ in rings]
    kernel = kernels.row_kernel(dot == "q8")
    args = (ProductArgs * 2)(*(product_args(kernel, rows[kernels.Q8_TYPES.get(w.qtype.name)], w, None, y, alive)
                               for w, y in zip((kv, gate), ys, strict=True)))
    ids, at = ape_rows.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
    if ids.shape != (x.shape[0],) or at.shape != ids.shape or ape.shape[1:] != kv.shape[:1]:
        raise ValueError(f"compressor_store: ape {tuple(ape.shape)}, ape_rows {tuple(ape_rows.shape)}, slots "
                         f"{tuple(slots.shape)} for {x.shape[0]} rows of {kv.shape[0]} values")
    if _lib().glue_compressor_store(args, kernels.threads(), ape.data_ptr(), ape.shape[0], ids.data_ptr(),
                                    at.data_ptr(), kv_ring.shape[0], kv_ring.data_ptr(), score_ring.data_ptr()):
        raise ValueError(f"compressor_store: a slot outside the rings' {kv_ring.shape[0]} rows or an ape row outside "
                         f"its {ape.shape[0]}")
    return kv_ring, score_ring
