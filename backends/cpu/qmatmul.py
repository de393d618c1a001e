"""qmatmul on the CPU without dequantizing a whole weight at once (contract: ops/qmatmul.py), and grouped_qmatmul
(ops/grouped_qmatmul.py) with all groups in one pass of the kernel pool.

- F32 weights are multiplied in place: the stored blocks are viewed as a float32 matrix (no copy).
- The types qgemv.c reads (`kernels.GGML_TYPE`: F16, BF16, the legacy Q4/Q5/Q8_0, K-quants, the IQ and TQ
  types, MXFP4) with M <= SMALL_M (decode, verify) go through the fused dequantize-and-multiply kernel
  (backends/cpu/qgemv.c): each block is dequantized into a small buffer and used by every row at once, so the
  weight is read once, in its stored size, and never materialized.
  F32 weights of STREAM_BYTES or more (the LM head) take the kernel too: MKL's few-row product over
  a weight stored [N, K] is far from memory speed once the weight leaves the cache (2-row BLAS 34 ms,
  the kernel ~10 ms for the 132 MB F32 head of a 129,280-token vocabulary on an AMD EPYC core); smaller,
  cache-resident ones stay in BLAS (docs/cpu.md).
- Other types (REFERENCE_TILES, declared: qgemv.c has no block-dot for them), larger M (prefill) and
  machines without a C compiler dequantize one tile of output rows at
  a time (about TILE_BYTES of float32, so the tile stays in cache while it is multiplied). A prefill batch of a
  type the kernel library reads takes `kernels.dense_product` (qgemm.c's dense_gemm): each tile dequantized once
  (the reference's values) and multiplied by every row in C, the output rows split across the kernel pool, each
  output the same bits for any M and thread count (1.2-2.2x BLAS on the tiles at M = 32, docs/cpu.md, "Prefill");
  the other types' tiles are taken in turn by the kernel pool's threads (`kernels.split`).
- `dot="q8"` (`--cpu-dot q8`, OpSet(cpu_dot="q8")): for M <= SMALL_M the types qdot8.c reads
  (`kernels.Q8_TYPES`: the K-quants, the legacy types, the IQ and TQ types, MXFP4) round the activations to
  8 bits per block and multiply in integers, F16 and BF16 round them to f16 and bf16, as llama.cpp does
  (backends/cpu/qdot8.c, reference ops/q8_activations.py); for larger M, Q8_0 weights take the 8-bit GEMM
  (backends/cpu/qgemm8.c) on AMX, AVX-512 VNNI or AVX2 (its plain C path is slower than the tiles); everything else
  as above.
- Q8_0 weights repacked at load (`repack.RepackedQ8_0`: `--cpu-dot q8` with the weights in memory) take their own
  row kernel (backends/cpu/q8repack.c) and, for more than SMALL_M rows, its GEMM: the bits of qdot8 and of qgemm8 on
  the stored weight (both add whole blocks in order, ops/q8_activations.py).
- For M <= SMALL_M every path is batch-invariant without a loop over rows: the kernel does the same
  arithmetic for each row whatever M is, and dense products run in fixed groups of rows
  (`rows.grouped_product`), so row r of an M-row call equals the 1-row call bit for bit.
"""
from __future__ import annotations

import torch

from backends.cpu.rows import grouped_product
from backends.registry import declare_quants, register
from ops.grouped_qmatmul import check_grouped, group_rows
from ops.qmatmul import SMALL_M, check_args
from ops.quants import QTensor

from . import glue, kernels, repack

# Types qgemv.c does not read: served by the reference dequantizer, one tile at a time (qmatmul, moe,
# shared_expert; correct and batch-invariant, but each decode step dequantizes the weight).
REFERENCE_TILES = frozenset({"I32", "FP8_E4M3"})
declare_quants("cpu", {**dict.fromkeys(kernels.GGML_TYPE, "fused kernel (qgemv.c)"),
                       **dict.fromkeys(REFERENCE_TILES, "reference dequantize per tile")})
