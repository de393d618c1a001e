"""The Q8_0 activation rounding of the 8-bit kernels (qdot8.c's q8_quantize, SIMD) against the reference
(ops/q8_activations.py, llama.cpp's quantize_row_q8_0_ref): halves away from zero, values just below a half, zero and
tiny blocks, blocks of many magnitudes; the 8-bit Q8_0 products at the 89M model's small shapes."""
import pytest
import torch

from backends.cpu import kernels
from ops import q8_activations as ref
from ops.quants import QTensor

pytestmark = pytest.mark.skipif(not kernels.built(), reason="no C compiler for the cpu kernels")


def awkward_rows() -> torch.Tensor:
    """Rows of 256 values (8 blocks of 32) that hit the rounding's edges."""
    g = torch.Generator().manual_seed(24)
    x = torch.randn(6, 256, generator=g) * torch.logspace(-30, 30, 6)[:, None]
    halves = torch.arange(-15.5, 16.5, 1.0)             # with a peak of 127, d = 1 and each value is its own quant
    x[0, :32] = halves
    x[0, 0] = 127.0
    x[0, 32:64] = torch.tensor([0.49999997, -0.49999997, 1.4999999, -1.4999999, 126.5, -126.5] + [0.0] * 25 + [127.0])
    x[1, :32] = 0.0                                     # a zero block: d = 0, every quant 0
    x[1, 32:64] = -0.0
    x[1, 64:96] = torch.linspace(-1e-30, 1e-30, 32)     # tiny values, d still a normal float
    x[2, :32] = -x[2, :32].abs()                        # a negative peak
    return x


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_q8_0_rounding_equals_reference(qtype):
    """Every block's d (f16-rounded) and quants are the reference's, for Q8_0 and Q8_1 (Q4_1's) activations."""
    x = torch.cat([awkward_rows(), torch.randn(16, 256, generator=torch.Generator().manual_seed(3))])
    expected = ref.quantize_q8_0(x) if qtype == "Q8_0" else ref.quantize_q8_1(x)
    width = 36 if qtype == "Q8_0" else 40
    raw = kernels.q8_quantize(x, qtype).reshape(x.shape[0], 8, width)
    assert torch.equal(raw[..., :4].contiguous().view(torch.float32)[..., 0], expected.d)
    assert torch.equal(raw[..., width - 32:].contiguous().view(torch.int8).to(torch.int32), expected.q)
    if qtype == "Q4_1":
        assert torch.equal(raw[..., 4:8].contiguous().view(torch.float32)[..., 0], expected.s)


def test_verify_argmax_in_one_pass_is_the_references():
    """The one-pass top-2 (SIMD lanes, then the tail): the largest in another lane than its duplicate, the largest or
    the second in the tail, a row of -inf, a NaN in the tail, widths around the lane count; the reference's values."""
    from backends.cpu import rowops
    from ops.verify_argmax import verify_argmax

    g = torch.Generator().manual_seed(13)
    for V in (2, 15, 16, 17, 33, 47, 129280):
        x = torch.randn(8, V, generator=g)
        x[1, -1] = 9.0                                  # the largest last (in the tail where V % 16)
        x[2, V // 2] = x[2, V // 3] = 9.0               # a duplicate largest: the lower index, margin 0
        x[3, 0] = 9.0
        x[3, -1] = 8.5                                  # the second largest last
        x[4] = -float("inf")
        x[5, -1] = float("nan")
        x[6] = x[6].round()                             # many ties below the top
        x[7, 1:] = -float("inf")
        top1, margin = rowops.verify_argmax(x)
        ref_top1, ref_margin = verify_argmax(x)
        assert torch.equal(top1, ref_top1), V
        assert torch.equal(margin.isnan(), ref_margin.isnan()), V
        assert torch.equal(margin.nan_to_num(), ref_margin.nan_to_num()), V


@pytest.mark.parametrize("K", (64, 96, 160, 256))
def test_exact_q8_0_rows_of_few_blocks_are_batch_and_thread_invariant(K, pool_threads, monkeypatch):
    """Exact Q8_0 at M = 1 with few blocks a row (K = 64: the 89M model's q_b and output_b; four rows' lane sums taken
    together, or four rows finished together where K is a multiple of 128) against row m of an M-row call (each block
    dequantized once for every row) on 1, 2 and 3 threads: the same bits; and close to the float64 product."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)     # split even these small weights
    g = torch.Generator().manual_seed(K)
    w = QTensor.quantize(torch.randn(23, K, generator=g) / 8, "Q8_0", "w")
    x = torch.randn(5, K, generator=g)
    torch.set_num_threads(1)
    together = kernels.qgemv(x, w)
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        for m in range(5):
            assert torch.equal(kernels.qgemv(x[m:m + 1], w), together[m:m + 1]), (K, n, m)
    expected = x.double() @ w.dequantize().double().T
    assert torch.allclose(together.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K", (64, 96, 4128, 8192))
def test_q8_q8_0_rows_equal_reference(K):
    """The 8-bit Q8_0 rows at M = 1 (each activation row's block pairs made once per call: on the stack up to K = 4096,
    allocated above; an odd block count leaves one block a row to the scalar step) on 9 rows: the reference's bits."""
    g = torch.Generator().manual_seed(K)
    w = QTensor.quantize(torch.randn(9, K, generator=g) / 8, "Q8_0", "w")
    x = torch.randn(1, K, generator=g)
    assert torch.equal(kernels.qdot8(x, w), ref.qdot8(x, w)), K
