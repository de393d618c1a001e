"""IQ4_XS (GGUF type 23): 256 values = f16 `d`, u16 `scales_h`, `scales_l[4]`, `qs[128]`; 8 sub-blocks of 32.

Sub-block j has `y = d*(ls[j] - 32)*KVALUES[q]` (IQ4_NL's table), `ls[j]` = nibble `j % 2` of `scales_l[j // 2]`
plus bits `2j` of `scales_h` shifted up by 4. Its 32 codes are the 16 bytes `qs[16j:]`, low nibbles first.
Quantizer: IQ4_NL's fit per sub-block, 6-bit scales set by the largest (not llama.cpp's scale search).
"""
import torch

from . import QuantType
from ._blocks import bit_planes, f16_bytes, f16_field, le_bytes, nearest_level, pack_planes, u16_fields
from .iq4_nl import KVALUES, error_weights, fit_levels
from .q4_0 import inverse, nibbles, pack_nibbles, signed_max

BLOCK, BYTES = 256, 136


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 136]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    low = bit_planes(b[:, 4:8, None], [0, 4], 15).reshape(-1, 8)
    high = (u16_fields(b, 2, 1) >> (2 * torch.arange(8, device=b.device))) & 3
    scale = (f16_field(b, 0) * ((low | (high << 4)) - 32).to(torch.float32))[:, :, None]
    q = KVALUES.to(b.device)[nibbles(b[:, 8:].reshape(-1, 16)).to(torch.int64)].reshape(-1, 8, 32)
    return (scale * q).reshape(*blocks.shape[:-1], BLOCK)


def quantize(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 136]`: per-32 level fit (weighted: see `weights`), 6-bit scales,
    nearest level.

    `weights` `[..., 256]`: an importance per value (an imatrix column), turned into llama.cpp's error weights.
    """
    v = x.reshape(-1, 8, 32).to(torch.float32)
    sub = fit_levels(v, error_weights(v, weights))[0][..., 0]
    d = (signed_max(sub) / -32).to(torch.float16).to(torch.float32)
    ls = torch.round(sub * inverse(d)).clamp(-32, 31)
    q = nearest_level(v * inverse(d * ls)[..., None], KVALUES.to(v.device))
    s = (ls + 32).to(torch.int64)
    scales_h = le_bytes(((s >> 4) << (2 * torch.arange(8, device=s.device))).sum(-1, keepdim=True), 2)
    scales_l = pack_planes((s & 15).reshape(-1, 4, 2).transpose(1, 2), [0, 4])
    qs = pack_nibbles(q.reshape(-1, 32)).reshape(-1, 128)
    return torch.cat([f16_bytes(d), scales_h, scales_l, qs], -1).reshape(*x.shape[:-1], BYTES)


QTYPE = QuantType("IQ4_XS", 23, BLOCK, BYTES, dequantize, quantize, error_bound=0.1)  # measured 0.0779
