"""DeepSeek V4 MTP head: one extra uncompressed block that drafts the token after next.

Row inputs are a trunk-shaped HC state H [S, D] and a token t: the block input is
`e_proj(RMSw(embed(t), enorm))` broadcast over the S streams plus `h_proj(RMSw(H_h, hnorm))` per stream;
one decoder block with ratio 0 (its own raw window cache, base-10000 RoPE, biased top-k routing); then
its own HC head + `norm` and the base LM head (model-spec §5, semantics §1b). Which H goes with which
t is the pairing (`ModelArgs.mtp_pairing`), decided by the caller (ds4.session): "official" pairs the
trunk state at i with token i+1 to predict token i+2; "ds4" pairs the state at i with token i.
Recursive drafting feeds back the head's own output state (before its HC head).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ds4.errors import ModelFileError
from models.deepseek_v4 import OPTIONAL, DeepseekV4, LayerCache, bind, block_shapes
from ops.quants import QTensor

PREFIX = "mtp.0."


def mtp_shapes(args) -> dict[str, tuple[int, ...]]:
    """Every MTP tensor name (`mtp.0.*`) and its PyTorch-order shape."""
    D, S = args.dim, args.hc_mult
    shapes = {f"{PREFIX}{k}": v for k, v in {
        "e_proj.weight": (D, D), "h_proj.weight": (D, D), "enorm.weight": (D,), "hnorm.weight": (D,),
        "norm.weight": (D,), "hc_head_fn.weight": (S, S * D), "hc_head_scale.weight": (1,),
        "hc_head_base.weight": (S,)}.items()}
    return shapes | block_shapes(args, PREFIX, 0, hashed=False)


class MTPHead:
    """The MTP block bound to a trunk (it shares the trunk's embedding, LM head, ops and switches)."""

    def __init__(self, trunk: DeepseekV4, weights: Mapping[str, QTensor]):
        self.trunk, self.args, self.ops = trunk, trunk.args, trunk.ops
        w = bind(weights, mtp_shapes(self.args), PREFIX, OPTIONAL)
        self.e_proj, self.h_proj = w.pop("e_proj.weight"), w.pop("h_proj.weight")
        self.enorm, self.hnorm = w.pop("enorm.weight"), w.pop("hnorm.weight")
        self.head_weights = {"fn": w.pop("hc_head_fn.weight"), "scale": w.pop("hc_head_scale.weight"),
                             "base": w.pop("hc_head_base.weight"), "norm": w.pop("norm.weight")}
        self.block = trunk.make_block(w, 0, False, self.args.clamp(self.args.n_layers))

    @classmethod
    def from_gguf(cls, trunk: DeepseekV4, path: str) -> MTPHead:
        """Load `mtp.0.*` from ds4's separate MTP GGUF."""
        from ds4 import gguf
        f = gguf.open(path)
        try:
            return cls(trunk, {name: f.raw(name) for name in f.tensors})
        except ModelFileError as e:
            raise ModelFileError(f"{path}: {e}") from None

    def new_cache(self, ctx: int, chunk: int) -> LayerCache:
        """Empty raw window cache of the MTP block."""
        return self.trunk.new_cache(0, ctx, chunk)

    def forward(self, states: torch.Tensor, ids: torch.Tensor, start: int, cache: LayerCache,
                valid_from: int = 0, logit_rows: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows (states [M, S, D], ids [M]) at cache positions start..start+M-1 -> output HC states
        [M, S, D] and the logits of `logit_rows` (None: no LM head). Cache rows below `valid_from`
        were never written and are not attended."""
        a, ops = self.args, self.ops
        e = ops.qmatmul(ops.rms_norm(self.trunk.embed(ids), self.enorm, a.rms_eps), self.e_proj)
        M, S, D = states.shape
        # one M-row product per stream (not one of M·S rows): batch-invariant while M <= SMALL_M
        h = torch.stack([ops.qmatmul(ops.rms_norm(states[:, i], self.hnorm, a.rms_eps), self.h_proj)
                         for i in range(S)], dim=1)
        X = h + e[:, None, :]
        pos = torch.arange(start, start + M)
        X = self.trunk.block(self.block, X, ids, pos, cache, valid_from)
        logits = None if logit_rows is None else self.trunk.logits(X[logit_rows], self.head_weights)
        return X, logits
