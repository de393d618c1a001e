"""IQ2_XXS's several-row products (`--cpu-dot q8`): the AMX tiles of the stored layout (backends/cpu/qdot8amx.c: each
value times its group's 2 ls + 1 split as 128 h + l, looked up from tables) and the layout repacked at load
(backends/cpu/iq2repack.c: 16 rows' blocks interleaved). The reference's bits (ops/q8_activations.py) on blocks of
random bytes (every group scale 0..15 and grid row, each value's sign) against saturated activations, for M = 1..16
on 1, 2 and 3 threads; the repack's bytes and back, routed experts by index, prefill's grouped call, the bound call,
the build without AVX-512; the default model's q8 tokens and logits with the tiles for every M as without them, and
on its repacked routed gate/up (`--weights memory`) as on the mapped file. The tiles' tests skip without AMX."""
from __future__ import annotations

import pytest
import torch

from backends.cpu import kernels, repack
from ds4.engine import default_model_paths
from ops import q8_activations as ref
from ops.quants import QTensor, get
from tests import repack_helpers as helpers
from tests import test_cpu_amx_rows
from tests.repack_helpers import repacked, run, threads_split  # noqa: F401 (a fixture)
from tests.test_cpu_q8 import rebuild_with

pytestmark = pytest.mark.skipif(not kernels.built(), reason="the cpu kernel library cannot be built here")
needs_amx = pytest.mark.skipif(not kernels.amx_rows(), reason="no AMX-INT8 here")
every_m = test_cpu_amx_rows.every_m


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


@needs_amx
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


@needs_amx
def test_tiles_equal_rows_path_at_the_expert_shape(every_m):
    """A routed gate/up expert's shape (64 of its 2048 rows, 4096 values): the same bits on the tiles as on the
    AVX-512 rows (tiles off), M = 6 and 16."""
    w, x = random_blocks(64, 4096, seed=2), saturated(16, 4096, seed=3)
    tiles = {M: kernels.qdot8(x[:M], w) for M in (6, 16)}
    kernels.amx_rows(False)
    for M, y in tiles.items():
        assert torch.equal(y, kernels.qdot8(x[:M], w)), M


@needs_amx
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


def test_repack_interleaves_blocks_and_back():
    """The repacked group holds each row's stored blocks, block b of row n at (16 b + n) x 66; rows past the last
    whole group stay as stored; unpack gives the stored bytes back; the record has no quant type."""
    w = random_blocks(37, 512)
    r = repacked(w)
    assert type(r) is repack.RepackedIQ2XXS and not hasattr(r, "qtype")
    stored = w.data[:32].reshape(2, 16, 2, 66)
    assert torch.equal(r.data[:32].reshape(2, 2, 16, 66), stored.transpose(1, 2))
    assert torch.equal(r.data[32:], w.data[32:])
    assert torch.equal(repack.unpack(r).data, w.data)


@pytest.mark.parametrize("amx_from", (2, 17))
def test_repacked_equals_reference_for_every_m_and_thread_split(amx_from, threads_split):  # noqa: F811
    """53 rows (three whole groups, 5 stored rows) of 512 values (and 256, 768) against saturated rows: the
    reference's bits for M = 1..16 on 1 thread and split across 2 and 3 (chunk boundaries inside groups), with the
    tiles from 2 rows and never (the VNNI rows for every M)."""
    with helpers.amx_from("IQ2_XXS", amx_from):
        for K in (512, 256, 768):
            w, x = random_blocks(53, K, seed=K), saturated(16, K)
            r, expected = repacked(w), ref.qdot8(x, w)
            helpers.assert_every_m(x, r, expected, (1, 2, 3) if K == 512 else (1,), (amx_from, K))


def test_repacked_experts_prefill_and_bound_call(threads_split):  # noqa: F811
    """A stack of experts by index (an expert -1 gives 0), prefill's grouped call and the bound call: the stored
    weight's bits, 2 threads."""
    g = torch.Generator().manual_seed(8)
    stack = random_blocks(3 * 48, 1024, seed=4)
    w = QTensor(stack.qtype, (3, 48, 1024), stack.data.reshape(3, 48, -1).contiguous(), "w")
    r = repacked(w)
    torch.set_num_threads(2)
    ids, x = torch.tensor([2, 0, -1, 1, 2]), torch.randn(5, 1024, generator=g)
    assert torch.equal(repack.product(x, r, ids), kernels.qdot8(x, w, ids))
    xs, groups, first = torch.randn(20, 1024, generator=g), torch.tensor([0, 2]), torch.tensor([0, 3, 20])
    assert torch.equal(repack.experts_product(xs, r, groups, first),
                       kernels.experts_product(xs, w, groups, first, "q8"))
    w2 = random_blocks(40, 1024, seed=5)
    bound = repack.bind(repacked(w2))
    for M in (1, 4, 16):
        assert torch.equal(kernels.bound_product(bound, xs[:M]), kernels.qdot8(xs[:M], w2)), M


def test_repacked_build_without_avx512(tmp_path, monkeypatch):
    """The build without AVX-512 (iq2repack.c's plain C loop: each row's blocks back in the stored order through
    qdot8): the same bits, M = 1, 2, 5, 16."""
    w, x = random_blocks(21, 512, seed=6), saturated(16, 512, seed=7)
    expected = kernels.qdot8(x, w)
    rebuild_with("-mno-avx512f", tmp_path, monkeypatch)
    r = repacked(w)
    for M in (1, 2, 5, 16):
        assert torch.equal(repack.product(x[:M], r), expected[:M]), M


def test_default_model_on_repacked_gate_up_equals_mapped():
    """`--weights memory --cpu-dot q8` repacks the default model's routed IQ2_XXS gate/up stacks at load; prefill
    (chunks of 32: several rows per expert) and decoding give the mapped file's tokens and logits bit for bit."""
    path = default_model_paths()[0]
    ids, logits, _ = run(path, "mmap", prompt=40, tokens=4)
    ids2, logits2, copied = run(path, "memory", prompt=40, tokens=4)
    assert all(type(L.experts.gate) is repack.RepackedIQ2XXS for L in copied.model.layers) == repack.worthwhile()
    assert ids == ids2 and len(ids) == 4
    assert all(torch.equal(a, b) for a, b in zip(logits, logits2, strict=True))
