"""qgemv.c's exact Q8_0 rows of K % 128 == 0 (`q8_0_own_rows` for rows of their own, `q8_0_weight_rows` for one weight
and M > 1 rows; docs/cpu.md "The 89M exact step (session 15)"): within float32 rounding of the dequantized weight
times x summed in float64, on row counts that leave rows after the four-row steps; every row of an M-row call the bits
of its 1-row call, for 1, 2 and 3 threads. By expert: test_cpu_grouped_types.py's `test_grouped_product_by_expert`."""
from __future__ import annotations

import pytest
import torch

from backends.cpu import kernels
from ops.quants import QTensor
from tests.rounding import within_rounding

pytestmark = pytest.mark.skipif(not kernels.built(), reason="the cpu kernel library is off (DS4_CPU_KERNELS=0)")


@pytest.mark.parametrize("K", (128, 256, 4096))
def test_exact_q8_0_is_the_reference_within_rounding_and_batch_invariant(K, pool_threads, monkeypatch):
    """43 rows (ten four-row steps, 3 left; K = 256: the 89M model's LM head and experts, 8 blocks a row): within
    rounding of the reference, each row of M = 1, 2, 7, 16 rows on 1, 2 and 3 threads the bits of its 1-row call."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)     # split even these small weights, into the most chunks
    g = torch.Generator().manual_seed(K)
    w = QTensor.quantize(torch.randn(43, K, generator=g) / 16, "Q8_0", "w")
    x = torch.randn(16, K, generator=g) * torch.logspace(-3, 3, K)     # values of many magnitudes in every block
    torch.set_num_threads(1)
    single = torch.cat([kernels.qgemv(x[m:m + 1], w) for m in range(16)])
    within_rounding(single, x, w.dequantize())
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        for M in (1, 2, 7, 16):
            assert torch.equal(kernels.qgemv(x[:M], w), single[:M]), (K, n, M)
