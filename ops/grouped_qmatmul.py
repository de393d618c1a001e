"""grouped_qmatmul: attention's grouped output projection (`attn_output_a`), one matrix per group of heads.

Contract: `grouped_qmatmul(x, w)` with `x` a float32 or float16 tensor [M, G, K] and `w` a 2-D `QTensor` [G·N, K]
returns float32 [M, G·N] whose columns g·N:(g+1)·N are `x[:, g] @ W[g·N:(g+1)·N].T`: group g of the activations
times the rows of group g of the weight (V4 Flash: 8 groups of 1024 rows over 4096 values). The reference is one
`qmatmul` per group, so it is batch-invariant for M <= SMALL_M as qmatmul is. Backends may run the groups in one
call (the cpu backend: one pass of its kernel pool over all groups).
"""
from __future__ import annotations

import torch

from ops.qmatmul import qmatmul
from ops.quants import QTensor

BATCH_INVARIANT = True


def group_rows(w: QTensor, g: int, groups: int) -> QTensor:
    """Zero-copy view of the rows of group `g` of `groups` of a 2-D weight, named `W[a:b]` (the imatrix records
    such a view as matrix a / (b - a) of W)."""
    n = w.shape[0] // groups
    return QTensor(w.qtype, (n, w.shape[1]), w.data[g * n:(g + 1) * n], f"{w.name}[{g * n}:{(g + 1) * n}]")


def check_grouped(x, w: QTensor) -> None:
    """Raise TypeError/ValueError unless `x` is [M, G, K] and `w` a 2-D QTensor [G·N, K]."""
    name = getattr(w, "name", None) or "weight"
    if not isinstance(w, QTensor) or len(w.shape) != 2:
        raise TypeError(f"grouped_qmatmul: {name} must be a 2-D QTensor [groups * out, in], "
                        f"got {getattr(w, 'shape', type(w))}")
    if len(x.shape) != 3:
        raise TypeError(f"grouped_qmatmul: x must be [M, groups, K], got shape {tuple(x.shape)}")
    if x.shape[1] < 1 or w.shape[0] % x.shape[1] or x.shape[2] != w.shape[1]:
        raise ValueError(f"grouped_qmatmul: x {tuple(x.shape)} does not fit {name} {tuple(w.shape)} "
                         f"(rows a multiple of the {x.shape[1]} groups, {w.shape[1]} values per group)")


def grouped_qmatmul(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """Each group of `x` [M, G, K] times its rows of `w` [G·N, K], concatenated: float32 [M, G·N]."""
    check_grouped(x, w)
    groups = x.shape[1]
    return torch.cat([qmatmul(x[:, g], group_rows(w, g, groups)) for g in range(groups)], dim=1)
