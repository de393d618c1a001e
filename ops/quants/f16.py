"""F16 (GGUF type 1): one IEEE half per 2-byte block."""
import torch

from . import QuantType


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 2]` -> float32 `[..., 1]`."""
    return blocks.contiguous().view(torch.float16).to(torch.float32)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float32 `[..., 1]` -> uint8 `[..., 2]`, rounded to nearest even."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


QTYPE = QuantType("F16", 1, 1, 2, dequantize, quantize, error_bound=2.6e-4)  # measured 2.0e-4
