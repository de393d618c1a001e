"""One sub-layer's HC post step followed by the next sub-layer's pre step (with its product and norms) as one op.

Contract: `hc_post_pre_norm(X [M, S, D], y [M, D], post [M, S], comb [M, S, S], fn QTensor [2S + S², S·D], scale [3],
base [2S + S²], norm [D], iters, hc_eps, rms_eps) -> (X' [M, S, D], x [M, D], post' [M, S], comb' [M, S, S])` with
`X' = hc_post(X, y, post, comb)` and `(x, post', comb') = hc_pre_norm(X', fn, scale, base, norm, iters, hc_eps,
rms_eps)` (docs/model.md §3.2-3.3: the attention's post step and the FFN's pre step of a block). The reference is that
sequence of references, so the unfused ops are its oracle; it is batch-invariant as they are. Backends run it as one
call (the cpu backend: one C call, backends/cpu/glue.c).
"""
from __future__ import annotations

from collections.abc import Callable

from ops.hc_post import hc_post as reference_hc_post
from ops.hc_pre_norm import hc_pre_norm as reference_hc_pre_norm

BATCH_INVARIANT = True


def hc_post_pre_norm_of(hc_post: Callable, hc_pre_norm: Callable) -> Callable:
    """`hc_post_pre_norm` made of the given implementations of its two ops (a backend passes its own)."""

    def hc_post_pre_norm(X, y, post, comb, fn, scale, base, norm, iters: int, hc_eps: float, rms_eps: float):
        """The new HC state and the next sub-layer's normed input, post and comb."""
        X = hc_post(X, y, post, comb)
        return (X, *hc_pre_norm(X, fn, scale, base, norm, iters, hc_eps, rms_eps))

    return hc_post_pre_norm


hc_post_pre_norm = hc_post_pre_norm_of(reference_hc_post, reference_hc_pre_norm)
