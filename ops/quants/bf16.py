"""BF16 (GGUF type 30): the top 16 bits of a float32 per 2-byte block."""
import torch

from . import QuantType


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 2]` -> float32 `[..., 1]`."""
    return blocks.contiguous().view(torch.bfloat16).to(torch.float32)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float32 `[..., 1]` -> uint8 `[..., 2]`, rounded to nearest even."""
    return x.to(torch.bfloat16).contiguous().view(torch.uint8)


QTYPE = QuantType("BF16", 30, 1, 2, dequantize, quantize, error_bound=2.2e-3)  # measured 1.67e-3
