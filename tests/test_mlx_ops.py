"""Every MLX op (backends/mlx) against its PyTorch reference on the CPU, at small and odd shapes.

Exact: selections and integers (indexer_topk, verify_argmax, routing), every dequantized weight (each
format's MLX values equal the reference's float32 values bit for bit, random bytes included), embed,
store_rows, fp8_sim, fp4_sim. Float ops differ from the references only by MLX's float32 rounding and
summation order; tolerances are stated per op (measured maxima on this CPU in docs/mlx.md).
"""
import functools
import math

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

from backends.mlx import attention, hc, linear, pointwise, select  # noqa: E402
from backends.mlx.arrays import MLXArrays  # noqa: E402
from backends.mlx.quants import FORMATS, dequantize, place  # noqa: E402
from ops import (  # noqa: E402
    compress,
    embed,
    fp4_sim,
    fp8_sim,
    grouped_qmatmul,
    hadamard,
    hc_head,
    hc_post,
    hc_pre,
    index_scores,
    indexer_topk,
    moe,
    qmatmul,
    rms_norm,
    rope_tail,
    shared_expert,
    sparse_attention,
    store_rows,
    verify_argmax,
)
from ops.moe import Experts  # noqa: E402
from ops.quants import TYPES, QTensor  # noqa: E402
from ops.sparse_attention import AttnRows  # noqa: E402
from tests.script_modules import script  # noqa: E402

A = MLXArrays("mlx")


def k_of(qtype: str) -> int:
    """K for a type's tests: several blocks, not a power of two where the block size allows."""
    block = TYPES[qtype].block_size
    return 41 if block == 1 else block * (5 if block <= 32 else 3 if block < 256 else 2)


QMATMUL_RTOL = 1e-6   # |y - ref| <= QMATMUL_RTOL * (|x| @ |W|.T): float32 sums in another order (measured <= 1.4e-7)
FLOAT_TOL = {"rms_norm": 1e-6, "rope_tail": 1e-6, "hc_pre": 1e-6, "hc_post": 1e-6, "hc_head": 1e-6,
             "compress": 1e-6, "index_scores": 1e-6, "sparse_attention": 1e-6, "hadamard": 1e-6,
             "moe": 5e-6, "shared_expert": 5e-6}   # max |got - ref| / max(1, max |ref|); measured maxima 0-7e-7


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def m(t: torch.Tensor) -> mx.array:
    """A torch tensor as MLX (int64 index arrays as the family's int32)."""
    return A.array(t, "float32" if t.is_floating_point() else "bool" if t.dtype == torch.bool else "int64")


def t(x) -> torch.Tensor:
    return torch.from_numpy(np.array(x))