TILE_BYTES = 1 << 20   # float32 bytes of one dequantized weight tile
STREAM_BYTES = 1 << 20   # F32 weights this large go through the kernel for M <= SMALL_M


def dense(w: QTensor) -> torch.Tensor | None:
    """The weight as a float32 [N, K] view of its stored bytes (F32 only), else None."""
    if w.qtype.name != "F32":
        return None
    return w.data.view(torch.float32).reshape(w.shape)


def tile_bounds(w: QTensor):
    """(start, stop) of each tile of output rows of `w` (about TILE_BYTES of float32 each)."""
    N, K = w.shape
    step = max(1, TILE_BYTES // (4 * K))
    return ((start, min(N, start + step)) for start in range(0, N, step))


def tile(w: QTensor, start: int, stop: int) -> torch.Tensor:
    """Float32 rows [start, stop) of `w`, dequantized by the kernel library where it serves the type."""
    dequantize = kernels.dequantize if kernels.available(w.qtype.name, w.shape[1]) else QTensor.dequantize
    return dequantize(QTensor(w.qtype, (stop - start, w.shape[1]), w.data[start:stop]))


class BoundWeights(kernels.PerWeight):
    """Each weight's kernel arguments, bound on its first eager product of a few rows (`kernels.bind`), so later calls
    skip the checks and lookups: a decode step makes ~50 products of small weights, whose Python cost more than
    their kernels. An entry lives as long as its QTensor and is used only while the QTensor holds the same data."""

    def __init__(self):
        super().__init__()
        self.group_ids: dict[tuple[int, int], torch.Tensor] = {}

    def get(self, w: QTensor, dot: str, groups: int = 0) -> kernels.Bound | None:
        """The bound product of `w` under `dot` (made on first use), None where the kernels do not serve it; with
        `groups`, of its `groups` groups of rows as a stack of experts (grouped_qmatmul, as `glue.products` serves it:
        an 8-bit kernel under q8 or none)."""
        return self.value((w,), (dot, groups), lambda: bind(w, dot, groups))

    def ids(self, groups: int, M: int) -> torch.Tensor:
        """The expert (group) of each of the groups·M rows of a grouped product: [0]*M + [1]*M + ..."""
        ids = self.group_ids.get((groups, M))
        if ids is None:
            ids = self.group_ids[(groups, M)] = torch.arange(groups).repeat_interleave(M)
        return ids


def bind(w: QTensor, dot: str, groups: int) -> kernels.Bound | None:
    """`w`'s bound product under `dot` (`BoundWeights.get`), None where the kernels do not serve it."""
    if type(w) in repack.REPACKED:
        stack = repack.groups_of(w, groups) if groups else w
        return repack.bind(stack) if dot == "q8" and stack is not None and kernels.built() else None
    if type(w) is not QTensor or len(w.shape) != 2 or not kernels.built():
        return None
    (N, K), name = w.shape, w.qtype.name
    if groups:
        served = kernels.q8_available if dot == "q8" else kernels.available
        if name != "F32" and N % groups == 0 and served(name, K):
            stack = QTensor(w.qtype, (groups, N // groups, K), w.data.reshape(groups, N // groups, -1), w.name)
            return kernels.bind(stack, q8=dot == "q8")
    elif dot == "q8" and kernels.q8_available(name, K):
        return kernels.bind(w, q8=True)
    elif (dense(w) is None or w.data.numel() >= STREAM_BYTES) and kernels.available(name, K):
        return kernels.bind(w, q8=False)
    return None


BOUND = BoundWeights()


@register("qmatmul", "cpu", batch_invariant=True)
def qmatmul(x: torch.Tensor, w: QTensor | repack.RepackedQ8_0, dot: str = "exact") -> torch.Tensor:
    """`x @ W.T` in float32; `dot="q8"`: the types qdot8.c (M <= SMALL_M) or qgemm8.c (larger M, not plain C) reads,
    with activations rounded to 8 bits, and Q8_0 weights repacked at load (`repacked_product`). Eager calls of up to
    SMALL_M contiguous float32 rows take the weight's bound kernel call (`BOUND`: the same kernel, the same bits)."""
    if not torch.compiler.is_compiling() and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= SMALL_M:
        bound = BOUND.get(w, dot) if isinstance(w, (QTensor, *repack.REPACKED)) else None
        if bound is not None and x.shape[1] == bound.k and x.is_contiguous() and w.shape[0] == bound.n:
            return kernels.bound_product(bound, x)
    if type(w) in repack.REPACKED:
        return repacked_product(x, w, dot)
    check_args(x, w)
    x = x.to(torch.float32)
    if dot == "q8" and x.shape[0] <= SMALL_M and kernels.q8_available(w.qtype.name, w.shape[1]):
        return kernels.qdot8(x, w)
    if dot == "q8" and x.shape[0] > SMALL_M and kernels.gemm8_available(w.qtype.name, w.shape[1]):
        return kernels.qgemm8(x, w)
    product = grouped_product if x.shape[0] <= SMALL_M else torch.matmul
    weight = dense(w)
    streamed = weight is None or w.data.numel() >= STREAM_BYTES
    if streamed and x.shape[0] <= SMALL_M and kernels.available(w.qtype.name, w.shape[1]):
        return kernels.qgemv(x, w)
    if weight is not None:
        return product(x, weight.T)
    if x.shape[0] > SMALL_M and kernels.available(w.qtype.name, w.shape[1]) and w.shape[1] % 16 == 0:
        return kernels.dense_product(x, w)
    out = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32)
    bounds = list(tile_bounds(w))

    def run(first: int, last: int) -> None:
        for start, stop in bounds[first:last]:
            out[:, start:stop] = product(x, tile(w, start, stop).T)

    prefill = x.shape[0] > SMALL_M      # verify rows stay on one thread: BLAS's kernel is the same for any split
    kernels.split(run, len(bounds), kernels.CHUNKS_PER_THREAD * kernels.threads() if prefill else 1)
    return out


def repacked_product(x: torch.Tensor, w: repack.RepackedQ8_0, dot: str) -> torch.Tensor:
    """`x @ W.T` for a 2-D weight repacked at load (q8 only; ValueError otherwise): up to MAX_ROWS rows its row kernel
    (`repack.product`), more rows (prefill) its GEMM (`q8r_gemm`: each block read once for all rows); the bits of qdot8
    and qgemm8 on the stored weight."""
    repack.require_q8(dot)
    if len(w.shape) != 2 or x.dim() != 2 or x.dtype not in (torch.float32, torch.float16) or x.shape[1] != w.shape[1]:
        raise ValueError(f"qmatmul: x {x.dtype} {tuple(x.shape)} does not fit the repacked {w.name or 'weight'} "
                         f"{tuple(w.shape)}")
    (M, K), N = x.shape, w.shape[0]
    if M == 0:
        return torch.empty((0, N), dtype=torch.float32)
    if M <= kernels.MAX_ROWS:
        return repack.product(x, w)
    xq = kernels.q8_quantize(x.to(torch.float32).contiguous(), "Q8_0")
    rc, y = kernels.split_rows(kernels.lib().q8r_gemm, kernels.Q8R_TYPE, w.data, N, None, xq, M, K)
    if rc:
        raise MemoryError(f"qmatmul: no memory for {M} rows") if rc == -2 else \
            ValueError(f"qmatmul: unsupported call of the repacked {w.name or 'weight'} (M={M}, K={K})")
    return y


@register("grouped_qmatmul", "cpu", batch_invariant=True)
def grouped_qmatmul(x: torch.Tensor, w: QTensor, dot: str = "exact") -> torch.Tensor:
    """Each group of `x` [M, G, K] times its rows of `w` (contract: ops/grouped_qmatmul.py): with the kernel library
    all groups in one pass of the kernel pool (`glue.products`; a decode step's eight 4.5 MB groups were eight
    calls), each group the bits of its own `qmatmul`; else one `qmatmul` per group. Up to MAX_ROWS (group, row)
    pairs (decode, short verify) are one product over the groups as a stack of experts: the rows are handed over
    (and rounded, under q8) once; eagerly through the weight's bound call (`BOUND`, the same bits). `dot`: as in
    qmatmul."""
    if not torch.compiler.is_compiling() and x.dtype == torch.float32 and x.dim() == 3 and \
            1 <= x.shape[0] * x.shape[1] <= kernels.MAX_ROWS and isinstance(w, (QTensor, *repack.REPACKED)):
        M, groups, K = x.shape
        bound = BOUND.get(w, dot, groups)
        if bound is not None and K == bound.k and w.shape[0] == groups * bound.n:    # the bits of glue.products
            rows = groups * M
            parts = 1 if kernels.threads() == 1 else max(1, min(bound.n, kernels.pool_parts(bound.read * rows)))
            xs = x.transpose(0, 1).reshape(rows, K).contiguous()      # [G·M, K]: each group's rows together
            y = kernels.bound_product(bound, xs, BOUND.ids(groups, M), parts)
            return y.reshape(groups, M, bound.n).transpose(0, 1).reshape(M, groups * bound.n)
    if type(w) in repack.REPACKED:
        return repacked_grouped(x, w, dot)
    check_grouped(x, w)
    M, groups, K = x.shape
    n = w.shape[0] // groups
    xs = x.to(torch.float32).transpose(0, 1).contiguous()     # [G, M, K]: each group's rows contiguous
    if groups * M <= kernels.MAX_ROWS:
        stack = QTensor(w.qtype, (groups, n, K), w.data.reshape(groups, n, -1), w.name)
        out = glue.products([(xs.reshape(groups * M, K), stack, torch.arange(groups).repeat_interleave(M))], dot)
        if out is not None:
            return out[0].reshape(groups, M, n).transpose(0, 1).reshape(M, groups * n)
    calls = [(xs[g], group_rows(w, g, groups), None) for g in range(groups)]
    out = glue.products(calls, dot)
    return torch.cat(out if out is not None else [qmatmul(xg, wg, dot) for xg, wg, _ in calls], dim=1)


def repacked_grouped(x: torch.Tensor, w: repack.RepackedQ8_0, dot: str) -> torch.Tensor:
    """`grouped_qmatmul` for a 2-D weight repacked at load whose groups are whole groups of 16 rows (q8 only): up to
    MAX_ROWS (group, row) pairs as one product over its groups as a stack, else each group's rows as a product of its
    own (`glue.products`, `repacked_product`): the bits of the stored weight's."""
    repack.require_q8(dot)
    if x.dim() != 3 or len(w.shape) != 2 or x.shape[2] != w.shape[1] or repack.groups_of(w, x.shape[1]) is None:
        raise ValueError(f"grouped_qmatmul: x {tuple(x.shape)} does not fit the repacked {w.name or 'weight'} "
                         f"{tuple(w.shape)} (groups of whole groups of {repack.GROUP} rows)")
    M, groups, K = x.shape
    xs = x.to(torch.float32).transpose(0, 1).contiguous()     # [G, M, K]: each group's rows contiguous
    if groups * M <= kernels.MAX_ROWS:
        out = glue.products([(xs.reshape(groups * M, K), repack.groups_of(w, groups),
                              torch.arange(groups).repeat_interleave(M))], dot)
        if out is not None:
            return out[0].reshape(groups, M, -1).transpose(0, 1).reshape(M, w.shape[0])
    calls = [(xs[g], repack.group_rows(w, g, groups), None) for g in range(groups)]
    out = glue.products(calls, dot)
    return torch.cat(out if out is not None else [repacked_product(xg, wg, dot) for xg, wg, _ in calls], dim=1)
