"""TQ1_0 (GGUF type 34): 256 ternary values = `qs[48]` + `qh[4]` (five or four base-3 digits a byte) + f16 `d`.

A byte b holds digits as a fixed-point fraction: digit p is `((b * 3**p) mod 256) * 3 >> 8`, and `y = d*(digit - 1)`.
Elements `32p + l` (p < 5) come from `qs[l]`, `160 + 16p + l` from `qs[32 + l]`, `240 + 4p + l` (p < 4) from
`qh[l]`. The quantizer is ggml's reference one (as gguf-py's): `d = max|x|`, `q = round(x/d) + 1`.
"""
import torch

from . import QuantType
from ._blocks import f16_bytes, f16_field
from .tq2_0 import ternary

BLOCK, BYTES = 256, 54
_POW3 = torch.tensor([1, 3, 9, 27, 81])


def _digits(b: torch.Tensor, count: int) -> torch.Tensor:
    """Bytes `[n, k]` -> their first `count` base-3 digits `[n, count * k]`, digit-major."""
    t = (b.to(torch.int64)[:, None, :] * _POW3[:count, None].to(b.device)) & 255
    return ((t * 3) >> 8).flatten(1)


def _pack(q: torch.Tensor, count: int) -> torch.Tensor:
    """Codes `[n, count * k]` (digit-major) -> bytes `[n, k]` holding them as a fraction of 243."""
    pow3 = _POW3.flip(0)[:count].to(q.device)  # 81, 27, ... : the first digit is the most significant
    v = (q.reshape(q.shape[0], count, -1) * pow3[:, None]).sum(1)
    return ((v * 256 + 242) // 243).to(torch.uint8)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 54]` -> float32 `[..., 256]`."""
    b = blocks.reshape(-1, BYTES)
    q = torch.cat([_digits(b[:, :32], 5), _digits(b[:, 32:48], 5), _digits(b[:, 48:52], 4)], -1) - 1
    return (f16_field(b, 52) * q.to(torch.float32)).reshape(*blocks.shape[:-1], BLOCK)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float32 `[..., 256]` -> uint8 `[..., 54]` (bit-exact with gguf-py's quantizer)."""
    d, q = ternary(x.reshape(-1, BLOCK).to(torch.float32))
    qs = [_pack(q[:, :160], 5), _pack(q[:, 160:240], 5), _pack(q[:, 240:], 4)]
    return torch.cat([*qs, f16_bytes(d)], -1).reshape(*x.shape[:-1], BYTES)


# measured 0.81: made for ternary weights, so Gaussian ones lose most of their energy
QTYPE = QuantType("TQ1_0", 34, BLOCK, BYTES, dequantize, quantize, error_bound=0.85)
