"""Batch invariance in the verify regime (M <= SMALL_M rows): row r of an M-row call is bit-identical to
the 1-row call, op by op and for the whole trunk + MTP forward (logits and every state row), with one
and with two threads."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from backends.registry import OPS, OpSet, reference
from ds4.session import Session
from ds4.tiny.build import tiny_model_weights
from models.args import ModelArgs
from models.deepseek_v4 import DeepseekV4
from models.mtp import MTPHead
from ops.moe import Experts
from ops.qmatmul import SMALL_M
from ops.quants import QTensor
from ops.sparse_attention import AttnRows

TORCH = OpSet("torch")
SIZES = {"n_layers": 2, "compress_ratios": (4, 16), "n_hash_layers": 1}


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def attention_case(M: int, seed: int) -> tuple[tuple, list[tuple]]:
    """A batched sparse_attention call whose queries see different numbers of raw and compressed rows
    (−1 padded), and for each query the 1-row call a decode makes (its compressed list unpadded)."""
    g = torch.Generator().manual_seed(seed)
    H, D, N, W, K = 4, 80, 40, 10, 12
    q, kv, sinks = randn(M, H, D, seed=seed), randn(N, D, seed=seed + 1), randn(H, seed=seed + 2)
    n_raw = torch.randint(1, W + 1, (M,), generator=g).tolist()
    n_comp = torch.randint(0, K + 1, (M,), generator=g).tolist()
    raw, comp = torch.randint(0, N, (M, W), generator=g), torch.randint(0, N, (M, K), generator=g)
    for m in range(M):
        raw[m, n_raw[m]:], comp[m, n_comp[m]:] = -1, -1
    rows = AttnRows(raw, tuple(n_raw), comp, tuple(n_comp))
    single = [AttnRows(raw[m:m + 1], (n_raw[m],), comp[m:m + 1, :n_comp[m]], (n_comp[m],)) for m in range(M)]
    return (q, kv, rows, sinks, 0.1), [(q[m:m + 1], kv, single[m], sinks, 0.1) for m in range(M)]


def moe_case(M: int, seed: int, hashed: bool) -> tuple[tuple, list[tuple]]:
    """A batched moe call and the 1-row calls of its rows (bias routing, or hash routing)."""
    E, D, inter, k, vocab = 8, 128, 40, 2, 32   # inter 40: rows of silu not a multiple of the vector width

    def weight(*shape, s):
        return QTensor.quantize(randn(*shape, seed=s) / shape[-1] ** 0.5, "F32", f"w{s}")

    g = torch.Generator().manual_seed(seed)
    x, ids = randn(M, D, seed=seed), torch.randint(0, vocab, (M,), generator=g)
    experts = Experts(weight(E, D, s=1), None if hashed else randn(E, seed=2),
                      torch.randint(0, E, (vocab, k), generator=g) if hashed else None,
                      weight(E, inter, D, s=3), weight(E, inter, D, s=4), weight(E, D, inter, s=5), k, 1.5, True, 10.0)
    return (x, ids, experts), [(x[m:m + 1], ids[m:m + 1], experts) for m in range(M)]


def index_case(M: int, seed: int) -> tuple[tuple, list[tuple]]:
    """Indexer scoring of M queries that see different numbers of keys, and each query's decode call."""
    Hi, di, n = 4, 32, 12
    q, keys, w = randn(M, Hi, di, seed=seed), randn(n, di, seed=seed + 1), randn(M, Hi, seed=seed + 2)
    visible = torch.randint(0, n + 1, (M,), generator=torch.Generator().manual_seed(seed)).tolist()
    visible[0] = n
    return (q, keys, w, tuple(visible)), [(q[m:m + 1], keys, w[m:m + 1], (v,)) for m, v in enumerate(visible)]


