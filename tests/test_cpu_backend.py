"""The `cpu` backend (backends/cpu, docs/cpu.md): each op against its reference, batch invariance of every
op it declares batch-invariant (row r of an M-row call equals the 1-row call bit for bit, M <= SMALL_M),
and the tiny model's greedy tokens unchanged against the reference path, plain and strict speculative."""
from __future__ import annotations

import functools

import pytest
import torch

from backends.cpu import hc, kernels
from backends.registry import OpSet, implementations, reference
from ds4.sampling import Sampler, SamplingParams
from ds4.session import Session
from ds4.speculative import generate_ids
from ds4.tiny.build import tiny_model_weights
from models.args import ModelArgs
from models.deepseek_v4 import DeepseekV4
from models.mtp import MTPHead
from ops.hc_pre import sinkhorn
from ops.qmatmul import SMALL_M
from ops.quants import QTensor, get
from tests.test_batch_invariance import CASES

CPU_OPS = sorted(op for op in ("qmatmul", "moe", "shared_expert", "sparse_attention", "index_scores", "hc_pre",
                               "hc_head", "hc_post", "rms_norm", "rope_tail", "grouped_qmatmul", "hc_pre_norm",
                               "qmatmul_norm_rope", "attention_output", "hc_post_pre_norm")   # compressor_store:
                 if "cpu" in implementations(op))   # tests/test_fused_ops.py


def cpu(op: str):
    return implementations(op)["cpu"]


def close(a, b, rtol=1e-5, atol=1e-5):
    for x, y in zip(*(o if isinstance(o, tuple) else (o,) for o in (a, b)), strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


def qmatmul_case(M: int, seed: int, qtype: str = "Q8_0", n: int = 48, k: int = 256):
    g = torch.Generator().manual_seed(seed)
    w = QTensor.quantize(torch.randn(n, k, generator=g) / 16, qtype, "w")
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(seed + 1))
    return (x, w), [(x[m:m + 1], w) for m in range(M)]


def test_fused_kernel_is_built_here():
    """This machine has a C compiler, so the fused kernel must serve (a broken build would silently fall
    back to the slow tiled path)."""
    assert all(kernels.available(t, 256) for t in kernels.GGML_TYPE)
    assert not kernels.available("FP8_E4M3", 256) and not kernels.available("F32", 96)
    assert kernels.available("F16", 96) and not kernels.available("F16", 48)


def test_cpu_backend_serves_auto_on_cpu_only():
    assert CPU_OPS == ["attention_output", "grouped_qmatmul", "hc_head", "hc_post", "hc_post_pre_norm", "hc_pre",
                       "hc_pre_norm", "index_scores", "moe", "qmatmul", "qmatmul_norm_rope", "rms_norm", "rope_tail",
                       "shared_expert", "sparse_attention"]
    assert OpSet().resolve("moe")[0].backend == "cpu"
    assert OpSet("torch").resolve("moe")[0].backend == "torch"
    assert OpSet().batch_invariant()


@pytest.mark.parametrize("qtype", [*kernels.GGML_TYPE, "FP8_E4M3"])   # FP8_E4M3: a type the kernel does not read
@pytest.mark.parametrize("M", (1, 3, 16, 40))
@pytest.mark.parametrize("fused", (True, False))
def test_qmatmul_matches_reference(qtype, M, fused, monkeypatch):
    """Fused kernel (where it serves the type) and the tiled fallback, decode/verify and prefill sizes."""
    monkeypatch.setattr("backends.cpu.qmatmul.TILE_BYTES", 4 * 256 * 20)   # several tiles, a ragged last one
    if not fused:
        monkeypatch.setattr("backends.cpu.kernels._lib", None)
    (x, w), _ = qmatmul_case(M, seed=M, qtype=qtype)
    close(cpu("qmatmul").fn(x, w), reference("qmatmul").fn(x, w))
    monkeypatch.setattr("backends.cpu.qmatmul.STREAM_BYTES", 0)     # F32 through the kernel too
    close(cpu("qmatmul").fn(x, w), reference("qmatmul").fn(x, w))


