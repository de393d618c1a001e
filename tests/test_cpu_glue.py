"""The cpu backend's glue kernels (backends/cpu/glue.c): each the bits of its reference in ops/ on 1, 2 and 3
kernel threads, close to the oracle op, and what the registered ops call."""
from __future__ import annotations

import pytest
import torch

from backends.cpu import ffn, glue, kernels, rowops
from backends.cpu.qmatmul import qmatmul
from backends.registry import implementations
from ops.compress import compress
from ops.embed import embed
from ops.exp_poly import exp_poly, swiglu_poly
from ops.grouped_qmatmul import group_rows, grouped_qmatmul
from ops.hc_head import hc_head, head_streams_poly
from ops.hc_post import hc_post
from ops.hc_pre import hc_pre, hc_pre_poly
from ops.quants import QTensor
from ops.rms_norm import rms_norm, rms_norm_lanes
from ops.rope_tail import rope_freqs, rope_tail
from ops.sparse_attention import AttnRows, sparse_attention, sparse_attention_lanes
from ops.store_rows import store_rows


@pytest.fixture(params=(1, 2, 3))
def threads(request):
    kernels.set_threads(request.param)
    yield request.param
    kernels.set_threads(1)
    kernels._pool_threads = 0


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def cpu(op: str):
    return implementations(op)["cpu"].fn


@pytest.mark.parametrize("shape", ((1, 4096), (3, 16384), (2, 8, 512), (4, 100), (1, 7)))
def test_rms_norm_is_the_lanes_reference(shape, threads):
    g = gen(len(shape) + shape[-1])
    x, w = torch.randn(*shape, generator=g) * 3, torch.rand(shape[-1], generator=g) + 0.5
    for weight in (w, None):
        out = cpu("rms_norm")(x, weight, 1e-6)
        assert torch.equal(out, rms_norm_lanes(x, weight, 1e-6))
        torch.testing.assert_close(out, rms_norm(x, weight, 1e-6), rtol=1e-6, atol=1e-6)


