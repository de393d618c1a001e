"""Routed mixture of experts: sqrt-softplus router, bias-only or hash selection, clamped SwiGLU experts.

Contract: `moe(x [M, D], ids [M] int64, experts: Experts) -> [M, D]` float32 (docs/model.md §3.7 steps
2-5), `ids` being the rows' token ids (hash layers route by them).
- `p = sqrt(softplus(router·x))`; experts = `tid2eid[ids]` (hash layers) or the top_k of `p + bias`
  (bias only selects; exact ties go to the lower expert id).
- weights `w = p_S / max(Σ p_S, 6.1035e-5) · route_scale` (no division when `normalize` is False).
- each expert adds `down · (silu(min(g, clamp)) · clamp(u, ±clamp) · w)` with `g = gate·x`, `u = up·x`,
  in increasing expert id order.
Expert parallelism: the stacks may hold only the experts [first, first + n) of the E the router scores
(`Experts.first`, n = `gate.shape[0]`); routing still ranks all E, and only the owned chosen experts are
added (the others count with weight 0 on a clamped index, so the shapes never depend on the routing).
Summing the ranks' outputs gives the full output, up to the order of the sum.
The expert stacks stay in their stored blocks: an expert's weights are gathered by index on the device,
never dequantized whole.
Batch-invariant for M <= SMALL_M (`BATCH_INVARIANT`, the decode and speculative-verify regime): such
calls run each row alone over its top_k experts, so neither the rows routed to the same expert nor the
length of elementwise ops (torch's vectorized and scalar-tail softplus/silu round differently) depend on
the other rows, and nothing is read back to the host. Larger M (prefill) groups each expert's rows into
one matmul, whose rounding may depend on M.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ops.qmatmul import SMALL_M, qmatmul
from ops.quants import QTensor

BATCH_INVARIANT = True


@dataclass(frozen=True)
class Experts:
    """One layer's routed experts: router, selection, the stacked expert weights and the routing constants."""

    router: QTensor                 # [E, D]
    bias: torch.Tensor | None       # [E] selection bias (non-hash layers)
    tid2eid: torch.Tensor | None    # [vocab, top_k] int64 token -> experts table (hash layers)
    gate: QTensor                   # [E, I, D]
    up: QTensor                     # [E, I, D]
    down: QTensor                   # [E, D, I]
    top_k: int
    route_scale: float
    normalize: bool
    clamp: float
    first: int = 0                  # global id of the stacks' expert 0 (expert parallelism: the owned range)

    @property
    def owned(self) -> range:
        """Global ids of the experts the stacks hold."""
        return range(self.first, self.first + self.gate.shape[0])

    def holds_all(self) -> bool:
        """Whether the stacks hold every expert the router scores (no expert parallelism)."""
        return self.first == 0 and self.gate.shape[0] == self.router.shape[0]


def check_owned(ex: Experts) -> None:
    """The owned range must lie inside the router's experts (ValueError naming both)."""
    n, total = ex.gate.shape[0], ex.router.shape[0]
    if ex.first < 0 or ex.first + n > total:
        raise ValueError(f"moe: owned experts [{ex.first}, {ex.first + n}) fall outside the router's {total}")


def owned_pairs(chosen: torch.Tensor, w: torch.Tensor, ex: Experts,
                missing: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen global expert ids as indices into the stacks and their routing weights, 0 where the expert is not
    held here, whose index is clamped into the stacks (or `missing`, for a kernel that skips it); unchanged when
    the stacks hold every expert."""
    if ex.holds_all():
        return chosen, w
    check_owned(ex)
    n = ex.gate.shape[0]
    local = chosen - ex.first
    mine = (local >= 0) & (local < n)
    index = local.clamp(0, n - 1) if missing is None else torch.where(mine, local, missing)
    return index, torch.where(mine, w, torch.zeros((), dtype=w.dtype, device=w.device))


def expert(w: QTensor, e: int | torch.Tensor) -> QTensor:
    """Expert `e` (an int, or a 1-element index array on the device) of a stacked `[E, out, in]` weight."""
    data = w.data[e] if isinstance(e, int) else w.data[e][0]
    return QTensor(w.qtype, tuple(w.shape[1:]), data, f"{w.name}[{e}]" if isinstance(e, int) else w.name)


def route(x: torch.Tensor, ids: torch.Tensor, ex: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen experts [M, top_k] and their routing weights [M, top_k]."""
    return select(torch.sqrt(F.softplus(qmatmul(x, ex.router))), ids, ex)


def select(p: torch.Tensor, ids: torch.Tensor, ex: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen experts [M, top_k] and their routing weights [M, top_k] from router scores `p` [M, E]."""
    if ex.tid2eid is not None:
        chosen = ex.tid2eid[ids]
    else:
        score = p if ex.bias is None else p + ex.bias
        chosen = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :ex.top_k]
    w = p.gather(1, chosen)
    if ex.normalize:
        w = w / w.sum(-1, keepdim=True).clamp(min=6.1035e-5)
    return chosen, w * ex.route_scale


def expert_ffn(x: torch.Tensor, ex: Experts, e, weight: torch.Tensor) -> torch.Tensor:
    """One expert's clamped SwiGLU on rows `x`, scaled by their routing `weight` [rows, 1]."""
    g = qmatmul(x, expert(ex.gate, e)).clamp(max=ex.clamp)
    u = qmatmul(x, expert(ex.up, e)).clamp(-ex.clamp, ex.clamp)
    return qmatmul(F.silu(g) * u * weight, expert(ex.down, e))


def moe(x: torch.Tensor, ids: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Routed-expert output of each row of `x` (shared expert not included)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0] <= SMALL_M:
        for r in range(x.shape[0]):
            chosen, w = route(x[r:r + 1], ids[r:r + 1], experts)
            chosen, order = torch.sort(chosen, dim=-1, stable=True)   # increasing expert id
            chosen, w = owned_pairs(chosen, w.gather(1, order), experts)
            for j in range(chosen.shape[1]):
                out[r:r + 1] += expert_ffn(x[r:r + 1], experts, chosen[0, j:j + 1], w[:, j:j + 1])
        return out
    check_owned(experts)
    chosen, w = route(x, ids, experts)
    for e in torch.unique(chosen).tolist():
        if e not in experts.owned:
            continue
        rows, slots = torch.nonzero(chosen == e, as_tuple=True)
        out.index_add_(0, rows, expert_ffn(x[rows], experts, e - experts.first, w[rows, slots, None]))
    return out
