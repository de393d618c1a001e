"""The fused ops on the CPU (contracts: ops/hc_pre_norm.py, ops/hc_post_pre_norm.py, ops/qmatmul_norm_rope.py,
ops/attention_output.py, ops/compressor_store.py, ops/attention_input.py, ops/indexer_query.py): each sequence in one
C call (backends/cpu/glue.c: the products through the kernel pool, the norms, the HC steps, the rotations and the
ring and cache writes chained), the bits of the cpu backend's own ops called one by one. Where the kernels do not
serve a product (F32 weights, more than 16 rows, no library, a compiled step) the sequence runs as those ops.
Row-wise, so batch-invariant."""
from __future__ import annotations

from functools import partial

import torch

from backends.cpu.hc import hc_post, hc_pre
from backends.cpu.qmatmul import grouped_qmatmul, qmatmul
from backends.cpu.rowops import cos_sin, fp4_sim, hadamard, rms_norm, rope_tail, store_rows
from backends.registry import register
from ops.attention_input import attention_input_of
from ops.attention_output import attention_output_of, check_groups
from ops.compressor_store import compressor_store_of
from ops.hc_post_pre_norm import hc_post_pre_norm_of
from ops.hc_pre_norm import hc_pre_norm_of
from ops.indexer_query import indexer_query_of
from ops.qmatmul_norm_rope import check_width, qmatmul_norm_rope_of
from ops.quants import QTensor

from . import glue


@register("hc_pre_norm", "cpu", batch_invariant=True)
def hc_pre_norm(X: torch.Tensor, fn: QTensor, scale: torch.Tensor, base: torch.Tensor, norm: torch.Tensor,
                iters: int, hc_eps: float, rms_eps: float,
                dot: str = "exact") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The normed sub-layer input, post and comb of HC state `X`; `dot` as in qmatmul."""
    out = glue.hc_pre_norm(X, fn, scale, base, norm, iters, hc_eps, rms_eps, dot)
    if out is not None:
        return out
    return hc_pre_norm_of(rms_norm, partial(qmatmul, dot=dot), hc_pre)(X, fn, scale, base, norm, iters, hc_eps,
                                                                       rms_eps)


@register("hc_post_pre_norm", "cpu", batch_invariant=True)
def hc_post_pre_norm(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: QTensor,
                     scale: torch.Tensor, base: torch.Tensor, norm: torch.Tensor, iters: int, hc_eps: float,
                     rms_eps: float, dot: str = "exact") -> tuple[torch.Tensor, ...]:
    """The new HC state and the next sub-layer's normed input, post and comb; `dot` as in qmatmul."""
    out = glue.hc_pre_norm(X, fn, scale, base, norm, iters, hc_eps, rms_eps, dot, after=(y, post, comb))
    if out is not None:
        return out
    return hc_post_pre_norm_of(hc_post, partial(hc_pre_norm, dot=dot))(X, y, post, comb, fn, scale, base, norm, iters,
                                                                       hc_eps, rms_eps)


@register("qmatmul_norm_rope", "cpu", batch_invariant=True)
def qmatmul_norm_rope(x: torch.Tensor, w: QTensor, norm: torch.Tensor | None, eps: float, width: int | None = None,
                      positions: torch.Tensor | None = None, freqs: torch.Tensor | None = None,
                      dot: str = "exact") -> torch.Tensor:
    """`x @ W.T`, RMS-normed per group of `width` outputs, the groups' tails rotated at `positions`; `dot` as in
    qmatmul."""
    width = check_width(w.shape[0], width, w.name or "weight")
    angles = None if positions is None or not glue.ready() else cos_sin(positions, freqs)
    out = glue.qmatmul_norm_rope(x, w, norm, eps, width, angles, dot)
    if out is not None:
        return out
    return qmatmul_norm_rope_of(partial(qmatmul, dot=dot), rms_norm, rope_tail)(x, w, norm, eps, width, positions,
                                                                                freqs)


@register("attention_output", "cpu", batch_invariant=True)
def attention_output(o: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, wa: QTensor, wb: QTensor,
                     groups: int, dot: str = "exact") -> torch.Tensor:
    """The attention sub-layer's output from the heads' outputs `o`; `dot` as in qmatmul."""
    check_groups(o, wa, groups)
    out = None if not glue.ready() else glue.attention_output(o, cos_sin(positions, freqs), wa, wb, groups, dot)
    if out is not None:
        return out
    return attention_output_of(rope_tail, partial(grouped_qmatmul, dot=dot), partial(qmatmul, dot=dot))(
        o, positions, freqs, wa, wb, groups)


@register("compressor_store", "cpu", batch_invariant=True)
def compressor_store(x: torch.Tensor, kv: QTensor, gate: QTensor, ape: torch.Tensor, ape_rows: torch.Tensor,
                     slots: torch.Tensor, kv_ring: torch.Tensor, score_ring: torch.Tensor,
                     dot: str = "exact") -> tuple[torch.Tensor, torch.Tensor]:
    """The rings with the rows' compressor kv and score written at `slots`; `dot` as in qmatmul."""
    out = glue.compressor_store(x, kv, gate, ape, ape_rows, slots, kv_ring, score_ring, dot)
    if out is not None:
        return out
    return compressor_store_of(partial(qmatmul, dot=dot), store_rows)(x, kv, gate, ape, ape_rows, slots, kv_ring,
                                                                      score_ring)


@register("attention_input", "cpu", batch_invariant=True)
def attention_input(x: torch.Tensor, q_a: QTensor, q_a_norm: torch.Tensor | None, q_b: QTensor, kv: QTensor,
                    kv_norm: torch.Tensor | None, eps: float, head_dim: int, positions: torch.Tensor,
                    freqs: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, fp8_dims: int = 0, f16: bool = False,
                    dot: str = "exact") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_lat, q, cache with the rows' kv written at `slots`) of a layer's attention input; `dot` as in qmatmul."""
    if glue.ready():
        out = glue.attention_input(x, q_a, q_a_norm, q_b, kv, kv_norm, eps, head_dim, cos_sin(positions, freqs), cache,
                                   slots, fp8_dims, f16, dot)
        if out is not None:
            return out
    return attention_input_of(partial(qmatmul_norm_rope, dot=dot), store_rows)(
        x, q_a, q_a_norm, q_b, kv, kv_norm, eps, head_dim, positions, freqs, cache, slots, fp8_dims, f16)


@register("indexer_query", "cpu", batch_invariant=True)
def indexer_query(q_lat: torch.Tensor, x: torch.Tensor, q_b: QTensor, proj: QTensor, head_dim: int,
                  positions: torch.Tensor, freqs: torch.Tensor, sim: bool, root: float,
                  dot: str = "exact") -> tuple[torch.Tensor, torch.Tensor]:
    """(the indexer's queries [M, Hi, di], its head weights [M, Hi]) of a layer's rows; `dot` as in qmatmul."""
    if glue.ready():
        out = glue.indexer_query(q_lat, x, q_b, proj, head_dim, cos_sin(positions, freqs), sim, root, dot)
        if out is not None:
            return out
    return indexer_query_of(partial(qmatmul, dot=dot), rope_tail, hadamard, fp4_sim)(q_lat, x, q_b, proj, head_dim,
                                                                                    positions, freqs, sim, root)
