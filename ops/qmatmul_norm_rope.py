"""A projection with its norm and rotation: qmatmul, rms_norm over groups of its outputs, then rope_tail.

Contract: `qmatmul_norm_rope(x [M, K], w QTensor [N, K], norm [width] or None, eps, width=None, positions [M] int64
or None, freqs [r/2] or None) -> float32 [M, N]`: `y = qmatmul(x, w)` cut into groups of `width` values (None: the
whole row), each group through `rms_norm(group, norm, eps)` and, when `positions` is given, `rope_tail` of each
group's tail at `positions` (attention's q_a -> q_a_norm, q_b -> the per-head norm and RoPE, kv -> kv_norm and RoPE;
docs/model.md §3.4). The reference is that sequence of references, so the unfused ops are its oracle; it is
batch-invariant as they are. Backends run it as one call (the cpu backend: one C call, backends/cpu/glue.c).
"""
from __future__ import annotations

from collections.abc import Callable

from ops.qmatmul import qmatmul as reference_qmatmul
from ops.rms_norm import rms_norm as reference_rms_norm
from ops.rope_tail import rope_tail as reference_rope_tail

BATCH_INVARIANT = True


def check_width(N: int, width: int | None, name: str) -> int:
    """The group width (`N` for None); ValueError unless it divides the N outputs."""
    width = N if width is None else width
    if width < 1 or N % width:
        raise ValueError(f"qmatmul_norm_rope: groups of {width} do not divide the {N} outputs of {name}")
    return width


def qmatmul_norm_rope_of(qmatmul: Callable, rms_norm: Callable, rope_tail: Callable) -> Callable:
    """`qmatmul_norm_rope` made of the given implementations of its three ops (a backend passes its own)."""

    def qmatmul_norm_rope(x, w, norm, eps: float, width: int | None = None, positions=None, freqs=None):
        """`x @ W.T`, RMS-normed per group of `width` outputs, the groups' tails rotated at `positions`."""
        N = w.shape[0]
        width = check_width(N, width, w.name or "weight")
        y = rms_norm(qmatmul(x, w).reshape(x.shape[0], N // width, width), norm, eps)
        if positions is not None:
            y = rope_tail(y, positions, freqs)
        return y.reshape(x.shape[0], N)

    return qmatmul_norm_rope


qmatmul_norm_rope = qmatmul_norm_rope_of(reference_qmatmul, reference_rms_norm, reference_rope_tail)
