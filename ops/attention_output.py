"""Attention's output path: the heads rotated back, the grouped projection and the output projection as one op.

Contract: `attention_output(o [M, H, hd], positions [M] int64, freqs [r/2], wa QTensor [G·R, H·hd/G], wb QTensor
[D', G·R], groups G) -> float32 [M, D']`: `u = grouped_qmatmul(rope_tail(o, positions, freqs, inverse=True)
.reshape(M, G, H·hd/G), wa)` and `qmatmul(u, wb)` (docs/model.md §3.4 step 8). The reference is that sequence of
references, so the unfused ops are its oracle; it is batch-invariant as they are. Backends run it as one call (the
cpu backend: one C call, backends/cpu/glue.c).
"""
from __future__ import annotations

from collections.abc import Callable

from ops.grouped_qmatmul import grouped_qmatmul as reference_grouped_qmatmul
from ops.qmatmul import qmatmul as reference_qmatmul
from ops.rope_tail import rope_tail as reference_rope_tail

BATCH_INVARIANT = True


def check_groups(o, wa, groups: int) -> None:
    """ValueError unless `groups` divides the rows of `wa` and the heads' values of a row of `o` into its columns."""
    values = o.shape[1] * o.shape[2]
    if groups < 1 or wa.shape[0] % groups or values != groups * wa.shape[1]:
        raise ValueError(f"attention_output: {groups} groups do not fit heads {tuple(o.shape[1:])} and "
                         f"{wa.name or 'weight'} {tuple(wa.shape)} (rows a multiple of the groups, "
                         f"{values} values = groups x {wa.shape[1]})")


def attention_output_of(rope_tail: Callable, grouped_qmatmul: Callable, qmatmul: Callable) -> Callable:
    """`attention_output` made of the given implementations of its three ops (a backend passes its own)."""

    def attention_output(o, positions, freqs, wa, wb, groups: int):
        """The attention sub-layer's output [M, D'] from the heads' outputs `o` [M, H, hd]."""
        check_groups(o, wa, groups)
        M = o.shape[0]
        u = grouped_qmatmul(rope_tail(o, positions, freqs, inverse=True).reshape(M, groups, -1), wa)
        return qmatmul(u, wb)

    return attention_output


attention_output = attention_output_of(reference_rope_tail, reference_grouped_qmatmul, reference_qmatmul)
