"""Q8_0 repacked for `--cpu-dot q8` (backends/cpu/q8repack.c, backends/cpu/repack.py): the repack is a permutation of
the bytes (and back), and the repacked kernels give today's q8 Q8_0 bits (kernels.qdot8 on the stored weight, itself
checked against ops/q8_activations.py) for M = 1..16 (prefill's more rows: kernels.qgemm8's), 1/2/3 threads with
chunk splits inside a group, row counts that are not whole groups, an odd block count, with the AMX tiles, the VNNI
rows and the AVX2 and plain C builds."""
from __future__ import annotations

import functools

import pytest
import torch

from backends.cpu import kernels, repack
from backends.cpu.qmatmul import qmatmul
from ops import q8_activations as ref
from ops.quants import QTensor
from tests import repack_helpers as helpers
from tests.test_cpu_q8 import rebuild_with

pytestmark = pytest.mark.skipif(not kernels.built(), reason="the cpu kernel library cannot be built here")


weight = functools.partial(helpers.weight, "Q8_0")
activations = functools.partial(helpers.activations, block=32)
repacked = helpers.repacked
threads_split = helpers.threads_split


def test_repack_is_a_permutation_and_back():
    """A group's blocks hold the 16 rows' scales and values in other places (pairs of blocks, values first), the rows
    past the last whole group stay as stored, unpack gives the stored bytes back, and there is no quant type."""
    w = weight(37, 96)                                          # 3 blocks a row: a pair and an odd last block
    r = repacked(w)
    assert not torch.equal(r.data[:32], w.data[:32])
    assert torch.equal(r.data[32:], w.data[32:])
    stored = w.data[:16].reshape(16, 3, 34)
    group = r.data[:16].reshape(-1)
    for b, (values, scales) in enumerate(((0, 1024), (512, 1056), (1088, 1600))):
        assert torch.equal(group[scales:scales + 32].view(torch.int16), stored[:, b, :2].reshape(-1).view(torch.int16))
        block = group[values:values + 512].reshape(8, 16, 4)    # vector k: row n's values 4k .. 4k + 3
        assert torch.equal(block.permute(1, 0, 2).reshape(16, 32), stored[:, b, 2:])
    assert torch.equal(repack.unpack(r).data, w.data)
    assert not hasattr(r, "qtype")


@pytest.mark.parametrize("amx_from", (2, 9, 17))
def test_repacked_equals_stored_for_every_m_and_thread_split(amx_from, threads_split):
    """87 output rows (five whole groups: four read at once and one alone, 7 rows in the stored layout) of 480 values
    (15 blocks) and 200 rows (12 groups) of 1024: kernels.qdot8's bits (and the reference's) for M = 1..16, on 1
    thread and split across 2 and 3; with the tiles from 2 rows, from 9 and never."""
    before = repack.amx_from("Q8_0")
    repack.amx_from("Q8_0", amx_from)
    try:
        for n, k in ((87, 480), (200, 1024)):
            w, x = weight(n, k), activations(16, k)
            r = repacked(w)
            expected = kernels.qdot8(x, w)
            assert torch.equal(expected[:3], ref.qdot8(x[:3], w))
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                for M in range(1, 17) if threads == 1 else (1, 3, 9, 16):
                    assert torch.equal(repack.product(x[:M], r), expected[:M]), (amx_from, n, k, threads, M)
    finally:
        repack.amx_from("Q8_0", before)


def test_groups_as_a_stack_of_experts(threads_split):
    """A 2-D repacked weight's groups of rows as a stack (the grouped output projection's: `groups_of`), each row
    against its group (-1: none, 0): kernels.qdot8's bits on the stored stack, M = 1..16, 1 and 3 threads; one group
    (`group_rows`) as a 2-D weight; groups that are not whole groups of 16 rows are refused."""
    w, x = weight(4 * 48, 320), activations(16, 320)
    r = repacked(w)
    stack, stored = repack.groups_of(r, 4), QTensor(w.qtype, (4, 48, 320), w.data.reshape(4, 48, -1), "w")
    ids = torch.tensor([3, 0, -1, 2, 1, 1, 0, 3, 2, -1, 0, 1, 2, 3, 3, 0])
    for threads in (1, 3):
        torch.set_num_threads(threads)
        for M in range(1, 17):
            assert torch.equal(repack.product(x[:M], stack, ids[:M]), kernels.qdot8(x[:M], stored, ids[:M])), M
    group = QTensor(w.qtype, (48, 320), w.data[96:144], "w")
    assert torch.equal(repack.product(x, repack.group_rows(r, 2, 4)), kernels.qdot8(x, group))
    assert repack.groups_of(r, 8) is None
    with pytest.raises(ValueError, match="not whole groups of 16 rows"):
        repack.group_rows(r, 0, 8)


