"""I32 (GGUF type 26): one little-endian int32 per 4-byte block (DeepSeek V4's hash-routing table)."""
import torch

from . import QuantType


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 4]` -> float32 `[..., 1]` (exact for |v| <= 2**24)."""
    return blocks.contiguous().view(torch.int32).to(torch.float32)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float32 `[..., 1]` -> uint8 `[..., 4]`, rounded to the nearest integer."""
    return torch.round(x).to(torch.int32).contiguous().view(torch.uint8)


QTYPE = QuantType("I32", 26, 1, 4, dequantize, quantize, error_bound=3.8e-4)  # measured 2.9e-4