def assert_close(op: str, got, ref: torch.Tensor) -> None:
    got = t(got).to(ref.dtype)
    assert got.shape == ref.shape, (op, got.shape, ref.shape)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got)) and torch.equal(ref[~fin], got[~fin]), op
    err = (got[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    scale = max(1.0, ref[fin].abs().max().item()) if fin.any() else 1.0
    assert err <= FLOAT_TOL[op] * scale, f"{op}: max error {err:.3g} (scale {scale:.3g})"


# ---- weights ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", sorted(TYPES))
def test_every_format_dequantizes_exactly(qtype):
    """Quantized random weights and random bytes (NaN/inf/subnormal scales) give the reference's values."""
    w = QTensor.quantize(torch.randn(3, 5, k_of(qtype), generator=gen(0)) * 3, qtype, "w")
    raw = QTensor(w.qtype, w.shape, torch.randint(0, 256, w.data.shape, dtype=torch.uint8, generator=gen(1)), "r")
    for q in (w, raw):
        got = t(dequantize(place(q).data))
        ref = q.dequantize()
        assert torch.equal(torch.isnan(got), torch.isnan(ref))
        assert torch.equal(got.nan_to_num(), ref.nan_to_num()), qtype


def test_every_quant_type_has_an_mlx_format():
    assert set(FORMATS) == set(TYPES)


@pytest.mark.parametrize("qtype", sorted(set(TYPES) - {"I32"}))
@pytest.mark.parametrize("M", [1, 3, 17])
def test_qmatmul(qtype, M):
    w = QTensor.quantize(torch.randn(7, k_of(qtype), generator=gen(2)), qtype, "w")
    x = torch.randn(M, k_of(qtype), generator=gen(3))
    got = t(linear.qmatmul(m(x), place(w)))
    dense = w.dequantize()
    bound = QMATMUL_RTOL * (x.abs() @ dense.abs().T) + 1e-30
    assert ((got - qmatmul.qmatmul(x, w)).abs() <= bound).all()


def test_qmatmul_tiles_dequantize_formats(monkeypatch):
    """A weight larger than a tile is dequantized and multiplied tile by tile (same result)."""
    w = QTensor.quantize(torch.randn(37, 256, generator=gen(4)), "Q2_K", "w")
    x = torch.randn(2, 256, generator=gen(5))
    whole = t(linear.qmatmul(m(x), place(w)))
    monkeypatch.setattr(linear, "TILE_ELEMS", 256 * 5)
    assert torch.equal(t(linear.qmatmul(m(x), place(w))), whole)


def test_qmatmul_rejects_bad_arguments():
    w = place(QTensor.quantize(torch.randn(4, 32), "Q8_0", "w"))
    with pytest.raises(ValueError, match="columns"):
        linear.qmatmul(mx.zeros((2, 31)), w)
    with pytest.raises(TypeError, match="placed for MLX"):
        linear.qmatmul(mx.zeros((2, 32)), QTensor.quantize(torch.randn(4, 32), "Q8_0", "w"))


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_K", "IQ2_XXS", "Q4_1", "Q5_K", "IQ4_XS"])
def test_embed_is_exact(qtype):
    table = QTensor.quantize(torch.randn(11, 256, generator=gen(6)), qtype, "emb")
    ids = torch.tensor([3, 0, 10, 3, 7])
    assert torch.equal(t(linear.embed(place(table), m(ids))), embed.embed(table, ids))


# ---- experts ------------------------------------------------------------------------------------------

@functools.cache
def experts(qtype: str, hashed: bool, D: int = 256, inter: int = 64, E: int = 5, seed: int = 7):
    g = gen(seed)
    mk = lambda *shape, s=1.0: torch.randn(*shape, generator=g) * s  # noqa: E731
    kw = dict(top_k=2, route_scale=1.5, normalize=True, clamp=7.0)
    ex = Experts(router=QTensor.quantize(mk(E, D, s=0.3), "F16", "router"),
                 bias=None if hashed else mk(E, s=0.5),
                 tid2eid=torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(50)]) if hashed else None,
                 gate=QTensor.quantize(mk(E, inter, D, s=0.2), qtype, "gate"),
                 up=QTensor.quantize(mk(E, inter, D, s=0.2), qtype, "up"),
                 down=QTensor.quantize(mk(E, D, inter, s=0.2),
                                       qtype if inter % TYPES[qtype].block_size == 0 else "Q8_0", "down"), **kw)
    mex = Experts(router=place(ex.router), bias=None if hashed else m(ex.bias),
                  tid2eid=m(ex.tid2eid) if hashed else None, gate=place(ex.gate), up=place(ex.up),
                  down=place(ex.down), **kw)
    return ex, mex


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_K", "IQ2_XXS", "MXFP4", "Q2_K", "FP8_E4M3",
                                   "Q5_0", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("M", [1, 3, 19])   # 19 rows x top-2 > 5 experts: the dequantized stack + gather_mm
def test_moe(qtype, hashed, M):
    ex, mex = experts(qtype, hashed, inter=64 if TYPES[qtype].block_size < 128 else 256)
    x = torch.randn(M, 256, generator=gen(8))
    ids = torch.randint(0, 50, (M,), generator=gen(9))
    ref_chosen, _ = moe.route(x, ids, ex)
    got_chosen, _ = linear.route(m(x), m(ids), mex)
    assert torch.equal(t(got_chosen).long(), ref_chosen.sort(-1).values)   # routing is exact
    assert_close("moe", linear.moe(m(x), m(ids), mex), moe.moe(x, ids, ex))


@pytest.mark.parametrize("M", [1, 19])
def test_moe_tiles_dequantize_formats(monkeypatch, M):
    """Expert weights dequantized a few output rows at a time give the untiled result."""
    _, mex = experts("IQ2_XXS", False, inter=256)
    x, ids = m(torch.randn(M, 256, generator=gen(8))), m(torch.zeros(M, dtype=torch.long))
    whole = t(linear.moe(x, ids, mex))
    monkeypatch.setattr(linear, "TILE_ELEMS", 256 * 5 * 24)
    assert_close("moe", linear.moe(x, ids, mex), whole)


