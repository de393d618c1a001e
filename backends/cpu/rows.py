"""Fixed tiling shared by the CPU ops: shapes that do not depend on how many rows a call has.

torch's CPU kernels round differently in their vectorized body and their scalar tail (transcendentals:
exp, sigmoid, silu, softplus) and BLAS picks its kernel by the row count, so a row's result may depend
on the other rows. These helpers make the work each row sees identical for any M <= SMALL_M, and
`row_chunks` runs a prefill's rows through that regime in chunks across the kernel pool's threads.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ops.qmatmul import SMALL_M

from . import kernels

VEC = 64     # elements: a multiple of every SIMD width x unroll torch uses, so no element hits a scalar tail
GROUP = 2    # rows per dense product in the verify regime (a 2-row product costs about a 1-row one)
CHUNKED = 1 << 18   # values of a prefill call's input from which the row-wise ops split it across the pool
Rows = torch.Tensor | tuple[torch.Tensor, ...]


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Elementwise `fn` on `x` [..., n] with each row padded to a multiple of VEC, so every element is
    computed by the vectorized body whatever the number of rows."""
    n = x.shape[-1]
    pad = -n % VEC
    return fn(x) if pad == 0 else fn(F.pad(x, (0, pad)))[..., :n]


def grouped_product(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """`x [M, K] @ wt [K, N]` as products of exactly GROUP rows (zero rows pad the last one): every row
    goes through the same BLAS kernel whatever M is, so row r equals the 1-row call bit for bit."""
    M = x.shape[0]
    if M == GROUP:
        return x @ wt
    if M % GROUP:
        x = F.pad(x, (0, 0, 0, GROUP - M % GROUP))
    if x.shape[0] == GROUP:
        return (x @ wt)[:M]
    return torch.cat([x[i:i + GROUP] @ wt for i in range(0, x.shape[0], GROUP)])[:M]


def split_rows(x: torch.Tensor) -> bool:
    """Whether a row-wise op runs `x` in row_chunks: a prefill call of CHUNKED values or more, on more than one
    thread (on one the whole call is the same bits, in fewer torch calls)."""
    return x.shape[0] > SMALL_M and x.numel() >= CHUNKED and kernels.threads() > 1


def row_chunks(run: Callable[[int, int], Rows], M: int, out: torch.Tensor | None = None) -> Rows:
    """`run(start, stop)` on chunks of SMALL_M of M rows, taken in turn by the kernel pool's threads, the outputs
    (a tensor or a tuple of them) written into `out` or concatenated by row: for a batch-invariant `run` every row
    is its 1-row call's bits, whatever the thread count."""
    starts = range(0, M, SMALL_M)
    parts: list[Rows | None] = [None] * len(starts)

    def part(first: int, last: int) -> None:
        for i in range(first, last):
            start, stop = starts[i], min(M, starts[i] + SMALL_M)
            if out is None:
                parts[i] = run(start, stop)
            else:
                out[start:stop] = run(start, stop)

    kernels.split(part, len(starts), len(starts))
    if out is not None:
        return out
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(rows) for rows in zip(*parts, strict=True))
    return torch.cat(parts)
