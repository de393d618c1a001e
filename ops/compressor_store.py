"""A compressor's inputs of the step's rows: both projections and their ring writes as one op.

Contract: `compressor_store(x [M, D], kv QTensor [c, D], gate QTensor [c, D], ape [ratio, c], ape_rows [M] int64,
slots [M] int64, kv_ring [N, c], score_ring [N, c]) -> (kv_ring, score_ring)` with `kv_ring[slots] = qmatmul(x, kv)`
and `score_ring[slots] = qmatmul(x, gate) + ape[ape_rows]` through `store_rows` (no rounding; docs/model.md §3.5).
The reference is that sequence of references, so the unfused ops are its oracle; it is batch-invariant as they are.
Torch writes the rings in place; callers keep the results (an implementation on immutable arrays returns new ones).
Backends run it as one call (the cpu backend: one C call, backends/cpu/glue.c).
"""
from __future__ import annotations

from collections.abc import Callable

from ops.qmatmul import qmatmul as reference_qmatmul
from ops.store_rows import store_rows as reference_store_rows

BATCH_INVARIANT = True


def compressor_store_of(qmatmul: Callable, store_rows: Callable) -> Callable:
    """`compressor_store` made of the given implementations of its two ops (a backend passes its own)."""

    def compressor_store(x, kv, gate, ape, ape_rows, slots, kv_ring, score_ring):
        """The rings with the rows' compressor kv and score (gate + position bias) written at `slots`."""
        kv_ring = store_rows(kv_ring, slots, qmatmul(x, kv))
        return kv_ring, store_rows(score_ring, slots, qmatmul(x, gate) + ape[ape_rows])

    return compressor_store


compressor_store = compressor_store_of(reference_qmatmul, reference_store_rows)
