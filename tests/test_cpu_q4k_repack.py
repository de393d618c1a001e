"""Q4_K repacked at load for `--cpu-dot q8` (backends/cpu/q4krepack.c, backends/cpu/repack.py): the repack is a
permutation of the bytes (and back), and the repacked kernels give today's q8 Q4_K bits (kernels.qdot8 on the stored
weight, itself checked against ops/q8_activations.py) for M = 1..16, 1/2/3 threads with chunk splits inside a group,
row counts that are not whole groups, routed experts by index, with the AMX tiles, the VNNI rows and the AVX2 and
plain C builds."""
from __future__ import annotations

import functools

import pytest
import torch

from backends.cpu import kernels, repack
from ops import q8_activations as ref
from ops.quants import QTensor
from tests import repack_helpers as helpers
from tests.test_cpu_q8 import rebuild_with

pytestmark = pytest.mark.skipif(not kernels.built(), reason="the cpu kernel library cannot be built here")


weight = functools.partial(helpers.weight, "Q4_K")
activations = helpers.activations
repacked = helpers.repacked
threads_split = helpers.threads_split


def test_repack_is_a_permutation_and_back():
    """The repacked group holds the same d/dmin and nibble bytes in other places, the rows past the last whole group
    stay as stored, unpack gives the stored bytes back, and the repacked weight has no quant type to mistake."""
    w = weight(37, 512)
    r = repacked(w)
    assert not torch.equal(r.data[:32], w.data[:32])
    assert torch.equal(r.data[32:], w.data[32:])
    stored = w.data[:16].reshape(16, 2, 144)                    # 16 rows x 2 blocks
    group = r.data[:16].reshape(2, 2304)                       # 2 group blocks of 16 rows
    for b in range(2):
        assert torch.equal(group[b, :32].view(torch.int16), stored[:, b, :2].reshape(-1).view(torch.int16))
        assert torch.equal(torch.sort(group[b, 256:])[0], torch.sort(stored[:, b, 16:].reshape(-1))[0])
    assert torch.equal(repack.unpack(r).data, w.data)
    assert not hasattr(r, "qtype")


@pytest.mark.parametrize("amx_from", (2, 17))
def test_repacked_equals_stored_for_every_m_and_thread_split(amx_from, threads_split):
    """87 output rows (five whole groups, 7 rows in the stored layout), 512 values: kernels.qdot8's bits (and the
    reference's) for M = 1..16, on 1 thread and split across 2 and 3; with the tiles from 2 rows and never."""
    w, x = weight(87, 512), activations(16, 512)
    r = repacked(w)
    expected = kernels.qdot8(x, w)
    assert torch.equal(expected[:3], ref.qdot8(x[:3], w))
    with helpers.amx_from("Q4_K", amx_from):
        helpers.assert_every_m(x, r, expected, (1, 2, 3), (amx_from,))


def test_repacked_experts_and_bound_call(threads_split):
    """A stack of experts by index (an expert -1 gives 0) and the bound call (kernels.bound_product) of a 2-D weight:
    the stored weight's bits, 1 and 2 threads."""
    w = weight(3, 48, 1024, seed=2)
    r = repacked(w)
    ids = torch.tensor([2, 0, -1, 1, 2])
    x = activations(5, 1024, seed=3)
    torch.set_num_threads(2)
    assert torch.equal(repack.product(x, r, ids), kernels.qdot8(x, w, ids))
    w2 = weight(40, 1024, seed=4)
    bound = repack.bind(repacked(w2))
    for M in (1, 4, 16):
        xs = activations(M, 1024, seed=M)
        assert torch.equal(kernels.bound_product(bound, xs), kernels.qdot8(xs, w2)), M


def test_refusals():
    """A type without a layout, fewer than 16 rows, too many activation rows: clear errors."""
    with pytest.raises(ValueError, match="not a repackable Q4_K"):
        repack.repack(QTensor.quantize(torch.randn(16, 256), "Q6_K", "w"))
    with pytest.raises(ValueError, match="not a repackable Q4_K"):
        repack.repack(weight(8, 256))
    r = repacked(weight(16, 256))
    with pytest.raises(ValueError, match="at most 16 rows"):
        repack.product(torch.randn(17, 256), r)


def test_build_without_avx512(tmp_path, monkeypatch):
    """The build without AVX-512 (the plain C group kernel, as on AVX2 and plain C targets): the same bits, M = 1, 2,
    16."""
    flags = "-mno-avx512f"
    w, x = weight(21, 512, seed=5), activations(16, 512, seed=6)
    expected = kernels.qdot8(x, w)
    rebuild_with(flags, tmp_path, monkeypatch)
    r = repacked(w)
    for M in (1, 2, 16):
        assert torch.equal(repack.product(x[:M], r), expected[:M]), (flags, M)


@pytest.fixture(scope="module")
def q4_tiny(tmp_path_factory) -> str:
    """A tiny random model in ds4's q4 mix with rows of 256 values, so that its routed experts are Q4_K stacks of
    whole groups (8 experts of 256 x 256)."""
    from ds4.tiny.build import write_tiny
    path = str(tmp_path_factory.mktemp("q4") / "tiny-q4.gguf")
    write_tiny(path, mix="q4", dim=256, moe_inter_dim=256, n_layers=2, n_hash_layers=1, compress_ratios=(0, 4))
    return path


def test_model_on_repacked_weights_equals_mapped(q4_tiny):
    """`--weights memory --cpu-dot q8` repacks the routed Q4_K stacks at load (typed, in place); prefill (the routed
    experts' groups), decode and a 3-row verify (more than 16 (row, expert) pairs) give the mapped weights' tokens and
    logits bit for bit; `--weights mmap` and the exact path keep the stored blocks."""
    ids, logits, mapped = helpers.run(q4_tiny, "mmap")
    ids2, logits2, copied = helpers.run(q4_tiny, "memory")
    stacks = [w for L in copied.model.layers for w in (L.experts.gate, L.experts.up, L.experts.down)]
    assert all(type(w) is repack.RepackedQ4K for w in stacks) == repack.worthwhile()
    assert all(type(w) is QTensor for L in mapped.model.layers for w in (L.experts.gate, L.experts.down))
    assert ids == ids2 and len(ids) == 5
    import ds4
    exact = ds4.load(q4_tiny, weights="memory")
    assert all(type(L.experts.gate) is QTensor for L in exact.model.layers)
    assert all(torch.equal(a, b) for a, b in zip(logits, logits2, strict=True))
    from backends.cpu import ffn
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(9))    # 9 rows x top-2: the unfused path
    outs = [ffn.moe(x, torch.arange(5, 14), engine.model.layers[1].experts, "q8") for engine in (mapped, copied)]
    assert torch.equal(outs[0], outs[1])
