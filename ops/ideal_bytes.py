"""Ideal memory traffic of each op: the bytes a perfect kernel moves for one call, given the call's arguments.

Every byte the op needs is read once and every output byte written once: all tensor arguments (weights in
their stored blocks) and the outputs, except where the contract reads a subset, which `IDEAL` states per op:
embed reads only the asked rows of its table; moe (and ffn, with its shared expert) only its router and the experts
the rows pick; sparse_attention only the listed cache rows; index_scores the keys some query sees; indexer_topk the
scores of visible columns; store_rows and attention_input write only their rows into the cache, compressor_store only
its rows into its rings. The traffic benchmark divides a kernel's measured bytes by this figure (its re-read ratio).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ops.moe import route
from ops.quants import QTensor


def nbytes(value) -> int:
    """Bytes of every tensor in `value`: a tensor, a QTensor's blocks, a dataclass's fields, a tuple or list."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, QTensor):
        return value.data.numel()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, tuple | list):
        return sum(nbytes(v) for v in value)
    return 0


def expert_bytes(w: QTensor) -> int:
    """Bytes of one expert of a stacked [E, out, in] weight."""
    return w.data[0].numel()


def embed(out, table: QTensor, ids: torch.Tensor) -> int:
    """The asked rows of the table, the ids, the output."""
    return ids.numel() * table.data.shape[-1] + nbytes(ids) + nbytes(out)


def moe(out, x: torch.Tensor, ids: torch.Tensor, ex) -> int:
    """x, ids, the router (and bias, and the hash table's rows), the experts picked (each once), the output."""
    chosen = route(x.float(), ids, ex)[0].unique().numel()
    table = 0 if ex.tid2eid is None else ids.numel() * ex.tid2eid.shape[-1] * ex.tid2eid.element_size()
    weights = chosen * (expert_bytes(ex.gate) + expert_bytes(ex.up) + expert_bytes(ex.down))
    return nbytes(x) + nbytes(ids) + nbytes(ex.router) + nbytes(ex.bias) + table + weights + nbytes(out)


def sparse_attention(out, q: torch.Tensor, kv: torch.Tensor, rows, sinks: torch.Tensor, scale: float) -> int:
    """q, the index arrays, the sinks, each listed cache row once, the output."""
    listed = [rows.raw[m, :n] for m, n in enumerate(rows.n_raw)]
    if rows.comp is not None:
        listed += [rows.comp[m, :n] for m, n in enumerate(rows.n_comp)]
    distinct = torch.cat(listed).unique() if listed else torch.empty(0)
    row_bytes = kv.shape[-1] * kv.element_size()
    return nbytes((q, rows.raw, rows.comp, sinks, out)) + int((distinct >= 0).sum()) * row_bytes


def index_scores(out, q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, visible: tuple[int, ...]) -> int:
    """q, w, the keys some query sees, the output."""
    return nbytes((q, w, out)) + max(visible, default=0) * keys.shape[-1] * keys.element_size()


def indexer_topk(out, scores: torch.Tensor, k: int, visible: torch.Tensor) -> int:
    """The visible scores of each row, the visible counts, the output."""
    return int(visible.sum()) * scores.element_size() + nbytes((visible, out))


def store_rows(out, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fp8_dims: int = 0,
               f16: bool = False) -> int:
    """The slots and rows read, the rows written into the cache (not the whole cache)."""
    return nbytes((slots, rows)) + rows.numel() * cache.element_size()


def compressor_store(out, x: torch.Tensor, kv: QTensor, gate: QTensor, ape: torch.Tensor, ape_rows: torch.Tensor,
                     slots: torch.Tensor, kv_ring: torch.Tensor, score_ring: torch.Tensor) -> int:
    """x, both weights, the position-bias rows used, the index arrays, the rows written into both rings."""
    written = 2 * slots.numel() * kv_ring.shape[-1] * kv_ring.element_size()
    return nbytes((x, kv, gate, ape_rows, slots)) + ape_rows.numel() * ape.shape[-1] * ape.element_size() + written


def attention_input(out, x: torch.Tensor, q_a: QTensor, q_a_norm, q_b: QTensor, kv: QTensor, kv_norm, eps: float,
                    head_dim: int, positions: torch.Tensor, freqs: torch.Tensor, cache: torch.Tensor,
                    slots: torch.Tensor, fp8_dims: int = 0, f16: bool = False) -> int:
    """x, the three weights and two norms, the positions, frequencies and slots, q_lat and q, the kv rows written
    into the cache."""
    read = nbytes((x, q_a, q_a_norm, q_b, kv, kv_norm, positions, freqs, slots, out[0], out[1]))
    return read + slots.numel() * cache.shape[-1] * cache.element_size()


def ffn(out, x: torch.Tensor, ids: torch.Tensor, ex, gate: QTensor, up: QTensor, down: QTensor, clamp) -> int:
    """moe's bytes (x, ids, the router, the experts picked, the output) and the shared expert's three weights."""
    return moe(out, x, ids, ex) + nbytes((gate, up, down))


IDEAL: dict[str, Callable[..., int]] = {  # op -> ideal bytes (output first, then the op's arguments)
    "embed": embed, "moe": moe, "sparse_attention": sparse_attention, "index_scores": index_scores,
    "indexer_topk": indexer_topk, "store_rows": store_rows, "compressor_store": compressor_store,
    "attention_input": attention_input, "ffn": ffn,
}


def ideal_bytes(op: str, out, *args, **kwargs) -> int:
    """Bytes a perfect kernel of `op` moves for the call `op(*args, **kwargs)` that returned `out`."""
    if op in IDEAL:
        return IDEAL[op](out, *args, **kwargs)
    return nbytes(args) + nbytes(tuple(kwargs.values())) + nbytes(out)
