"""The whole tiny model on MLX (`--backend mlx`, CPU here): greedy tokens equal the torch backend's, plain and
strict speculative; every op is served by mlx; a forward crosses between torch and MLX once at most.

Greedy tokens are compared exactly. They could in principle differ (MLX sums float32 in another order than
torch), so the test also bounds the logits: teacher-forcing the MLX tokens, MLX and torch logits agree to
LOGIT_TOL, far below the smallest top-1/top-2 margin of these prompts (so equal tokens are expected, not lucky).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("mlx.core")

import ds4  # noqa: E402
from backends import registry  # noqa: E402
from backends.mlx import arrays as mlx_arrays  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "generate.py"
PROMPTS = [[0, 5, 9, 17], [0, 100, 200, 300, 400] + [17] * 5 + [3] * 15, [1, 2], [0, *range(40, 80)], [0] + [7] * 7]
N_TOKENS = 12
LOGIT_TOL = 1e-4   # max |mlx - torch| over every teacher-forced logit (measured: 5.8e-6 to 2.4e-5)


@pytest.fixture(scope="module")
def engines(tiny_gguf):
    base, mtp = tiny_gguf
    return ds4.load(base, mtp, backend="torch"), ds4.load(base, mtp, backend="mlx")


def greedy(engine, prompt, **kw) -> list[int]:
    return [t.id for t in engine.generate(prompt, max_tokens=N_TOKENS, **kw) if t.id >= 0]


def test_mlx_engine_is_resident_in_mlx(engines):
    _, mlx = engines
    assert mlx.ops.device == "mlx" and mlx.ops.arrays.family == "mlx"
    assert all(mlx.ops.resolve(op)[0].backend == "mlx" for op in registry.OPS)
    assert not mlx.ops.batch_invariant()   # strict speculation verifies row by row on MLX


def test_device_mlx_gives_every_op_to_mlx(tiny_gguf):
    engine = ds4.load(*tiny_gguf, device="mlx")   # backend auto
    assert engine.ops.backend == "auto" and all(engine.ops.resolve(op)[0].backend == "mlx" for op in registry.OPS)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_torch_plain_and_strict(engines, prompt):
    torch_engine, mlx_engine = engines
    expected = greedy(torch_engine, prompt, mtp_draft=0)
    assert greedy(mlx_engine, prompt, mtp_draft=0) == expected
    assert greedy(mlx_engine, prompt, mtp_draft=2, strict=True) == expected
    # the same tokens teacher-forced in one forward: the logits agree far inside the decision margins
    ids = prompt + expected
    ref = torch_engine.session(ctx=128).forward(ids)
    got = mlx_engine.session(ctx=128).forward(ids)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert (got - ref).abs().max().item() <= LOGIT_TOL
    top2 = ref[len(prompt) - 1:-1].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min().item() > 10 * LOGIT_TOL


def test_a_forward_crosses_once(engines, monkeypatch):
    """Count every torch <-> numpy/MLX conversion: prefill, decode, a 3-row verify and an MTP draft each
    convert exactly once (their logits), and a forward without an LM head never."""
    _, mlx_engine = engines
    session = mlx_engine.session(ctx=128, prefill_chunk=16)
    crossings = []

    def counted(owner, name):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, **k: crossings.append(name) or real(*a, **k))

    for name in ("from_numpy", "as_tensor", "tensor"):
        counted(torch, name)
    for name in ("numpy", "__array__"):
        counted(torch.Tensor, name)
    for name in ("to_torch", "from_torch"):
        counted(mlx_arrays, name)

    def once(step):
        crossings.clear()
        out = step()
        assert sorted(crossings) == ["from_numpy", "to_torch"], crossings   # to_torch -> torch.from_numpy
        return out

    logits = once(lambda: session.prefill([0, *range(40, 70)]))          # two chunks: one crossing
    assert isinstance(logits, torch.Tensor) and logits.shape == (512,)
    once(lambda: session.decode(5))
    once(lambda: session.forward([6, 7, 8]))
    once(lambda: session.mtp_draft(9))
    crossings.clear()
    assert session.forward([10], None) is None and crossings == []


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_cli_json_shows_every_op_on_mlx(tiny_gguf, engines):
    base, mtp = tiny_gguf
    r = generate("--model", base, "--mtp", mtp, "--prompt-ids", "0,5,9,17", "-n", "8", "--json", "--backend", "mlx",
                 "--mtp-draft", "2", "--strict", "--explain-backends")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["generated_ids"] == greedy(engines[0], [0, 5, 9, 17], mtp_draft=0)[:8]
    report = out["backends"]
    assert {"qmatmul", "ffn", "sparse_attention", "indexer_topk", "verify_argmax", "hc_pre_norm"} <= set(report)
    assert {r["backend"] for r in report.values()} == {"mlx"}
    explained = [line.split() for line in r.stderr.splitlines() if line.split()[:1] and line.split()[0] in report]
    assert len(explained) == len(report) and all(row[1] == "mlx" for row in explained)


def test_cli_refuses_impossible_combinations(tiny_gguf):
    base, _ = tiny_gguf
    r = generate("--model", base, "--prompt-ids", "0,5", "-n", "1", "--backend", "triton", "--device", "mlx")
    assert r.returncode != 0
    assert "backend 'triton' cannot run on device 'mlx'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.filterwarnings("ignore:.*is not a multiple of the")
def test_quantized_model_equals_torch(tmp_path):
    """A 2-layer model in the q4 mix (Q4_K experts through gather_qmm, Q8_0 projections, F16 tables), with a
    prompt crossing the window and both compressors: tokens and logits as on the torch backend."""
    from ds4.tiny.build import write_tiny
    base, mtp = str(tmp_path / "q4.gguf"), str(tmp_path / "q4-mtp.gguf")
    write_tiny(base, mtp, mix="q4", seed=3, n_layers=2, dim=256, moe_inter_dim=256, n_experts=4, n_hash_layers=1,
               compress_ratios=(4, 16), vocab_size=320)
    torch_engine, mlx_engine = ds4.load(base, mtp, backend="torch"), ds4.load(base, mtp, backend="mlx")
    assert {L.experts.gate.qtype.name for L in mlx_engine.model.layers} == {"Q4_K"}
    prompt = [0, 5, 9, 17] + [3] * 19
    expected = greedy(torch_engine, prompt, mtp_draft=0)
    assert greedy(mlx_engine, prompt, mtp_draft=0) == expected
    assert greedy(mlx_engine, prompt, mtp_draft=3, strict=True) == expected
    ref, got = (e.session(ctx=64).forward(prompt + expected) for e in (torch_engine, mlx_engine))
    assert (got - ref).abs().max().item() <= LOGIT_TOL


def test_session_state_matches_torch(engines):
    """Every logical state tensor (caches, compressor rings, indexer rows, MTP state) of an MLX session, read
    back as torch, is the torch session's within float32 rounding (measured <= 6.2e-6 relative)."""
    states = []
    for engine in engines:
        s = engine.session(ctx=128, prefill_chunk=16)
        s.prefill([0, *range(40, 80)])
        s.decode(3)
        states.append(s.state_tensors())
    ref, got = states
    assert ref.keys() == got.keys()
    for name, x in ref.items():
        assert got[name].shape == x.shape, name
        if x.numel():
            scale = max(1.0, x.abs().max().item())
            assert (got[name].to(x.dtype) - x).abs().max().item() <= 1e-4 * scale, name