def shared_expert_case(M: int, seed: int) -> tuple[tuple, list[tuple]]:
    """The shared expert (inter 64, a multiple of the vector width) on M rows and on each row alone."""
    D, inter = 128, 64
    w = [QTensor.quantize(randn(*shape, seed=s) / shape[-1] ** 0.5, "Q8_0", f"w{s}")
         for s, shape in ((1, (inter, D)), (2, (inter, D)), (3, (D, inter)))]
    x = randn(M, D, seed=seed)
    return (x, *w, 10.0), [(x[m:m + 1], *w, 10.0) for m in range(M)]


def ffn_case(M: int, seed: int) -> tuple[tuple, list[tuple]]:
    """A layer's routed experts (bias routing) and shared expert (D 128, as shared_expert_case) on M rows and alone."""
    (x, ids, experts), _ = moe_case(M, seed, hashed=False)
    (_, *shared, clamp), _ = shared_expert_case(M, seed)
    return (x, ids, experts, *shared, clamp), [(x[m:m + 1], ids[m:m + 1], experts, *shared, clamp) for m in range(M)]


def store_case(M: int, seed: int) -> tuple[tuple, list[tuple]]:
    """Rows stored (FP8 no-RoPE dims, F16) at distinct slots, batched and one at a time."""
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(seed))[:M]
    rows = randn(M, 80, seed=seed) * 3
    return (torch.zeros(32, 80), slots, rows, 64, True), [(torch.zeros(32, 80), slots[m:m + 1], rows[m:m + 1], 64, True)
                                                         for m in range(M)]


def row_case(op: str, M: int, seed: int) -> tuple[tuple, list[tuple]]:
    """Batched and per-row arguments of the row-wise ops the model calls on verify batches."""
    S, D = 4, 128
    if op == "hc_pre":
        args = (randn(M, S, D, seed=seed), randn(M, 2 * S + S * S, seed=seed + 1), randn(3, seed=2),
                randn(2 * S + S * S, seed=3), 20, 1e-6)
        rows = (0, 1)
    elif op == "hc_post":
        args = (randn(M, S, D, seed=seed), randn(M, D, seed=seed + 1), randn(M, S, seed=seed + 2),
                randn(M, S, S, seed=seed + 3))
        rows = (0, 1, 2, 3)
    elif op == "rope_tail":
        args = (randn(M, S, 80, seed=seed), torch.arange(seed, seed + M) * 37, randn(8, seed=4).abs())
        rows = (0, 1)
    elif op == "hc_head":
        args = (randn(M, S, D, seed=seed), QTensor.quantize(randn(S, S * D, seed=5), "F32"), randn(1, seed=6),
                randn(S, seed=7), 1e-6, 1e-6)
        rows = (0,)
    elif op == "embed":
        args = (QTensor.quantize(randn(40, D, seed=8), "Q8_0"), torch.randint(0, 40, (M,)))
        rows = (1,)
    else:  # compress
        args = (randn(M, 8, 160, seed=seed), randn(M, 8, 160, seed=seed + 1))
        rows = (0, 1)
    return args, [tuple(a[m:m + 1] if i in rows else a for i, a in enumerate(args)) for m in range(M)]


def grouped_case(M: int, seed: int) -> tuple[tuple, list[tuple]]:
    """The grouped output projection (4 groups of 24 rows over 64 values) on M rows and on each row alone."""
    w = QTensor.quantize(randn(4 * 24, 64, seed=9) / 8, "Q8_0", "attn_output_a.weight")
    x = randn(M, 4, 64, seed=seed)
    return (x, w), [(x[m:m + 1], w) for m in range(M)]


