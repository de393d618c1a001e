"""F32 (GGUF type 0): one little-endian float32 per 4-byte block."""
import torch

from . import QuantType


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 4]` -> float32 `[..., 1]`."""
    return blocks.contiguous().view(torch.float32)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float32 `[..., 1]` -> uint8 `[..., 4]`."""
    return x.to(torch.float32).contiguous().view(torch.uint8)


QTYPE = QuantType("F32", 0, 1, 4, dequantize, quantize, error_bound=0.0)  # measured 0.0
