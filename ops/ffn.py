"""A layer's feed-forward as one op: its routed experts and its shared expert, added.

Contract: `ffn(x [M, D], ids [M] int64, experts: Experts, gate QTensor [I, D], up QTensor [I, D], down QTensor [D, I],
clamp: float | None) -> [M, D]` float32 = `moe(x, ids, experts) + shared_expert(x, gate, up, down, clamp)` (a float32
add), docs/model.md §3.7. The reference is that sum of the two references, so the unfused ops are its oracle; it is
batch-invariant as they are. The model calls it where no rank sums the routed experts (no expert or tensor
parallelism); backends run it as one call (the cpu backend: a decode's rows in one C call, backends/cpu/glue.c).
"""
from __future__ import annotations

from collections.abc import Callable

from ops.moe import moe as reference_moe
from ops.shared_expert import shared_expert as reference_shared_expert

BATCH_INVARIANT = True


def ffn_of(moe: Callable, shared_expert: Callable) -> Callable:
    """`ffn` made of the given implementations of its two ops (a backend passes its own)."""

    def ffn(x, ids, experts, gate, up, down, clamp: float | None):
        """The routed experts' output of each row plus the shared expert's [M, D]."""
        return moe(x, ids, experts) + shared_expert(x, gate, up, down, clamp)

    return ffn


ffn = ffn_of(reference_moe, reference_shared_expert)
