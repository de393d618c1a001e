"""qgemv.c's block functions for the IQ codebook types, TQ1_0/TQ2_0, MXFP4 and BF16: the block dequantizer equals
the reference (ops/quants/<type>.py) bit for bit on random blocks whose scales include zero, subnormal, infinite
and NaN values, and the fused product of the types that dequantize first (all but MXFP4, IQ2_XS, IQ3_XXS and TQ2_0,
which take the grouped path on AVX-512: tests/test_cpu_grouped_types.py) equals the reference's dequantized weight
multiplied in the kernel's own order (element k into lane k % 16, the lanes added in order) bit for bit, for
M = 1..16, 1/2/3 threads, plain and by expert (so batch invariance and thread invariance hold)."""
from __future__ import annotations

import pytest
import torch

from backends.cpu import kernels
from ops.quants import QTensor, get, iq2_xxs, iq3_s

TYPES = ("IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4", "BF16")
GROUPED = ("MXFP4", "IQ2_XS", "IQ3_XXS", "TQ2_0")    # scale * (sum of values * x) per group, not the lane order below
LANE_ORDER_TYPES = tuple(t for t in TYPES if t not in GROUPED)
SCALE_AT = {"TQ1_0": 52, "TQ2_0": 64}   # byte offset of the f16 scale `d` (0 for the IQ types but IQ1_M)
ODD_HALVES = (0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01)  # incl. inf, NaN
ODD_E8M0 = (0, 1, 2, 126, 127, 254, 255)   # MXFP4's scale byte: subnormal, normal and largest scales

pytestmark = pytest.mark.skipif(not kernels.built(), reason="the cpu kernel library is off (DS4_CPU_KERNELS=0)")


@pytest.fixture
def threads():
    """Restores torch's thread count after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def set_scale(blocks: torch.Tensor, qtype: str, half: torch.Tensor) -> None:
    """Write the f16 bit patterns `half` [n] (int64) as the super-block scale `d` of blocks [n, block_bytes]."""
    if qtype == "IQ1_M":    # d's four nibbles are the top nibbles of the u16 scales at bytes 48..55
        for i in range(4):
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 15) | (((half >> (4 * i)) & 15) << 4).to(torch.uint8)
        return
    at = SCALE_AT.get(qtype, 0)
    blocks[:, at], blocks[:, at + 1] = (half & 255).to(torch.uint8), (half >> 8).to(torch.uint8)


def random_weight(qtype: str, shape: tuple[int, ...], seed: int, odd: bool) -> QTensor:
    """Random blocks of `qtype` of a [..., N, K] weight; `odd`: every kind of scale (zero, subnormal, inf, NaN),
    else moderate finite scales (for products whose every value is finite)."""
    t = get(qtype)
    g = torch.Generator().manual_seed(seed)
    if qtype == "BF16":
        values = torch.randn(*shape, generator=g)
        if odd:
            values.view(-1)[:5] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, -float("inf")])
        return QTensor.quantize(values, "BF16")
    n = int(torch.tensor(shape).prod()) // t.block_size
    blocks = torch.randint(0, 256, (n, t.block_bytes), dtype=torch.uint8, generator=g)
    if qtype == "MXFP4":
        choices = torch.tensor(ODD_E8M0) if odd else torch.arange(118, 128)
        blocks[:, 0] = choices[torch.randint(0, len(choices), (n,), generator=g)].to(torch.uint8)
    else:
        halves = torch.tensor(ODD_HALVES) if odd else torch.arange(0x1000, 0x2400, 0x100)  # 2**-11 .. 2**-6
        set_scale(blocks, qtype, halves[torch.randint(0, len(halves), (n,), generator=g)])
    return QTensor(t, shape, blocks.reshape(*shape[:-1], t.row_bytes(shape[-1])))


def lane_order_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.T [K, N] in float32 as qgemv.c adds it: per output, 16 lanes (element k in lane k % 16)
    accumulated in order of k, then the lanes added in order."""
    prod = x[:, None, :] * w[None]                  # [M, N, K], each product rounded to float32
    lanes = torch.zeros(*prod.shape[:2], 16)
    for chunk in prod.split(16, -1):
        lanes = lanes + chunk
    out = torch.zeros(prod.shape[:2])
    for lane in range(16):
        out = out + lanes[..., lane]
    return out


