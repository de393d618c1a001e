"""Tensor parallelism (`parallel="tp"`, docs/distributed.md): which tensors rank r of N keeps a share of.

The official inference code's split: the embedding and the LM head by vocabulary rows, attention by heads
(wq_b's heads with their sinks, the grouped wo_a's groups, wo_b by its input columns), the lightning
indexer by heads (wq_b and its head weights), the shared expert by its hidden rows (gate and up by rows,
down by columns). Routed experts split by index as under `ep` (`owned_experts`); everything else (the
shared KV head, the compressors, HC, norms, the router) is replicated. Each rank's share is a contiguous
range: rows are zero-copy views of the mapped blocks, columns a copy of whole quant blocks. A count the
ranks do not divide, or columns that would cut a quant block, is refused with a UsageError.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ds4.errors import UsageError
from models.args import ModelArgs
from ops.quants import QTensor


@dataclass(frozen=True)
class Split:
    """How one tensor splits: along `axis` (0: output rows, 1: input columns) into `units` equal parts
    (heads, groups, vocabulary rows), named `what` in errors."""

    axis: int
    units: int
    what: str


def splits(args: ModelArgs) -> dict[str, Split]:
    """The split tensors by name (without a `blk.N.` or `mtp.0.` prefix); every other tensor is replicated."""
    vocab, heads = Split(0, args.vocab_size, "vocabulary rows"), Split(0, args.n_heads, "attention heads")
    groups, index_heads = Split(0, args.o_groups, "output groups"), Split(0, args.index_n_heads, "indexer heads")
    hidden = args.moe_inter_dim * args.n_shared_experts
    shared = Split(0, hidden, "shared expert rows")
    return {"token_embd.weight": vocab, "output.weight": vocab,
            "attn_q_b.weight": heads, "attn_sinks.weight": heads,
            "attn_output_a.weight": groups, "attn_output_b.weight": Split(1, args.o_groups, "output groups"),
            "indexer.attn_q_b.weight": index_heads, "indexer.proj.weight": index_heads,
            "ffn_gate_shexp.weight": shared, "ffn_up_shexp.weight": shared,
            "ffn_down_shexp.weight": Split(1, hidden, "shared expert rows")}


def short_name(name: str) -> str:
    """A tensor name without its `blk.N.` or `mtp.0.` prefix."""
    return re.sub(r"^(blk|mtp)\.\d+\.", "", name)


@dataclass(frozen=True)
class TensorSplit:
    """Rank `rank` of `world`'s share of every split tensor."""

    rank: int
    world: int
    table: dict[str, Split]

    def part(self, size: int) -> range:
        """This rank's contiguous share of `size` elements: [rank·size/N, (rank+1)·size/N)."""
        return range(self.rank * size // self.world, (self.rank + 1) * size // self.world)

    def rows(self, name: str, shape: tuple[int, ...]) -> range | None:
        """The output rows of tensor `name` (full or short) this rank holds, None when it holds them all or the
        tensor splits by columns."""
        split = self.table.get(short_name(name))
        return self.part(shape[0]) if split is not None and split.axis == 0 else None

    def values(self, short: str, values: Any) -> Any:
        """This rank's share of a small dequantized tensor (attention sinks: its heads')."""
        split = self.table.get(short)
        if split is None:
            return values
        part = self.part(values.shape[0])
        return values[part.start:part.stop]

    def weight(self, short: str, w: QTensor) -> QTensor:
        """This rank's share of a quantized 2-D weight: a zero-copy view of its rows, or a copy of its columns
        (whole quant blocks only, else UsageError)."""
        split = self.table.get(short)
        if split is None:
            return w
        part = self.part(w.shape[split.axis])
        if split.axis == 0:
            return QTensor(w.qtype, (len(part), *w.shape[1:]), w.data[part.start:part.stop],
                           f"{w.name}[{part.start}:{part.stop}]")
        size = w.qtype.block_size
        if part.start % size or len(part) % size:
            raise UsageError(f"--parallel tp over {self.world} ranks gives each {len(part)} of the {w.shape[1]} "
                             f"columns of {w.name} ({w.qtype.name}), which cuts its blocks of {size} values: use "
                             "fewer ranks (or --parallel ep)")
        first, stop = part.start // size * w.qtype.block_bytes, part.stop // size * w.qtype.block_bytes
        return QTensor(w.qtype, (w.shape[0], len(part)), w.data[:, first:stop].contiguous(),
                       f"{w.name}[:, {part.start}:{part.stop}]")


def tensor_split(args: ModelArgs, rank: int, world: int) -> TensorSplit:
    """The split of rank `rank` of `world`; UsageError when `world` does not divide a split count (heads,
    groups, vocabulary rows, shared expert rows)."""
    for split in splits(args).values():
        if split.units % world:
            raise UsageError(f"--parallel tp cannot split the {split.units} {split.what} over {world} ranks: "
                             f"use a number of ranks that divides {split.units} (or --parallel ep)")
    return TensorSplit(rank, world, splits(args))
