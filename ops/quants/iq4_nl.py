"""IQ4_NL (GGUF type 20): 32 values = f16 `d` + 16 bytes of nibbles (as Q4_0); `y = d*KVALUES[q]`.

KVALUES is a fixed non-linear 16-level table. Quantizer: `d` maps the value of largest magnitude to -127, then
the nearest level, then one least-squares refit of `d` (not llama.cpp's scale search).
"""
import torch

from . import QuantType
from ._blocks import f16_bytes, f16_field, importance_weights, nearest_level
from .q4_0 import inverse, nibbles, pack_nibbles, signed_max

BLOCK, BYTES = 32, 18
KVALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 18]` -> float32 `[..., 32]`."""
    b = blocks.reshape(-1, BYTES)
    q = KVALUES.to(b.device)[nibbles(b[:, 2:]).to(torch.int64)]
    return (f16_field(b, 0) * q).reshape(*blocks.shape[:-1], BLOCK)


def error_weights(v: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor | None:
    """llama.cpp's error weights for super-blocks of groups `[n, S, L]` from an importance per value, or None; a
    group whose weights are all zero (an imatrix column no activation reached) is weighted evenly."""
    if importance is None:
        return None
    if importance.numel() != v.numel():
        raise ValueError(f"weights have {importance.numel()} values for {v.numel()} values to quantize")
    w = importance_weights(v, importance.reshape(v.shape).to(torch.float32))
    return torch.where(w.sum(-1, keepdim=True) > 0, w, 1)


def fit_levels(v: torch.Tensor, w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups `[..., L]` -> scale `[..., 1]` (may be negative) and level codes `[..., L]` for `v ≈ scale*KVALUES[q]`,
    the scale refit to least squares (weighted by `w`, same shape as v, when given)."""
    kv = KVALUES.to(v.device)
    scale = signed_max(v) / -127
    q = nearest_level(v * inverse(scale), kv)
    k = kv[q]
    wk = k if w is None else w * k
    kk = (wk * k).sum(-1, keepdim=True)
    refit = (wk * v).sum(-1, keepdim=True) / kk.clamp(min=1e-30)
    scale = torch.where(kk > 0, refit, scale)
    return scale, nearest_level(v * inverse(scale), kv)


def quantize(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `[..., 32]` -> uint8 `[..., 18]`: nearest level, least-squares scale (weighted: see `weights`).

    `weights` `[..., 32]`: an importance per value (an imatrix column), turned into llama.cpp's error weights.
    """
    v = x.reshape(-1, BLOCK).to(torch.float32)
    w = error_weights(v[:, None], weights)
    d, _ = fit_levels(v, None if w is None else w[:, 0])
    d = d.to(torch.float16).to(torch.float32)
    q = nearest_level(v * inverse(d), KVALUES.to(v.device))
    return torch.cat([f16_bytes(d), pack_nibbles(q)], -1).reshape(*x.shape[:-1], BYTES)


QTYPE = QuantType("IQ4_NL", 20, BLOCK, BYTES, dequantize, quantize, error_bound=0.1)  # measured 0.0775