def test_hc_ops_are_their_references_bits(threads):
    g = gen(1)
    X, y = torch.randn(3, 4, 1024, generator=g), torch.randn(3, 1024, generator=g)
    post, comb = torch.rand(3, 4, generator=g), torch.rand(3, 4, 4, generator=g)
    assert torch.equal(cpu("hc_post")(X, y, post, comb), hc_post(X, y, post, comb))
    mixes, scale, base = torch.randn(3, 24, generator=g), torch.rand(3, generator=g), torch.randn(24, generator=g)
    out = cpu("hc_pre")(X, mixes, scale, base, 20, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(out, hc_pre_poly(X, mixes, scale, base, 20, 1e-6), strict=True))
    torch.testing.assert_close(out, hc_pre(X, mixes, scale, base, 20, 1e-6), rtol=1e-5, atol=1e-5)
    fn = QTensor.quantize(torch.randn(4, 4096, generator=g) / 64, "F32", "fn")
    out = cpu("hc_head")(X, fn, scale[:1], base[:4], 1e-6, 1e-6)
    mixes = qmatmul(rms_norm_lanes(X.flatten(1), None, 1e-6), fn)
    assert torch.equal(out, head_streams_poly(X, mixes, scale[:1], base[:4], 1e-6))
    torch.testing.assert_close(out, hc_head(X, fn, scale[:1], base[:4], 1e-6, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", ("F16", "Q8_0"))
def test_hc_head_in_one_call_is_the_separate_calls_bits(qtype, threads):
    """glue.hc_head (rms_norm, the product and head_streams in one C call) against the calls one by one, M = 1..3:
    every row its bits, and close to the oracle."""
    g = gen(11)
    fn = QTensor.quantize(torch.randn(4, 4096, generator=g) / 64, qtype, "fn")
    scale, base = torch.rand(1, generator=g), torch.randn(4, generator=g)
    for M in (1, 2, 3):
        X = torch.randn(M, 4, 1024, generator=g) * 2
        out = glue.hc_head(X, fn, scale, base, 1e-6, 1e-6)
        mixes = qmatmul(rms_norm_lanes(X.flatten(1), None, 1e-6), fn)
        assert torch.equal(out, head_streams_poly(X, mixes, scale, base, 1e-6))
        assert torch.equal(cpu("hc_head")(X, fn, scale, base, 1e-6, 1e-6), out)
        torch.testing.assert_close(out, hc_head(X, fn, scale, base, 1e-6, 1e-6), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("inverse", (False, True))
def test_rope_is_the_reference_rotation(inverse, threads):
    g, freqs = gen(2), rope_freqs(64, 10000.0)
    pos = torch.tensor([5, 77, 1000])
    for shape in ((3, 8, 128), (3, 512)):
        x = torch.randn(*shape, generator=g)
        assert torch.equal(cpu("rope_tail")(x, pos, freqs, inverse), rope_tail(x, pos, freqs, inverse))
    x = torch.randn(3, 512, generator=g)
    first = cpu("rope_tail")(x, pos, freqs, inverse)
    pos[0] = 6                                          # an edited positions tensor is not served stale angles
    assert not torch.equal(cpu("rope_tail")(x, pos, freqs, inverse), first)
    assert len(rowops._angles) <= rowops.ANGLES_KEPT


def test_exp_poly_is_close_to_exp():
    x = torch.cat([torch.linspace(-86, 87, 40001), torch.tensor([0.0, -88.0, float("-inf"), 89.0, float("inf")])])
    e = exp_poly(x)
    assert e[-5] == 1 and e[-4] == 0 and e[-3] == 0 and e[-2] == e[-1] == float("inf")
    ref = torch.exp(x[:-5].double())
    assert ((e[:-5].double() - ref).abs() / ref).max() < 2e-7


def attention_case(seed: int, M: int, H: int, D: int, N: int, L: int):
    g = gen(seed)
    q, kv, sinks = torch.randn(M, H, D, generator=g), torch.randn(N, D, generator=g) / 3, torch.randn(H, generator=g)
    counts = tuple(int(v) for v in torch.randint(0, L + 1, (M,), generator=g))
    raw = torch.randint(0, N, (M, L), generator=g)
    for m, n in enumerate(counts):
        raw[m, n:] = -1
    return q, kv, AttnRows(raw, counts), sinks


@pytest.mark.parametrize("shape", ((1, 64, 512, 300, 128), (3, 4, 80, 50, 20), (20, 8, 64, 40, 17)))
def test_attention_is_the_lanes_reference_on_any_thread_count(shape, threads):
    q, kv, rows, sinks = attention_case(sum(shape), *shape)
    out = cpu("sparse_attention")(q, kv, rows, sinks, 0.044)
    assert torch.equal(out, sparse_attention_lanes(q, kv, rows, sinks, 0.044))
    torch.testing.assert_close(out, sparse_attention(q, kv, rows, sinks, 0.044), rtol=1e-5, atol=1e-5)
    padded = AttnRows(torch.nn.functional.pad(rows.raw, (0, 9), value=-1), rows.n_raw)   # longer lists: same bits
    assert torch.equal(cpu("sparse_attention")(q, kv, padded, sinks, 0.044), out)
    g = gen(7)      # compressed rows after the raw ones (not concatenated on the way): the padded list's bits
    comp = torch.randint(-1, kv.shape[0], (q.shape[0], 6), generator=g)
    both = AttnRows(rows.raw, rows.n_raw, comp, (6,) * q.shape[0])
    out = cpu("sparse_attention")(q, kv, both, sinks, 0.044)
    assert torch.equal(out, sparse_attention_lanes(q, kv, both, sinks, 0.044))
    assert torch.equal(cpu("sparse_attention")(q, kv, AttnRows(both.padded(), rows.n_raw), sinks, 0.044), out)
    with pytest.raises(ValueError):
        cpu("sparse_attention")(q, kv, AttnRows(rows.raw, rows.n_raw, comp[:-1] if q.shape[0] > 1 else comp[:0],
                                                (6,) * q.shape[0]), sinks, 0.044)


def test_glue_is_off_in_a_compiled_step(monkeypatch):
    assert glue.ready()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not glue.ready()


@pytest.mark.parametrize("fp8_dims, f16", ((448, True), (448, False), (0, True), (0, False)))
def test_store_rows_is_the_reference(fp8_dims, f16):
    g = gen(fp8_dims + f16)
    rows = torch.randn(5, 512, generator=g) * torch.logspace(-9, 5, 5)[:, None]
    rows[0, :64] = 0.0                                  # an all-zero block: the 1e-4 floor of the scale
    rows[1, 64:128] *= 1e-30                            # subnormal F16 and E4M3 values
    rows[2, 448:] = torch.tensor([7e4, -7e4, 65519.0, 65520.0] * 16)   # F16 overflow: +-inf, and the last finite
    slots = torch.tensor([3, 0, 7, 5, 1])
    cache, expected = torch.zeros(8, 512), torch.zeros(8, 512)
    out = cpu("store_rows")(cache, slots, rows, fp8_dims, f16)
    assert out is cache and torch.equal(cache, store_rows(expected, slots, rows, fp8_dims, f16))
    with pytest.raises(ValueError, match="outside"):
        cpu("store_rows")(cache, torch.tensor([0, 8, 1, 2, 3]), rows, fp8_dims, f16)


@pytest.mark.parametrize("dot", ("exact", "q8"))
@pytest.mark.parametrize("qtype", ("Q8_0", "Q4_K", "Q2_K", "IQ2_XXS", "F16"))
def test_products_in_one_pool_call(qtype, dot, monkeypatch):
    """Several products in one pass of the kernel pool (glue.products: two weights sharing their rows, and routed
    experts by pair): each row the bits of its own 1-row kernel call, on 1, 2 and 3 threads, for M = 1..16;
    F32 weights and more than MAX_ROWS rows are left to the caller (None)."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)     # split even these small weights, into the most chunks
    g = gen(3)
    a, b = (QTensor.quantize(torch.randn(rows, 512, generator=g) / 16, qtype, name) for rows, name in ((40, "a"),
                                                                                                          (24, "b")))
    stack = QTensor.quantize(torch.randn(3, 40, 512, generator=g) / 16, qtype, "experts")
    x, z = torch.randn(16, 512, generator=g), torch.randn(16, 512, generator=g)
    ids = torch.randint(0, 3, (16,), generator=g)
    single = [torch.cat([qmatmul(x[m:m + 1], w, dot) for m in range(16)]) for w in (a, b)]
    single.append(torch.cat([ffn.pairs_product(z[m:m + 1], stack, ids[m:m + 1], dot) for m in range(16)]))
    for n in (1, 2, 3):
        kernels.set_threads(n)
        for M in range(1, 17):
            out = glue.products([(x[:M], a, None), (x[:M], b, None), (z[:M], stack, ids[:M])], dot)
            assert all(torch.equal(y, e[:M]) for y, e in zip(out, single, strict=True)), (n, M)
    kernels._pool_threads = 0
    assert glue.products([(torch.randn(17, 512), a, None)], dot) is None
    assert glue.products([(x, a, None), (x, QTensor.quantize(torch.randn(8, 512), "F32", "f"), None)], dot) is None
    assert glue.products([(z, stack, None)], dot) is None and glue.products([(x, a, ids)], dot) is None


@pytest.mark.parametrize("qtype", ("Q8_0", "Q4_K"))
def test_grouped_output_projection_in_one_pool_call(qtype, monkeypatch):
    """The cpu grouped_qmatmul (all groups in one glue.products call): each group the bits of its own 1-row qmatmul,
    exact and q8, on 1, 2 and 3 threads, for M = 1..16."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)
    w = QTensor.quantize(torch.randn(4 * 24, 512, generator=gen(8)) / 16, qtype, "attn_output_a.weight")
    x = torch.randn(16, 4, 512, generator=gen(9))
    for dot in ("exact", "q8"):
        single = torch.cat([torch.cat([qmatmul(x[m:m + 1, g], group_rows(w, g, 4), dot) for g in range(4)], dim=1)
                            for m in range(16)])
        for n in (1, 2, 3):
            kernels.set_threads(n)
            for M in range(1, 17):
                assert torch.equal(cpu("grouped_qmatmul")(x[:M], w, dot), single[:M]), (dot, n, M)
        kernels._pool_threads = 0
        if dot == "exact":
            torch.testing.assert_close(single, grouped_qmatmul(x, w), rtol=1e-5, atol=1e-5)


def test_swiglu_and_expert_sum_are_their_references(threads):
    g = gen(4)
    a, b, w = torch.randn(5, 300, generator=g) * 8, torch.randn(5, 300, generator=g) * 8, torch.rand(5, generator=g)
    for clamp in (None, 7.0):
        for weight in (None, w):
            assert torch.equal(glue.swiglu(a, b, clamp, weight),
                               swiglu_poly(a, b, clamp, None if weight is None else weight[:, None]))
    h = glue.swiglu(a, b, 7.0)
    torch.testing.assert_close(h, torch.nn.functional.silu(a.clamp(max=7.0)) * b.clamp(-7.0, 7.0), rtol=1e-6,
                               atol=1e-6)
    y = torch.randn(3, 6, 200, generator=g)
    expected = y[:, 0]
    for k in range(1, 6):
        expected = expected + y[:, k]
    assert torch.equal(glue.sum_rows(y), expected)


def test_compress_is_the_reference():
    """The cpu compress (one block pooled without the reference's slices and concatenation) is the reference's bits for
    one block and several, with absent candidates (score -inf)."""
    g = gen(12)
    kv, score = torch.randn(3, 8, 128, generator=g), torch.randn(3, 8, 128, generator=g) * 4
    score[0, :4] = float("-inf")
    for B in (1, 3):
        assert torch.equal(cpu("compress")(kv[:B], score[:B]), compress(kv[:B], score[:B]))
    assert torch.equal(cpu("compress")(kv[1:2], score[1:2]), compress(kv, score)[1:2])


@pytest.mark.parametrize("qtype", ("F16", "Q8_0", "Q4_K", "F32"))
def test_embed_is_the_reference(qtype):
    table = QTensor.quantize(torch.randn(40, 512, generator=gen(5)), qtype, "token_embd.weight")
    for ids in (torch.tensor([3, 0, 39, 3]), torch.tensor([17]), torch.tensor([2, -1]), torch.tensor([5, 3])[1:]):
        assert torch.equal(cpu("embed")(table, ids), embed(table, ids))
    if qtype != "F32":      # the rows read in place serve ids inside the table only (torch's indexing the others)
        assert glue.embed(table, torch.tensor([2, -1])) is None and glue.embed(table, torch.tensor([40])) is None
        with pytest.raises(IndexError):
            cpu("embed")(table, torch.tensor([40]))


def test_route_is_select_sorted_by_expert():
    """glue.route (the routed experts' selection in C) against ops.moe.select then a stable sort by expert id: the
    same ids and weight bits for M = 1..16, every top_k it serves, bias/none/hash routing, with and without
    normalization, on scores with ties, a NaN and sums below the clamp; and a prefill's 40 rows."""
    from ops.moe import Experts, select
    g, E = gen(9), 64
    table = torch.randint(0, E, (50, glue.ROUTE_MAX_K), generator=g)
    for M in (*range(1, 17), 40):
        p = torch.sqrt(torch.nn.functional.softplus(torch.randn(M, E, generator=g) * 4))
        p[:, ::3] = torch.round(p[:, ::3] * 2) / 2      # ties
        p[0, 5] = 1e-7 if M % 2 else float("nan")
        ids = torch.randint(0, 50, (M,), generator=g)
        for k in range(1, glue.ROUTE_MAX_K + 1):
            for bias, tid2eid in ((None, None), (torch.randn(E, generator=g), None), (None, table[:, :k])):
                for normalize in (True, False):
                    ex = Experts(None, bias, tid2eid, None, None, None, k, 2.5, normalize, 7.0)
                    chosen, w = select(p, ids, ex)
                    chosen, order = torch.sort(chosen, dim=-1, stable=True)
                    got = glue.route(p, ids, bias, tid2eid, k, normalize, 2.5)
                    assert torch.equal(got[0], chosen)
                    torch.testing.assert_close(got[1], w.gather(1, order), rtol=0, atol=0, equal_nan=True)
    tiny = torch.full((1, E), 1e-6)
    assert torch.equal(glue.route(tiny, torch.tensor([0]), None, None, 6, True, 1.0)[1], torch.full((1, 6), 1e-6
                                                                                                 / 6.1035e-5))
    assert glue.route(tiny, torch.tensor([0]), None, None, glue.ROUTE_MAX_K + 1, True, 1.0) is None
    with pytest.raises(ValueError, match="expert table"):
        glue.route(tiny, torch.tensor([50]), None, table, 6, True, 1.0)


@pytest.mark.parametrize("qtype,dot", (("Q4_K", "exact"), ("Q4_K", "q8"), ("Q8_0", "q8"), ("Q2_K", "exact"),
                                       ("F16", "q8")))
def test_moe_rows_is_the_separate_calls(qtype, dot, threads, monkeypatch):
    """glue.moe_rows (the decode's routed experts, or the shared expert, in one C call) gives the bits of the separate
    calls, M = 1..16 rows (up to MAX_ROWS pairs in one call, more through the separate calls), any thread count,
    with an expert another rank holds (-1)."""
    from ops.moe import Experts
    g, E, n, D = gen(11), 8, 256, 256
    stack = [QTensor.quantize(torch.randn(E, *shape, generator=g) * 0.1, qtype) for shape in ((n, D), (n, D), (D, n))]
    ex = Experts(QTensor.quantize(torch.randn(E, D, generator=g) * 0.1, "F16"), torch.randn(E, generator=g) * 0.1,
                 None, *stack, 3, 1.5, True, 0.7)
    for M in (1, 2, 5, 16):
        x, ids = torch.randn(M, D, generator=g), torch.arange(M)
        chosen, w = ffn.route(x, ids, ex, dot)
        chosen[0, 1] = -1
        fused = glue.moe_rows(x, *stack, chosen, w, ex.clamp, dot)
        assert (fused is None) == (M * 3 > kernels.MAX_ROWS)
        with monkeypatch.context() as m:
            m.setattr(glue, "moe_rows", lambda *a, **k: None)
            m.setattr(glue, "route_moe_rows", lambda *a, **k: None)
            m.setattr(ffn, "route_scores", lambda *a, routed=(chosen, w), **k: routed)
            separate = cpu("moe")(x, ids, ex, dot)
        assert fused is None or torch.equal(fused, separate)
    shared = [QTensor.quantize(torch.randn(*shape, generator=g) * 0.1, qtype) for shape in ((n, D), (n, D), (D, n))]
    for M, clamp in ((1, 0.7), (2, None), (16, 0.7), (17, None)):
        x = torch.randn(M, D, generator=g)
        fused = glue.moe_rows(x, *shared, None, None, clamp, dot)
        assert (fused is None) == (M > kernels.MAX_ROWS)
        with monkeypatch.context() as m:
            m.setattr(glue, "moe_rows", lambda *a, **k: None)
            separate = cpu("shared_expert")(x, *shared, clamp, dot)
        assert fused is None or torch.equal(fused, separate)


@pytest.mark.parametrize("qtype,dot", (("Q4_K", "q8"), ("Q2_K", "exact")))
def test_route_moe_rows_is_route_then_moe_rows(qtype, dot, threads):
    """glue.route_moe_rows (a decode's routing and its experts in one C call, what the cpu moe op runs) gives the bits
    of ffn.route then glue.moe_rows: bias routing and hash routing, M = 1..5; a token id outside the hash table is a
    ValueError, and a rank holding part of the experts, or more than MAX_ROWS pairs, gives None."""
    from ops.moe import Experts
    g, E, n, D = gen(13), 8, 256, 256
    stack = [QTensor.quantize(torch.randn(E, *shape, generator=g) * 0.1, qtype) for shape in ((n, D), (n, D), (D, n))]
    router = QTensor.quantize(torch.randn(E, D, generator=g) * 0.1, "F16")
    table = torch.randint(0, E, (50, 3), generator=g)
    for bias, tid2eid in ((torch.randn(E, generator=g) * 0.1, None), (None, table)):
        ex = Experts(router, bias, tid2eid, *stack, 3, 1.5, tid2eid is None, 0.7)
        for M in (1, 2, 5):
            x, ids = torch.randn(M, D, generator=g), torch.randint(0, 50, (M,), generator=g)
            fused = glue.route_moe_rows(x, ffn.router_scores(x, ex, dot), ids, ex, dot)
            chosen, w = ffn.route(x, ids, ex, dot)
            separate = glue.moe_rows(x, *stack, chosen, w, ex.clamp, dot)
            assert (fused is None) == (separate is None) == (M * 3 > kernels.MAX_ROWS)
            assert fused is None or torch.equal(fused, separate)
            assert fused is None or torch.equal(cpu("moe")(x, ids, ex, dot), fused)
    x = torch.randn(1, D, generator=g)
    with pytest.raises(ValueError, match="outside the 50-row expert table"):
        glue.route_moe_rows(x, ffn.router_scores(x, ex, dot), torch.tensor([50]), ex, dot)
    part = Experts(router, None, table, *(QTensor(t.qtype, (4, *t.shape[1:]), t.data[2:6]) for t in stack), 3, 1.5,
                   False, 0.7, first=2)
    assert glue.route_moe_rows(x, ffn.router_scores(x, part, dot), torch.tensor([1]), part, dot) is None


@pytest.mark.parametrize("dot", ("exact", "q8"))
def test_router_scores_of_one_row_are_its_rows_bits(dot):
    """ffn.router_scores of one row (the router's bound product into a padded row, softplus and root in place) gives
    the bits of that row of a several-row call (rowwise over qmatmul), F16 and Q8_0 routers of 16 and 72 experts, rows
    over eight decades (softplus's linear range above 20 included)."""
    from ops.moe import Experts
    g, D = gen(14), 256
    x = torch.randn(8, D, generator=g) * torch.logspace(-4, 3, 8)[:, None]
    for qtype, E in (("F16", 16), ("Q8_0", 72)):
        router = QTensor.quantize(torch.randn(E, D, generator=g) * 0.1, qtype)
        ex = Experts(router, None, None, router, router, router, 4, 1.5, True, None)
        rows = ffn.router_scores(x, ex, dot)
        assert rows.shape == (8, E) and (rows > 20).any()
        for m in range(8):
            assert torch.equal(ffn.router_scores(x[m:m + 1], ex, dot), rows[m:m + 1]), (qtype, dot, m)


def test_index_scores_total_in_c_is_the_torch_ops_bits(monkeypatch):
    """The cpu index_scores with its heads' relu, weights, sum and mask in one C call (glue.index_total): the bits of
    its torch ops, for a decode (every query sees all keys) and queries seeing different counts (0 included), with
    negative, -0 and NaN products; a visible count beyond the products is a ValueError."""
    from backends.cpu import attention
    g = gen(15)
    keys = torch.randn(70, 32, generator=g)
    keys[3] = 0.0
    keys[5, 0] = float("nan")
    for visible in ((9,), (70,), (0, 9, 4), (65, 1, 64, 65, 3)):
        M = len(visible)
        q, w = torch.randn(M, 4, 32, generator=g), torch.randn(M, 4, generator=g)
        q[0, 1] = -q[0, 1].abs()
        fused = attention.index_scores(q, keys, w, visible)
        with monkeypatch.context() as m:
            m.setattr(glue, "ready", lambda: False)
            separate = attention.index_scores(q, keys, w, visible)
        assert torch.equal(fused.view(torch.int32), separate.view(torch.int32)), visible
        assert fused[0, 5].isnan() or visible[0] <= 5
    with pytest.raises(ValueError, match="visible"):
        glue.index_total(torch.zeros(1, 4, 64), torch.zeros(1, 4), (65,), 70)


def test_moe_rows_binding_follows_the_weights():
    """glue.moe_rows binds its weights on first use (glue.EXPERTS): a weight given new data is bound again (the new
    weight's bits), F32 weights and shapes the kernels do not serve give None, and a freed weight's entry goes."""
    g, D, n = gen(12), 256, 256
    shared = [QTensor.quantize(torch.randn(*shape, generator=g) * 0.1, "Q4_K") for shape in ((n, D), (n, D), (D, n))]
    x = torch.randn(2, D, generator=g)
    first = glue.moe_rows(x, *shared, None, None, None)
    shared[0].data = QTensor.quantize(torch.randn(n, D, generator=g) * 0.1, "Q4_K").data
    again = glue.moe_rows(x, *shared, None, None, None)
    assert not torch.equal(first, again)
    assert torch.equal(again, cpu("shared_expert")(x, *(QTensor(t.qtype, t.shape, t.data.clone()) for t in shared),
                                                    None))
    f32 = QTensor.quantize(torch.randn(n, D, generator=g), "F32")
    assert glue.moe_rows(x, f32, *shared[1:], None, None, None) is None
    assert glue.moe_rows(x, *shared, torch.zeros((2, 1), dtype=torch.int64), torch.ones(2, 1), None) is None
    entries = len(glue.EXPERTS.entries)
    del shared[0], f32
    assert len(glue.EXPERTS.entries) < entries
