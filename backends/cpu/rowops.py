"""rms_norm, rope_tail, store_rows, embed, hadamard, fp4_sim and verify_argmax on the CPU (contracts: ops/<op>.py)
in one C call each (backends/cpu/glue.c; embed through the kernel library's dequantizer; hadamard and fp4_sim, the
indexer's simulation, and verify_argmax through step.c): a decode step makes ~15-45 norms, ~6-20 rotations and a few
row writes of a few thousand values each, where every torch call costs microseconds of dispatch, tens of
microseconds once a large product has evicted the caches. rms_norm gives `ops.rms_norm.rms_norm_lanes`' bits;
rope_tail the reference's rotation of the angles' cos/sin, which are computed once per (positions, frequencies) and
reused by the other calls of the step; the others the reference's. A compiled step and a machine without the kernel
library take torch ops. Row-wise, so batch-invariant."""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from backends.registry import register
from ops.compress import compress as reference_compress
from ops.compress import pool
from ops.embed import embed as reference_embed
from ops.fp4_sim import fp4_sim as reference_fp4_sim
from ops.hadamard import hadamard as reference_hadamard
from ops.quants import QTensor
from ops.store_rows import store_rows as reference_store_rows
from ops.verify_argmax import verify_argmax as reference_verify_argmax

from . import glue, kernels

ANGLES_KEPT = 8     # (positions, frequencies) pairs whose cos/sin are kept: a step's layers use a few


@register("rms_norm", "cpu", batch_invariant=True)
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(mean(x²) + eps) (* weight)` over the last dim."""
    if glue.ready():
        return glue.rms_norm(x, weight, eps)
    return F.rms_norm(x.to(torch.float32), (x.shape[-1],), weight, eps)


_angles: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor, torch.Tensor]] = {}
_angles_lock = threading.Lock()


def cos_sin(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [M, P] of the angles positions ⊗ freqs, reused while the same two tensors (unmodified) come back
    (the q, kv and output rotations of a layer share them)."""
    key = (id(positions), id(freqs))
    kept = _angles.get(key)     # one dict lookup, atomic: a hit needs no lock
    if kept is not None and kept[0] is positions and kept[1] is freqs and kept[2] == positions._version \
            and kept[3] == freqs._version:
        return kept[4], kept[5]
    with _angles_lock:      # sessions may decode on several threads (the server)
        angle = torch.outer(positions.to(torch.float32), freqs)
        cos, sin = torch.cos(angle), torch.sin(angle)
        if len(_angles) >= ANGLES_KEPT:
            _angles.pop(next(iter(_angles)))
        _angles[key] = (positions, freqs, positions._version, freqs._version, cos, sin)
        return cos, sin


@register("store_rows", "cpu", batch_invariant=True)
def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fp8_dims: int = 0,
               f16: bool = False) -> torch.Tensor:
    """`cache` with `rows` (rounded as stored) written at `slots`: one C call, the FP8 scales taken exactly from the
    float bits (the reference's log2 can disagree only within an ulp of a power of two)."""
    if glue.ready() and cache.dtype == torch.float32 and cache.is_contiguous():
        return glue.store_rows(cache, slots, rows, fp8_dims, f16)
    return reference_store_rows(cache, slots, rows, fp8_dims, f16)


@register("rope_tail", "cpu", batch_invariant=True)
def rope_tail(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2·len(freqs) dims of `x` in adjacent pairs."""
    if glue.ready():
        cos, sin = cos_sin(positions, freqs)
        return glue.rope(x, cos, sin, inverse)
    r = 2 * freqs.shape[0]
    angle = torch.outer(positions.to(torch.float32), freqs).reshape(x.shape[0], *([1] * (x.dim() - 2)), r // 2)
    cos, sin = torch.cos(angle), torch.sin(angle)
    if inverse:
        sin = sin.neg_()
    out = x.to(torch.float32, copy=True)
    x0, x1 = x[..., -r::2].to(torch.float32), x[..., -r + 1::2].to(torch.float32)
    out[..., -r::2] = x0 * cos - x1 * sin
    out[..., -r + 1::2] = x0 * sin + x1 * cos
    return out


@register("compress", "cpu", batch_invariant=True)
def compress(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """The pooled row of each block (ops.compress); a decode's one block pooled as it is (the reference cuts the
    blocks into one-block calls and concatenates them: the same bits with two slices and a copy more)."""
    if kv.shape[0] == 1:
        return pool(kv, score)
    return reference_compress(kv, score)


@register("embed", "cpu", batch_invariant=True)
def embed(table: QTensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of `table` as float32, dequantized by the kernel library where it reads the type (the reference's
    values, in one call instead of the reference dequantizer's torch ops)."""
    if glue.ready() and table.qtype.name != "F32" and kernels.available(table.qtype.name, table.shape[1]):
        out = glue.embed(table, ids)   # the rows read in place; else gathered (torch's index errors), then
        if out is not None:            # the library's dequantizer without the dispatcher (kernels.dequantize)
            return out
        return kernels.dequantize_op(table.data[ids], kernels.GGML_TYPE[table.qtype.name], ids.shape[0], table.shape[1])
    return reference_embed(table, ids)


@register("hadamard", "cpu", batch_invariant=True)
def hadamard(x: torch.Tensor) -> torch.Tensor:
    """`x · H_n / sqrt(n)` over the last dim: the reference's butterfly in one C call."""
    n = x.shape[-1]
    if glue.ready() and n and not n & (n - 1):
        return kernels.index_sim(x, hadamard=True, fp4=False)
    return reference_hadamard(x)


@register("fp4_sim", "cpu", batch_invariant=True)
def fp4_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """E2M1 quantize-dequantize with a power-of-two scale per block of 32 in one C call; the scale is the exact
    power-of-two ceiling of amax / 6, which torch's log2 could round otherwise only within an ulp above a power of
    two (as store_rows' FP8 scales)."""
    if glue.ready() and block == 32 and x.shape[-1] and x.shape[-1] % 32 == 0:
        return kernels.index_sim(x, hadamard=False, fp4=True)
    return reference_fp4_sim(x, block)


@register("verify_argmax", "cpu", batch_invariant=True)
def verify_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 token (lowest id on ties) and its margin over the runner-up in one C pass per row (torch's argmax and
    topk read a 129,280-logit row in ~0.2 and ~0.5 ms on one thread)."""
    if glue.ready() and logits.dim() == 2 and logits.shape[1] >= 2:
        return kernels.verify_argmax(logits)
    return reference_verify_argmax(logits)
