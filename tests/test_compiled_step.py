"""The fixed-capacity plan and the compiled step (docs/cpu.md, "The compiled step").

A fixed plan's shapes and counts depend only on the row count and the cache's capacities, so one graph
per row count serves every position; it attends to exactly what the eager plan does (the cpu backend
gives bit-identical logits and state, the references the same within float order). The compiled step
(the sync-free forward exported and compiled by AOTInductor) gives the eager tokens, and strict speculation on a
compiled session still equals plain greedy."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.arrays import TorchArrays
from backends.cpu import custom_ops
from backends.registry import OPS, OpSet
from ds4.errors import BackendUnavailable
from ds4.sampling import Sampler, SamplingParams
from ds4.session import Session
from ds4.speculative import generate_ids
from ds4.tiny.build import tiny_model_weights
from models.args import ModelArgs
from models.deepseek_v4 import DeepseekV4, plan_positions
from models.mtp import MTPHead

CHUNKS = [1] * 10 + [2, 3, 4, 1, 16, 1, 1, 5, 1, 2]   # crosses the window, ratio-4/16 blocks and the top-k


def tiny(backend: str, mix: str = "f32") -> tuple[DeepseekV4, MTPHead]:
    md, base, mtp = tiny_model_weights(mix=mix, seed=5)
    trunk = DeepseekV4(ModelArgs.from_metadata(md), base, OpSet(backend, device="mlx" if backend == "mlx" else "cpu"))
    return trunk, MTPHead(trunk, mtp)


def shapes(plan) -> dict[str, object]:
    """Every array's shape and every host count of a plan (what a compiled graph specializes on)."""
    out = {}
    for f in dataclasses.fields(plan):
        v = getattr(plan, f.name)
        if dataclasses.is_dataclass(v):
            out.update({f"{f.name}.{k}": s for k, s in shapes(v).items()})
        else:
            out[f.name] = tuple(v.shape) if isinstance(v, torch.Tensor) else v
    return out


@pytest.mark.parametrize("M", [1, 2, 5])
def test_fixed_plan_shapes_do_not_depend_on_position(M):
    trunk, _ = tiny("torch")
    caches = trunk.new_caches(200, 16)
    for cache in caches[:3]:
        seen = {str(shapes(plan_positions(trunk.ops, start, M, trunk.args.window, cache, fixed=True)))
                for start in (0, 3, 15, 16, 77, 190)}
        assert len(seen) == 1, seen
        eager = {str(shapes(plan_positions(trunk.ops, start, M, trunk.args.window, cache)))
                 for start in (0, 3, 15, 16, 77, 190)}
        assert cache.ratio == 0 or len(eager) > 1  # the eager plan does vary: the test can tell them apart


@pytest.mark.parametrize("backend", ["cpu", "torch", "mlx"])
def test_fixed_plan_attends_to_what_the_eager_plan_does(backend):
    if backend == "mlx":
        pytest.importorskip("mlx.core")
    trunk, _ = tiny(backend)
    eager, fixed = Session(trunk, 200, 16), Session(trunk, 200, 16)
    ids, worst = list(range(5, 45)), 0.0
    for n in CHUNKS:
        chunk, ids = ids[:n], ids[n:] + ids[:n]
        start = eager.pos
        a = trunk.ops.to_torch(trunk.forward(chunk, start, eager.caches, list(range(n)))[1])
        b = trunk.ops.to_torch(trunk.forward(chunk, start, fixed.caches, list(range(n)), step="fixed")[1])
        eager.tokens += chunk
        fixed.tokens += chunk
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        worst = max(worst, float((a - b).abs().max() / a.abs().max()))
    state_a, state_b = eager.state_tensors(), fixed.state_tensors()
    if backend == "cpu":  # padding only appends exact zeros there: bit-identical logits and state
        assert worst == 0.0
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    else:  # float order differs; once a last-bit difference flips an FP8/F16 cache rounding (docs/cpu.md,
        # "Numerics") later steps drift: per step <= 1e-6 at first, 3.6e-5 by the 20th chunk with MKL on AMD
        assert worst < 1e-4
        assert all(close_but_for_cache_roundings(state_a[k], state_b[k]) for k in state_a)


