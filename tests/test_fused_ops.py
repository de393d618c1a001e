"""The fused ops (ops/hc_pre_norm.py, ops/hc_post_pre_norm.py, ops/qmatmul_norm_rope.py, ops/attention_output.py,
ops/compressor_store.py, ops/attention_input.py, ops/indexer_query.py, ops/ffn.py): the reference is the sequence of
references; the cpu backend's one C call is the bits of its own ops called one by one (exact and q8, 1/2/3 kernel
threads, M = 1..17, the last past the kernels' 16 rows); Triton (interpreter) and MLX close to the reference."""
from __future__ import annotations

from functools import cache, partial

import pytest
import torch

from backends.cpu import glue, kernels
from backends.registry import implementations
from ops.attention_input import attention_input, attention_input_of
from ops.attention_output import attention_output, attention_output_of
from ops.compressor_store import compressor_store, compressor_store_of
from ops.ffn import ffn, ffn_of
from ops.fp4_sim import fp4_sim
from ops.grouped_qmatmul import grouped_qmatmul
from ops.hadamard import hadamard
from ops.hc_post import hc_post
from ops.hc_post_pre_norm import hc_post_pre_norm, hc_post_pre_norm_of
from ops.hc_pre import hc_pre
from ops.hc_pre_norm import hc_pre_norm, hc_pre_norm_of
from ops.indexer_query import indexer_query, indexer_query_of
from ops.moe import Experts, moe
from ops.qmatmul import qmatmul
from ops.qmatmul_norm_rope import qmatmul_norm_rope, qmatmul_norm_rope_of
from ops.quants import QTensor
from ops.rms_norm import rms_norm
from ops.rope_tail import rope_freqs, rope_tail
from ops.shared_expert import shared_expert
from ops.store_rows import store_rows

S, D, HD = 4, 64, 32     # streams, hidden, head width (the head's tail of 16 values rotated)


def impl(op: str, backend: str):
    return implementations(op)[backend].fn


