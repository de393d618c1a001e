"""TQ2_0 (GGUF type 35): 256 ternary values = `qs[64]` (2-bit codes) + f16 `d`; `y = d*(q - 1)`.

Element `128c + 32s + l` is bits 2s of `qs[32c + l]`. The quantizer is ggml's reference one (as gguf-py's):
`d = max|x|`, `q = round(x/d) + 1`.
"""
import torch

from . import QuantType
from ._blocks import bit_planes, f16_bytes, f16_field, pack_planes, round_half_away
from .q4_0 import inverse

BLOCK, BYTES = 256, 66
_PAIRS = [0, 2, 4, 6]


def ternary(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `[n, 256]` -> `d = max|x|` `[n, 1]` and codes `round(x/d) + 1` in 0..2 (int64 `[n, 256]`)."""
    d = x.abs().amax(-1, keepdim=True)
    return d, (round_half_away(x * inverse(d)) + 1).to(torch.int64)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 66]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    q = bit_planes(b[:, :64].reshape(-1, 2, 32), _PAIRS, 3).reshape(-1, 256).to(torch.int32) - 1
    return (f16_field(b, 64) * q.to(torch.float32)).reshape(*blocks.shape[:-1], BLOCK)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 66]` (bit-exact with gguf-py's quantizer)."""
    d, q = ternary(x.reshape(-1, BLOCK).to(torch.float32))
    qs = pack_planes(q.reshape(-1, 2, 4, 32), _PAIRS).reshape(-1, 64)
    return torch.cat([qs, f16_bytes(d)], -1).reshape(*x.shape[:-1], BYTES)


QTYPE = QuantType("TQ2_0", 35, BLOCK, BYTES, dequantize, quantize, error_bound=0.85)  # measured 0.81
