"""DeepSeek V4 MTP head: one extra uncompressed block that drafts the token after next.

Row inputs are a trunk-shaped HC state H [S, D] and a token t: the block input is
`e_proj(RMSw(embed(t), enorm))` broadcast over the S streams plus `h_proj(RMSw(H_h, hnorm))` per stream;
one decoder block with ratio 0 (its own raw window cache, base-10000 RoPE, biased top-k routing); then
its own HC head + `norm` and the base LM head (docs/model.md §5, docs/switches.md §1b). Which H goes with
which t is the pairing (`ModelArgs.mtp_pairing`), decided by the caller (ds4.session): "official" pairs
the trunk state at i with token i+1 to predict token i+2; "ds4" pairs the state at i with token i.
Recursive drafting feeds back the head's own output state (before its HC head).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from models.args import MTP_PREFIX, mtp_shapes
from models.deepseek_v4 import (
    OPTIONAL,
    STEPS,
    Array,
    DeepseekV4,
    HCHead,
    LayerCache,
    Plan,
    bind,
    logit_index,
    make_block,
    plan_positions,
)
from ops.quants import QTensor


class MTPHead:
    """The MTP block bound to a trunk (it shares the trunk's embedding, LM head, ops and switches)."""

    def __init__(self, trunk: DeepseekV4, weights: Mapping[str, QTensor]):
        self.trunk, self.args, self.ops = trunk, trunk.args, trunk.ops
        w = bind(weights, mtp_shapes(self.args), MTP_PREFIX, self.ops, OPTIONAL, owned=trunk.owned, split=trunk.split)
        self.e_proj, self.h_proj = w.pop("e_proj.weight"), w.pop("h_proj.weight")
        self.enorm, self.hnorm = w.pop("enorm.weight"), w.pop("hnorm.weight")
        self.head = HCHead(w.pop("hc_head_fn.weight"), w.pop("hc_head_scale.weight"),
                           w.pop("hc_head_base.weight"), w.pop("norm.weight"))
        self.block = make_block(self.args, self.ops, w, 0, False, self.args.clamp(self.args.n_layers),
                                trunk.owned.start)
        self._compiled_run = None

    def new_cache(self, ctx: int, chunk: int) -> LayerCache:
        """Empty raw window cache of the MTP block."""
        return self.trunk.new_cache(0, ctx, chunk)

    def forward(self, states: Array, ids: Sequence[int], start: int, cache: LayerCache, valid_from: int = 0,
                logit_rows: Sequence[int] | None = None, step: str = "eager",
                runner: Callable | None = None) -> tuple[Array, Array | None]:
        """Rows (states [M, S, D], token ids) at cache positions start..start+M-1 -> output HC states
        [M, S, D] and the logits of `logit_rows` (None: no LM head). Cache rows below `valid_from` were
        never written and are not attended. `step` and `runner` as in DeepseekV4.forward."""
        if step not in STEPS:
            raise ValueError(f"step must be one of {STEPS}, got {step!r}")
        plan = plan_positions(self.ops, start, len(ids), self.args.window, cache, valid_from, fixed=step != "eager")
        run = runner or (self.compiled_step() if step == "compiled" else self.run)
        return run(states, self.ops.array(list(ids)), plan, cache, logit_index(self.ops, logit_rows))

    def compiled_step(self):
        """`run` compiled by the OpSet, built once per head (a graph per row count, traced on first use)."""
        if self._compiled_run is None:
            self._compiled_run = self.ops.compile(self.run)
        return self._compiled_run

    def run(self, states: Array, token_ids: Array, plan: Plan, cache: LayerCache,
            logit_rows: Array | None = None) -> tuple[Array, Array | None]:
        """The MTP forward of `token_ids` [M] under `plan` (everything on the device)."""
        a, ops = self.args, self.ops
        e = ops.qmatmul(ops.rms_norm(self.trunk.embed(token_ids), self.enorm, a.rms_eps), self.e_proj)
        M, S, D = states.shape
        # one M-row product per stream (not one of M·S rows): batch-invariant while M <= SMALL_M
        h = ops.cat([ops.qmatmul(ops.rms_norm(states[:, i], self.hnorm, a.rms_eps), self.h_proj)[:, None]
                     for i in range(S)], dim=1)
        X = self.trunk.block(self.block, h + e[:, None, :], token_ids, plan, cache)
        logits = None if logit_rows is None else self.trunk.logits(X[logit_rows], self.head)
        return X, logits