@pytest.mark.parametrize("qtype", TYPES)
def test_block_dequantizer_is_the_reference_bit_for_bit(qtype):
    """kernels.dequantize (prefill's tiles) against ops/quants on random blocks with odd scales: the same bits,
    NaN payloads and signed zeros included."""
    w = random_weight(qtype, (24, 512), seed=1, odd=True)
    got, want = kernels.dequantize(w), w.dequantize()
    assert want.isnan().any() or qtype == "MXFP4"      # the odd scales occur
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), qtype


@pytest.mark.parametrize("odd", (False, True))
@pytest.mark.parametrize("qtype", LANE_ORDER_TYPES)
def test_fused_product_is_the_dequantized_product_in_lane_order(qtype, odd, threads, monkeypatch):
    """qgemv equals the reference's dequantized weight multiplied in the kernel's summation order, bit for bit
    (NaN where the reference's values make one), for M = 1..16 and 1/2/3 threads (uneven row splits)."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)     # split even these small weights
    monkeypatch.setattr(kernels, "_pool_threads", 0)     # the pool follows torch's thread count
    w = random_weight(qtype, (40, 512), seed=2, odd=odd)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(3))
    want = lane_order_product(x, w.dequantize())
    assert odd or want.isfinite().all()
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        for M in range(1, 17):
            torch.testing.assert_close(kernels.qgemv(x[:M], w), want[:M], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("qtype", LANE_ORDER_TYPES)
def test_fused_product_by_expert(qtype, threads, monkeypatch):
    """Routed experts read in place by index ([E, N, K] stacks, a row per (token, expert) pair; -1: another
    rank's expert, 0): each row the lane-order product with its own expert, for 1 and 3 threads."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)
    monkeypatch.setattr(kernels, "_pool_threads", 0)
    w = random_weight(qtype, (4, 24, 256), seed=4, odd=False)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([3, 0, 2, -1, 1, 3, 3, 0, 2, 1, -1, 0, 1, 2, 3, 0])
    dense = w.dequantize()
    want = torch.stack([lane_order_product(x[m:m + 1], dense[e])[0] if e >= 0 else torch.zeros(24)
                        for m, e in enumerate(ids.tolist())])
    for n in (1, 3):
        torch.set_num_threads(n)
        for M in (1, 7, 16):
            assert torch.equal(kernels.qgemv(x[:M], w, ids[:M]), want[:M]), (qtype, n, M)


def test_rows_the_kernel_cannot_take_are_refused():
    """A row length that is not a whole number of blocks (of 32 values for BF16 and MXFP4) is an error naming
    the type, never a wrong product."""
    assert kernels.available("BF16", 96) and not kernels.available("BF16", 48)
    w = random_weight("IQ3_S", (8, 256), seed=6, odd=False)
    with pytest.raises(ValueError, match="unsupported call .IQ3_S"):
        torch.ops.ds4.qgemv(torch.randn(1, 128), w.data, kernels.GGML_TYPE["IQ3_S"], 16, None)
    with pytest.raises(ValueError, match="unsupported call .MXFP4"):
        torch.ops.ds4.dequantize(w.data, kernels.GGML_TYPE["MXFP4"], 8, 100)


def test_a_grid_the_kernel_cannot_hold_fails_the_build(monkeypatch):
    """A codebook value that is not a small integer (the kernel keeps grids as bytes) is a build failure naming
    the type, and the table in use stays as it was."""
    w = random_weight("IQ3_S", (8, 256), seed=7, odd=False)
    before = kernels.dequantize(w)
    monkeypatch.setattr(iq3_s, "GRID", iq3_s.GRID + 0.5)
    with pytest.raises(kernels.BuildFailed, match="IQ3_S grid"):
        kernels._set_codebooks(kernels.lib(), iq2_xxs.KSIGNS.to(torch.int64))
    assert torch.equal(kernels.dequantize(w), before)
