"""Q6_K (GGUF type 14): 256 values = `ql[128]` (low nibbles), `qh[64]` (2-bit highs), int8 `scales[16]`, f16 `d`.

Sub-block j (16 values) has `y = d*scales[j]*(q - 32)`, q in 0..63. Element `128c + 64h + l` (l < 64) has its
low 4 bits in nibble h of `ql[64c + l]`; element `128c + 32s + l` (l < 32) its high 2 bits in bits 2s of
`qh[32c + l]`. Quantizer: round to nearest with the sub-block scale set by its largest magnitude, or with an
importance matrix the best of 19 scales around it (a short form of llama.cpp's search).
"""
import torch

from . import QuantType
from ._blocks import bit_planes, f16_bytes, f16_field, importance_weights, pack_planes, round_half_away
from .q4_0 import inverse, signed_max

BLOCK, BYTES = 256, 210
_PAIRS = [0, 2, 4, 6]


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 210]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    scale = (f16_field(b, 208) * b[:, 192:208].contiguous().view(torch.int8).to(torch.float32))[:, :, None]
    ql = bit_planes(b[:, :128].reshape(-1, 2, 64), [0, 4], 15).reshape(-1, 256)
    qh = bit_planes(b[:, 128:192].reshape(-1, 2, 32), _PAIRS, 3).reshape(-1, 256)
    q = ((ql | (qh << 4)).to(torch.int32) - 32).to(torch.float32).reshape(-1, 16, 16)
    return (scale * q).reshape(*blocks.shape[:-1], BLOCK)


def symmetric_scales(v: torch.Tensor, qmin: int, smax: int,
                     weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sub-blocks `[n, S, L]` -> f16 `d` `[n]`, integer scales `[n, S]` in -smax..smax-1, and the codes `[n, S, L]`
    in qmin..-qmin-1: each sub-block's largest magnitude maps to `qmin` (with error `weights`: the best of a
    few scales, `weighted_scale`), its scale to `-smax` at the largest."""
    sub = signed_max(v)[..., 0] / qmin if weights is None else weighted_scale(v, qmin, weights)
    d = (signed_max(sub) / -smax).to(torch.float16).to(torch.float32)
    sc = round_half_away(sub * inverse(d)).clamp(-smax, smax - 1)
    q = round_half_away(v * inverse(d * sc)[..., None]).clamp(qmin, -qmin - 1)
    return d[:, 0], sc, q


def weighted_scale(v: torch.Tensor, qmin: int, w: torch.Tensor, steps: int = 19) -> torch.Tensor:
    """Per sub-block of `v` `[n, S, L]`, the scale with the least `w`-weighted squared error among `steps`
    candidates: the largest magnitude mapped to `qmin` -/+ up to 0.9 of a level, each rounded and then refit by
    weighted least squares (the idea of llama.cpp's make_qx_quants)."""
    peak = signed_max(v)
    best = peak[..., 0] / qmin
    best_err = _weighted_err(v, best, qmin, w)
    for k in range(steps):
        iscale = (qmin + 0.9 * (2 * k / (steps - 1) - 1)) * inverse(peak)
        q = round_half_away(v * iscale).clamp(qmin, -qmin - 1)
        sum_qq = (w * q * q).sum(-1)
        scale = (w * q * v).sum(-1) / torch.where(sum_qq > 0, sum_qq, 1)
        err = _weighted_err(v, scale, qmin, w)
        better = err < best_err
        best, best_err = torch.where(better, scale, best), torch.where(better, err, best_err)
    return best


def _weighted_err(v: torch.Tensor, scale: torch.Tensor, qmin: int, w: torch.Tensor) -> torch.Tensor:
    """Weighted squared error of rounding `v` `[n, S, L]` to codes in qmin..-qmin-1 at `scale` `[n, S]`."""
    q = round_half_away(v * inverse(scale)[..., None]).clamp(qmin, -qmin - 1)
    return (w * (q * scale[..., None] - v) ** 2).sum(-1)


def quantize(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 210]`: per-16 scales from the largest magnitude, round to nearest.

    `weights` `[..., 256]`: an importance per value (an imatrix column); each 16's scale is then the best of
    a few for llama.cpp's error weights (`weighted_scale`).
    """
    v = x.reshape(-1, 16, 16).to(torch.float32)
    w = None if weights is None else importance_weights(v, weights.reshape(-1, 16, 16).to(torch.float32))
    d, sc, q = symmetric_scales(v, -32, 128, w)
    q = (q + 32).to(torch.int64).reshape(-1, 256)
    ql = pack_planes((q & 15).reshape(-1, 2, 2, 64), [0, 4]).reshape(-1, 128)
    qh = pack_planes((q >> 4).reshape(-1, 2, 4, 32), _PAIRS).reshape(-1, 64)
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([ql, qh, scales, f16_bytes(d)], -1).reshape(*x.shape[:-1], BYTES)


QTYPE = QuantType("Q6_K", 14, BLOCK, BYTES, dequantize, quantize, error_bound=0.024)  # measured 0.0187
