"""Per-row greedy choice of a batched verify: the top-1 token and its margin over the runner-up.

Contract: `verify_argmax(logits [M, V]) -> (top1 [M] int64, margin [M] float32 = top1 − top2 logit)`,
V >= 2; exact ties go to the lower token id (margin 0). Row-wise, so batch-invariant.
"""
from __future__ import annotations

import torch

BATCH_INVARIANT = True


def verify_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy token of each row (lowest id on ties) and the top-1 minus top-2 logit."""
    logits = logits.to(torch.float32)
    top2 = torch.topk(logits, 2, dim=-1).values
    return torch.argmax(logits, dim=-1), top2[:, 0] - top2[:, 1]