@pytest.mark.skipif(not kernels.built(), reason="the cpu kernel library is off (DS4_CPU_KERNELS=0)")
@pytest.mark.parametrize("qtype", [t for t in kernels.GGML_TYPE if t != "F32"])
def test_block_dequantizer_is_the_reference(qtype):
    """The kernel library's dequantizer (prefill's tiles) on random bytes, so every scale kind occurs (zero,
    subnormal, infinite and NaN halves): the reference's values bit for bit."""
    t = get(qtype)
    data = torch.randint(0, 256, (24, t.row_bytes(512)), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    w = QTensor(t, (24, 512), data)
    torch.testing.assert_close(kernels.dequantize(w), w.dequantize(), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="unsupported call"):
        torch.ops.ds4.dequantize(data, kernels.GGML_TYPE["Q8_0"], 24, 500)


def test_sinkhorn_torch_path_agrees_with_the_kernel_library(monkeypatch):
    """hc_pre's Sinkhorn where no C compiler is found (in-place torch ops) against sinkhorn.c."""
    logits = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(2)) * 4
    through_library = hc.sinkhorn(logits, 20, 1e-6)
    monkeypatch.setattr("backends.cpu.kernels._lib", None)
    close(hc.sinkhorn(logits, 20, 1e-6), through_library)
    close(through_library, sinkhorn(logits, 20, 1e-6))


CPU_CASES = {name: case for name, case in CASES.items() if name.removesuffix("_hashed") in CPU_OPS}
CPU_CASES["qmatmul"] = qmatmul_case
CPU_CASES["qmatmul_f32"] = lambda M, seed: qmatmul_case(M, seed, "F32", n=40, k=96)
CPU_CASES["qmatmul_f32_streamed"] = lambda M, seed: qmatmul_case(M, seed, "F32", n=1024, k=256)   # 1 MB: the kernel
CPU_CASES["qmatmul_f16"] = lambda M, seed: qmatmul_case(M, seed, "F16", n=40, k=96)
CPU_CASES["qmatmul_q4_k"] = lambda M, seed: qmatmul_case(M, seed, "Q4_K", n=40, k=512)
CPU_CASES["qmatmul_q2_k"] = lambda M, seed: qmatmul_case(M, seed, "Q2_K", n=40, k=512)
CPU_CASES["moe_q4_k"] = lambda M, seed: quantized_moe_case(M, seed, "Q4_K")
CPU_CASES["qmatmul_iq2_xxs"] = lambda M, seed: qmatmul_case(M, seed, "IQ2_XXS", n=40, k=512)
CPU_CASES["moe_q2_k"] = lambda M, seed: quantized_moe_case(M, seed, "Q2_K")
CPU_CASES["moe_f32"] = lambda M, seed: quantized_moe_case(M, seed, "F32")   # the kernel reads F32 experts in place
CPU_CASES["moe_f16"] = lambda M, seed: quantized_moe_case(M, seed, "F16")
CPU_CASES["qmatmul_q6_k"] = lambda M, seed: qmatmul_case(M, seed, "Q6_K", n=40, k=512)
CPU_CASES["moe_q5_k"] = lambda M, seed: quantized_moe_case(M, seed, "Q5_K")
CPU_CASES["rms_norm"] = lambda M, seed: rms_norm_case(M, seed, weighted=True)
CPU_CASES["rms_norm_unweighted_heads"] = lambda M, seed: rms_norm_case(M, seed, weighted=False)
CPU_CASES["rope_tail_inverse"] = lambda M, seed: rope_inverse_case(M, seed)


