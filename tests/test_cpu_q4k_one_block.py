"""qgemv.c's exact Q4_K rows of one block (K = 256, `q4_k_block_rows`: the 89M model's routed experts, four rows
finished together): the bits of the grouped path's M > 1 rows (`unpack_q4_k`, `finish` a row), within float32
rounding of the reference, for every M = 1..16, 1, 2 and 3 threads, by expert (-1: another rank's) and plain, on row
counts that leave rows after the four-row steps."""
from __future__ import annotations

import pytest
import torch

from backends.cpu import kernels
from ops.quants import QTensor

pytestmark = pytest.mark.skipif(not kernels.built(), reason="the cpu kernel library is off (DS4_CPU_KERNELS=0)")


def test_one_block_rows_are_the_grouped_rows_bits(pool_threads, monkeypatch):
    """Each row of a 1-row call and of an M-row call by expert: the bits of row 0 of a 2-row call of its expert's
    weight (the grouped path, one weight for both rows), within rounding of x @ the dequantized weight."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)     # split even these small weights, into the most chunks
    g = torch.Generator().manual_seed(24)
    w = QTensor.quantize(torch.randn(4, 43, 256, generator=g) / 16, "Q4_K", "w")
    x = torch.randn(16, 256, generator=g) * torch.logspace(-3, 3, 16)[:, None]
    ids = torch.tensor([3, 0, 2, -1, 1, 3, 3, 0, 2, 1, -1, 0, 1, 2, 3, 0])
    dense = w.dequantize().double()
    torch.set_num_threads(1)
    grouped = torch.zeros(16, 43)
    for m, e in enumerate(ids.tolist()):
        if e >= 0:
            grouped[m] = kernels.qgemv(x[m].expand(2, 256), QTensor(w.qtype, (43, 256), w.data[e]))[0]
            want = dense[e] @ x[m].double()
            assert ((grouped[m].double() - want).abs() <= 1e-5 * (dense[e].abs() @ x[m].double().abs())).all()
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        for M in range(1, 17):
            assert torch.equal(kernels.qgemv(x[:M], w, ids[:M]), grouped[:M]), (n, M)
        for m, e in enumerate(ids.tolist()):
            if e >= 0:
                plain = kernels.qgemv(x[m:m + 1], QTensor(w.qtype, (43, 256), w.data[e]))
                assert torch.equal(plain[0], grouped[m]), (n, m)
