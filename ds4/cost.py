"""Decode cost model: decode is memory-bound, so a pass's work is the weight bytes it reads.

A pass of r rows reads every dense weight once, the LM head once when it computes logits, and the
routed experts its rows pick: at most min(n_experts, n_experts_used * r) per layer (an upper bound;
rows often share experts). Lookup tables (`token_embd`, `ffn_gate_tid2eid`) are read one row per
token and left out. Sizes come from the real model's shapes and a tensor-type mix (ds4/formats/quant_mix.py).
"""
from __future__ import annotations

import math

from ds4.formats.quant_mix import tensor_type
from ds4.tiny.build import FLASH_SIZES, tiny_metadata
from models.args import ModelArgs, model_shapes, mtp_shapes
from ops.quants import get

LOOKUPS = ("token_embd.weight", "ffn_gate_tid2eid.weight")
ROUTED = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def flash_args() -> ModelArgs:
    """ModelArgs of the real DeepSeek V4 Flash."""
    return ModelArgs.from_metadata(tiny_metadata(**FLASH_SIZES))


def tensor_bytes(name: str, shape: tuple[int, ...], mix: str) -> int:
    """Bytes of tensor `name` stored in the type `mix` gives it."""
    return math.prod(shape[:-1]) * get(tensor_type(name, shape, mix)).row_bytes(shape[-1])


def weight_bytes(args: ModelArgs, mix: str) -> dict[str, int]:
    """Bytes by part: trunk_dense, trunk_expert (one routed expert in every layer), lm_head, mtp_dense,
    mtp_expert (one routed expert of the MTP block)."""
    out = dict.fromkeys(("trunk_dense", "trunk_expert", "lm_head", "mtp_dense", "mtp_expert"), 0)
    for part, shapes in (("trunk", model_shapes(args)), ("mtp", mtp_shapes(args))):
        for name, shape in shapes.items():
            size = tensor_bytes(name, shape, mix)
            if name == "output.weight":
                out["lm_head"] += size
            elif name.endswith(ROUTED):
                out[f"{part}_expert"] += size // args.n_experts
            elif not name.endswith(LOOKUPS):
                out[f"{part}_dense"] += size
    return out


class PassCost:
    """Weight bytes read by each kind of decode pass of a model `args` stored under `mix`."""

    def __init__(self, args: ModelArgs, mix: str = "q2"):
        self.args, self.bytes = args, weight_bytes(args, mix)

    def experts(self, rows: int) -> int:
        """Routed experts a layer reads for `rows` rows (upper bound)."""
        return min(self.args.n_experts, self.args.n_experts_used * rows)

    def target_pass(self, rows: int) -> int:
        """A target forward of `rows` rows with logits."""
        b = self.bytes
        return b["trunk_dense"] + b["lm_head"] + self.experts(rows) * b["trunk_expert"]

    def mtp_catch_up(self, rows: int) -> int:
        """An MTP call of `rows` rows without the LM head (the session's catch-up)."""
        return self.bytes["mtp_dense"] + self.experts(rows) * self.bytes["mtp_expert"]

    def mtp_draft(self) -> int:
        """One MTP draft step: one row through the MTP block and the base LM head."""
        return self.mtp_catch_up(1) + self.bytes["lm_head"]

    def decode(self, metrics) -> int:
        """Bytes of the decode a SpecMetrics recorded: target decode passes and every MTP call (the
        prefill's catch-up included; the prefill's target work is the same with or without MTP)."""
        return (sum(n * self.target_pass(rows) for rows, n in metrics.target_pass_rows.items())
                + sum(n * self.mtp_catch_up(rows) for rows, n in metrics.mtp_catch_up_rows.items())
                + metrics.mtp_passes * self.mtp_draft())
