"""Exact Q4_K and IQ2_XXS for several rows of one weight (backends/cpu/q4kexact.c, iq2exact.c: prefill's routed
experts): every row the bits of its own one-row qgemv call, for any number of rows of an expert and any thread
count."""
from __future__ import annotations

import pytest
import torch

from backends.cpu import kernels
from ops.quants import QTensor, get

pytestmark = pytest.mark.skipif(not kernels.built(), reason="cpu kernel library not built")

SCALES = {"Q4_K": (144, 0, 2), "IQ2_XXS": (66, 0, 1)}   # block bytes, offset and count of its f16 scales


def random_blocks(name: str, experts: int, N: int, K: int, seed: int) -> QTensor:
    """A stack of experts of random bytes (every scale, index, sign and nibble), the f16 scales finite."""
    block_bytes, at, halves = SCALES[name]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts * N * K // 256, block_bytes), dtype=torch.uint8, generator=g)
    scales = (torch.rand(blocks.shape[0], halves, generator=g) / 64).to(torch.float16)
    blocks[:, at:at + 2 * halves] = scales.view(torch.uint8)
    return QTensor(get(name), (experts, N, K), blocks.reshape(experts, -1))


def one_row_calls(x: torch.Tensor, w: QTensor, ids: list[int], first: list[int]) -> torch.Tensor:
    """Each row through qgemv alone against its expert."""
    N, K = w.shape[1:]
    return torch.cat([kernels.qgemv(x[r:r + 1], QTensor(w.qtype, (N, K), w.data[e]))
                      for g, e in enumerate(ids) for r in range(first[g], first[g + 1])])


@pytest.mark.parametrize("name", sorted(SCALES))
def test_rows_of_an_expert_equal_one_row_calls(pool_threads, name):
    """Experts of 1..16 rows and 17 (16 + 1) in one call equal the rows' one-row calls, on 1, 2 and 3 threads; rows
    of large magnitude among them."""
    w = random_blocks(name, 4, 37, 768, seed=3)
    sizes = list(range(1, 18))
    ids = [i % 4 for i in range(len(sizes))]
    first = [0]
    for s in sizes:
        first.append(first[-1] + s)
    x = torch.randn(first[-1], 768, generator=torch.Generator().manual_seed(4))
    x[::5] *= 1e4
    expected = one_row_calls(x, w, ids, first)
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        got = kernels.experts_product(x, w, torch.tensor(ids), torch.tensor(first), "exact")
        assert torch.equal(got, expected), n
