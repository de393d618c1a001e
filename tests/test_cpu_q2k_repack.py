"""Q2_K repacked at load for `--cpu-dot q8` (backends/cpu/q2krepack.c, backends/cpu/repack.py): the repack is a
permutation of the bytes (and back), and the repacked kernels give today's q8 Q2_K bits (kernels.qdot8 on the stored
weight, itself checked against ops/q8_activations.py) for M = 1..16, 1/2/3 threads with chunk splits inside a group,
row counts that are not whole groups, routed experts by index, with the AMX tiles, the VNNI rows and the AVX2 and
plain C builds; a tiny model with Q2_K routed down stacks repacks them and keeps its tokens and logits."""
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


weight = functools.partial(helpers.weight, "Q2_K")
activations = helpers.activations
repacked = helpers.repacked
threads_split = helpers.threads_split


def test_repack_is_a_permutation_and_back():
    """The repacked group holds the same d/dmin, scale and field bytes in other places, the rows past the last whole
    group stay as stored, unpack gives the stored bytes back, and the repacked weight has no quant type to mistake."""
    w = weight(37, 512)
    r = repacked(w)
    assert type(r) is repack.RepackedQ2K and not hasattr(r, "qtype")
    assert not torch.equal(r.data[:32], w.data[:32])
    assert torch.equal(r.data[32:], w.data[32:])
    stored = w.data[:16].reshape(16, 2, 84)                     # 16 rows x 2 blocks
    group = r.data[:16].reshape(2, 1344)                       # 2 group blocks of 16 rows
    for b in range(2):
        assert torch.equal(group[b, :32].view(torch.int16), stored[:, b, 80:82].reshape(-1).view(torch.int16))
        assert torch.equal(group[b, 32:64].view(torch.int16), stored[:, b, 82:84].reshape(-1).view(torch.int16))
        assert torch.equal(torch.sort(group[b, 64:320])[0], torch.sort(stored[:, b, :16].reshape(-1))[0])
        assert torch.equal(group[b, 320:].reshape(16, 16, 4), stored[:, b, 16:80].reshape(16, 16, 4).transpose(0, 1))
    assert torch.equal(repack.unpack(r).data, w.data)


@pytest.mark.parametrize("amx_from", (2, 17))
def test_repacked_equals_stored_for_every_m_and_thread_split(amx_from, threads_split):
    """87 output rows (five whole groups, 7 rows in the stored layout), 512 values (and 256, 768: one and three
    blocks): kernels.qdot8's bits (and the reference's) for M = 1..16, on 1 thread and split across 2 and 3; with the
    tiles from 2 rows and never."""
    with helpers.amx_from("Q2_K", amx_from):
        for K in (512, 256, 768):
            w, x = weight(87, K), activations(16, K)
            r = repacked(w)
            expected = kernels.qdot8(x, w)
            assert torch.equal(expected[:3], ref.qdot8(x[:3], w))
            helpers.assert_every_m(x, r, expected, (1, 2, 3) if K == 512 else (1,), (amx_from, K))


def test_repacked_experts_prefill_and_bound_call(threads_split):
    """A stack of experts by index (an expert -1 gives 0), prefill's grouped call (experts_product) and the bound
    call (kernels.bound_product) of a 2-D weight: the stored weight's bits, 1 and 2 threads."""
    w = weight(3, 48, 1024, seed=2)
    r = repacked(w)
    ids = torch.tensor([2, 0, -1, 1, 2])
    x = activations(5, 1024, seed=3)
    torch.set_num_threads(2)
    assert torch.equal(repack.product(x, r, ids), kernels.qdot8(x, w, ids))
    xs, groups, first = activations(20, 1024, seed=7), torch.tensor([0, 2]), torch.tensor([0, 3, 20])
    assert torch.equal(repack.experts_product(xs, r, groups, first),
                       kernels.experts_product(xs, w, groups, first, "q8"))
    w2 = weight(40, 1024, seed=4)
    bound = repack.bind(repacked(w2))
    for M in (1, 4, 16):
        xs = activations(M, 1024, seed=M)
        assert torch.equal(kernels.bound_product(bound, xs), kernels.qdot8(xs, w2)), M


def test_refusals():
    """Not a repackable type, fewer than 16 rows, too many activation rows, a non-repacked weight's layout: clear
    errors."""
    with pytest.raises(ValueError, match="not a repackable Q4_K, Q2_K, IQ2_XXS or Q8_0"):
        repack.repack(QTensor.quantize(torch.randn(16, 256), "Q3_K", "w"))
    with pytest.raises(ValueError, match="not a repackable"):
        repack.repack(weight(8, 256))
    r = repacked(weight(16, 256))
    with pytest.raises(ValueError, match="at most 16 rows"):
        repack.product(torch.randn(17, 256), r)
    with pytest.raises(TypeError, match="not a repacked weight"):
        repack.layout_of(weight(16, 256))


def test_build_without_avx512(tmp_path, monkeypatch):
    """The build without AVX-512 (the plain C group kernel, as on AVX2 and plain C targets): the same bits, M = 1, 2,
    5, 16."""
    flags = "-mno-avx512f"
    w, x = weight(21, 512, seed=5), activations(16, 512, seed=6)
    expected = kernels.qdot8(x, w)
    rebuild_with(flags, tmp_path, monkeypatch)
    r = repacked(w)
    for M in (1, 2, 5, 16):
        assert torch.equal(repack.product(x[:M], r), expected[:M]), (flags, M)


@pytest.fixture(scope="module")
def q2_down_tiny(tmp_path_factory) -> str:
    """A tiny random model in ds4's q4 mix but with Q2_K routed down projections (the q2 mix's; its IQ2_XXS gate/up
    would take the reference quantizer a minute), rows of 256 values, so that its routed stacks are Q4_K and Q2_K
    stacks of whole groups (8 experts of 256 x 256)."""
    from ds4.formats import quant_mix
    from ds4.tiny.build import write_tiny
    path = str(tmp_path_factory.mktemp("q2") / "tiny-q2-down.gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(quant_mix._ROUTED["q4"], "ffn_down_exps", "Q2_K")
        write_tiny(path, mix="q4", dim=256, moe_inter_dim=256, n_layers=2, n_hash_layers=1, compress_ratios=(0, 4))
    return path


def test_model_on_repacked_weights_equals_mapped(q2_down_tiny):
    """`--weights memory --cpu-dot q8` repacks the routed Q2_K (and Q4_K) stacks at load (typed, in place); prefill,
    decode and a 9-row call of the unfused path give the mapped weights' tokens and logits bit for bit."""
    ids, logits, mapped = helpers.run(q2_down_tiny, "mmap")
    ids2, logits2, copied = helpers.run(q2_down_tiny, "memory")
    assert all(type(L.experts.down) is repack.RepackedQ2K and type(L.experts.gate) is repack.RepackedQ4K
               for L in copied.model.layers) == repack.worthwhile()
    assert all(type(L.experts.down) is QTensor and L.experts.down.qtype.name == "Q2_K" for L in mapped.model.layers)
    assert ids == ids2 and len(ids) == 5
    assert all(torch.equal(a, b) for a, b in zip(logits, logits2, strict=True))
    from backends.cpu import ffn
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(9))    # 9 rows x top-2: the unfused path
    outs = [ffn.moe(x, torch.arange(5, 14), engine.model.layers[1].experts, "q8") for engine in (mapped, copied)]
    assert torch.equal(outs[0], outs[1])
