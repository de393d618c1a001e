"""Triton row writes into caches and the token-embedding gather; contracts in `ops/store_rows.py` and
`ops/embed.py`.

- `store_rows`: one program per written row. The row is loaded once as a tile of 64-value blocks; the
  blocks inside `fp8_dims` go through the E4M3 simulation (`sims.fp8_round_blocks`, bit-exact), the
  whole row is optionally rounded to float16 and back, and the result is written straight to its slot:
  the simulation is fused into the write (one launch, no temporary row). The cache is updated in place
  and returned. Slots must lie in [0, N); a negative slot writes nothing (the reference would wrap it).
- `embed`: one program per (token, D chunk) dequantizes only the asked rows of the quantized table,
  with the same per-type helpers as `qmatmul` (`quants.dequant`), so the values equal the reference's
  dequantization bit for bit.
Both are row-wise, hence batch-invariant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.registry import register
from backends.triton.common import check_device
from backends.triton.quants import SUPPORTED, dequant, tables
from backends.triton.sims import fp8_round_blocks
from ds4.errors import BackendUnavailable

FP8_BLOCK = 64
EMBED_BLOCK = 256


@triton.jit
def store_rows_kernel(cache_ptr, slots_ptr, rows_ptr, d, stride_cache, stride_rows, fp8_blocks,
                      F16: tl.constexpr, N_BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    """cache[slots[m]] = round(rows[m]): E4M3 on the first fp8_blocks blocks, then optionally float16."""
    m = tl.program_id(0)
    slot = tl.load(slots_ptr + m)
    b = tl.arange(0, N_BLOCKS)[:, None]
    offs = b * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < d
    y = tl.load(rows_ptr + m.to(tl.int64) * stride_rows + offs, mask=mask, other=0.0).to(tl.float32)
    if fp8_blocks > 0:
        y = tl.where(b < fp8_blocks, fp8_round_blocks(y), y)
    if F16:
        y = y.to(tl.float16).to(tl.float32)
    if slot >= 0:
        tl.store(cache_ptr + slot * stride_cache + offs, y, mask=mask)


@register("store_rows", "triton", batch_invariant=True)
def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fp8_dims: int = 0,
               f16: bool = False) -> torch.Tensor:
    """`cache` (updated in place) with `rows`, rounded as stored, written at `slots`."""
    check_device(cache, "store_rows")
    M, d = rows.shape
    if cache.dim() != 2 or cache.shape[1] != d or slots.shape != (M,) or fp8_dims % FP8_BLOCK or fp8_dims > d:
        raise ValueError(f"store_rows: cache {tuple(cache.shape)}, slots {tuple(slots.shape)}, "
                         f"rows {tuple(rows.shape)}, "
                         f"fp8_dims {fp8_dims} (a multiple of {FP8_BLOCK})")
    if cache.dtype != torch.float32 or cache.stride(1) != 1:
        raise ValueError(f"store_rows: the triton kernel writes contiguous float32 rows, got {cache.dtype}")
    if M:
        rows = rows if rows.stride(1) == 1 else rows.contiguous()
        store_rows_kernel[(M,)](cache, slots.contiguous(), rows, d, cache.stride(0), rows.stride(0),
                                fp8_dims // FP8_BLOCK, F16=f16,
                                N_BLOCKS=triton.next_power_of_2(triton.cdiv(d, FP8_BLOCK)), BLOCK=FP8_BLOCK)
    return cache


@triton.jit
def embed_kernel(table_ptr, ids_ptr, out_ptr, grid_ptr, signs_ptr, D, row_bytes, QTYPE: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """out[m, chunk] = dequantize(table[ids[m]])[chunk]."""
    m = tl.program_id(0).to(tl.int64)
    row = table_ptr + tl.load(ids_ptr + m) * row_bytes
    k = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    mask = k < D
    tl.store(out_ptr + m * D + k, dequant(QTYPE, row, k, mask, grid_ptr, signs_ptr), mask=mask)


@register("embed", "triton", batch_invariant=True)
def embed(table, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the quantized `table` as float32 [M, D]."""
    check_device(ids, "embed")
    qtype = table.qtype.name
    if qtype not in SUPPORTED:
        raise BackendUnavailable(f"triton embed has no kernel for quant type {qtype} (tensor {table.name or '?'}); "
                                 f"supported: {', '.join(SUPPORTED)}; use DS4_OPS=embed:torch")
    if ids.dim() != 1 or len(table.shape) != 2:
        raise ValueError(f"embed: ids {tuple(ids.shape)} (want [M]) into table {tuple(table.shape)}")
    M, D = ids.shape[0], table.shape[1]
    data = table.data.contiguous()
    out = torch.empty((M, D), dtype=torch.float32, device=ids.device)
    if M:
        grid_bytes, signs = tables(data.device)
        embed_kernel[(M, triton.cdiv(D, EMBED_BLOCK))](data, ids.contiguous(), out, grid_bytes, signs, D,
                                                      data.stride(0), QTYPE=qtype, BLOCK_D=EMBED_BLOCK)
    return out
