"""Python side of glue.c: the small ops of a decode step as one C call each (rms_norm, hc_pre, hc_post, the HC
stream sums, rope_tail's rotation, sparse_attention, store_rows), each the bits of its reference in ops/ (docs/cpu.md,
"Per-step overhead"). `ready()` is False where the kernel library cannot be built and inside a compiled step
(Inductor fuses the torch ops instead); the callers then take their torch paths."""
from __future__ import annotations

import ctypes

import torch

from ops.quants import QTensor

from . import kernels

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


def pair_product(x: torch.Tensor, a: QTensor, b: QTensor,
                 dot: str = "exact") -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x @ A.T, x @ B.T) for two weights of one type and shape (the shared expert's gate and up) in one kernel call
    over the pool: the kernel's by-expert rows, with B `b - a` bytes after A, so each chunk of output rows reads both
    weights; None where the kernels do not serve them or x has more than MAX_ROWS / 2 rows."""
    M, K = x.shape
    if a.qtype != b.qtype or a.shape != b.shape or 2 * M > kernels.MAX_ROWS or len(a.shape) != 2:
        return None
    q8 = dot == "q8" and kernels.q8_available(a.qtype.name, K)
    if not (q8 or kernels.available(a.qtype.name, K)) or a.qtype.name == "F32":
        return None
    k, N = _lib(), a.shape[0]
    wa, wb = a.data.contiguous(), b.data.contiguous()
    rows = f32(x).repeat(2, 1)
    rows = kernels.q8_quantize(rows, a.qtype.name) if q8 else rows
    experts = torch.arange(2).repeat_interleave(M)
    y = torch.empty((2 * M, N), dtype=torch.float32)
    parts = kernels.pool_parts(2 * wa.numel())
    kernel = k.qdot8_rows if q8 else k.qgemv
    if k.pool_rows(ctypes.cast(kernel, ctypes.c_void_p), kernels.GGML_TYPE[a.qtype.name], wa.data_ptr(),
                   wb.data_ptr() - wa.data_ptr(), experts.data_ptr(), N, K, rows.data_ptr(), 2 * M, y.data_ptr(), N,
                   parts, kernels.threads()):
        raise ValueError(f"pair_product: unsupported call ({a.qtype.name}, M={M}, K={K}, dot={dot})")
    return y[:M], y[M:]


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
