"""Helpers shared by the block formats: f16 fields inside byte blocks and the K-quant affine fit."""
from __future__ import annotations

import torch


def f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian f16 at byte `offset` of each block, as float32 `[n, 1]`."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


def f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """Float32 `[n]` rounded to f16 and returned as its 2 bytes `[n, 2]`."""
    return x.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C `roundf`: to nearest, halves away from zero (ggml's quantizers use it)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def fit_affine(x: torch.Tensor, nmax: int, steps: int = 12,
               weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block `scale >= 0, low <= 0` so that `x ≈ scale*q + low` with q in 0..nmax; x is `[..., L]`.

    Tries `steps` inverse scales around (max-min)/nmax; for each, rounds q and solves the 2x2 least squares
    for (scale, low), keeping the candidate with the least squared error (weighted by `weights`, same shape
    as x, when given).
    """
    w = torch.ones_like(x) if weights is None else weights
    lo = x.amin(-1).clamp(max=0)
    hi = x.amax(-1)
    span = (hi - lo).clamp(min=1e-30)
    n = w.sum(-1)
    sum_x = (w * x).sum(-1)
    best_scale, best_low = span / nmax, lo
    best_err = _sq_err(x, best_scale, best_low, nmax, w)
    for k in range(steps):
        iscale = (nmax - 1 + 2 * k / (steps - 1)) / span  # (nmax-1 .. nmax+1) / span
        q = torch.round((x - lo[..., None]) * iscale[..., None]).clamp(0, nmax)
        sum_q, sum_qq, sum_qx = (w * q).sum(-1), (w * q * q).sum(-1), (w * q * x).sum(-1)
        det = n * sum_qq - sum_q * sum_q
        ok = det > 0
        det = torch.where(ok, det, torch.ones_like(det))
        scale = torch.where(ok, (n * sum_qx - sum_q * sum_x) / det, best_scale)
        low = torch.where(ok, (sum_qq * sum_x - sum_q * sum_qx) / det, best_low)
        # the format needs low <= 0: refit the scale alone with low = 0
        pos = low > 0
        scale = torch.where(pos, sum_qx / torch.where(sum_qq > 0, sum_qq, 1), scale).clamp(min=0)
        low = low.clamp(max=0)
        err = _sq_err(x, scale, low, nmax, w)
        better = err < best_err
        best_scale = torch.where(better, scale, best_scale)
        best_low = torch.where(better, low, best_low)
        best_err = torch.where(better, err, best_err)
    return best_scale, best_low


def _sq_err(x: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, nmax: int, w: torch.Tensor) -> torch.Tensor:
    """Weighted squared error of the best q (0..nmax) for a given (scale, low), summed over the last axis."""
    q = affine_codes(x, scale, low, nmax)
    return (w * (q * scale[..., None] + low[..., None] - x) ** 2).sum(-1)


def importance_weights(x: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """llama.cpp's K-quant error weights from an imatrix: `importance * sqrt(sigma2 + x^2)`, sigma2 being twice
    the mean square of each super-block; x and importance are `[n, S, L]`."""
    sigma2 = 2 * (x * x).mean((-1, -2), keepdim=True)
    return importance * torch.sqrt(sigma2 + x * x)


def affine_codes(x: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, nmax: int) -> torch.Tensor:
    """The nearest codes q in 0..nmax for `x ≈ scale*q + low` (0 where scale is 0), as float."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((x - low[..., None]) / safe[..., None]).clamp(0, nmax)
    return torch.where(scale[..., None] > 0, q, torch.zeros_like(q))


def quantize_superblock(
    scale: torch.Tensor, low: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sub-block (scale, -low) `[n, S]` -> f16 `d`, `dmin` `[n]` and integer codes `sc`, `m` in 0..levels."""
    d = (scale.amax(-1) / levels).to(torch.float16).to(torch.float32)
    dmin = ((-low).amax(-1) / levels).to(torch.float16).to(torch.float32)
    sc = torch.round(scale / torch.where(d > 0, d, 1)[:, None]).clamp(0, levels)
    m = torch.round(-low / torch.where(dmin > 0, dmin, 1)[:, None]).clamp(0, levels)
    return d, dmin, sc, m


def pow2_ceil(y: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= y, for positive normal float32 y (exact: read off frexp)."""
    mant, expo = torch.frexp(y)
    return torch.ldexp(torch.ones_like(y), torch.where(mant == 0.5, expo - 1, expo))


def u16_fields(blocks: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    """`count` little-endian uint16 at byte `offset` of each block, as int64 `[n, count]`."""
    b = blocks[:, offset : offset + 2 * count].to(torch.int64).reshape(-1, count, 2)
    return b[..., 0] | (b[..., 1] << 8)


def u32_fields(blocks: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    """`count` little-endian uint32 at byte `offset` of each block, as int64 `[n, count]`."""
    lo = u16_fields(blocks, offset, 2 * count).reshape(-1, count, 2)
    return lo[..., 0] | (lo[..., 1] << 16)


def le_bytes(x: torch.Tensor, width: int) -> torch.Tensor:
    """Integers `[..., c]` -> their `width` little-endian bytes each, uint8 `[..., c * width]`."""
    x = x.to(torch.int64)
    return ((x[..., None] >> (8 * torch.arange(width, device=x.device))) & 255).to(torch.uint8).flatten(-2)


def bit_planes(x: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """`(x[..., None, :] >> shift) & mask` for each shift: `[..., k]` -> `[..., len(shifts), k]` in x's dtype."""
    s = torch.tensor(shifts, dtype=x.dtype, device=x.device)[:, None]
    return (x[..., None, :] >> s) & mask


def pack_planes(q: torch.Tensor, shifts: list[int]) -> torch.Tensor:
    """Inverse of `bit_planes`: int codes `[..., len(shifts), k]` -> uint8 `[..., k]` (fields must not overlap)."""
    s = torch.tensor(shifts, dtype=torch.int64, device=q.device)[:, None]
    return (q.to(torch.int64) << s).sum(-2).to(torch.uint8)


def gguf_grid(name: str) -> torch.Tensor:
    """The codebook of IQ type `name` as float32 `[points, width]`, taken from gguf-py rather than retyped."""
    import gguf

    cls = getattr(gguf.quants, name)
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy())


def nearest_level(t: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of the sorted float `levels` for each value of `t` (ties to the lower one)."""
    mid = (levels[1:] + levels[:-1]) / 2
    return torch.searchsorted(mid.to(t.device), t.contiguous(), right=False)
