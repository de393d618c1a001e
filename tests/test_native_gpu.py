"""Native GPU variants of the Triton tests: what the interpreter cannot run. The compiled kernels at V4 Flash
sizes (dim 4096, 64 heads of 512, window 128, top-512 over 8192 keys, 2048-wide experts, vocabulary 129280),
every decode/verify row count 1..16, the autotuned prefill tiles, float16 activations at those sizes, a
3-layer V4 Flash model against the reference, and CUDA graphs of whole steps. Skipped with a reason under
the interpreter (`native_only`, tests/conftest.py); the assertions are the interpreter tests' own: the
reference's tolerance, exact integers, batch invariance bit for bit.
"""
from __future__ import annotations

import copy

import pytest
import torch

from backends.registry import OpSet, implementations
from ds4.bench.common import random_weight, stacked_weight
from ds4.session import Session, step_graphs
from ds4.tiny.build import FLASH_SIZES
from ds4.tiny.random_model import random_args, random_model
from ops.moe import Experts
from ops.qmatmul import SMALL_M
from ops.quants import QTensor
from ops.sparse_attention import AttnRows
from tests.devices import DEVICE

pytestmark = [pytest.mark.on_device, pytest.mark.native_only]

F = FLASH_SIZES
QTYPES = ("F16", "BF16", "Q8_0", "Q4_K", "Q2_K", "IQ2_XXS", "MXFP4", "FP8_E4M3")


def impls(op: str):
    """(Triton kernel, PyTorch reference) of op."""
    table = implementations(op)
    return table["triton"].fn, table["torch"].fn


