"""A layer's attention input as one op: the query latent, the queries and the kv row written into the cache.

Contract: `attention_input(x [M, D], q_a QTensor [r, D], q_a_norm [r], q_b QTensor [H·hd, r], kv QTensor [hd, D],
kv_norm [hd], eps, head_dim hd, positions [M] int64, freqs [rope/2], cache [N, hd], slots [M] int64, fp8_dims=0,
f16=False) -> (q_lat float32 [M, r], q float32 [M, H·hd], cache)`, the sequence of docs/model.md §3.4 steps 2-5:
`q_lat = qmatmul_norm_rope(x, q_a, q_a_norm, eps)`, `q = qmatmul_norm_rope(q_lat, q_b, None, eps, hd, positions,
freqs)` (each head normed and its tail rotated), `kv = qmatmul_norm_rope(x, kv, kv_norm, eps, hd, positions, freqs)`
and `store_rows(cache, slots, kv, fp8_dims, f16)`. The reference is that sequence of references, so the unfused ops
are its oracle; it is batch-invariant as they are. Torch writes the cache in place; callers keep the returned one (an
implementation on immutable arrays returns a new one). Backends run it as one call (the cpu backend: one C call,
backends/cpu/glue.c).
"""
from __future__ import annotations

from collections.abc import Callable

from ops.qmatmul_norm_rope import qmatmul_norm_rope as reference_qmatmul_norm_rope
from ops.store_rows import store_rows as reference_store_rows

BATCH_INVARIANT = True


def attention_input_of(qmatmul_norm_rope: Callable, store_rows: Callable) -> Callable:
    """`attention_input` made of the given implementations of its two ops (a backend passes its own)."""

    def attention_input(x, q_a, q_a_norm, q_b, kv, kv_norm, eps: float, head_dim: int, positions, freqs, cache, slots,
                        fp8_dims: int = 0, f16: bool = False):
        """(q_lat, q, cache with the rows' kv written at `slots`)."""
        q_lat = qmatmul_norm_rope(x, q_a, q_a_norm, eps)
        q = qmatmul_norm_rope(q_lat, q_b, None, eps, head_dim, positions, freqs)
        rows = qmatmul_norm_rope(x, kv, kv_norm, eps, head_dim, positions, freqs)
        return q_lat, q, store_rows(cache, slots, rows, fp8_dims, f16)

    return attention_input


attention_input = attention_input_of(reference_qmatmul_norm_rope, reference_store_rows)
