"""Routed experts and shared expert: the Triton kernels (interpreter) against the PyTorch references.

Expert selection is exact (the ids the reference picks, in increasing id order). Routing weights are
within 1e-5 relative + 1e-6 (router logits summed in another order; torch's softplus against the
kernel's exp/log) and expert outputs within 1e-5 · max|reference| (float32 sums in another order; torch's
silu against the kernel's sigmoid).
Batch invariance is bit for bit: row r of an M-row call (M <= 16) equals the 1-row call.
"""
import pytest
import torch

import backends.triton.moe as kernels
from backends.registry import implementations
from ops.moe import Experts
from ops.moe import moe as reference_moe
from ops.moe import route as reference_route
from ops.qmatmul import SMALL_M
from ops.quants import QTensor
from ops.shared_expert import shared_expert as reference_shared

pytestmark = pytest.mark.on_device  # CUDA when present, else the interpreter (tests/devices.py)

E, VOCAB = 5, 50


def randn(*shape: int, seed: int) -> torch.Tensor:
    """Seeded standard normal samples."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def experts(types=("F16", "F16", "F16"), d: int = 73, inter: int = 20, top_k: int = 2, *, hashed=False,
            bias=True, router_scale=1.0, normalize=True, seed=0) -> Experts:
    """Random experts with stacks quantized to `types` (gate, up, down)."""
    q = QTensor.quantize
    return Experts(
        router=q(randn(E, d, seed=seed) * router_scale, "F32", "router"),
        bias=randn(E, seed=seed + 1) * 0.1 if bias and not hashed else None,
        tid2eid=torch.randint(0, E, (VOCAB, top_k), generator=torch.Generator().manual_seed(seed)) if hashed else None,
        gate=q(randn(E, inter, d, seed=seed + 2) * 0.3, types[0], "gate"),
        up=q(randn(E, inter, d, seed=seed + 3) * 0.3, types[1], "up"),
        down=q(randn(E, d, inter, seed=seed + 4) * 0.3, types[2], "down"),
        top_k=top_k, route_scale=1.5, normalize=normalize, clamp=1.0)


def inputs(ex: Experts, m: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [m, D] and token ids [m]."""
    ids = torch.randint(0, VOCAB, (m,), generator=torch.Generator().manual_seed(seed))
    return randn(m, ex.router.shape[1], seed=seed), ids


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-5 of the largest reference magnitude."""
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def assert_routes_like_reference(ex: Experts, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The kernel picks the reference's experts (in increasing id order) with its weights; returns them."""
    chosen, weight = kernels.route(x, ids, ex)
    ref_chosen, ref_weight = reference_route(x, ids, ex)
    ref_chosen, order = torch.sort(ref_chosen, dim=-1, stable=True)
    assert torch.equal(chosen.long(), ref_chosen)
    torch.testing.assert_close(weight, ref_weight.gather(1, order), rtol=1e-5, atol=1e-6)
    return chosen


@pytest.mark.parametrize("case", ["bias", "hash", "no bias, unnormalized", "top_k=1"])
def test_route_is_exact(case):
    """M = 17 rows: sqrt-softplus router, bias-only selection or hash table, weights normalized and scaled."""
    ex = {"bias": experts(top_k=3), "hash": experts(hashed=True, top_k=3),
          "no bias, unnormalized": experts(bias=False, normalize=False, router_scale=8.0),
          "top_k=1": experts(top_k=1, seed=3)}[case]
    assert_routes_like_reference(ex, *inputs(ex, SMALL_M + 1))


def test_route_ties_go_to_the_lower_expert_id():
    """A zero router makes every score equal: experts 0..top_k-1 in every row."""
    ex = experts(bias=False, top_k=3)
    ex = Experts(**{**ex.__dict__, "router": QTensor.quantize(torch.zeros(E, 73), "F32")})
    chosen = assert_routes_like_reference(ex, *inputs(ex, 4))
    assert chosen.tolist() == [[0, 1, 2]] * 4