def close_but_for_cache_roundings(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within float-order noise except at most 1% of entries, each at most one FP8 step (1/8 of the value)
    apart: where a last-bit difference upstream flipped a cache rounding."""
    a, b = a.double(), b.double()
    off = ~torch.isclose(a, b, rtol=1e-4, atol=1e-5)
    return float(off.double().mean()) <= 0.01 and bool(((a - b).abs() <= a.abs() / 8 + 1e-6)[off].all())


def test_compile_refuses_devices_it_does_not_serve():
    with pytest.raises(BackendUnavailable, match="CPU only"):
        TorchArrays("meta").compile(lambda x: x)


@pytest.fixture(scope="module")
def compiled():
    """One cpu-backend trunk + MTP whose compiled steps (M = 1, 2) are shared by the tests below."""
    return tiny("cpu", "q2")


def greedy(session: Session, prompt: list[int], n: int, draft=None, strict=False) -> list[int]:
    sampler = Sampler(SamplingParams(0.0))
    return list(generate_ids(session, prompt, max_tokens=n, sampler=sampler, eos_id=None, draft=draft,
                             strict=strict))


def test_compiled_decode_gives_the_eager_tokens(compiled):
    trunk, mtp = compiled
    prompt = list(range(5, 45))
    eager, comp = Session(trunk, 256, 16, mtp), Session(trunk, 256, 16, mtp, compile=True)
    a, b = eager.prefill(prompt), comp.prefill(prompt)
    assert torch.equal(a, b)  # prefill is never compiled
    for i in range(24):
        tok = int(a.argmax())
        assert tok == int(b.argmax()), f"step {i}"
        a, b = eager.decode(tok), comp.decode(tok)
        assert float((a - b).abs().max() / a.abs().max()) < 1e-5
    assert comp.counters["compiled_rows"] == 24 and eager.counters["compiled_rows"] == 0
    state_a, state_b = eager.mtp_first_state(), comp.mtp_first_state()
    assert float((state_a - state_b).abs().max() / state_a.abs().max()) < 1e-5
    tok = int(a.argmax())
    draft_a, draft_b = eager.mtp_draft(tok)[0], comp.mtp_draft(tok)[0]   # the MTP head's compiled 1-row step
    assert int(draft_a.argmax()) == int(draft_b.argmax())
    assert float((draft_a - draft_b).abs().max() / draft_a.abs().max()) < 1e-5


def test_compiled_verify_rows_match_one_row_steps(compiled):
    trunk, mtp = compiled
    one, two = Session(trunk, 256, 16, mtp, compile=True), Session(trunk, 256, 16, mtp, compile=True)
    one.prefill(list(range(5, 45)))
    two.prefill(list(range(5, 45)))
    rows = torch.stack([one.decode(50), one.decode(61)])
    batched = two.forward([50, 61])
    assert torch.equal(rows.argmax(-1), batched.argmax(-1))
    assert float((rows - batched).abs().max() / rows.abs().max()) < 1e-5
    assert not two.batch_invariant()  # so strict verifies one row at a time on a compiled session


def test_strict_speculation_on_a_compiled_session_equals_plain_greedy(compiled):
    trunk, mtp = compiled
    prompt = list(range(5, 45)) + list(range(5, 25))
    plain = greedy(Session(trunk, 256, 16, mtp, compile=True), prompt, 20)
    for depth in (1, 2):
        s = Session(trunk, 256, 16, mtp, compile=True)
        assert greedy(s, prompt, 20, draft=depth, strict=True) == plain
        assert s.counters["compiled_rows"] > 0


class CheckedGraph(torch.fx.Interpreter):
    """Runs dynamo's graph of a step op by op, checking each `ds4_step` op's outputs against the shapes, strides and
    dtypes its fake kernel gave while tracing (what inductor's code takes on trust)."""

    def run_node(self, n):
        out = super().run_node(n)
        if n.op == "call_function" and str(n.target).startswith("ds4_step."):
            fakes = n.meta.get("example_value")     # None: an op that returns nothing (writes in place)
            for real, fake in zip(out or [], fakes or [], strict=True):
                assert (real.shape, real.stride(), real.dtype) == (fake.shape, fake.stride(), fake.dtype), n.target
        return out


@pytest.fixture
def c_ops():
    """Compiled steps call the cpu backend's ops as `ds4_step` ops (DS4_COMPILE_C_OPS=1) for OpSets made here."""
    custom_ops.use_c_ops(True)
    try:
        yield
    finally:
        custom_ops.use_c_ops(custom_ops.WANTED)


@pytest.mark.parametrize("dot", ["exact", "q8"])
def test_a_traced_step_calls_the_cpu_ops_as_custom_ops_and_gives_the_eager_bits(dot, c_ops):
    """Dynamo's graph of a decode step (no inductor: a backend running the graph node by node) holds the cpu
    backend's C calls as `ds4_step` ops, their fake shapes are the real ones, and it gives the eager step's bits on
    the same (fixed) plan: the ops run as eager runs them."""
    md, base, _ = tiny_model_weights(mix="q2", seed=5)
    trunk = DeepseekV4(ModelArgs.from_metadata(md), base, OpSet("cpu", device="cpu", cpu_dot=dot))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lambda *args: CheckedGraph(gm).run(*args)

    for op in OPS:      # bound before tracing, as OpSet.compile does
        getattr(trunk.ops, op)
    step = torch.compile(trunk.run, backend=backend, fullgraph=True, dynamic=False)
    eager, traced = Session(trunk, 256, 16), Session(trunk, 256, 16)
    prompt = list(range(5, 45))
    a, b = eager.prefill(prompt), traced.prefill(prompt)
    for i in range(4):
        tok = int(a.argmax())
        a = trunk.forward([tok], eager.pos, eager.caches, [0], step="fixed")[1]
        b = trunk.forward([tok], traced.pos, traced.caches, [0], step="fixed", runner=step)[1]
        eager.tokens.append(tok)
        traced.tokens.append(tok)
        assert torch.equal(a, b), f"step {i}"
    assert all(torch.equal(x, y) for x, y in zip(eager.state_tensors().values(), traced.state_tensors().values(),
                                                 strict=True))
    called = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    fused = {"hc_pre_norm", "hc_post_pre_norm", "attention_input", "indexer_query", "attention_output",
             "compressor_store", "ffn", "store_rows", "sparse_attention", "hc_post", "embed",
             "hc_head", "qmatmul"}
    assert {f"ds4_step.{op}" for op in fused} <= called
    assert not any(t.startswith("ds4.") for t in called)       # no traced fallback reaching the bare kernels


def test_a_compiled_step_with_the_custom_ops_is_saved_loaded_and_gives_the_eager_tokens(c_ops, tmp_path, monkeypatch):
    """Inductor's step with the `ds4_step` ops (saved whole: the package calls the ops by name) gives the eager tokens;
    a second model of the same file loads it instead of compiling."""
    monkeypatch.setenv("DS4_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    trunk, _ = tiny("cpu", "q2")
    prompt = list(range(5, 45))
    eager, comp = Session(trunk, 64, 16), Session(trunk, 64, 16, compile=True)
    a, b = eager.prefill(prompt), comp.prefill(prompt)
    tokens = []
    for i in range(6):
        tokens.append(int(a.argmax()))
        assert tokens[-1] == int(b.argmax()), f"step {i}"
        a, b = eager.decode(tokens[-1]), comp.decode(tokens[-1])
        assert float((a - b).abs().max() / a.abs().max()) < 1e-5
    assert (trunk.compiled_step().compiled, trunk.compiled_step().loaded) == (1, 0)
    again, _ = tiny("cpu", "q2")
    s = Session(again, 64, 16, compile=True)
    s.prefill(prompt)
    for tok in tokens:
        c = s.decode(tok)
    assert torch.equal(c, b)
    assert (again.compiled_step().compiled, again.compiled_step().loaded) == (0, 1)
