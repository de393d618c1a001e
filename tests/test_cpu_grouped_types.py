"""qgemv.c's grouped exact path for Q6_K, Q5_K, Q3_K, IQ4_XS, the 32-value types, MXFP4, IQ2_XS, IQ3_XXS, TQ2_0
and Q2_K (`dot_<type>` for rows of their own, `unpack_<type>` for M > 1; docs/cpu.md "The other types' exact M = 1
kernels", "Exact 2- and 3-bit kernels at M = 1"):
within float32 rounding of the reference's dequantized weight times x (summed in float64), plain and by expert, on
row counts that leave rows after the four-row steps and on rows the grouped path does not take (32-value types,
K % 128 != 0), and Q8_0 by expert; every row of an M-row call the bits of its 1-row call, for M = 1..16 and 1, 2 and 3
threads."""
from __future__ import annotations

import pytest
import torch

from backends.cpu import kernels
from ops.quants import QTensor
from tests.rounding import within_rounding

TYPES = ("Q6_K", "Q5_K", "Q3_K", "IQ4_XS", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4", "IQ2_XS", "IQ3_XXS",
         "TQ2_0", "Q2_K")
SUPER_BLOCK = dict.fromkeys(("Q6_K", "Q5_K", "Q3_K", "IQ4_XS", "IQ2_XS", "IQ3_XXS", "TQ2_0", "Q2_K"), 256)  # else 32

pytestmark = pytest.mark.skipif(not kernels.built(), reason="the cpu kernel library is off (DS4_CPU_KERNELS=0)")


@pytest.mark.parametrize("qtype", TYPES)
def test_grouped_product_is_the_reference_within_rounding_and_batch_invariant(qtype, pool_threads, monkeypatch):
    """43 rows (ten four-row steps, 3 left) at K of 2 super-blocks (and K = 160 for the 32-value types, which the
    grouped path leaves to dequantize-then-multiply): within rounding of the reference, each row of every M = 1..16
    call and every thread count the bits of the 1-row, 1-thread call."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)     # split even these small weights, into the most chunks
    g = torch.Generator().manual_seed(11)
    for k in (2 * SUPER_BLOCK.get(qtype, 128),) + (() if qtype in SUPER_BLOCK else (160,)):
        w = QTensor.quantize(torch.randn(43, k, generator=g) / 16, qtype, "w")
        x = torch.randn(16, k, generator=g)
        torch.set_num_threads(1)
        single = torch.cat([kernels.qgemv(x[m:m + 1], w) for m in range(16)])
        within_rounding(single, x, w.dequantize())
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for M in range(1, 17):
                assert torch.equal(kernels.qgemv(x[:M], w), single[:M]), (qtype, k, n, M)


@pytest.mark.parametrize("qtype", TYPES + ("Q8_0",))
def test_grouped_product_by_expert(qtype, pool_threads):
    """Routed experts read in place by index (-1: another rank's expert, 0): each row within rounding of its own
    expert's product and the bits of its 1-row call, on 1 and 3 threads."""
    g = torch.Generator().manual_seed(12)
    k = SUPER_BLOCK.get(qtype, 128) * 2
    w = QTensor.quantize(torch.randn(4, 22, k, generator=g) / 16, qtype, "w")
    x = torch.randn(16, k, generator=g)
    ids = torch.tensor([3, 0, 2, -1, 1, 3, 3, 0, 2, 1, -1, 0, 1, 2, 3, 0])
    dense = w.dequantize()
    torch.set_num_threads(1)
    single = torch.cat([kernels.qgemv(x[m:m + 1], w, ids[m:m + 1]) for m in range(16)])
    for m, e in enumerate(ids.tolist()):
        if e < 0:
            assert torch.equal(single[m], torch.zeros(22))
        else:
            within_rounding(single[m:m + 1], x[m:m + 1], dense[e])
    for n in (1, 3):
        torch.set_num_threads(n)
        for M in (1, 7, 16):
            assert torch.equal(kernels.qgemv(x[:M], w, ids[:M]), single[:M]), (qtype, n, M)
