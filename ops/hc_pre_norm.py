"""Hyper-connection pre step with its product and both norms: the four ops of a sub-layer's input as one.

Contract: `hc_pre_norm(X [M, S, D], fn QTensor [2S + S², S·D], scale [3], base [2S + S²], norm [D], iters, hc_eps,
rms_eps) -> (x [M, D], post [M, S], comb [M, S, S])`: `mixes = qmatmul(rms_norm(flat X), fn)`, then
`hc_pre(X, mixes, scale, base, iters, hc_eps)`, and its `x` through `rms_norm(x, norm)` (docs/model.md §3.2, the
attention and FFN norms). The reference is that sequence of references, so the unfused ops are its oracle; it is
batch-invariant as they are. Backends run it as one call (the cpu backend: one C call, backends/cpu/glue.c).
"""
from __future__ import annotations

from collections.abc import Callable

from ops.hc_pre import hc_pre as reference_hc_pre
from ops.qmatmul import qmatmul as reference_qmatmul
from ops.rms_norm import rms_norm as reference_rms_norm

BATCH_INVARIANT = True


def hc_pre_norm_of(rms_norm: Callable, qmatmul: Callable, hc_pre: Callable) -> Callable:
    """`hc_pre_norm` made of the given implementations of its three ops (a backend passes its own)."""

    def hc_pre_norm(X, fn, scale, base, norm, iters: int, hc_eps: float, rms_eps: float):
        """The normed sub-layer input, post and comb of HC state `X`."""
        M, S, D = X.shape
        mixes = qmatmul(rms_norm(X.reshape(M, S * D), None, rms_eps), fn)
        x, post, comb = hc_pre(X, mixes, scale, base, iters, hc_eps)
        return rms_norm(x, norm, rms_eps), post, comb

    return hc_pre_norm


hc_pre_norm = hc_pre_norm_of(reference_rms_norm, reference_qmatmul, reference_hc_pre)
