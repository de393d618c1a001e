"""MLX quantized products: `qmatmul`, `grouped_qmatmul`, `embed`, `moe`, `shared_expert` (contracts in ops/<op>.py).

Exact-repack formats (Q8_0, Q4_K, MXFP4; backends/mlx/quants.py) run `mx.quantized_matmul` and, for the
routed experts, `mx.gather_qmm` with the chosen expert ids as `rhs_indices`. Dequantize formats rebuild
float32 weights with MLX ops, a tile of output rows at a time (about `TILE_ELEMS` values in flight), and
multiply with `@`. Their routed experts are gathered by index before dequantizing (decode and verify), or,
when a call routes more rows than there are experts (prefill), the stack is dequantized once per call and
served by `mx.gather_mm`. No per-expert Python loop and no read-back: routing stays on the device.
Float results differ from the torch reference only by summation order (float32 accumulation).
"""
from __future__ import annotations

import mlx.core as mx

from backends.mlx.quants import Packed, dequantize, fmt_of
from backends.mlx.select import topk_lower_index
from backends.registry import register
from ops.grouped_qmatmul import check_grouped, group_rows
from ops.moe import Experts
from ops.quants import QTensor

TILE_ELEMS = 1 << 24  # dequantized weight values materialized at once by a dequantize-format qmatmul


def check(x: mx.array, w: QTensor) -> None:
    """TypeError/ValueError unless x is float [M, K] and w a placed 2-D weight [N, K]."""
    name = w.name or "weight"
    if not isinstance(w, QTensor) or len(w.shape) != 2 or not isinstance(w.data, Packed):
        raise TypeError(f"qmatmul: {name} must be a 2-D QTensor placed for MLX, got {type(getattr(w, 'data', w))}")
    if x.ndim != 2 or x.dtype not in (mx.float32, mx.float16):
        raise TypeError(f"qmatmul: x must be float32/float16 [M, K], got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"qmatmul: x has {x.shape[1]} columns but {name} {w.shape} expects {w.shape[1]}")


def matmul_t(x: mx.array, data: Packed, n: int, k: int) -> mx.array:
    """x [..., K] @ W.T for a placed [n, k] weight (or rows of one)."""
    f = fmt_of(data)
    if f.quant is not None:
        mode, bits, group = f.quant
        return mx.quantized_matmul(x, *data.fields, transpose=True, group_size=group, bits=bits, mode=mode)
    tile = max(1, TILE_ELEMS // max(k, 1))
    if n <= tile:
        return x @ dequantize(data).T
    return mx.concatenate([x @ dequantize(data[s:s + tile]).T for s in range(0, n, tile)], axis=-1)


@register("qmatmul", "mlx")
def qmatmul(x: mx.array, w: QTensor) -> mx.array:
    """`x @ W.T` in float32 from W's MLX format."""
    check(x, w)
    return matmul_t(x.astype(mx.float32), w.data, w.shape[0], w.shape[1])


@register("grouped_qmatmul", "mlx")
def grouped_qmatmul(x: mx.array, w: QTensor) -> mx.array:
    """Each group of `x` [M, G, K] times its rows of `w` (contract: ops/grouped_qmatmul.py): one `qmatmul` per group
    on its rows' packed fields."""
    check_grouped(x, w)
    groups = x.shape[1]
    return mx.concatenate([qmatmul(x[:, g], group_rows(w, g, groups)) for g in range(groups)], axis=1)


@register("embed", "mlx")
def embed(table: QTensor, ids: mx.array) -> mx.array:
    """Rows `ids` of the table, dequantized (only those rows)."""
    return dequantize(table.data[ids])


def softplus(x: mx.array) -> mx.array:
    """torch's softplus (beta 1, threshold 20)."""
    return mx.where(x > 20, x, mx.log1p(mx.exp(mx.minimum(x, 20))))


def silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def route(x: mx.array, ids: mx.array, ex: Experts) -> tuple[mx.array, mx.array]:
    """Chosen experts [M, top_k] in increasing id order and their routing weights [M, top_k]."""
    p = mx.sqrt(softplus(qmatmul(x, ex.router)))
    if ex.tid2eid is not None:
        chosen = ex.tid2eid[ids]
    else:
        chosen = topk_lower_index(p if ex.bias is None else p + ex.bias, ex.top_k)
    w = mx.take_along_axis(p, chosen, axis=1)
    if ex.normalize:
        w = w / mx.maximum(w.sum(-1, keepdims=True), 6.1035e-5)
    w = w * ex.route_scale
    order = mx.argsort(chosen, axis=-1)   # ids within a row are distinct: a plain sort is exact
    return mx.take_along_axis(chosen, order, axis=1), mx.take_along_axis(w, order, axis=1)


def gathered(x: mx.array, w: QTensor, chosen: mx.array) -> mx.array:
    """x [M, k, 1, K] (or [M, 1, 1, K]) times expert `chosen[m, j]`'s W.T -> [M, k, 1, N]."""
    f = fmt_of(w)
    if f.quant is not None:
        mode, bits, group = f.quant
        return mx.gather_qmm(x, *w.data.fields, rhs_indices=chosen, transpose=True, group_size=group, bits=bits,
                             mode=mode)
    E, N, K = w.shape
    stack = chosen.size > E   # prefill: dequantize the whole stack once and gather it by index
    tile = max(1, TILE_ELEMS // ((E if stack else chosen.size) * K))
    outs = []
    for s in range(0, N, tile):   # output rows a tile at a time: bounded float32 weights in flight
        if stack:
            outs.append(mx.gather_mm(x, dequantize(w.data[:, s:s + tile]).swapaxes(-1, -2), rhs_indices=chosen))
        else:   # only the chosen experts' blocks, [M, k, tile, K]
            outs.append(x @ dequantize(w.data[chosen][:, :, s:s + tile]).swapaxes(-1, -2))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)


@register("moe", "mlx")
def moe(x: mx.array, ids: mx.array, experts: Experts) -> mx.array:
    """Routed-expert output of each row (shared expert not included); experts summed in increasing id order."""
    ex = experts
    if not ex.holds_all():
        raise ValueError(f"mlx moe: the stacks hold experts {ex.owned.start}..{ex.owned.stop - 1} of "
                         f"{ex.router.shape[0]}; expert parallelism runs on the torch family (torch, cpu, triton)")
    x = x.astype(mx.float32)
    chosen, w = route(x, ids, ex)
    xe = x[:, None, None, :]
    g = mx.minimum(gathered(xe, ex.gate, chosen), ex.clamp)
    u = mx.clip(gathered(xe, ex.up, chosen), -ex.clamp, ex.clamp)
    h = silu(g) * u * w[:, :, None, None]                                       # [M, k, 1, I]
    y = gathered(h, ex.down, chosen)[:, :, 0]                                    # [M, k, D]
    out = y[:, 0]
    for j in range(1, ex.top_k):
        out = out + y[:, j]
    return out


@register("shared_expert", "mlx")
def shared_expert(x: mx.array, gate: QTensor, up: QTensor, down: QTensor, clamp: float | None) -> mx.array:
    """SwiGLU of every row through the shared expert."""
    g, u = qmatmul(x, gate), qmatmul(x, up)
    if clamp is not None:
        g, u = mx.minimum(g, clamp), mx.clip(u, -clamp, clamp)
    return qmatmul(silu(g) * u, down)
