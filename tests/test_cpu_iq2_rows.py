"""IQ2_XXS's several-row products on AMX tiles (backends/cpu/qdot8amx.c: each value times its group's 2 ls + 1 split
as 128 h + l, looked up from tables): the reference's bits (ops/q8_activations.py) on blocks of random bytes (every
group scale 0..15 and grid row, each value's sign) against saturated activations, for M = 1..16 on 1, 2 and 3 threads;
the default model's q8 greedy tokens and logits with the tiles for every M as without them. Skipped without AMX."""
from __future__ import annotations

import pytest
import torch

from backends.cpu import kernels
from ds4.engine import default_model_paths
from ops import q8_activations as ref
from ops.quants import QTensor, get
from tests.repack_helpers import run

pytestmark = pytest.mark.skipif(not kernels.amx_rows(), reason="no AMX-INT8 here (or the kernels are not built)")


@pytest.fixture
def every_m():
    """The tiles for every M from 2; back to the default."""
    kernels.amx_rows(True, every_m=True)
    yield
    kernels.amx_rows(True)


def random_blocks(n: int, k: int, seed: int = 0) -> QTensor:
    """An [n, k] IQ2_XXS weight of random bytes (any 64 bytes after d are a valid block), d = 2^-6."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 256, 66), dtype=torch.uint8, generator=g)
    blocks[..., :2] = torch.tensor([0x00, 0x24], dtype=torch.uint8)        # f16 2^-6, little-endian
    return QTensor(get("IQ2_XXS"), (n, k), blocks.reshape(n, -1).contiguous(), "w")


def saturated(M: int, K: int, seed: int = 1) -> torch.Tensor:
    """Rows whose values round to +-127 (equal magnitudes, random signs), one random row and an all-zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.where(torch.rand(M, K, generator=g) < 0.5, -1.0, 1.0)
    x[1] = torch.randn(K, generator=g)
    x[0, :256] = 0
    return x


def test_random_blocks_hold_every_scale():
    """The test weight has every group scale 0..15 (the top 4 bits of each group's second word) and both signs."""
    w = random_blocks(53, 512)
    words = w.data.reshape(53, 2, 66)[..., 2:].reshape(-1, 8, 8)[..., 4:].to(torch.int64)
    assert set((words[..., 3] >> 4).flatten().tolist()) == set(range(16))


def test_tiles_equal_reference_on_every_scale_and_thread_split(every_m, monkeypatch):
    """53 rows of 512 random-byte values against saturated rows: the reference's bits for M = 1..16 on 1 thread and
    split in chunks across 2 and 3 (a chunk boundary inside a tile of 16 rows)."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)
    monkeypatch.setattr(kernels, "_pool_threads", 0)
    before = torch.get_num_threads()
    w, x = random_blocks(53, 512), saturated(16, 512)
    expected = ref.qdot8(x, w)
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for M in range(1, 17) if threads == 1 else (2, 6, 11, 16):
                assert torch.equal(kernels.qdot8(x[:M], w), expected[:M]), (threads, M)
    finally:
        torch.set_num_threads(before)


def test_tiles_equal_rows_path_at_the_expert_shape(every_m):
    """A routed gate/up expert's shape (64 of its 2048 rows, 4096 values): the same bits on the tiles as on the
    AVX-512 rows (tiles off), M = 6 and 16."""
    w, x = random_blocks(64, 4096, seed=2), saturated(16, 4096, seed=3)
    tiles = {M: kernels.qdot8(x[:M], w) for M in (6, 16)}
    kernels.amx_rows(False)
    for M, y in tiles.items():
        assert torch.equal(y, kernels.qdot8(x[:M], w)), M


def test_default_model_logits_with_tiles_for_every_m(every_m):
    """The default model (IQ2_XXS routed gate/up, 8 experts, 2 per token) under q8: a 40-token prompt prefilled in
    chunks of 32 (~8 rows per routed expert) and 4 decoding steps give the same greedy tokens and logits, bit for
    bit, with the tiles for every M as with the tiles off."""
    path = default_model_paths()[0]
    tiles = run(path, "mmap", prompt=40, tokens=4)
    kernels.amx_rows(False)
    plain = run(path, "mmap", prompt=40, tokens=4)
    assert tiles[0] == plain[0] and len(plain[0]) == 4
    assert all(torch.equal(a, b) for a, b in zip(tiles[1], plain[1], strict=True))
