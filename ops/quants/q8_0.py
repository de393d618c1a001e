"""Q8_0 (GGUF type 8): 32 values = f16 `d` + 32 int8 `q`; `y = d*q`."""
import torch

from . import QuantType
from ._blocks import f16_bytes, f16_field, round_half_away

BLOCK, BYTES = 32, 34


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 34]` -> float32 `[..., 32]`."""
    b = blocks.reshape(-1, BYTES)
    q = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return (q * f16_field(b, 0)).reshape(*blocks.shape[:-1], BLOCK)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float32 `[..., 32]` -> uint8 `[..., 34]`, as ggml's reference quantizer: d = amax/127."""
    v = x.reshape(-1, BLOCK).to(torch.float32)
    d = v.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    q = round_half_away(v * inv[:, None]).to(torch.int8).view(torch.uint8)
    return torch.cat([f16_bytes(d), q], -1).reshape(*x.shape[:-1], BYTES)


QTYPE = QuantType("Q8_0", 8, BLOCK, BYTES, dequantize, quantize, error_bound=7.0e-3)  # measured 5.35e-3
