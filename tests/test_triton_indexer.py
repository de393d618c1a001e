"""Lightning indexer: the Triton kernels (interpreter) against the PyTorch references, and batch invariance.

`indexer_topk` is exact (integer indices, ties to the lower index, −1 padding). `index_scores` is within
1e-5 · Σ_h |w_h| · |q_h · key| of the reference elementwise (float32 sums in another order; tf32x3 on a
GPU), with −inf at exactly the same places. Batch invariance is bit for bit for M = 1..16.
"""
import pytest
import torch

from backends.registry import implementations
from ops.index_scores import index_scores as reference_scores
from ops.indexer_topk import indexer_topk as reference_topk
from ops.qmatmul import SMALL_M

pytestmark = pytest.mark.on_device  # CUDA when present, else the interpreter (tests/devices.py)

RTOL = 1e-5


def kernel(op: str):
    """The registered Triton implementation of `op`."""
    return implementations(op)["triton"].fn


def randn(*shape: int, seed: int) -> torch.Tensor:
    """Seeded standard normal samples."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_scores_close(got: torch.Tensor, q, keys, w, visible) -> None:
    """got equals the reference's −inf pattern and is within RTOL of its finite values."""
    expected = reference_scores(q, keys, w, visible)
    assert torch.equal(got.isneginf(), expected.isneginf())
    bound = RTOL * torch.einsum("mhd,nd->mhn", q, keys).abs().mul(w.abs()[:, :, None]).sum(1) + 1e-30
    seen = ~expected.isneginf()
    assert ((got - expected).abs()[seen] <= bound[seen]).all()


@pytest.mark.parametrize("heads,dim,n", [(4, 32, 70), (64, 128, 40)])  # tiny; real heads × dims
def test_index_scores_matches_reference_and_is_batch_invariant(heads, dim, n):
    """M = 1..17 queries with visible counts 0, 1, partial blocks and the whole buffer."""
    M = SMALL_M + 1
    q, keys, w = randn(M, heads, dim, seed=0), randn(n, dim, seed=1), randn(M, heads, seed=2)
    visible = tuple((0, 1, n, 33, n - 1, 5)[r % 6] for r in range(M))
    fn = kernel("index_scores")
    assert_scores_close(fn(q, keys, w, visible), q, keys, w, visible)
    single = torch.cat([fn(q[r:r + 1], keys, w[r:r + 1], visible[r:r + 1]) for r in range(SMALL_M)])
    assert_scores_close(single, q[:SMALL_M], keys, w[:SMALL_M], visible[:SMALL_M])
    for m in (2, 7, SMALL_M):
        assert torch.equal(fn(q[:m], keys, w[:m], visible[:m]), single[:m])


def scores_with_ties(M: int, n: int, seed: int) -> torch.Tensor:
    """Random scores with repeated values, ±0.0 and −inf entries."""
    s = randn(M, n, seed=seed).round(decimals=1)    # many exact ties
    s[:, 3], s[:, 4] = -0.0, 0.0
    s[1::3, 7] = float("-inf")
    return s


@pytest.mark.parametrize("k", [1, 4, 64])   # top_k = 1; tiny; more than any row sees
def test_indexer_topk_is_exact(k):
    """M = 17 rows, visible 0..n (fewer than k included): exactly the reference's indices."""
    s = scores_with_ties(SMALL_M + 1, 37, seed=k)
    visible = torch.tensor([(0, 1, 2, 37, 5, 36, 30)[r % 7] for r in range(SMALL_M + 1)])
    got = kernel("indexer_topk")(s, k, visible)
    assert got.dtype == torch.int64 and torch.equal(got, reference_topk(s, k, visible))


def test_indexer_topk_is_batch_invariant():
    """Row r of the M-row call equals the 1-row call (one program per row: the M = 16 call covers M < 16)."""
    s = scores_with_ties(SMALL_M, 37, seed=5)
    visible = torch.tensor([(0, 1, 2, 37, 5, 36, 30)[r % 7] for r in range(SMALL_M)])
    fn = kernel("indexer_topk")
    single = torch.cat([fn(s[r:r + 1], 4, visible[r:r + 1]) for r in range(SMALL_M)])
    assert torch.equal(fn(s, 4, visible), single)
    assert torch.equal(fn(s[:3], 4, visible[:3]), single[:3])


def test_indexer_topk_real_k_with_ties():
    """top-512 of 700 rows with heavy ties and a constant row: ties go to the lower index."""
    s = scores_with_ties(2, 700, seed=3)
    s[1] = 0.25
    visible = torch.tensor([700, 600])
    got = kernel("indexer_topk")(s, 512, visible)
    assert torch.equal(got, reference_topk(s, 512, visible))
    assert got[1].tolist() == list(range(512))