def randn(*shape: int, seed: int) -> torch.Tensor:
    """Seeded standard normal samples (drawn on the CPU: the same values on every device)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rows_equal_single_calls(fn, *per_row, widths=range(2, SMALL_M + 1)) -> torch.Tensor:
    """fn(*per_row[:m]) equals the stacked 1-row calls bit for bit for every m in widths; returns those."""
    single = torch.cat([fn(*[t[r:r + 1] for t in per_row]) for r in range(SMALL_M)])
    for m in widths:
        assert torch.equal(fn(*[t[:m] for t in per_row]), single[:m]), f"M={m} differs from 1-row calls"
    return single


def assert_qmatmul_close(y: torch.Tensor, x: torch.Tensor, w: QTensor) -> None:
    """y within 1e-5 * (|x| @ |W|.T) of x @ dequantize(W).T (tests/test_qmatmul.py's bound)."""
    dense = w.dequantize()
    bound = 1e-5 * (x.float().abs() @ dense.abs().T) + 1e-30
    err = (y - x.float() @ dense.T).abs()
    assert y.dtype == torch.float32 and (err <= bound).all(), f"max error ratio {(err / bound).max():.3g}"


def check_qmatmul(qtype: str, n: int, k: int, prefill: int) -> None:
    """Decode/verify rows 1..16 bitwise against 1-row calls and within the bound; float16 rows; a prefill."""
    tri = implementations("qmatmul")["triton"].fn
    w = random_weight(qtype, n, k, torch.device(DEVICE))
    x = randn(SMALL_M, k, seed=1)
    assert_qmatmul_close(rows_equal_single_calls(lambda a: tri(a, w), x), x, w)
    assert_qmatmul_close(tri(x.half(), w), x.half(), w)
    xp = randn(prefill, k, seed=2)
    assert_qmatmul_close(tri(xp, w), xp, w)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", [(F["q_lora_rank"], F["dim"]), (F["dim"], F["o_lora_rank"] * 2)])
def test_qmatmul_at_flash_shapes(qtype, n, k):
    check_qmatmul(qtype, n, k, prefill=512)


def test_qmatmul_lm_head():
    """The LM head: 129280 x 4096 in Q8_0 (the q2 and q4 mixes' output type)."""
    check_qmatmul("Q8_0", F["vocab_size"], F["dim"], prefill=64)


def check_attention(H: int, D: int, window: int, top_k: int, seed: int = 0) -> None:
    """Every query lists window raw rows and top_k compressed rows, valid counts at random; −1 after."""
    g = torch.Generator().manual_seed(seed)
    n_rows = window + 4 * top_k
    q, kv = torch.randn(SMALL_M, H, D, generator=g), torch.randn(n_rows, D, generator=g)

    def lists(width: int) -> tuple[torch.Tensor, tuple[int, ...]]:
        idx = torch.stack([torch.randperm(n_rows, generator=g)[:width] for _ in range(SMALL_M)])
        counts = torch.randint(0, width + 1, (SMALL_M,), generator=g).tolist()
        for r, c in enumerate(counts):
            idx[r, c:] = -1
        return idx, tuple(counts)

    rows = AttnRows(*lists(window), *lists(top_k))
    sinks, scale = torch.randn(H, generator=g) * 2, D ** -0.5
    tri, ref = impls("sparse_attention")

    def call(fn, a: int, b: int) -> torch.Tensor:
        return fn(q[a:b], kv, AttnRows(rows.raw[a:b], rows.n_raw[a:b], rows.comp[a:b], rows.n_comp[a:b]), sinks, scale)

    single = torch.cat([call(tri, r, r + 1) for r in range(SMALL_M)])
    for m in range(2, SMALL_M + 1):
        assert torch.equal(call(tri, 0, m), single[:m]), f"M={m} differs from 1-row calls"
    torch.testing.assert_close(single, call(ref, 0, SMALL_M), rtol=0, atol=2e-5)


def test_sparse_attention_at_flash_shapes():
    check_attention(F["n_heads"], F["head_dim"], F["window"], F["index_topk"])


def check_indexer(heads: int, dim: int, n: int, k: int) -> None:
    """Scores of every row count against the reference's bound; top-k exactly the reference's indices."""
    tri, ref = impls("index_scores")
    q, keys, w = randn(SMALL_M, heads, dim, seed=0), randn(n, dim, seed=1), randn(SMALL_M, heads, seed=2)
    visible = tuple(n * (SMALL_M - r) // SMALL_M - r for r in range(SMALL_M))  # the whole buffer, then fewer
    single = torch.cat([tri(q[r:r + 1], keys, w[r:r + 1], visible[r:r + 1]) for r in range(SMALL_M)])
    for m in range(2, SMALL_M + 1):
        assert torch.equal(tri(q[:m], keys, w[:m], visible[:m]), single[:m]), f"M={m} differs from 1-row calls"
    expected = ref(q, keys, w, visible)
    bound = 1e-5 * torch.einsum("mhd,nd->mhn", q, keys).abs().mul(w.abs()[:, :, None]).sum(1) + 1e-30
    seen = ~expected.isneginf()
    assert torch.equal(single.isneginf(), expected.isneginf())
    assert ((single - expected).abs()[seen] <= bound[seen]).all()
    topk, ref_topk = impls("indexer_topk")
    scores = randn(SMALL_M, n, seed=3).round(decimals=2)  # ties
    rows = torch.tensor(visible)
    picked = rows_equal_single_calls(lambda s, v: topk(s, k, v), scores, rows)
    assert torch.equal(picked, ref_topk(scores, k, rows))


def test_indexer_at_flash_shapes():
    check_indexer(F["index_n_heads"], F["index_head_dim"], 8192, F["index_topk"])


def check_moe(n_experts: int, dim: int, inter: int, top_k: int, prefill: int) -> None:
    """The q2 mix's expert stacks: rows 1..16 bitwise and within 1e-5 of the largest reference value."""
    device = torch.device(DEVICE)
    ex = Experts(router=random_weight("F16", n_experts, dim, device), bias=randn(n_experts, seed=1) * 0.1,
                 tid2eid=None, gate=stacked_weight("IQ2_XXS", n_experts, inter, dim, device),
                 up=stacked_weight("IQ2_XXS", n_experts, inter, dim, device),
                 down=stacked_weight("Q2_K", n_experts, dim, inter, device),
                 top_k=top_k, route_scale=1.5, normalize=True, clamp=10.0)
    tri, ref = impls("moe")
    for m in (SMALL_M, prefill):
        x = randn(m, dim, seed=m) * 0.1
        ids = torch.randint(0, 1000, (m,), generator=torch.Generator().manual_seed(m))
        got = rows_equal_single_calls(lambda a, b: tri(a, b, ex), x, ids, widths=(2, 7, SMALL_M)) \
            if m == SMALL_M else tri(x, ids, ex)
        want = ref(x, ids, ex)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_moe_at_flash_shapes():
    check_moe(32, F["dim"], F["moe_inter_dim"], F["n_experts_used"], prefill=96)


def check_hyper(S: int, D: int) -> None:
    """hc_pre, hc_post and hc_head: rows 1..16 bitwise and within 1e-5 of the references."""
    tol = {"rtol": 1e-5, "atol": 1e-5}
    X, mixes = randn(SMALL_M, S, D, seed=0), randn(SMALL_M, 2 * S + S * S, seed=1)
    scale, base = torch.rand(3, generator=torch.Generator().manual_seed(2)) + 0.5, randn(2 * S + S * S, seed=3)
    tri, ref = impls("hc_pre")
    for got, want in zip(tri(X, mixes, scale, base, 20, 1e-6), ref(X, mixes, scale, base, 20, 1e-6), strict=True):
        torch.testing.assert_close(got, want, **tol)
    rows_equal_single_calls(lambda a, b: tri(a, b, scale, base, 20, 1e-6)[0], X, mixes)
    tri, ref = impls("hc_post")
    y, post, comb = randn(SMALL_M, D, seed=4), torch.rand(SMALL_M, S), torch.rand(SMALL_M, S, S)
    torch.testing.assert_close(rows_equal_single_calls(tri, X, y, post, comb), ref(X, y, post, comb), **tol)
    tri, ref = impls("hc_head")
    fn = QTensor.quantize(randn(S, S * D, seed=5) * 0.01, "F32", name="hc_head.fn")
    head_scale, head_base = torch.rand(1) + 0.5, randn(S, seed=6)
    got = rows_equal_single_calls(lambda a: tri(a, fn, head_scale, head_base, 1e-6, 1e-6), X)
    torch.testing.assert_close(got, ref(X, fn, head_scale, head_base, 1e-6, 1e-6), **tol)


def test_hyper_connections_at_flash_shapes():
    check_hyper(4, F["dim"])


def test_verify_argmax_over_the_vocabulary():
    tri, ref = impls("verify_argmax")
    x = randn(SMALL_M, F["vocab_size"], seed=0) * 4
    top1 = rows_equal_single_calls(lambda a: tri(a)[0], x)
    margin = rows_equal_single_calls(lambda a: tri(a)[1], x)
    want_top1, want_margin = ref(x)
    assert torch.equal(top1, want_top1) and torch.equal(margin, want_margin)


@pytest.fixture(scope="module")
def flash_models():
    """A 3-layer V4 Flash trunk (ratios 0, 0, 4) in the q2 mix, on Triton and on the references."""
    args = random_args(3)
    return (random_model(args, "q2", OpSet("triton", device=DEVICE), seed=0),
            random_model(args, "q2", OpSet("torch", device=DEVICE), seed=0))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference over the largest reference magnitude."""
    return float((got - want).abs().max() / want.abs().max())


def steps_through_graphs(session: Session, model, steps: list[int], capture: bool, passes: int) -> list[torch.Tensor]:
    """Logits of one-token decodes of `steps`, then of one verify of them, from the same position, `passes` times,
    on a copy of `session` whose steps run through CUDA graphs (`capture`) or their static buffers eagerly."""
    graphed = copy.deepcopy(session, memo={id(model): model})
    graphed.graphs = step_graphs(model, None, capture=capture)
    out = []
    for _ in range(passes):  # a step is recorded on its first call and replayed after
        graphed.truncate(session.pos)
        out.append(torch.stack([graphed.decode(t) for t in steps]))
        graphed.truncate(session.pos)
        out.append(graphed.forward(steps))
    assert graphed.graphs["trunk"].replays == passes * (len(steps) + 1) - 2  # all but the first decode and verify
    return out


def check_model(triton_model, reference_model, prompt: list[int], steps: list[int]) -> None:
    """Triton against the references on a prefill and decodes; a verify equals the decodes bit for bit; the
    fixed plan's steps close to the eager ones, and their CUDA-graph replays equal to them bit for bit."""
    ctx = len(prompt) + 3 * len(steps) + 8
    tri, ref = Session(triton_model, ctx, 16), Session(reference_model, ctx, 16)
    for got, want in [(tri.prefill(prompt), ref.prefill(prompt))] + [(tri.decode(t), ref.decode(t)) for t in steps]:
        assert relative_error(got, want) < 1e-2  # FP8 cache roundings may flip on last-bit differences
    snapshot = copy.deepcopy(tri, memo={id(triton_model): triton_model})
    decoded = torch.stack([tri.decode(t) for t in steps])
    assert torch.equal(snapshot.forward(steps), decoded)
    fixed = steps_through_graphs(snapshot, triton_model, steps, capture=False, passes=1)
    assert all(relative_error(f, decoded) < 1e-3 for f in fixed)  # float order; a cache rounding may flip
    replayed = steps_through_graphs(snapshot, triton_model, steps, capture=DEVICE == "cuda", passes=2)
    assert all(torch.equal(r, f) for r, f in zip(replayed, fixed * 2, strict=True))


def test_flash_model_matches_reference_and_its_cuda_graphs(flash_models):
    check_model(*flash_models, prompt=list(range(100, 109)), steps=[5, 6, 7])
