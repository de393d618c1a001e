"""The search shared by the codebook (IQ) quantizers: scaled grid points nearest to groups of values.

A codebook type stores, per sub-block of values, a small integer `ls` and, per chunk of `G` values, the index
of a grid point; the chunk decodes to `d * mult[ls] * grid[index]` (signs aside). These quantizers are plain
nearest-point searches over a few candidate scales (deterministic), not llama.cpp's longer searches. With an
importance per value (an imatrix column) they minimise llama.cpp's weighted squared error instead.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ._blocks import importance_weights, nearest_level

_FACTORS = torch.linspace(0.6, 1.2, 7)  # candidate sub-block scales, as multiples of amax / max grid value
CHUNK_BLOCKS = 256  # blocks searched at once, to bound the [blocks, chunks, points] dot-product tables


def nearest(target: torch.Tensor, grid: torch.Tensor, scale: torch.Tensor,
            w: torch.Tensor | None = None) -> torch.Tensor:
    """Point index minimizing |v - scale*p|^2 (weighted by `w`, same shape, when given) for each chunk v of
    `target` `[n, S, C, G]`; `scale` `[n, S]`.

    One matrix product: argmax over p of <v, p> - scale/2 * |p|^2 = <(v, -scale/2), (p, |p|^2)>; weighted,
    <w*v, p> - scale/2 * <w, p*p>.
    """
    if w is not None:
        return ((w * target) @ grid.T - (scale / 2)[..., None, None] * (w @ (grid * grid).T)).argmax(-1)
    half = (-scale / 2)[..., None, None].expand(*target.shape[:-1], 1)
    points = torch.cat([grid, (grid * grid).sum(-1, keepdim=True)], -1)
    return (torch.cat([target, half], -1) @ points.T).argmax(-1)


def fit(target: torch.Tensor, grid: torch.Tensor,
        w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares scale `[n, S]` per sub-block of `target` `[n, S, C, G]` and its residual (minus |v|^2),
    both weighted by `w` (same shape as target) when given."""
    base = target.abs().amax((-1, -2)) / grid.abs().max()
    best_err = torch.full(target.shape[:2], float("inf"))
    best_scale = torch.zeros(target.shape[:2])
    for f in _FACTORS:
        p = grid[nearest(target, grid, base * f, w)]
        wp = p if w is None else w * p
        dot = (wp * target).sum((-1, -2))
        sq = (wp * p).sum((-1, -2)).clamp(min=1e-30)
        err = torch.where(dot > 0, -dot * dot / sq, 0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, (dot / sq).clamp(min=0), best_scale)
    return best_scale, best_err


def super_scale(scale: torch.Tensor, mult: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sub-block scales `[n, S]` -> f16-rounded `d` `[n]` and codes `ls` `[n, S]` with `d*mult[ls] ≈ scale`."""
    d = (scale.amax(-1) / mult[-1]).to(torch.float16).to(torch.float32)
    ratio = scale / torch.where(d > 0, d, 1)[:, None]
    return d, nearest_level(ratio, mult)


def error_weights(target: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor | None:
    """llama.cpp's error weights for groups `[n, S, C, G]` from an importance per value (same shape), or None;
    a sub-block whose weights are all zero (an imatrix column no activation reached) is weighted evenly."""
    if importance is None:
        return None
    n, s = target.shape[:2]
    w = importance_weights(target.reshape(n, s, -1), importance.reshape(n, s, -1).to(torch.float32))
    return torch.where(w.sum(-1, keepdim=True) > 0, w, 1).reshape(target.shape)


def codebook_quantize(target: torch.Tensor, grid: torch.Tensor, mult: torch.Tensor,
                      db: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], importance: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups `[n, S, C, G]` -> `d` `[n]`, `ls` `[n, S]` and point indices `[n, S, C]`; `db(d, ls)` is the
    decoder's exact per-sub-block scale; `importance` (same shape as target) weights the error."""
    w = error_weights(target, importance)
    scale, _ = fit(target, grid, w)
    d, ls = super_scale(scale, mult)
    idx = nearest(target, grid, db(d, ls), w)
    return d, ls, idx


def in_chunks(quantize_blocks: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], x: torch.Tensor,
              block: int, nbytes: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Apply `quantize_blocks` (float32 `[n, block]` and importance `[n, block]` or None -> uint8 `[n, nbytes]`)
    on the CPU, CHUNK_BLOCKS at a time."""
    v = x.reshape(-1, block).to("cpu", torch.float32)
    if weights is None:
        parts = [(c, None) for c in v.split(CHUNK_BLOCKS)]
    else:
        if weights.numel() != x.numel():
            raise ValueError(f"weights have {weights.numel()} values for {x.numel()} values to quantize")
        w = weights.reshape(-1, block).to("cpu", torch.float32)
        parts = list(zip(v.split(CHUNK_BLOCKS), w.split(CHUNK_BLOCKS), strict=True))
    out = [quantize_blocks(c, w) for c, w in parts] or [torch.empty(0, nbytes, dtype=torch.uint8)]
    return torch.cat(out).reshape(*x.shape[:-1], nbytes).to(x.device)


def even_parity_signs(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of 8 `[..., 8]` -> (target magnitudes, negative flags) with an even number of minus signs: where
    the count is odd, the smallest magnitude's sign is flipped (its target then becomes -|x|)."""
    mag = v.abs()
    neg = v < 0
    odd = (neg.sum(-1, keepdim=True) & 1).bool()
    flip = odd & (torch.arange(8) == mag.argmin(-1, keepdim=True))
    return torch.where(flip, -mag, mag), neg ^ flip


def groups(importance: torch.Tensor | None, *shape: int) -> torch.Tensor | None:
    """Importance `[n, block]` reshaped to the groups `[n, *shape]` the search uses, or None."""
    return None if importance is None else importance.reshape(-1, *shape)