def hc_case(M: int, qtype: str = "F16", seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    fn = QTensor.quantize(torch.randn(2 * S + S * S, S * D, generator=g) / 16, qtype, "hc_fn")
    return (torch.randn(M, S, D, generator=g), fn, torch.rand(3, generator=g) + 0.5,
            torch.randn(2 * S + S * S, generator=g), torch.rand(D, generator=g) + 0.5, 20, 1e-6, 1e-6)


def post_case(M: int, qtype: str = "F16", seed: int = 0) -> tuple:
    """hc_post's arguments (sub-layer output, post, comb), then the next sub-layer's hc_pre_norm arguments."""
    g = torch.Generator().manual_seed(seed + 100)
    X, *rest = hc_case(M, qtype, seed)
    return (X, torch.randn(M, D, generator=g), torch.rand(M, S, generator=g), torch.rand(M, S, S, generator=g), *rest)


def projection_case(M: int, qtype: str = "Q8_0", seed: int = 0, n: int = 4 * HD, k: int = 256) -> tuple:
    g = torch.Generator().manual_seed(seed)
    w = QTensor.quantize(torch.randn(n, k, generator=g) / 16, qtype, "attn_q_b.weight")
    return (torch.randn(M, k, generator=g), w, torch.rand(HD, generator=g) + 0.5, 1e-6, HD,
            torch.arange(M) * 37 + seed, rope_freqs(16, 10000.0))


def output_case(M: int, qtype: str = "Q8_0", seed: int = 0, groups: int = 2) -> tuple:
    """Heads [M, 4, HD] rotated back, 2 groups of 64 values projected to 32 rows each, then to D."""
    g = torch.Generator().manual_seed(seed)
    wa = QTensor.quantize(torch.randn(groups * 32, 4 * HD // groups, generator=g) / 8, qtype, "attn_output_a.weight")
    wb = QTensor.quantize(torch.randn(D, groups * 32, generator=g) / 8, qtype, "attn_output_b.weight")
    return torch.randn(M, 4, HD, generator=g), torch.arange(M) * 37 + seed, rope_freqs(16, 10000.0), wa, wb, groups


def compressor_case(M: int, qtype: str = "F16", seed: int = 0) -> tuple:
    """Two projections of 256 values into rings of 12 rows of 64, the rows at distinct slots."""
    g = torch.Generator().manual_seed(seed)
    kv, gate = (QTensor.quantize(torch.randn(64, 256, generator=g) / 16, qtype, name)
                for name in ("attn_compressor_kv.weight", "attn_compressor_gate.weight"))
    slots = torch.randperm(24, generator=g)[:M]
    return (torch.randn(M, 256, generator=g), kv, gate, torch.randn(4, 64, generator=g), torch.arange(M) % 4, slots,
            torch.zeros(24, 64), torch.zeros(24, 64))


def input_case(M: int, qtypes: str = "Q8_0", seed: int = 0, hd: int = 128) -> tuple:
    """A layer's attention input: 256 values into a latent of 256 (q_a) and 4 heads of `hd` (q_b), a kv row of `hd`
    written into a 24-row cache at distinct slots, FP8 dims on odd M, F16 rounding unless M % 3 == 1. `qtypes`: one
    type, or q_a/q_b's and kv's ("Q8_0/F16")."""
    g = torch.Generator().manual_seed(seed)
    q_type, _, kv_type = qtypes.partition("/")
    shapes = ((256, 256, q_type, "attn_q_a.weight"), (4 * hd, 256, q_type, "attn_q_b.weight"),
              (hd, 256, kv_type or q_type, "attn_kv.weight"))
    q_a, q_b, kv = (QTensor.quantize(torch.randn(n, k, generator=g) / 16, t, name) for n, k, t, name in shapes)
    return (torch.randn(M, 256, generator=g), q_a, torch.rand(256, generator=g) + 0.5, q_b, kv,
            torch.rand(hd, generator=g) + 0.5, 1e-6, hd, torch.arange(M) * 37 + seed, rope_freqs(16, 10000.0),
            torch.zeros(24, hd), torch.randperm(24, generator=g)[:M], 64 * (M % 2), M % 3 != 1)


def query_case(M: int, qtypes: str = "Q8_0", seed: int = 0, di: int = 64) -> tuple:
    """The indexer's queries of 3 heads of `di` from a latent of 256 and its head weights from 256 values, the FP4
    simulation on unless M % 3 == 2, root sqrt(6 heads · di) (inexact). `qtypes`: one type, or q_b's and proj's."""
    g = torch.Generator().manual_seed(seed)
    q_type, _, w_type = qtypes.partition("/")
    q_b = QTensor.quantize(torch.randn(3 * di, 256, generator=g) / 16, q_type, "indexer.attn_q_b.weight")
    proj = QTensor.quantize(torch.randn(3, 256, generator=g) / 16, w_type or q_type, "indexer.proj.weight")
    return (torch.randn(M, 256, generator=g), torch.randn(M, 256, generator=g), q_b, proj, di,
            torch.arange(M) * 37 + seed, rope_freqs(16, 10000.0), M % 3 != 2, (6 * di) ** 0.5)


@cache
def ffn_weights(qtype: str, hashed: bool) -> tuple[Experts, list[QTensor]]:
    """8 routed experts (top 3 of 256 x 256; hash or bias routing) and a shared expert (512 inner), made once per type
    (quantizing to the k-quants in torch takes seconds)."""
    g = torch.Generator().manual_seed(int(hashed))
    E, n, K = 8, 256, 256
    stack = [QTensor.quantize(torch.randn(E, *s, generator=g) / 16, qtype, name)
             for s, name in (((n, K), "ffn_gate_exps.weight"), ((n, K), "ffn_up_exps.weight"),
                             ((K, n), "ffn_down_exps.weight"))]
    shared = [QTensor.quantize(torch.randn(*s, generator=g) / 16, qtype, name)
              for s, name in (((512, K), "ffn_gate_shexp.weight"), ((512, K), "ffn_up_shexp.weight"),
                              ((K, 512), "ffn_down_shexp.weight"))]
    ex = Experts(QTensor.quantize(torch.randn(E, K, generator=g) / 16, "F16", "ffn_gate_inp.weight"),
                 None if hashed else torch.randn(E, generator=g) / 8,
                 torch.randint(0, E, (50, 3), generator=g) if hashed else None, *stack, 3, 1.5, not hashed, 0.7)
    return ex, shared


def ffn_case(M: int, qtype: str = "Q8_0", seed: int = 0) -> tuple:
    """A layer's routed experts and shared expert (`ffn_weights`; hash routing on odd seeds), the shared clamp on
    unless M % 3 == 2."""
    g = torch.Generator().manual_seed(seed)
    ex, shared = ffn_weights(qtype, seed % 2 == 1)
    return (torch.randn(M, 256, generator=g), torch.randint(0, 50, (M,), generator=g), ex, *shared,
            0.7 if M % 3 != 2 else None)


def test_references_are_the_unfused_sequences():
    X, fn, scale, base, norm, iters, hc_eps, rms_eps = hc_case(3)
    mixes = qmatmul(rms_norm(X.reshape(3, S * D), None, rms_eps), fn)
    x, post, comb = hc_pre(X, mixes, scale, base, iters, hc_eps)
    want = (rms_norm(x, norm, rms_eps), post, comb)
    assert all(torch.equal(a, b) for a, b in zip(hc_pre_norm(*hc_case(3)), want, strict=True))
    x, w, norm, eps, width, pos, freqs = projection_case(3)
    heads = rope_tail(rms_norm(qmatmul(x, w).reshape(3, -1, HD), norm, eps), pos, freqs)
    assert torch.equal(qmatmul_norm_rope(x, w, norm, eps, width, pos, freqs), heads.reshape(3, -1))
    whole = rms_norm(qmatmul(x, w), None, eps)
    assert torch.equal(qmatmul_norm_rope(x, w, None, eps), whole)
    with pytest.raises(ValueError, match="groups of 48 do not divide the 128 outputs of attn_q_b.weight"):
        qmatmul_norm_rope(x, w, None, eps, 48)
    X, y, post, comb, *rest = post_case(3)
    Xn = hc_post(X, y, post, comb)
    assert all(torch.equal(a, b) for a, b in zip(hc_post_pre_norm(*post_case(3)), (Xn, *hc_pre_norm(Xn, *rest)),
                                                 strict=True))
    o, pos, freqs, wa, wb, groups = output_case(3)
    u = grouped_qmatmul(rope_tail(o, pos, freqs, inverse=True).reshape(3, groups, -1), wa)
    assert torch.equal(attention_output(o, pos, freqs, wa, wb, groups), qmatmul(u, wb))
    for fn in (attention_output, impl("attention_output", "cpu")):
        with pytest.raises(ValueError, match="3 groups do not fit heads"):
            fn(o, pos, freqs, wa, wb, 3)
    x, kv, gate, ape, ape_rows, slots, kv_ring, score_ring = compressor_case(3)
    want = (store_rows(kv_ring.clone(), slots, qmatmul(x, kv)),
            store_rows(score_ring.clone(), slots, qmatmul(x, gate) + ape[ape_rows]))
    got = compressor_store(x, kv, gate, ape, ape_rows, slots, kv_ring, score_ring)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and got[0].abs().sum() > 0
    x, q_a, q_a_norm, q_b, kv, kv_norm, eps, hd, pos, freqs, cache, slots, fp8_dims, f16 = input_case(3)
    q_lat = qmatmul_norm_rope(x, q_a, q_a_norm, eps)
    rows = qmatmul_norm_rope(x, kv, kv_norm, eps, hd, pos, freqs)
    want = (q_lat, qmatmul_norm_rope(q_lat, q_b, None, eps, hd, pos, freqs),
            store_rows(cache.clone(), slots, rows, fp8_dims, f16))
    got = attention_input(*input_case(3))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and fp8_dims and f16
    assert got[2][slots].abs().min() > 0 and got[2].abs().sum() == got[2][slots].abs().sum()
    q_lat, x, q_b, proj, di, pos, freqs, sim, root = query_case(3)
    q = rope_tail(qmatmul(q_lat, q_b).reshape(3, 3, di), pos, freqs)
    got = indexer_query(*query_case(3))
    assert torch.equal(got[0], fp4_sim(hadamard(q))) and torch.equal(got[1], qmatmul(x, proj) / root) and sim
    x, ids, ex, gate, up, down, clamp = ffn_case(3)
    assert torch.equal(ffn(*ffn_case(3)), moe(x, ids, ex) + shared_expert(x, gate, up, down, clamp))


def unfused_cpu(op: str, dot: str):
    """The fused op's sequence made of the cpu backend's own registered ops."""
    mm = partial(impl("qmatmul", "cpu"), dot=dot)
    if op == "hc_pre_norm":
        return hc_pre_norm_of(impl("rms_norm", "cpu"), mm, impl("hc_pre", "cpu"))
    if op == "hc_post_pre_norm":
        return hc_post_pre_norm_of(impl("hc_post", "cpu"), unfused_cpu("hc_pre_norm", dot))
    if op == "attention_output":
        return attention_output_of(impl("rope_tail", "cpu"), partial(impl("grouped_qmatmul", "cpu"), dot=dot), mm)
    if op == "compressor_store":
        return compressor_store_of(mm, impl("store_rows", "cpu"))
    if op == "attention_input":
        return attention_input_of(unfused_cpu("qmatmul_norm_rope", dot), impl("store_rows", "cpu"))
    if op == "indexer_query":
        return indexer_query_of(mm, impl("rope_tail", "cpu"), impl("hadamard", "cpu"), impl("fp4_sim", "cpu"))
    if op == "ffn":
        return ffn_of(partial(impl("moe", "cpu"), dot=dot), partial(impl("shared_expert", "cpu"), dot=dot))
    return qmatmul_norm_rope_of(mm, impl("rms_norm", "cpu"), impl("rope_tail", "cpu"))


CASE = {"hc_pre_norm": hc_case, "hc_post_pre_norm": post_case, "qmatmul_norm_rope": projection_case,
        "attention_output": output_case, "compressor_store": compressor_case, "attention_input": input_case,
        "indexer_query": query_case, "ffn": ffn_case}
REFERENCE = {"hc_pre_norm": hc_pre_norm, "hc_post_pre_norm": hc_post_pre_norm, "qmatmul_norm_rope": qmatmul_norm_rope,
             "attention_output": attention_output, "compressor_store": compressor_store,
             "attention_input": attention_input, "indexer_query": indexer_query, "ffn": ffn}


CPU_CASES = [("hc_pre_norm", "F16", "exact"), ("hc_pre_norm", "F16", "q8"), ("hc_pre_norm", "Q8_0", "exact"),
             ("hc_post_pre_norm", "F16", "exact"), ("hc_post_pre_norm", "F16", "q8"),
             ("qmatmul_norm_rope", "Q8_0", "exact"), ("qmatmul_norm_rope", "Q8_0", "q8"),
             ("qmatmul_norm_rope", "Q4_K", "exact"), ("qmatmul_norm_rope", "Q4_K", "q8"),
             ("qmatmul_norm_rope", "F16", "q8"), ("attention_output", "Q8_0", "exact"),
             ("attention_output", "Q8_0", "q8"), ("attention_output", "F16", "q8"),
             ("attention_output", "F32", "exact"), ("compressor_store", "F16", "exact"),
             ("compressor_store", "F16", "q8"), ("compressor_store", "Q8_0", "q8"),
             ("attention_input", "Q8_0", "exact"), ("attention_input", "Q8_0", "q8"), ("attention_input", "Q4_K", "q8"),
             ("attention_input", "Q8_0/F16", "q8"), ("attention_input", "Q4_K/Q8_0", "exact"),
             ("indexer_query", "Q8_0", "exact"), ("indexer_query", "Q8_0", "q8"), ("indexer_query", "Q8_0/F16", "q8"),
             ("indexer_query", "Q4_K/F16", "exact"), ("ffn", "Q4_K", "q8"), ("ffn", "Q2_K", "q8"),
             ("ffn", "Q8_0", "exact")]


@pytest.mark.parametrize("op,qtype,dot", CPU_CASES)
def test_cpu_is_the_unfused_cpu_ops_bits(op, qtype, dot, monkeypatch):
    """One C call with the bits of the separate cpu calls, for M = 1, 2, 5, 16 (the C call) and 17 (the separate
    calls), on 1, 2 and 3 kernel threads (SPLIT_BYTES lowered so that the pool splits these small weights), close to
    the reference."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1 << 12)
    called = []
    name = {"hc_post_pre_norm": "hc_pre_norm", "ffn": "route_moe_shared"}.get(op, op)   # its C call's wrapper
    fused_c = getattr(glue, name)
    monkeypatch.setattr(glue, name, lambda *a, **k: called.append(fused_c(*a, **k)) or called[-1])
    fused, unfused = partial(impl(op, "cpu"), dot=dot), unfused_cpu(op, dot)
    reference = REFERENCE[op]
    served = {"attention_output": (1, 2, 5) if qtype != "F32" else (), "ffn": (1, 2, 5)}.get(op, (1, 2, 5, 16))
    # attention_output's 2 groups and ffn's 3 experts a row: up to 16 products' rows; F32 weights take BLAS

    def case(M: int) -> tuple:     # fresh arguments for each call (compressor_store writes its rings)
        args = CASE[op](M, qtype, M)
        if op == "qmatmul_norm_rope" and M == 2:
            return args[0], args[1], None, args[3]     # no rotation, the whole row normed without a weight
        return args

    try:
        for n in (1, 2, 3):
            kernels.set_threads(n)
            for M in (1, 2, 5, 16, 17):
                got, want = fused(*case(M)), unfused(*case(M))
                got, want = ((o,) if isinstance(o, torch.Tensor) else o for o in (got, want))
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (n, M)
                if dot == "exact":
                    ref = reference(*case(M))
                    torch.testing.assert_close(got, (ref,) if isinstance(ref, torch.Tensor) else ref, rtol=1e-4,
                                               atol=1e-4)
    finally:
        kernels.set_threads(1)
        kernels._pool_threads = 0
    assert sum(out is not None for out in called) == 3 * len(served)    # one C call for each M served


@pytest.mark.on_device
def test_triton_is_close_to_the_reference():
    for M in (1, 3):
        for got, want in zip(impl("hc_pre_norm", "triton")(*hc_case(M, "Q8_0")), hc_pre_norm(*hc_case(M, "Q8_0")),
                             strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for op in ("hc_post_pre_norm", "qmatmul_norm_rope", "attention_output", "compressor_store", "attention_input",
                   "indexer_query", "ffn"):
            got, want = impl(op, "triton")(*CASE[op](M, "Q8_0")), REFERENCE[op](*CASE[op](M, "Q8_0"))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_mlx_is_close_to_the_reference():
    pytest.importorskip("mlx.core")
    from backends.mlx.arrays import MLXArrays
    from backends.mlx.quants import place
    A = MLXArrays("mlx")

    def m(t):
        return A.array(t, "float32" if t.is_floating_point() else "int64")

    def torch_of(x):
        return A.to_torch(x)

    X, fn, scale, base, norm, iters, hc_eps, rms_eps = hc_case(3, "Q8_0")
    got = impl("hc_pre_norm", "mlx")(m(X), place(fn), m(scale), m(base), m(norm), iters, hc_eps, rms_eps)
    for a, b in zip(got, hc_pre_norm(*hc_case(3, "Q8_0")), strict=True):
        torch.testing.assert_close(torch_of(a), b, rtol=1e-4, atol=1e-4)
    X, y, post, comb, fn, scale, base, norm, iters, hc_eps, rms_eps = post_case(3, "Q8_0")
    got = impl("hc_post_pre_norm", "mlx")(m(X), m(y), m(post), m(comb), place(fn), m(scale), m(base), m(norm), iters,
                                          hc_eps, rms_eps)
    for a, b in zip(got, hc_post_pre_norm(*post_case(3, "Q8_0")), strict=True):
        torch.testing.assert_close(torch_of(a), b, rtol=1e-4, atol=1e-4)
    x, w, norm, eps, width, pos, freqs = projection_case(3)
    got = impl("qmatmul_norm_rope", "mlx")(m(x), place(w), m(norm), eps, width, m(pos), m(freqs))
    torch.testing.assert_close(torch_of(got), qmatmul_norm_rope(x, w, norm, eps, width, pos, freqs), rtol=1e-4,
                               atol=1e-4)
    o, pos, freqs, wa, wb, groups = output_case(3)
    got = impl("attention_output", "mlx")(m(o), m(pos), m(freqs), place(wa), place(wb), groups)
    torch.testing.assert_close(torch_of(got), attention_output(o, pos, freqs, wa, wb, groups), rtol=1e-4, atol=1e-4)
    x, kv, gate, ape, ape_rows, slots, kv_ring, score_ring = compressor_case(3, "Q8_0")
    got = impl("compressor_store", "mlx")(m(x), place(kv), place(gate), m(ape), m(ape_rows), m(slots), m(kv_ring),
                                          m(score_ring))
    for a, b in zip(got, compressor_store(*compressor_case(3, "Q8_0")), strict=True):
        torch.testing.assert_close(torch_of(a), b, rtol=1e-4, atol=1e-4)
    x, q_a, q_a_norm, q_b, kv, kv_norm, eps, hd, pos, freqs, cache, slots, fp8_dims, f16 = input_case(3)
    got = impl("attention_input", "mlx")(m(x), place(q_a), m(q_a_norm), place(q_b), place(kv), m(kv_norm), eps, hd,
                                         m(pos), m(freqs), m(cache), m(slots), fp8_dims, f16)
    for a, b in zip(got, attention_input(*input_case(3)), strict=True):
        torch.testing.assert_close(torch_of(a), b, rtol=1e-4, atol=1e-4)
    q_lat, x, q_b, proj, di, pos, freqs, sim, root = query_case(3)
    got = impl("indexer_query", "mlx")(m(q_lat), m(x), place(q_b), place(proj), di, m(pos), m(freqs), sim, root)
    for a, b in zip(got, indexer_query(*query_case(3)), strict=True):
        torch.testing.assert_close(torch_of(a), b, rtol=1e-4, atol=1e-4)
    x, ids, ex, gate, up, down, clamp = ffn_case(3, seed=1)
    mex = Experts(place(ex.router), None, m(ex.tid2eid), place(ex.gate), place(ex.up), place(ex.down), ex.top_k,
                  ex.route_scale, ex.normalize, ex.clamp)
    got = impl("ffn", "mlx")(m(x), m(ids), mex, place(gate), place(up), place(down), clamp)
    torch.testing.assert_close(torch_of(got), ffn(*ffn_case(3, seed=1)), rtol=1e-4, atol=1e-4)


def test_cpu_attention_input_refuses_a_slot_outside_the_cache():
    """A slot outside the cache is a ValueError naming it, from the C call (nothing written) as from the separate ops
    past the kernels' 16 rows."""
    for M in (1, 17):
        args = list(input_case(M))
        args[10], args[11] = torch.zeros(32, 128), torch.arange(M) + 32
        with pytest.raises(ValueError, match="outside the cache's 32 rows"):
            impl("attention_input", "cpu")(*args)
        assert not args[10].any()