def test_routing_ties_go_to_the_lower_expert():
    ex, mex = experts("F32", False, seed=8)
    x = torch.zeros(2, 256)                       # every p equal: the bias alone decides, with ties
    ex = Experts(**{**ex.__dict__, "bias": torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])})
    mex = Experts(**{**mex.__dict__, "bias": m(ex.bias)})
    chosen, _ = linear.route(m(x), m(torch.zeros(2, dtype=torch.long)), mex)
    assert t(chosen).tolist() == [[1, 2], [1, 2]] == moe.route(x, torch.zeros(2, dtype=torch.long), ex)[0].tolist()


@pytest.mark.parametrize("M", [1, 3])
def test_grouped_qmatmul(M):
    """Each group through the MLX qmatmul on its rows' packed fields: its bits, and close to the reference."""
    w = QTensor.quantize(torch.randn(3 * 8, 64, generator=gen(6)), "Q8_0", "w")
    x = torch.randn(M, 3, 64, generator=gen(7))
    got = t(linear.grouped_qmatmul(m(x), place(w)))
    groups = [t(linear.qmatmul(m(x[:, g]), place(grouped_qmatmul.group_rows(w, g, 3)))) for g in range(3)]
    assert torch.equal(got, torch.cat(groups, dim=1))
    bound = QMATMUL_RTOL * torch.cat([x[:, g].abs() @ w.dequantize()[8 * g:8 * g + 8].abs().T for g in range(3)], 1)
    assert ((got - grouped_qmatmul.grouped_qmatmul(x, w)).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("clamp", [None, 0.5])
def test_shared_expert(clamp):
    g, u = (QTensor.quantize(torch.randn(64, 96, generator=gen(s)) * 0.3, "Q8_0", n) for s, n in ((1, "g"), (2, "u")))
    d = QTensor.quantize(torch.randn(96, 64, generator=gen(3)) * 0.3, "Q8_0", "d")
    x = torch.randn(3, 96, generator=gen(4))
    assert_close("shared_expert", linear.shared_expert(m(x), place(g), place(u), place(d), clamp),
                 shared_expert.shared_expert(x, g, u, d, clamp))


# ---- selections ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, k", [(1, 4), (7, 3), (33, 4), (64, 16)])
def test_indexer_topk_is_exact_with_ties(n, k):
    scores = torch.randint(-3, 4, (5, n), generator=gen(n)).float()   # many exact ties
    scores[1, :2] = float("-inf")
    scores[2] = -0.0
    visible = torch.tensor([n, 0, n, max(0, n - 2), min(n, 2)])
    got = t(select.indexer_topk(m(scores), k, m(visible))).long()
    assert torch.equal(got, indexer_topk.indexer_topk(scores, k, visible))


def test_verify_argmax_is_exact_with_ties():
    logits = torch.randint(0, 5, (6, 37), generator=gen(10)).float()
    logits[0, [3, 9]] = 10.0                      # tied top-1: the lower id, margin 0
    logits[1] = torch.arange(37.0)
    for x in (logits, m(logits)):                 # the decoder passes torch logits; MLX ones work too
        top1, margin = select.verify_argmax(x)
        ref_top1, ref_margin = verify_argmax.verify_argmax(logits)
        assert t(top1).tolist() == ref_top1.tolist() and torch.equal(t(margin), ref_margin)


# ---- row-wise ops ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 64), (2, 129)])
def test_rms_norm(shape):
    x = torch.randn(*shape, generator=gen(11)) * 4
    w = torch.randn(shape[-1], generator=gen(12))
    assert_close("rms_norm", pointwise.rms_norm(m(x), m(w), 1e-6), rms_norm.rms_norm(x, w, 1e-6))
    assert_close("rms_norm", pointwise.rms_norm(m(x), None, 1e-3), rms_norm.rms_norm(x, None, 1e-3))


@pytest.mark.parametrize("shape, r", [((3, 80), 16), ((2, 3, 18), 6), ((1, 4, 2, 8), 8)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail(shape, r, inverse):
    x = torch.randn(*shape, generator=gen(13))
    pos = torch.tensor([0, 5, 4095][:shape[0]])
    freqs = rope_tail.rope_freqs(r, 10000.0, (16.0, 32.0, 1.0, 64))
    assert_close("rope_tail", pointwise.rope_tail(m(x), m(pos), m(freqs), inverse),
                 rope_tail.rope_tail(x, pos, freqs, inverse))


@pytest.mark.parametrize("shape", [(1, 8), (3, 2, 64), (5, 128)])
def test_hadamard(shape):
    x = torch.randn(*shape, generator=gen(14))
    assert_close("hadamard", pointwise.hadamard(m(x)), hadamard.hadamard(x))
    with pytest.raises(ValueError, match="power-of-two"):
        pointwise.hadamard(mx.zeros((2, 6)))


@pytest.mark.parametrize("shape", [(1, 64), (3, 2, 128), (7, 192)])
def test_fp8_sim_is_exact(shape):
    x = torch.randn(*shape, generator=gen(15)) * torch.logspace(-6, 3, shape[-1])
    x[0, :64] = 0.0                                   # the amax floor
    x.view(-1)[5] = 1e-3 * 0.5 ** 10                  # subnormal E4M3 range after scaling
    assert torch.equal(t(pointwise.fp8_sim(m(x))), fp8_sim.fp8_sim(x))


@pytest.mark.parametrize("shape", [(1, 32), (3, 2, 64), (5, 96)])
def test_fp4_sim_is_exact(shape):
    x = torch.randn(*shape, generator=gen(16)) * torch.logspace(-4, 2, shape[-1])
    x[0, :32] = 0.0
    x.view(-1)[40 % x.numel()] = 0.25 * 6          # ties on the e2m1 grid
    assert torch.equal(t(pointwise.fp4_sim(m(x))), fp4_sim.fp4_sim(x))


@pytest.mark.parametrize("B, n, d", [(1, 4, 8), (3, 8, 5), (17, 16, 80)])
def test_compress(B, n, d):
    kv, score = torch.randn(B, n, d, generator=gen(17)), torch.randn(B, n, d, generator=gen(18)) * 3
    score[0, : n // 2] = float("-inf")                # absent candidates
    assert_close("compress", pointwise.compress(m(kv), m(score)), compress.compress(kv, score))


@pytest.mark.parametrize("M", [1, 3, 18])
def test_hc_ops(M):
    S, D = 4, 24
    X = torch.randn(M, S, D, generator=gen(19))
    mixes = torch.randn(M, 2 * S + S * S, generator=gen(20))
    scale, base = torch.randn(3, generator=gen(21)), torch.randn(2 * S + S * S, generator=gen(22)) * 0.5
    got, ref = hc.hc_pre(m(X), m(mixes), m(scale), m(base), 20, 1e-6), hc_pre.hc_pre(X, mixes, scale, base, 20, 1e-6)
    for a, b in zip(got, ref, strict=True):
        assert_close("hc_pre", a, b)
    y = torch.randn(M, D, generator=gen(23))
    assert_close("hc_post", hc.hc_post(m(X), m(y), m(ref[1]), m(ref[2])), hc_post.hc_post(X, y, ref[1], ref[2]))
    fn = QTensor.quantize(torch.randn(S, S * D, generator=gen(24)) * 0.2, "F16", "fn")
    s1, b1 = torch.randn(1, generator=gen(25)), torch.randn(S, generator=gen(26))
    assert_close("hc_head", hc.hc_head(m(X), place(fn), m(s1), m(b1), 1e-6, 1e-6),
                 hc_head.hc_head(X, fn, s1, b1, 1e-6, 1e-6))


@pytest.mark.parametrize("visible", [(1,), (0, 3, 9), tuple(range(18))])
def test_index_scores(visible):
    M, Hi, di, N = len(visible), 3, 32, 20
    q, keys = torch.randn(M, Hi, di, generator=gen(27)), torch.randn(N, di, generator=gen(28))
    w = torch.randn(M, Hi, generator=gen(29))
    assert_close("index_scores", attention.index_scores(m(q), m(keys), m(w), visible),
                 index_scores.index_scores(q, keys, w, visible))


def attn_rows(M: int, window: int, n_kv: int, with_comp: bool, seed: int):
    g = gen(seed)
    n_raw = tuple(int(v) for v in torch.randint(1, window + 1, (M,), generator=g))
    raw = torch.full((M, window), -1)
    for r, n in enumerate(n_raw):
        raw[r, :n] = torch.randperm(n_kv // 2, generator=g)[:n]
    if not with_comp:
        return AttnRows(raw, n_raw)
    n_comp = tuple(int(v) for v in torch.randint(0, 4, (M,), generator=g))
    comp = torch.full((M, 5), -1)
    for r, n in enumerate(n_comp):
        comp[r, :n] = n_kv // 2 + torch.randperm(n_kv // 2, generator=g)[:n]
    return AttnRows(raw, n_raw, comp, n_comp)


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("with_comp", [False, True])
def test_sparse_attention(M, with_comp):
    H, D, n_kv = 3, 40, 24
    q, kv = torch.randn(M, H, D, generator=gen(30)), torch.randn(n_kv, D, generator=gen(31))
    sinks = torch.randn(H, generator=gen(32))
    rows = attn_rows(M, 6, n_kv, with_comp, 33 + M)
    mrows = AttnRows(m(rows.raw), rows.n_raw, None if rows.comp is None else m(rows.comp), rows.n_comp)
    assert_close("sparse_attention", attention.sparse_attention(m(q), m(kv), mrows, m(sinks), 1 / math.sqrt(D)),
                 sparse_attention.sparse_attention(q, kv, rows, sinks, 1 / math.sqrt(D)))


@pytest.mark.parametrize("fp8_dims, f16", [(0, False), (64, False), (64, True), (0, True)])
def test_store_rows_is_exact(fp8_dims, f16):
    cache = torch.randn(9, 80, generator=gen(34))
    rows, slots = torch.randn(3, 80, generator=gen(35)) * 10, torch.tensor([4, 0, 8])
    got = attention.store_rows(m(cache), m(slots), m(rows), fp8_dims, f16)
    assert torch.equal(t(got), store_rows.store_rows(cache.clone(), slots, rows, fp8_dims, f16))


def test_declared_batch_invariance_holds():
    """The MLX ops declared batch-invariant (the selections) give row r of an M-row call bit for bit."""
    from backends.registry import OPS, implementations
    declared = {op for op in OPS if implementations(op)["mlx"].batch_invariant}
    assert declared == {"indexer_topk", "verify_argmax"}
    scores = torch.randint(-3, 4, (16, 40), generator=gen(40)).float()
    visible = torch.randint(0, 41, (16,), generator=gen(41))
    many = t(select.indexer_topk(m(scores), 6, m(visible)))
    top1, margin = (t(a) for a in select.verify_argmax(m(scores)))
    for r in range(16):
        assert torch.equal(t(select.indexer_topk(m(scores[r:r + 1]), 6, m(visible[r:r + 1])))[0], many[r])
        one = [t(a)[0] for a in select.verify_argmax(m(scores[r:r + 1]))]
        assert one[0] == top1[r] and torch.equal(one[1], margin[r])


def load_bench():
    """scripts/bench.py as a module."""
    return script("bench")


def test_bench_times_the_mlx_qmatmul(capsys):
    """scripts/bench.py qmatmul --backend mlx: one CSV row per (type, M), served by the MLX kernel."""
    load_bench().main(["qmatmul", "--csv", "--backend", "mlx", "--types", "Q4_K", "Q2_K", "--shapes", "8x256",
                       "--m", "1", "3", "--reps", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# MLX ")
    rows = lines[lines.index("type,N,K,M,backend,time_us,GB/s,%copy,x_baseline") + 1:]
    assert [r.split(",")[:5] for r in rows] == [["Q4_K", "8", "256", "1", "mlx"], ["Q4_K", "8", "256", "3", "mlx"],
                                                ["Q2_K", "8", "256", "1", "mlx"], ["Q2_K", "8", "256", "3", "mlx"]]


def test_bench_model_on_mlx(capsys):
    """scripts/bench.py model --backend mlx at smoke size: the random q2-mix model runs on MLX (each decode's
    logits and, at the end, every cache evaluated) and every op is served by mlx."""
    load_bench().main(["model", "--tiny", "--layers", "3", "--prompt", "5", "--decode", "2", "--backend", "mlx",
                       "--csv", "--reps", "1"])
    captured = capsys.readouterr()
    row = captured.out.splitlines()[1].split(",")
    assert row[:3] == ["mlx", "q2", "3"] and float(row[5]) > 0
    served = [line.split()[1] for line in captured.err.splitlines() if line.split()[:1] == ["qmatmul"]
              or line.split()[:1] == ["ffn"] or line.split()[:1] == ["sparse_attention"]]
    assert served == ["mlx"] * 3