MX_HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "__array__", "__dlpack__")


def no_host_reads(monkeypatch):
    """Make every MLX host read (and mx.eval / mx.async_eval) raise while a trunk or MTP forward runs;
    returns the list whose non-emptiness marks "inside a forward"."""
    import mlx.core as mx

    from models.deepseek_v4 import DeepseekV4
    from models.mtp import MTPHead
    inside = []

    def guard(name, real):
        def check(*args, **kwargs):
            if inside:
                raise AssertionError(f"host read inside a forward: {name}")
            return real(*args, **kwargs)
        return check

    for name in MX_HOST_READS:
        monkeypatch.setattr(mx.array, name, guard(name, getattr(mx.array, name)))
    for name in ("eval", "async_eval"):
        monkeypatch.setattr(mx, name, guard(name, getattr(mx, name)))

    def guarded(forward):
        def run(*args, **kwargs):
            inside.append(forward)
            try:
                return forward(*args, **kwargs)
            finally:
                inside.pop()
        return run

    monkeypatch.setattr(DeepseekV4, "forward", guarded(DeepseekV4.forward))
    monkeypatch.setattr(MTPHead, "forward", guarded(MTPHead.forward))
    return inside


def test_mlx_forwards_read_nothing_back(engines, monkeypatch):
    """Decode, MTP drafts and 2..16-row verifies build their MLX graphs without a host read or an eval: MLX
    stays lazy until the session converts the logits, outside the forward."""
    session = engines[1].session(ctx=128, prefill_chunk=16)
    session.prefill(list(range(5, 40)))
    no_host_reads(monkeypatch)
    assert session.decode(7).shape == (512,)
    _, state = session.mtp_draft(9)
    session.mtp_draft(11, state)
    for M in (2, 5, 16):
        snap = session.snapshot()
        assert session.forward(list(range(40, 40 + M)), "all").shape == (M, 512)
        session.restore(snap)


def test_the_mlx_guard_catches_a_host_read(engines, monkeypatch):
    from models.deepseek_v4 import DeepseekV4
    real = DeepseekV4.logits
    monkeypatch.setattr(DeepseekV4, "logits", lambda self, X, head: int(X.abs().max()) and real(self, X, head))
    no_host_reads(monkeypatch)
    with pytest.raises(AssertionError, match="host read inside a forward: __int__"):
        engines[1].session(ctx=16).decode(7)
