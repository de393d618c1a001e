"""MXFP4 (GGUF type 39): 32 values = an e8m0 scale byte `e` + 16 bytes of E2M1 nibbles; `y = 2**(e-127) * v`.

E2M1 codes 0..7 are {0, .5, 1, 1.5, 2, 3, 4, 6}, code | 8 is the negative. Byte j holds element j in its low
nibble and element j+16 in its high nibble (gguf-py 0.19's layout). The official DeepSeek V4 checkpoint packs
the same codes two per byte, element 2i low and 2i+1 high, with one e8m0 scale per 32 along K; `from_official`
repacks it losslessly.
"""
import torch

from . import QTensor, QuantType
from ._blocks import pow2_ceil

BLOCK, BYTES = 32, 17
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
_CODE_OF_TWICE = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7])  # code of each magnitude, indexed by 2|v|
_AMAX_FLOOR = 6 * 2.0**-126  # keeps the scale a normal float (e >= 1), as DeepSeek's fp4 quantizer does


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the E2M1 grid, ties to the even code, clamped to ±6; float32 out."""
    a = x.to(torch.float32).abs().clamp(max=6)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, x.to(torch.float32))


def _half_scale(e: torch.Tensor) -> torch.Tensor:
    """2**(e-128) as float32 from e8m0 bytes (ggml's e8m0_to_fp32_half; exact, subnormal for e < 2)."""
    e = e.to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., 17]` -> float32 `[..., 32]`."""
    b = blocks.reshape(-1, BYTES)
    codes = torch.cat([b[:, 1:] & 15, b[:, 1:] >> 4], -1).to(torch.int64)
    return (_half_scale(b[:, :1]) * (2 * E2M1.to(b.device)[codes])).reshape(*blocks.shape[:-1], BLOCK)


def _pack(e: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Exponent bytes `[n]` and codes `[n, 32]` -> blocks `[n, 17]`."""
    codes = codes.to(torch.uint8)
    return torch.cat([e.to(torch.uint8)[:, None], codes[:, :16] | (codes[:, 16:] << 4)], -1)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float32 `[..., 32]` -> uint8 `[..., 17]`: scale 2**ceil(log2(amax/6)), then E2M1 round to nearest even."""
    v = x.reshape(-1, BLOCK).to(torch.float32)
    scale = pow2_ceil(v.abs().amax(-1).clamp(min=_AMAX_FLOOR) / 6).clamp(max=2.0**127)
    e = torch.frexp(scale)[1] + 126
    r = round_e2m1(v / scale[:, None])
    codes = _CODE_OF_TWICE.to(v.device)[(2 * r.abs()).to(torch.int64)] | torch.where(v < 0, 8, 0)
    return _pack(e, codes).reshape(*x.shape[:-1], BYTES)


def from_official(packed_fp4: torch.Tensor, scale: torch.Tensor, name: str = "") -> QTensor:
    """Official FP4 weight (int8/uint8 `[..., out, in/2]`, e8m0 scale `[..., out, in/32]`) -> MXFP4 QTensor."""
    n_in = packed_fp4.shape[-1] * 2
    if n_in % BLOCK or tuple(scale.shape) != (*packed_fp4.shape[:-1], n_in // BLOCK):
        raise ValueError(
            f"{name or 'FP4 weight'}: packed shape {tuple(packed_fp4.shape)} and scale shape "
            f"{tuple(scale.shape)} do not match (need in % 32 == 0 and scale [..., out, in/32])"
        )
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"{name or 'FP4 weight'}: scale dtype {scale.dtype} is not float8_e8m0fnu")
    u = packed_fp4.contiguous().view(torch.uint8)
    codes = torch.stack([u & 15, u >> 4], -1).reshape(-1, BLOCK)
    data = _pack(scale.contiguous().view(torch.uint8).reshape(-1), codes)
    shape = (*packed_fp4.shape[:-1], n_in)
    return QTensor(QTYPE, shape, data.reshape(*shape[:-1], n_in // BLOCK * BYTES), name)


QTYPE = QuantType("MXFP4", 39, BLOCK, BYTES, dequantize, quantize, error_bound=0.15)  # measured 0.115
