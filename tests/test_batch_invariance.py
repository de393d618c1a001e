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
from ds4.tiny import tiny_model_weights
from models.deepseek_v4 import DeepseekV4, ModelArgs, index_scores
from models.mtp import MTPHead
from ops.qmatmul import SMALL_M
from ops.quants import QTensor

TORCH = OpSet("torch")
SIZES = {"n_layers": 2, "compress_ratios": (4, 16), "n_hash_layers": 1}


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def attention_case(M: int, seed: int) -> tuple[tuple, list[tuple]]:
    """A batched sparse_attention call whose row lists have different lengths (−1 padded to the longest)
    and holes, and for each row the 1-row call a decode makes: its own list, unpadded."""
    g = torch.Generator().manual_seed(seed)
    H, D, N = 4, 80, 40
    q, kv, sinks = randn(M, H, D, seed=seed), randn(N, D, seed=seed + 1), randn(H, seed=seed + 2)
    lists = []
    for _ in range(M):
        row = torch.randint(0, N, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g)
        lists.append(torch.where(torch.rand(row.shape, generator=g) < 0.2, -1, row))
    width = max(len(r) for r in lists)
    rows = torch.full((M, width), -1)
    for m, r in enumerate(lists):
        rows[m, :len(r)] = r
    return (q, kv, rows, sinks, 0.1), [(q[m:m + 1], kv, lists[m][None], sinks, 0.1) for m in range(M)]


def moe_case(M: int, seed: int, hashed: bool) -> tuple[tuple, list[tuple]]:
    """A batched moe call and the 1-row calls of its rows (bias routing, or hash routing)."""
    E, D, inter, k = 8, 128, 40, 2   # inter 40: rows of silu not a multiple of the vector width

    def weight(*shape, s):
        return QTensor.quantize(randn(*shape, seed=s) / shape[-1] ** 0.5, "F32", f"w{s}")

    x = randn(M, D, seed=seed)
    hash_experts = torch.randint(0, E, (M, k), generator=torch.Generator().manual_seed(seed)) if hashed else None
    fixed = (weight(E, D, s=1), None if hashed else randn(E, seed=2))
    experts = (weight(E, inter, D, s=3), weight(E, inter, D, s=4), weight(E, D, inter, s=5), k, 1.5, True, 10.0,
               TORCH)
    return ((x, *fixed, hash_experts, *experts),
            [(x[m:m + 1], *fixed, hash_experts[m:m + 1] if hashed else None, *experts) for m in range(M)])


def index_case(M: int, seed: int) -> tuple[tuple, list[tuple]]:
    """Indexer scoring of M queries that see different numbers of keys, and each query's decode call:
    its own visible keys only."""
    Hi, di, n = 4, 32, 12
    q, keys, w = randn(M, Hi, di, seed=seed), randn(n, di, seed=seed + 1), randn(M, Hi, seed=seed + 2)
    visible = torch.randint(0, n + 1, (M,), generator=torch.Generator().manual_seed(seed))
    visible[0] = n
    return (q, keys, w, visible), [(q[m:m + 1], keys[:v], w[m:m + 1], visible[m:m + 1])
                                   for m, v in enumerate(visible.tolist())]


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
    else:  # compress
        args = (randn(M, 8, 160, seed=seed), randn(M, 8, 160, seed=seed + 1))
        rows = (0, 1)
    return args, [tuple(a[m:m + 1] if i in rows else a for i, a in enumerate(args)) for m in range(M)]


CASES = {"sparse_attention": attention_case, "moe": lambda M, seed: moe_case(M, seed, hashed=False),
         "moe_hashed": lambda M, seed: moe_case(M, seed, hashed=True),
         **{op: (lambda M, seed, op=op: row_case(op, M, seed)) for op in ("hc_pre", "hc_post", "rope_tail",
                                                                           "compress")}}


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
            for b, s in zip(*(o if isinstance(o, tuple) else (o,) for o in (batched, single)), strict=True):
                assert torch.equal(b[m:m + 1], s), (case, M, m)


def test_indexer_scores_equal_one_row_calls():
    """Indexer scoring (model glue, not a registry op): for every M in 1..SMALL_M each query's scores of
    the keys it sees equal those of its decode call, which scores only those keys."""
    for M in range(1, SMALL_M + 1):
        batched_args, single_args = index_case(M, seed=M)
        batched = index_scores(*batched_args)
        for m, args in enumerate(single_args):
            single = index_scores(*args)
            assert torch.equal(batched[m:m + 1, :single.shape[1]], single), (M, m)


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
