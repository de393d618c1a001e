"""Triton quantized matmul `y = x @ W.T` reading W's raw GGUF blocks; contract in `ops/qmatmul.py`.

One kernel, two configurations chosen by the number of rows M:
- decode and verify (M <= 16): BLOCK_M is fixed at 16 (rows past M are masked), so every M in
  1..16 runs the very same compiled program and one weight read serves all rows. When N alone
  gives too few programs to fill the GPU, K is split into a fixed number of ranges (chosen from
  N, K and the device, never from M) whose partial sums a second kernel adds in a fixed order:
  deterministic, no atomics.
- prefill (M > 16): a tiled GEMM with larger M tiles (autotuned on (N, K) on a GPU).

Each K tile is dequantized to float32 by the type's helper in `quants.py` and multiplied with
`tl.dot(..., input_precision="tf32x3")`: tensor cores with about float32 accuracy, float32
accumulation. Rows of a dot are independent and the K order depends only on the configuration,
hence batch invariance: row r of any call with M <= 16 is bit-identical to the 1-row call.
Prefill calls are invariant among themselves for a fixed (N, K) within a process (the autotuner
keys on N and K only), but not bit-equal to the M <= 16 path (different tiles and MMA shapes).
"""
from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl

from backends.registry import register
from backends.triton.quants import SUPPORTED, dequant, tables
from ds4.errors import BackendUnavailable
from ops.grouped_qmatmul import check_grouped, group_rows
from ops.qmatmul import SMALL_M, check_args

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Tile choices: ptxas (sm_90a, Triton 3.9) reports no register spills for any type with these;
# larger tiles or software pipelining (num_stages > 1) spill. Not yet tuned on a GPU.
SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}  # M-independent on purpose
PREFILL = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}  # interpreter's prefill
PREFILL_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=1)
    for bm, bn, bk, w in [(64, 64, 32, 4), (128, 64, 32, 8), (64, 128, 32, 8), (64, 64, 64, 8)]
]


@triton.jit
def accumulate_w_xt(acc, rows, n_mask, x_cols, m_mask, k_start, k_end, K, grid_ptr, signs_ptr,
                    QTYPE: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc[BLOCK_N, BLOCK_M] += W[rows, k_start:k_end] @ x[cols, k_start:k_end].T, one K tile at a time.

    `rows` are uint8 pointers to weight rows [BLOCK_N, 1] (an expert kernel adds its expert offset),
    `x_cols` pointers to activation rows [1, BLOCK_M] (a gathered set of tokens works the same way).
    """
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = dequant(QTYPE, rows, k[None, :], n_mask & (k[None, :] < K), grid_ptr, signs_ptr)
        x_t = tl.load(x_cols + k[:, None], mask=(k[:, None] < K) & m_mask, other=0.0)
        acc = tl.dot(w, x_t.to(tl.float32), acc, input_precision="tf32x3")
    return acc


@triton.jit(do_not_specialize=["M"])
def qmatmul_kernel(x_ptr, w_ptr, out_ptr, grid_ptr, signs_ptr, M, N, K, stride_xm, row_bytes, k_per_split,
                   QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pid_k] (M x N, float32) = x[:, K range of pid_k] @ W[:, same range].T, computed as W @ x.T tiles."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(2)
    n_mask = offs_n[:, None] < N
    m_mask = offs_m[None, :] < M
    rows = w_ptr + offs_n[:, None].to(tl.int64) * row_bytes
    x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm
    k_start = pid_k * k_per_split
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc = accumulate_w_xt(acc, rows, n_mask, x_cols, m_mask, k_start, tl.minimum(K, k_start + k_per_split), K,
                          grid_ptr, signs_ptr, QTYPE, BLOCK_K)
    out = out_ptr + pid_k.to(tl.int64) * M * N + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    tl.store(out, acc, mask=n_mask & m_mask)


@triton.jit
def sum_splits_kernel(part_ptr, out_ptr, total, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out = part[0] + part[1] + ... in that order, elementwise (deterministic split-K reduction)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc, mask=mask)


prefill_kernel = qmatmul_kernel if INTERPRET else triton.autotune(PREFILL_CONFIGS, key=["N", "K", "QTYPE"])(
    qmatmul_kernel)


@cache
def split_k(n: int, k: int, device: torch.device) -> int:
    """How many K ranges the decode/verify kernel uses: enough programs to fill the device (M-independent)."""
    target = 2 if INTERPRET else 4 * torch.cuda.get_device_properties(device).multi_processor_count
    n_tiles = triton.cdiv(n, SMALL["BLOCK_N"])
    k_tiles = triton.cdiv(k, SMALL["BLOCK_K"])
    return max(1, min(k_tiles, target // n_tiles))


@register("qmatmul", "triton", batch_invariant=True)
def qmatmul(x: torch.Tensor, w) -> torch.Tensor:
    """`x @ W.T` in float32 for `x` [M, K] float32/float16 and a 2-D QTensor `w` [N, K]."""
    check_args(x, w)
    qtype = w.qtype.name
    if qtype not in SUPPORTED:
        raise BackendUnavailable(f"triton qmatmul has no kernel for quant type {qtype} (tensor {w.name or '?'}); "
                                 f"supported: {', '.join(SUPPORTED)}; use DS4_OPS=qmatmul:torch")
    if x.device != w.data.device:
        raise ValueError(f"qmatmul: x is on {x.device} but weight {w.name or '?'} is on {w.data.device}")
    if x.device.type != "cuda" and not INTERPRET:
        raise BackendUnavailable(f"triton qmatmul needs CUDA tensors, but x and weight {w.name or '?'} are on "
                                 f"{x.device}; use DS4_OPS=qmatmul:torch (or backend='torch')")
    (m, k), n = x.shape, w.shape[0]
    x = x.contiguous()
    data = w.data.contiguous()
    grid_bytes, signs = tables(x.device)
    args = (grid_bytes, signs, m, n, k, x.stride(0), data.stride(0))
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    if m > SMALL_M:
        if INTERPRET:
            grid = (triton.cdiv(n, PREFILL["BLOCK_N"]), triton.cdiv(m, PREFILL["BLOCK_M"]), 1)
            qmatmul_kernel[grid](x, data, out, *args, k, QTYPE=qtype, **PREFILL)
        else:
            def grid(meta):
                return triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]), 1
            prefill_kernel[grid](x, data, out, *args, k, QTYPE=qtype)
        return out
    splits = split_k(n, k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, SMALL["BLOCK_K"]), splits) * SMALL["BLOCK_K"]
    splits = triton.cdiv(k, k_per_split)
    part = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    qmatmul_kernel[(triton.cdiv(n, SMALL["BLOCK_N"]), 1, splits)](x, data, part, *args, k_per_split,
                                                                   QTYPE=qtype, **SMALL)
    if splits > 1:
        block = 1024
        sum_splits_kernel[(triton.cdiv(m * n, block),)](part, out, m * n, SPLITS=splits, BLOCK=block)
    return out


@register("grouped_qmatmul", "triton", batch_invariant=True)
def grouped_qmatmul(x: torch.Tensor, w) -> torch.Tensor:
    """Each group of `x` [M, G, K] times its rows of `w` (contract: ops/grouped_qmatmul.py): one `qmatmul` launch per
    group, so batch-invariant as qmatmul is (a CUDA graph records the launches together)."""
    check_grouped(x, w)
    groups = x.shape[1]
    return torch.cat([qmatmul(x[:, g], group_rows(w, g, groups)) for g in range(groups)], dim=1)