def rms_norm_case(M: int, seed: int, weighted: bool):
    """Rows of 256 values with a weight, or [M, 4 heads, 80] without one (the query norm)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 256, generator=g) * 3 if weighted else torch.randn(M, 4, 80, generator=g)
    w = torch.rand(256, generator=g) + 0.5 if weighted else None
    return (x, w, 1e-6), [(x[m:m + 1], w, 1e-6) for m in range(M)]


def rope_inverse_case(M: int, seed: int):
    """The rope_tail case rotated backwards (the attention output's inverse rotation)."""
    args, rows = CASES["rope_tail"](M, seed)
    return (*args, True), [(*r, True) for r in rows]


@functools.cache
def quantized_experts(qtype: str) -> tuple[QTensor, ...]:
    """Router and 8 experts (D 256, inter 256) with the expert stacks in `qtype`, quantized once."""
    g = torch.Generator().manual_seed(0)
    q = [QTensor.quantize(torch.randn(8, *shape, generator=g) / shape[-1] ** 0.5, qtype, f"w{i}")
         for i, shape in enumerate(((256, 256), (256, 256), (256, 256)))]
    return QTensor.quantize(torch.randn(8, 256, generator=g) / 16, "F32", "router"), *q


def quantized_moe_case(M: int, seed: int, qtype: str):
    """The moe case with its expert stacks in `qtype` (through the fused kernel, or gathered and dequantized)."""
    (_, ids, ex), _ = CASES["moe"](M, seed)
    x = torch.randn(M, 256, generator=torch.Generator().manual_seed(seed))
    router, *q = quantized_experts(qtype)
    ex = type(ex)(router, ex.bias, None, *q, ex.top_k, ex.route_scale, ex.normalize, ex.clamp)
    return (x, ids, ex), [(x[m:m + 1], ids[m:m + 1], ex) for m in range(M)]


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_cpu_op_matches_reference_and_is_batch_invariant(case):
    """For every M in 1..SMALL_M: close to the reference, and each row equals its 1-row call bit for bit."""
    op = max((o for o in CPU_OPS if case == o or case.startswith(o + "_")), key=len)   # "moe_q4_k" -> "moe"
    impl = cpu(op)
    assert impl.batch_invariant
    for M in range(1, SMALL_M + 1):
        batched_args, single_args = CPU_CASES[case](M, seed=M)
        batched = impl.fn(*batched_args)
        close(batched, reference(op).fn(*batched_args))
        for m, args in enumerate(single_args):
            single = impl.fn(*args)
            for b, s in zip(*(o if isinstance(o, tuple) else (o,) for o in (batched, single)), strict=True):
                assert torch.equal(b[m:m + 1], s), (case, M, m)


@pytest.fixture(scope="module")
def tiny():
    md, base, mtp = tiny_model_weights()
    return ModelArgs.from_metadata(md), base, mtp


def run(tiny, ops: OpSet, prompt: list[int], draft: int | None, chunk: int):
    args, base, mtp = tiny
    trunk = DeepseekV4(args, base, ops)
    session = Session(trunk, 256, chunk, MTPHead(trunk, mtp))
    logs: list[torch.Tensor] = []
    ids = list(generate_ids(session, prompt, max_tokens=20, sampler=Sampler(SamplingParams(temperature=0.0)),
                            eos_id=None, draft=draft, strict=draft is not None, on_logits=logs.append))
    return ids, torch.stack(logs)


@pytest.mark.parametrize("draft", (None, 2))
def test_tiny_model_greedy_tokens_unchanged(tiny, draft):
    """Plain and strict speculative decoding on the cpu backend give the reference's greedy tokens; a
    40-token prompt crosses the window, compression blocks and the indexer's top-k and prefills through the
    large-M paths (chunk 32). The prompt's logits (same state, new float order) are within 1e-5 of the
    largest logit; later steps read KV rows that went through the FP8/F16 cache rounding, where a last-bit
    difference can flip a rounding, so they are held to 1e-3 (docs/cpu.md)."""
    prompt = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref_ids, ref_logits = run(tiny, OpSet("torch"), prompt, draft, 32)
    ids, logits = run(tiny, OpSet("auto"), prompt, draft, 32)
    assert ids == ref_ids
    scale = ref_logits.abs().amax(-1, keepdim=True)
    rel = ((logits - ref_logits).abs() / scale).amax(-1)
    assert rel[0] < 1e-5 and rel.max() < 1e-3, rel


def test_decode_and_verify_read_nothing_back(tiny, monkeypatch):
    """The cpu backend keeps the forward sync-free (tests/test_no_sync.py's guard) for decode and verify."""
    from tests.test_no_sync import guarded
    args, base, mtp = tiny
    trunk = DeepseekV4(args, base, OpSet("auto"))
    s = Session(trunk, 128, SMALL_M, MTPHead(trunk, mtp))
    s.prefill(list(range(5, 40)))
    monkeypatch.setattr(DeepseekV4, "forward", guarded(DeepseekV4.forward))
    monkeypatch.setattr(MTPHead, "forward", guarded(MTPHead.forward))
    s.decode(7)
    for M in (2, 5, SMALL_M):
        snap = s.snapshot()
        s.forward(list(range(40, 40 + M)), "all")
        s.restore(snap)