def test_prefill_rows_equal_stored_gemm(threads_split):
    """More than 16 rows (prefill: q8r_gemm, each group read once for all rows, 16 rows at a time from the cache):
    the stored weight's 8-bit GEMM's bits (kernels.qgemm8) for 17..40 rows, on 1 thread and split across 2 and 3,
    with rows past the last whole group and a group cut by a chunk."""
    for n, k in ((87, 480), (200, 1024)):
        w, x = weight(n, k, seed=3), activations(40, k, seed=4)
        r = repacked(w)
        expected = kernels.qgemm8(x, w)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for M in (17, 20, 33, 40) if threads == 1 else (17, 40):
                assert torch.equal(qmatmul(x[:M], r, "q8"), expected[:M]), (n, k, threads, M)


def test_large_output_written_around_the_cache(threads_split):
    """An output of at least 1 MB (16 rows x 16400: q8repack.c streams whole groups' outputs past the cache, a group
    cut by a chunk stored as usual): kernels.qdot8's bits on 1 and 2 threads, with the tiles and the VNNI rows."""
    w, x = weight(16400, 64, seed=7), activations(16, 64, seed=8)
    r = repacked(w)
    expected = kernels.qdot8(x, w)
    before = repack.amx_from("Q8_0")
    try:
        for amx_from, threads in ((2, 1), (2, 2), (17, 1)):
            repack.amx_from("Q8_0", amx_from)
            torch.set_num_threads(threads)
            assert torch.equal(repack.product(x, r), expected), (amx_from, threads)
    finally:
        repack.amx_from("Q8_0", before)


def test_refusals():
    """A type without a layout, fewer than 16 rows, a Q8_0 stack, experts, too many activation rows: clear errors."""
    with pytest.raises(ValueError, match="not a repackable Q4_K, Q2_K, IQ2_XXS or Q8_0 weight: .*Q5_K"):
        repack.repack(QTensor.quantize(torch.randn(16, 256), "Q5_K", "w"))
    with pytest.raises(ValueError, match="not a repackable"):
        repack.repack(weight(8, 256))
    stack = weight(32, 256)
    with pytest.raises(ValueError, match="not a repackable"):
        repack.repack(QTensor(stack.qtype, (2, 16, 256), stack.data.reshape(2, 16, -1), "stack"))
    r = repacked(weight(16, 256))
    with pytest.raises(ValueError, match="2-D repacked Q8_0 weight takes no experts"):
        repack.product(torch.randn(2, 256), r, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="at most 16 rows"):
        repack.product(torch.randn(17, 256), r)


def test_build_without_avx512(tmp_path, monkeypatch):
    """The build without AVX-512 (the plain C group kernel, as on AVX2 and plain C targets): the same bits, M = 1, 2,
    16, and prefill's 20 rows."""
    flags = "-mno-avx512f"
    w, x = weight(21, 480, seed=5), activations(20, 480, seed=6)
    expected, gemm = kernels.qdot8(x[:16], w), kernels.qgemm8(x, w)
    rebuild_with(flags, tmp_path, monkeypatch)
    assert not repack.worthwhile()
    r = repacked(w)
    for M in (1, 2, 16):
        assert torch.equal(repack.product(x[:M], r), expected[:M]), (flags, M)
    assert torch.equal(qmatmul(x, r, "q8"), gemm)


@pytest.fixture(scope="module")
def q2_tiny(tmp_path_factory) -> str:
    """A tiny random model in ds4's q2 mix (Q8_0 attention, shared expert and LM head, rows of 256 values)."""
    from ds4.tiny.build import write_tiny
    path = str(tmp_path_factory.mktemp("q2") / "tiny-q2.gguf")
    write_tiny(path, mix="q2", dim=256, moe_inter_dim=256, n_layers=2, n_hash_layers=1, compress_ratios=(0, 4))
    return path


