"""FP8_E4M3 (not a GGUF type): 128 values along K = a little-endian float32 scale + 128 E4M3FN bytes.

`y = scale * e4m3`. The official DeepSeek V4 checkpoint stores FP8 weights with one scale per 128x128 tile;
`from_official` repeats each tile's scale on its rows, a lossless repack.
"""
import math

import torch

from . import QTensor, QuantType
from ._blocks import pow2_ceil

BLOCK, BYTES = 128, 132
E4M3_MAX = 448.0
_AMAX_FLOOR = 1e-30  # an all-zero block still gets a normal power-of-two scale


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E4M3FN value, ties to even, clamped to ±448; float32 out."""
    return x.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 132]` -> float32 `[..., 128]`."""
    b = blocks.reshape(-1, BYTES)
    scale = b[:, :4].contiguous().view(torch.float32)
    vals = b[:, 4:].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    return (vals * scale).reshape(*blocks.shape[:-1], BLOCK)


def _pack(scale: torch.Tensor, e4m3: torch.Tensor) -> torch.Tensor:
    """Float32 scales `[n]` and E4M3FN values `[n, 128]` -> blocks `[n, 132]`."""
    return torch.cat([scale.to(torch.float32).reshape(-1, 1).view(torch.uint8), e4m3.view(torch.uint8)], -1)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float32 `[..., 128]` -> uint8 `[..., 132]`: scale 2**ceil(log2(amax/448)), then E4M3 round to nearest even."""
    v = x.reshape(-1, BLOCK).to(torch.float32)
    scale = pow2_ceil(v.abs().amax(-1).clamp(min=_AMAX_FLOOR) / E4M3_MAX)
    e4m3 = (v / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return _pack(scale, e4m3).reshape(*x.shape[:-1], BYTES)


def from_official(weight_e4m3: torch.Tensor, scale: torch.Tensor, name: str = "") -> QTensor:
    """Official FP8 weight (e4m3fn/uint8 `[out, in]`, scale `[ceil(out/128), ceil(in/128)]` f32/e8m0) -> QTensor."""
    label = name or "FP8 weight"
    if weight_e4m3.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"{label}: expected a 2-D weight and scale, "
                             f"got {tuple(weight_e4m3.shape)}, {tuple(scale.shape)}")
    n_out, n_in = weight_e4m3.shape
    if n_in % BLOCK or tuple(scale.shape) != (math.ceil(n_out / BLOCK), n_in // BLOCK):
        raise ValueError(
            f"{label}: weight {tuple(weight_e4m3.shape)} with scale {tuple(scale.shape)}; "
            f"need in % 128 == 0 and scale [ceil(out/128), in/128]"
        )
    if weight_e4m3.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"{label}: dtype {weight_e4m3.dtype} is not float8_e4m3fn")
    row_scale = scale.to(torch.float32).repeat_interleave(BLOCK, 0)[:n_out].reshape(-1)
    e4m3 = weight_e4m3.contiguous().view(torch.float8_e4m3fn).reshape(-1, BLOCK)
    data = _pack(row_scale, e4m3).reshape(n_out, n_in // BLOCK * BYTES)
    return QTensor(QTYPE, (n_out, n_in), data, name)


QTYPE = QuantType("FP8_E4M3", None, BLOCK, BYTES, dequantize, quantize, error_bound=0.035)  # measured 0.0266
