"""Q4_K (GGUF type 12): 256 values = f16 `d`, f16 `dmin`, 12 bytes of 6-bit (scale, min) x 8, 128 bytes of nibbles.

Sub-block j (32 values) has `y = d*sc[j]*q - dmin*m[j]`, q in 0..15. Nibbles: byte `32c + l` holds element
`64c + l` (low) and `64c + 32 + l` (high).
"""
import torch

from . import QuantType
from ._blocks import affine_codes, f16_bytes, f16_field, fit_affine, importance_weights, quantize_superblock

BLOCK, BYTES = 256, 144


def _unpack_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes `[n, 12]` -> 6-bit scales and mins `[n, 8]` (ggml's get_scale_min_k4)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], -1)
    m = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], -1)
    return sc, m


def _pack_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Inverse of `_unpack_scales`: uint8 codes `[n, 8]` each -> `[n, 12]`."""
    lo = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mid = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return torch.cat([lo, mid, hi], -1)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 144]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    sc, m = _unpack_scales(b[:, 4:16])
    scale = (f16_field(b, 0) * sc.to(torch.float32))[:, :, None]
    low = (f16_field(b, 2) * m.to(torch.float32))[:, :, None]
    qs = b[:, 16:].reshape(-1, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], 2).reshape(-1, 8, 32).to(torch.float32)
    return (scale * q - low).reshape(*blocks.shape[:-1], BLOCK)


def quantize(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 144]`: affine fit per 32 (weighted: see `weights`), 6-bit scales.

    `weights` `[..., 256]`: an importance per value (an imatrix column), turned into llama.cpp's error weights.
    """
    v = x.reshape(-1, 8, 32).to(torch.float32)
    w = None if weights is None else importance_weights(v, weights.reshape(-1, 8, 32).to(torch.float32))
    d, dmin, sc, m = quantize_superblock(*fit_affine(v, 15, weights=w), 63)
    q = affine_codes(v, d[:, None] * sc, -dmin[:, None] * m, 15).to(torch.uint8).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    scales = _pack_scales(sc.to(torch.uint8), m.to(torch.uint8))
    return torch.cat([f16_bytes(d), f16_bytes(dmin), scales, qs], -1).reshape(*x.shape[:-1], BYTES)


QTYPE = QuantType("Q4_K", 12, BLOCK, BYTES, dequantize, quantize, error_bound=0.093)  # measured 0.0712