def test_model_on_repacked_q8_0_equals_mapped(q2_tiny, threads_split):
    """`--weights memory --cpu-dot q8` repacks the trunk's 2-D Q8_0 weights at load (each block's q_a, q_b, kv,
    output_a, output_b, shared expert, and the LM head): a 20-row prefill (chunks of 16 rows) and
    decode steps give the mapped weights' tokens and logits bit for bit; the weights' products (qmatmul, the fused
    attention input and output, the grouped output projection, the shared expert) equal the stored weights' for
    M = 1..16 and 20 rows on 1, 2 and 3
    threads; the exact path keeps the stored blocks and a repacked weight refuses it."""
    from backends.cpu import ffn, fused, qmatmul
    from ds4.weights import BLOCK_Q8_0
    ids, logits, mapped = helpers.run(q2_tiny, "mmap")
    ids2, logits2, copied = helpers.run(q2_tiny, "memory")
    layers = copied.model.layers
    dense = [getattr(L, name) for L in layers for name in BLOCK_Q8_0] + [w for L in layers for w in L.shared]
    assert all(type(w) is repack.RepackedQ8_0 for w in [*dense, copied.model.output]) == repack.worthwhile()
    assert ids == ids2 and len(ids) == 5
    assert all(torch.equal(a, b) for a, b in zip(logits, logits2, strict=True))
    args, stored, packed = mapped.model.args, mapped.model.layers[1], layers[1]
    hd, g = args.head_dim, torch.Generator().manual_seed(3)
    x, o = torch.randn(20, args.dim, generator=g), torch.randn(20, args.n_heads, hd, generator=g)
    groups = stored.output_a.shape[0] // args.o_lora_rank

    def products(L, M: int, head) -> list[torch.Tensor]:
        pos = torch.arange(M)
        attn_in = fused.attention_input(x[:M], L.q_a, L.q_a_norm, L.q_b, L.kv, L.kv_norm, args.rms_eps, hd, pos,
                                        L.freqs, torch.zeros(32, hd), pos, dot="q8")
        return [qmatmul.qmatmul(x[:M], head, "q8"), *attn_in,
                fused.attention_output(o[:M], pos, L.freqs, L.output_a, L.output_b, groups, "q8"),
                qmatmul.grouped_qmatmul(o[:M].reshape(M, groups, -1), L.output_a, "q8"),
                ffn.shared_expert(x[:M], *L.shared, L.shared_clamp, "q8")]

    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        for M in (*range(1, 17), 20) if threads == 1 else (1, 3, 16, 20):
            expected, got = products(stored, M, mapped.model.output), products(packed, M, copied.model.output)
            assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), (threads, M)
    with pytest.raises(ValueError, match="--cpu-dot q8 only"):
        qmatmul.qmatmul(x[:1], packed.q_a, "exact")
    import ds4
    exact = ds4.load(q2_tiny, weights="memory")
    assert all(type(L.q_a) is QTensor for L in exact.model.layers) and type(exact.model.output) is QTensor


def test_full_width_bench_repacks_as_load_and_restores(q2_tiny, monkeypatch):
    """`bench.py cpu --full-layers` on a file read into memory under q8 makes ds4.load's repacks for its run
    (`full_width.as_loaded`) and rewrites the file's bytes back after, so an exact run on the same opened file reads
    the stored blocks; a mapped file is never repacked."""
    from ds4.bench import full_width
    from ds4.formats import gguf
    seen = []
    monkeypatch.setattr(full_width, "greedy", lambda s, out: seen.append(type(s.model.output)) or int(out.argmax()))
    f = gguf.open(q2_tiny, "memory")
    stored = {name: f.raw(name).data.clone() for name in f.tensors}
    for dot in ("q8", "exact"):
        full_width.run_ds4(f, [3, 4, 5], 2, dot)
        assert all(torch.equal(f.raw(name).data, data) for name, data in stored.items()), dot
    assert (seen[0] is repack.RepackedQ8_0) == repack.worthwhile() and seen[-1] is QTensor   # the q8 run, the exact
    mapped = gguf.open(q2_tiny)
    full_width.run_ds4(mapped, [3, 4, 5], 1, "q8")
    assert seen[-1] is QTensor
