"""IQ4_NL (GGUF type 20): 32 values = f16 `d` + 16 bytes of nibbles (as Q4_0); `y = d*KVALUES[q]`.

KVALUES is a fixed non-linear 16-level table. Quantizer: `d` maps the value of largest magnitude to -127, then
the nearest level, then one least-squares refit of `d` (not llama.cpp's scale search).
"""
import torch

from . import QuantType
from ._blocks import f16_bytes, f16_field, nearest_level
from .q4_0 import inverse, nibbles, pack_nibbles, signed_max

BLOCK, BYTES = 32, 18
KVALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 18]` -> float32 `[..., 32]`."""
    b = blocks.reshape(-1, BYTES)
    q = KVALUES.to(b.device)[nibbles(b[:, 2:]).to(torch.int64)]
    return (f16_field(b, 0) * q).reshape(*blocks.shape[:-1], BLOCK)


def fit_levels(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups `[..., L]` -> scale `[..., 1]` (may be negative) and level codes `[..., L]` for `v ≈ scale*KVALUES[q]`."""
    kv = KVALUES.to(v.device)
    scale = signed_max(v) / -127
    q = nearest_level(v * inverse(scale), kv)
    k = kv[q]
    kk = (k * k).sum(-1, keepdim=True)
    refit = (k * v).sum(-1, keepdim=True) / kk.clamp(min=1)
    scale = torch.where(kk > 0, refit, scale)
    return scale, nearest_level(v * inverse(scale), kv)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float32 `[..., 32]` -> uint8 `[..., 18]`: nearest level, least-squares scale."""
    v = x.reshape(-1, BLOCK).to(torch.float32)
    d, _ = fit_levels(v)
    d = d.to(torch.float16).to(torch.float32)
    q = nearest_level(v * inverse(d), KVALUES.to(v.device))
    return torch.cat([f16_bytes(d), pack_nibbles(q)], -1).reshape(*x.shape[:-1], BYTES)


QTYPE = QuantType("IQ4_NL", 20, BLOCK, BYTES, dequantize, quantize, error_bound=0.1)  # measured 0.0775
