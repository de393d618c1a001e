"""The lightning indexer's queries and head weights of a layer's rows as one op.

Contract: `indexer_query(q_lat [M, r], x [M, D], q_b QTensor [Hi·di, r], proj QTensor [Hi, D], head_dim di,
positions [M] int64, freqs [rope/2], sim: bool, root: float) -> (q float32 [M, Hi, di], w float32 [M, Hi])`, the
sequence of docs/model.md §3.6 steps 2-4: `q = rope_tail(qmatmul(q_lat, q_b) viewed [M, Hi, di], positions, freqs)`,
then with `sim` (the switch indexer_fp4_sim) `q = fp4_sim(hadamard(q))`; `w = qmatmul(x, proj) / root` (root =
sqrt(all heads · di), a float32 division). The reference is that sequence of references, so the unfused ops are its
oracle; it is batch-invariant as they are. Backends run it as one call (the cpu backend: one C call,
backends/cpu/glue.c).
"""
from __future__ import annotations

from collections.abc import Callable

from ops.fp4_sim import fp4_sim as reference_fp4_sim
from ops.hadamard import hadamard as reference_hadamard
from ops.qmatmul import qmatmul as reference_qmatmul
from ops.rope_tail import rope_tail as reference_rope_tail

BATCH_INVARIANT = True


def indexer_query_of(qmatmul: Callable, rope_tail: Callable, hadamard: Callable, fp4_sim: Callable) -> Callable:
    """`indexer_query` made of the given implementations of its four ops (a backend passes its own)."""

    def indexer_query(q_lat, x, q_b, proj, head_dim: int, positions, freqs, sim: bool, root: float):
        """(the indexer's queries [M, Hi, di], its head weights [M, Hi])."""
        q = rope_tail(qmatmul(q_lat, q_b).reshape(q_lat.shape[0], -1, head_dim), positions, freqs)
        return fp4_sim(hadamard(q)) if sim else q, qmatmul(x, proj) / root

    return indexer_query


indexer_query = indexer_query_of(reference_qmatmul, reference_rope_tail, reference_hadamard, reference_fp4_sim)