def fused_case(op: str, M: int, seed: int) -> tuple[tuple, list[tuple]]:
    """The fused ops (hc_pre_norm, hc_post_pre_norm; qmatmul_norm_rope with per-head norms and RoPE;
    attention_output; compressor_store at distinct slots, fresh rings per call; attention_input, its kv rows at
    distinct slots of a fresh cache; indexer_query) on M rows and on each row alone."""
    S, D = 4, 64
    positions, freqs = torch.arange(seed, seed + M) * 37, randn(8, seed=4).abs()
    if op == "hc_pre_norm":
        fn = QTensor.quantize(randn(2 * S + S * S, S * D, seed=10) / 16, "F16", "hc_fn")
        args = (randn(M, S, D, seed=seed), fn, randn(3, seed=2), randn(2 * S + S * S, seed=3), randn(D, seed=4), 20,
                1e-6, 1e-6)
        rows = (0,)
    elif op == "hc_post_pre_norm":
        fn = QTensor.quantize(randn(2 * S + S * S, S * D, seed=10) / 16, "F16", "hc_fn")
        args = (randn(M, S, D, seed=seed), randn(M, D, seed=seed + 1), randn(M, S, seed=seed + 2),
                randn(M, S, S, seed=seed + 3), fn, randn(3, seed=2), randn(2 * S + S * S, seed=3), randn(D, seed=4), 20,
                1e-6, 1e-6)
        rows = (0, 1, 2, 3)
    elif op == "qmatmul_norm_rope":
        w = QTensor.quantize(randn(4 * 32, D, seed=11) / 8, "Q8_0", "attn_q_b.weight")
        args, rows = (randn(M, D, seed=seed), w, None, 1e-6, 32, positions, freqs), (0, 5)
    elif op == "attention_output":
        wa = QTensor.quantize(randn(2 * 32, 64, seed=12) / 8, "Q8_0", "attn_output_a.weight")
        wb = QTensor.quantize(randn(D, 2 * 32, seed=13) / 8, "Q8_0", "attn_output_b.weight")
        args, rows = (randn(M, 4, 32, seed=seed), positions, freqs, wa, wb, 2), (0, 1)
    elif op == "attention_input":
        q_a, q_b, kv = (QTensor.quantize(randn(n, k, seed=s) / 8, "Q8_0", f"w{s}")
                        for n, k, s in ((32, D, 17), (2 * 128, 32, 18), (128, D, 19)))
        x, slots = randn(M, D, seed=seed), torch.randperm(32, generator=gen(seed))[:M]
        weights = (q_a, randn(32, seed=5).abs(), q_b, kv, randn(128, seed=6).abs(), 1e-6, 128)
        return ((x, *weights, positions, freqs, torch.zeros(32, 128), slots, 64, True),
                [(x[m:m + 1], *weights, positions[m:m + 1], freqs, torch.zeros(32, 128), slots[m:m + 1], 64, True)
                 for m in range(M)])
    elif op == "indexer_query":
        q_b, proj = (QTensor.quantize(randn(n, D, seed=s) / 8, "Q8_0", f"w{s}") for n, s in ((2 * 64, 20), (2, 21)))
        args, rows = (randn(M, D, seed=seed), randn(M, D, seed=seed + 1), q_b, proj, 64, positions, freqs, True,
                      181.0), (0, 1, 5)
    else:
        kv, gate = (QTensor.quantize(randn(32, D, seed=s) / 8, "F16", f"w{s}") for s in (14, 15))
        x, ape, slots = randn(M, D, seed=seed), randn(4, 32, seed=16), torch.randperm(32, generator=gen(seed))[:M]
        return ((x, kv, gate, ape, torch.arange(M) % 4, slots, torch.zeros(32, 32), torch.zeros(32, 32)),
                [(x[m:m + 1], kv, gate, ape, torch.tensor([m % 4]), slots[m:m + 1], torch.zeros(32, 32),
                  torch.zeros(32, 32)) for m in range(M)])
    return args, [tuple(a[m:m + 1] if i in rows else a for i, a in enumerate(args)) for m in range(M)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


FUSED = ("hc_pre_norm", "hc_post_pre_norm", "qmatmul_norm_rope", "attention_output", "compressor_store",
         "attention_input", "indexer_query")
CACHES = {"store_rows": (1, 0), "compressor_store": (5, 0), "attention_input": (11, 2)}  # the slots' argument and the
# first output that is a cache (compared at the slots written, not whole)
CASES = {"sparse_attention": attention_case, "grouped_qmatmul": grouped_case,
         "moe": lambda M, seed: moe_case(M, seed, hashed=False),
         "moe_hashed": lambda M, seed: moe_case(M, seed, hashed=True), "index_scores": index_case,
         "shared_expert": shared_expert_case, "store_rows": store_case, "ffn": ffn_case,
         **{op: (lambda M, seed, op=op: row_case(op, M, seed)) for op in ("hc_pre", "hc_post", "rope_tail",
                                                                           "compress", "hc_head", "embed")},
         **{op: (lambda M, seed, op=op: fused_case(op, M, seed)) for op in FUSED}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_rows_equal_one_row_calls(case):
    """For every M in 1..SMALL_M, each row of the batched call equals its 1-row call bit for bit."""
    op = reference(case.removesuffix("_hashed"))
    assert op.batch_invariant
    for M in range(1, SMALL_M + 1):
        batched_args, single_args = CASES[case](M, seed=M)
        batched = op.fn(*batched_args)
        for m, args in enumerate(single_args):
            single = op.fn(*args)
            slots, first_cache = CACHES.get(case, (None, None))
            outs = zip(*(o if isinstance(o, tuple) else (o,) for o in (batched, single)), strict=True)
            for i, (b, s) in enumerate(outs):
                if slots is not None and i >= first_cache:   # the rows written, not the whole cache
                    at = batched_args[slots][m:m + 1]
                    assert torch.equal(b[at], s[at]), (case, M, m)
                else:
                    assert torch.equal(b[m:m + 1], s), (case, M, m)


def test_every_decode_op_has_a_batch_invariance_case():
    """Every op on the decode/verify path is covered above (qmatmul, verify_argmax and indexer_topk have
    their own tests; the simulations and norms are elementwise)."""
    covered = {case.removesuffix("_hashed") for case in CASES}
    assert set(OPS) - covered == {"qmatmul", "verify_argmax", "indexer_topk", "rms_norm", "fp8_sim", "fp4_sim",
                                  "hadamard"}


def test_opset_batch_invariant_needs_every_op():
    """Every reference op declares batch invariance, so strict speculation may verify in one pass; one
    implementation that does not makes the whole OpSet not batch-invariant."""
    assert all(reference(op).batch_invariant for op in OPS)
    ops = OpSet("torch")
    assert ops.batch_invariant()
    impl, note = ops.resolve("moe")
    ops._resolved["moe"] = (dataclasses.replace(impl, batch_invariant=False), note)
    assert not ops.batch_invariant()


@pytest.fixture(scope="module")
def prefixed():
    """A tiny trunk + MTP session after a 13-token prompt, and the 16 tokens that follow it: positions
    13..28 cross the window, ratio-4 and ratio-16 blocks and the indexer's top-k."""
    md, base, mtp = tiny_model_weights(seed=5, **SIZES)
    trunk = DeepseekV4(ModelArgs.from_metadata(md), base, TORCH)
    session = Session(trunk, 64, SMALL_M, MTPHead(trunk, mtp))
    tokens = torch.randint(0, md["deepseek4.vocab_size"], (13 + SMALL_M,),
                           generator=torch.Generator().manual_seed(9)).tolist()
    session.prefill(tokens[:13])
    return session, tokens[13:]


def clone(session: Session) -> Session:
    return copy.deepcopy(session, memo={id(session.model): session.model, id(session.mtp): session.mtp})


@pytest.mark.parametrize("threads", (1, 2))
def test_model_forward_equals_successive_decodes(prefixed, threads):
    """A forward of M tokens (M = 1..SMALL_M) gives the logits and the whole session state (trunk rings,
    compressor and indexer state, compressed rows, MTP cache and state) of M one-token decodes, bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        session, tokens = prefixed
        ref, decoded, states = clone(session), [], []
        for token in tokens:
            decoded.append(ref.decode(token))
            states.append(ref.state_tensors())
        for M in range(1, SMALL_M + 1):
            s = clone(session)
            logits = s.forward(tokens[:M])
            assert torch.equal(logits, torch.stack(decoded[:M])), M
            state = s.state_tensors()
            assert state.keys() == states[M - 1].keys()
            for name, t in state.items():
                assert torch.equal(t, states[M - 1][name]), (M, name)
    finally:
        torch.set_num_threads(before)
