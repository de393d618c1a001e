"""The fused ops (ops/hc_pre_norm.py, ops/qmatmul_norm_rope.py): the reference is the sequence of references; the cpu
backend's one C call is the bits of its own ops called one by one (exact and q8, 1/2/3 kernel threads, M = 1..17, the
last past the kernels' 16 rows); Triton (interpreter) and MLX close to the reference; and the model calls them."""
from __future__ import annotations

from functools import partial

import pytest
import torch

from backends.cpu import glue, kernels
from backends.registry import implementations
from ops.hc_pre import hc_pre
from ops.hc_pre_norm import hc_pre_norm, hc_pre_norm_of
from ops.qmatmul import qmatmul
from ops.qmatmul_norm_rope import qmatmul_norm_rope, qmatmul_norm_rope_of
from ops.quants import QTensor
from ops.rms_norm import rms_norm
from ops.rope_tail import rope_freqs, rope_tail

S, D, HD = 4, 64, 32     # streams, hidden, head width (the head's tail of 16 values rotated)


def impl(op: str, backend: str):
    return implementations(op)[backend].fn


def hc_case(M: int, qtype: str = "F16", seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    fn = QTensor.quantize(torch.randn(2 * S + S * S, S * D, generator=g) / 16, qtype, "hc_fn")
    return (torch.randn(M, S, D, generator=g), fn, torch.rand(3, generator=g) + 0.5,
            torch.randn(2 * S + S * S, generator=g), torch.rand(D, generator=g) + 0.5, 20, 1e-6, 1e-6)


def projection_case(M: int, qtype: str = "Q8_0", seed: int = 0, n: int = 4 * HD, k: int = 256) -> tuple:
    g = torch.Generator().manual_seed(seed)
    w = QTensor.quantize(torch.randn(n, k, generator=g) / 16, qtype, "attn_q_b.weight")
    return (torch.randn(M, k, generator=g), w, torch.rand(HD, generator=g) + 0.5, 1e-6, HD,
            torch.arange(M) * 37 + seed, rope_freqs(16, 10000.0))


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


def unfused_cpu(op: str, dot: str):
    """The fused op's sequence made of the cpu backend's own registered ops."""
    mm = partial(impl("qmatmul", "cpu"), dot=dot)
    if op == "hc_pre_norm":
        return hc_pre_norm_of(impl("rms_norm", "cpu"), mm, impl("hc_pre", "cpu"))
    return qmatmul_norm_rope_of(mm, impl("rms_norm", "cpu"), impl("rope_tail", "cpu"))


CPU_CASES = [("hc_pre_norm", "F16", "exact"), ("hc_pre_norm", "F16", "q8"), ("hc_pre_norm", "Q8_0", "exact"),
             ("qmatmul_norm_rope", "Q8_0", "exact"), ("qmatmul_norm_rope", "Q8_0", "q8"),
             ("qmatmul_norm_rope", "Q4_K", "exact"), ("qmatmul_norm_rope", "Q4_K", "q8"),
             ("qmatmul_norm_rope", "F16", "q8")]


@pytest.mark.parametrize("op,qtype,dot", CPU_CASES)
def test_cpu_is_the_unfused_cpu_ops_bits(op, qtype, dot, monkeypatch):
    """One C call with the bits of the separate cpu calls, for M = 1, 2, 5, 16 (the C call) and 17 (the separate
    calls), on 1, 2 and 3 kernel threads (SPLIT_BYTES lowered so that the pool splits these small weights), close to
    the reference."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1 << 12)
    called = []
    fused_c = getattr(glue, op)
    monkeypatch.setattr(glue, op, lambda *a: called.append(fused_c(*a)) or called[-1])
    fused, unfused = partial(impl(op, "cpu"), dot=dot), unfused_cpu(op, dot)
    reference = hc_pre_norm if op == "hc_pre_norm" else qmatmul_norm_rope
    try:
        for n in (1, 2, 3):
            kernels.set_threads(n)
            for M in (1, 2, 5, 16, 17):
                args = hc_case(M, qtype, M) if op == "hc_pre_norm" else projection_case(M, qtype, M)
                if op == "qmatmul_norm_rope" and M == 2:
                    args = args[:4]     # no rotation, the whole row normed without a weight
                    args = (args[0], args[1], None, args[3])
                got, want = fused(*args), unfused(*args)
                got, want = ((o,) if isinstance(o, torch.Tensor) else o for o in (got, want))
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (n, M)
                if dot == "exact":
                    ref = reference(*args)
                    torch.testing.assert_close(got, (ref,) if isinstance(ref, torch.Tensor) else ref, rtol=1e-4,
                                               atol=1e-4)
    finally:
        kernels.set_threads(1)
        kernels._pool_threads = 0
    assert [out is not None for out in called] == [True, True, True, True, False] * 3    # M <= 16: one C call


@pytest.mark.on_device
def test_triton_is_close_to_the_reference():
    for M in (1, 3):
        for got, want in zip(impl("hc_pre_norm", "triton")(*hc_case(M, "Q8_0")), hc_pre_norm(*hc_case(M, "Q8_0")),
                             strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        args = projection_case(M)
        torch.testing.assert_close(impl("qmatmul_norm_rope", "triton")(*args), qmatmul_norm_rope(*args),
                                   rtol=1e-4, atol=1e-4)


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
    x, w, norm, eps, width, pos, freqs = projection_case(3)
    got = impl("qmatmul_norm_rope", "mlx")(m(x), place(w), m(norm), eps, width, m(pos), m(freqs))
    torch.testing.assert_close(torch_of(got), qmatmul_norm_rope(x, w, norm, eps, width, pos, freqs), rtol=1e-4,
                               atol=1e-4)