@pytest.mark.parametrize("types,d,inter", [(("F16", "F16", "F16"), 73, 20),          # K not a multiple of the tile
                                           (("IQ2_XXS", "Q4_K", "Q8_0"), 256, 32),   # super-block types
                                           (("Q6_K", "Q5_K", "IQ4_NL"), 256, 32),    # llama.cpp's K-mix types
                                           (("Q3_K", "IQ4_XS", "Q5_0"), 256, 32)])
def test_moe_matches_reference(types, d, inter):
    """Decode (1 row), verify (3 rows) and prefill (17 rows, grouped by expert) against the reference."""
    ex = experts(types, d, inter)
    moe = implementations("moe")["triton"].fn
    for m in ((1, 3, SMALL_M + 1) if d < 256 else (1, SMALL_M + 1)):
        x, ids = inputs(ex, m, seed=m)
        assert_close(moe(x, ids, ex), reference_moe(x, ids, ex))


def test_moe_all_rows_to_one_expert_and_float16():
    """top_k = 1 with a bias that sends every row to expert 3: one expert's tiles carry all rows."""
    ex = experts(top_k=1, bias=False)
    ex = Experts(**{**ex.__dict__, "bias": torch.tensor([0.0, 0.0, 0.0, 100.0, 0.0])})
    moe = implementations("moe")["triton"].fn
    for m in (2, 40):
        x, ids = inputs(ex, m, seed=m)
        assert (assert_routes_like_reference(ex, x, ids) == 3).all()
        assert_close(moe(x, ids, ex), reference_moe(x, ids, ex))
        x16 = x.half()
        assert_close(moe(x16, ids, ex), reference_moe(x16, ids, ex))


def test_moe_is_batch_invariant():
    """Row r of every M-row call, M = 1..16, equals the 1-row call bit for bit (hash and bias layers)."""
    moe = implementations("moe")["triton"].fn
    for ex in (experts(), experts(hashed=True, seed=7)):
        x, ids = inputs(ex, SMALL_M)
        single = torch.cat([moe(x[r:r + 1], ids[r:r + 1], ex) for r in range(SMALL_M)])
        assert_close(single, reference_moe(x, ids, ex))
        for m in (7, SMALL_M) if ex.tid2eid is None else (SMALL_M,):   # rows are independent programs
            assert torch.equal(moe(x[:m], ids[:m], ex), single[:m]), f"M={m} differs from 1-row calls"


def shared_weights(types=("F16", "Q8_0", "F16"), d: int = 64, inter: int = 37) -> tuple[QTensor, QTensor, QTensor]:
    """Shared-expert gate, up [inter, d] and down [d, inter]."""
    q = QTensor.quantize
    return (q(randn(inter, d, seed=1) * 0.3, types[0], "shexp.gate"),
            q(randn(inter, d, seed=2) * 0.3, types[1], "shexp.up"),
            q(randn(d, inter, seed=3) * 0.3, types[2], "shexp.down"))


def test_shared_expert_matches_reference_and_is_batch_invariant():
    """M = 17 against the reference with and without the SwiGLU clamp; rows of M <= 16 bitwise."""
    shared = implementations("shared_expert")["triton"].fn
    w = shared_weights()
    x = randn(SMALL_M + 1, 64, seed=4)
    for clamp in (None, 0.5):
        assert_close(shared(x, *w, clamp), reference_shared(x, *w, clamp))
    single = torch.cat([shared(x[r:r + 1], *w, 0.5) for r in range(SMALL_M)])
    assert_close(single, reference_shared(x[:SMALL_M], *w, 0.5))
    for m in (3, SMALL_M):
        assert torch.equal(shared(x[:m], *w, 0.5), single[:m])


def test_registry_declares_invariance():
    """Both ops register for triton as batch-invariant, like their references."""
    for op in ("moe", "shared_expert"):
        impls = implementations(op)
        assert impls["triton"].batch_invariant and impls["torch"].batch_invariant
