"""Fixed tiling shared by the CPU ops: shapes that do not depend on how many rows a call has.

torch's CPU kernels round differently in their vectorized body and their scalar tail (transcendentals:
exp, sigmoid, silu, softplus) and BLAS picks its kernel by the row count, so a row's result may depend
on the other rows. These helpers make the work each row sees identical for any M <= SMALL_M, and
`row_chunks` runs a prefill's rows (attention's queries) through that regime in chunks across the kernel pool.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ops.qmatmul import SMALL_M

from . import kernels

VEC = 64     # elements: a multiple of every SIMD width x unroll torch uses, so no element hits a scalar tail
GROUP = 2    # rows per dense product in the verify regime (a 2-row product costs about a 1-row one)


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


def row_chunks(run: Callable[[int, int], torch.Tensor], M: int, out: torch.Tensor, row_work: int) -> torch.Tensor:
    """`out[start:stop] = run(start, stop)` over chunks of SMALL_M of M rows, taken in turn by the kernel pool's
    threads (CHUNKS_PER_THREAD parts a thread) when the call's multiply-adds (M * row_work) reach
    kernels.SPLIT_WORK, else on the calling thread: for a batch-invariant `run` every row is its 1-row call's bits,
    whatever the thread count."""
    starts = range(0, M, SMALL_M)

    def part(first: int, last: int) -> None:
        for start in starts[first:last]:
            out[start:start + SMALL_M] = run(start, min(M, start + SMALL_M))

    parts = kernels.CHUNKS_PER_THREAD * kernels.threads() if M * row_work >= kernels.SPLIT_WORK else 1
    kernels.split(part, len(starts), parts)
    return out
