"""Expert and tensor parallelism (docs/distributed.md): the moe contract's owned range on every backend, the
tensor-parallel split's refusals, and two ranks on gloo (spawned here, one CPU thread each) against one process.

Tolerance: the ranks' partial sums (experts; under tp also attention heads, indexer heads and the shared
expert's rows) are added by the all_reduce in another order than one process adds them, so logits agree within
1e-4 · max|logits| (measured: ep 6e-7, tp 2e-5), and greedy, strict speculative and seeded sampled tokens are
equal. Each rank holds half the routed experts' bytes; under tp also half the attention, indexer, shared
expert, embedding and LM head bytes.
"""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import ds4
from backends.registry import OpSet
from ds4 import distributed
from ds4.errors import BackendUnavailable, ParallelError, UsageError
from ds4.tiny.random_model import random_args
from models.deepseek_v4 import experts_slice, owned_experts
from models.tensor_parallel import TensorSplit, splits, tensor_split
from ops.moe import Experts
from ops.quants import QTensor

MODES = ("ep", "tp")
E, VOCAB, PROMPT = 16, 50, list(range(3, 27))   # 24 prompt tokens: a prefill above 16 rows (grouped experts)
RUNS = {  # name -> generate() arguments
    "greedy": {"mtp_draft": 0},
    "speculative": {"mtp_draft": 1},
    "strict": {"mtp_draft": 2, "strict": True},
    "sampled": {"mtp_draft": 1, "temperature": 0.9, "top_k": 20, "seed": 7},
}


def randn(*shape: int, seed: int) -> torch.Tensor:
    """Seeded standard normal samples."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def experts(owned: range, hashed: bool, d: int = 64, inter: int = 32, top_k: int = 4) -> Experts:
    """Random experts (Q8_0 stacks) of which the stacks hold only `owned`: views into whole stacks whose other
    experts are NaN, so a rank that reads another rank's expert fails."""
    def stack(*shape, seed):
        whole = QTensor.quantize(randn(E, *shape, seed=seed) * 0.3, "Q8_0", "stack")
        poisoned = whole.data.clone()
        poisoned[:owned.start], poisoned[owned.stop:] = 0xFF, 0xFF   # float16 scales of 0xFFFF: NaN
        return experts_slice(QTensor(whole.qtype, whole.shape, poisoned, "stack"), owned)
    return Experts(
        router=QTensor.quantize(randn(E, d, seed=0), "F32", "router"), bias=None if hashed else randn(E, seed=1) * 0.1,
        tid2eid=torch.randint(0, E, (VOCAB, top_k), generator=torch.Generator().manual_seed(2)) if hashed else None,
        gate=stack(inter, d, seed=3), up=stack(inter, d, seed=4), down=stack(d, inter, seed=5),
        top_k=top_k, route_scale=1.5, normalize=True, clamp=1.0, first=owned.start)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("m", [3, 20])   # decode/verify rows and a prefill
@pytest.mark.parametrize("hashed", [False, True])
def test_owned_ranges_sum_to_the_whole_moe(backend, m, hashed):
    """Each rank's moe adds only its experts: the ranks' outputs sum to the single-process output. On the cpu
    backend rows of 128 values take the kernel's grouped Q8_0 path (the interpreter keeps Triton's smaller)."""
    ops, d, inter = OpSet(backend), *((128, 128) if backend == "cpu" else (64, 32))
    x, ids = randn(m, d, seed=9), torch.randint(0, VOCAB, (m,), generator=torch.Generator().manual_seed(8))
    whole = ops.moe(x, ids, experts(range(E), hashed, d, inter))
    parts = [ops.moe(x, ids, experts(owned_experts(E, r, 2), hashed, d, inter)) for r in range(2)]
    assert not torch.equal(parts[0], whole)   # each rank's share is only a part
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=0, atol=1e-5 * whole.abs().max().item())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q2_K", "IQ2_XXS"])
def test_cpu_kernel_gives_zero_for_an_expert_another_rank_holds(qtype):
    """Expert -1 (another rank's) is a zero row on every path of the fused kernel, the grouped ones included."""
    from backends.cpu import kernels
    if not kernels.available(qtype, 256):
        pytest.skip("the cpu kernel library is not built here")
    w = QTensor.quantize(randn(2, 8, 256, seed=1), qtype, "stack")
    y = kernels.qgemv(randn(3, 256, seed=2), w, torch.tensor([1, -1, 0]))
    assert torch.equal(y[1], torch.zeros(8)) and y[0].abs().sum() > 0 and y[2].abs().sum() > 0


def test_an_owned_range_outside_the_router_and_mlx_refuse():
    x, ids = randn(2, 64, seed=9), torch.zeros(2, dtype=torch.int64)
    ex = experts(range(8, 16), False)
    bad = Experts(**{**vars(ex), "first": 12})
    with pytest.raises(ValueError, match=r"owned experts \[12, 20\) fall outside the router's 16"):
        OpSet("torch").moe(x, ids, bad)
    pytest.importorskip("mlx.core")
    from backends.mlx.linear import moe as mlx_moe
    with pytest.raises(ValueError, match="expert parallelism runs on the torch family"):
        mlx_moe(x, ids, ex)
    with pytest.raises(BackendUnavailable, match="MLX runs in one process"):
        OpSet("mlx", device="mlx", parallel="ep")


def test_owned_experts_partition_every_expert():
    for n_experts, world in ((16, 2), (256, 8), (10, 4), (8, 3)):
        ranges = [owned_experts(n_experts, r, world) for r in range(world)]
        assert [e for r in ranges for e in r] == list(range(n_experts))


def test_parallel_without_torchrun_says_how_to_start(monkeypatch, tiny_gguf):
    for key in distributed.TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(UsageError, match=r"torchrun --nproc-per-node N scripts/generate.py \.\.\. --parallel ep"):
        ds4.load(*tiny_gguf, parallel="ep")
    with pytest.raises(UsageError, match=r"--parallel tp runs one process per rank, started by torchrun"):
        ds4.load(*tiny_gguf, parallel="tp")
    with pytest.raises(UsageError, match="--parallel must be ep or tp, got 'pp'"):
        ds4.load(*tiny_gguf, parallel="pp")
    with pytest.raises(BackendUnavailable, match="needs torch.distributed initialised"):
        OpSet("torch", parallel="ep")


def test_generate_parallel_without_torchrun_is_one_error_line(monkeypatch, capsys):
    from tests.script_modules import script
    for key in distributed.TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    assert script("generate").main(["--parallel", "ep", "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --parallel ep runs one process per rank, started by torchrun") and "\n" == err[-1]


def test_a_count_the_ranks_do_not_divide_is_refused():
    """tp splits vocabulary rows, heads, groups and shared expert rows evenly, and columns in whole quant blocks."""
    with pytest.raises(UsageError, match=r"cannot split the 512 vocabulary rows over 3 ranks: use a number of ranks "
                                         r"that divides 512 \(or --parallel ep\)"):
        tensor_split(random_args(tiny=True), 0, 3)
    with pytest.raises(UsageError, match="cannot split the 4 attention heads over 3 ranks"):
        tensor_split(random_args(tiny=True, vocab_size=513), 0, 3)
    w = QTensor.quantize(randn(8, 512, seed=0), "Q4_K", "blk.0.attn_output_b.weight")
    with pytest.raises(UsageError, match=r"each 128 of the 512 columns of blk.0.attn_output_b.weight \(Q4_K\), "
                                         "which cuts its blocks of 256 values"):
        TensorSplit(1, 4, splits(random_args(tiny=True))).weight("attn_output_b.weight", w)
    half = tensor_split(random_args(tiny=True), 1, 2).weight("attn_output_b.weight", w)
    torch.testing.assert_close(half.dequantize(), w.dequantize()[:, 256:], rtol=0, atol=0)


def test_every_split_tensor_is_a_model_tensor():
    from models.args import block_shapes, model_shapes
    args = random_args(tiny=True)
    known = {*model_shapes(args), *block_shapes(args, "", 4, False)}
    assert set(splits(args)) <= known


def held_bytes(engine) -> dict[str, int]:
    """Bytes this process holds of each part of the model (trunk and MTP block)."""
    layers = [*engine.model.layers, engine.mtp.block]
    indexers = [L.indexer for L in layers if L.indexer is not None]
    parts = {"experts": [w for L in layers for w in (L.experts.gate, L.experts.up, L.experts.down)],
             "attention": [w for L in layers for w in (L.q_b, L.output_a, L.output_b)],
             "indexer": [w for ix in indexers for w in (ix.q_b, ix.proj)],
             "shared expert": [w for L in layers for w in L.shared],
             "embedding": [engine.model.embedding], "LM head": [engine.model.output],
             "replicated": [w for L in layers for w in (L.q_a, L.kv, L.hc_attn.fn, L.experts.router)]}
    return {name: sum(w.data.nbytes for w in ws) for name, ws in parts.items()}


def generations(paths: tuple[str, str], parallel: str | None) -> dict:
    """Every run of RUNS on one model: token ids (and the greedy run's logits), plus the bytes held."""
    engine = ds4.load(*paths, "auto", ctx=64, prefill_chunk=16, parallel=parallel)
    out = {"bytes": held_bytes(engine)}
    for name, kwargs in RUNS.items():
        logits = []
        out[name] = [t.id for t in engine.generate(PROMPT, max_tokens=12, on_logits=logits.append, **kwargs)]
        if name == "greedy":
            out["logits"] = torch.stack(logits)
    return out


def steps_read_nothing_back(paths: tuple[str, str], parallel: str) -> bool:
    """A decode, an MTP draft and a 4-row verify of the parallel model under tests/test_no_sync.py's guard."""
    from test_no_sync import guarded

    from models.deepseek_v4 import DeepseekV4
    from models.mtp import MTPHead
    engine = ds4.load(*paths, "auto", ctx=64, prefill_chunk=16, parallel=parallel)
    session = engine.session()
    session.prefill(PROMPT)
    real = DeepseekV4.forward, MTPHead.forward
    DeepseekV4.forward, MTPHead.forward = guarded(real[0]), guarded(real[1])
    try:
        session.decode(5)
        session.mtp_draft(6)
        session.forward([7, 8, 9, 10], "all")
    finally:
        DeepseekV4.forward, MTPHead.forward = real
    return True


def bench_rows(parallel: str) -> list[dict]:
    """`bench.py model --parallel ep|tp` at smoke size (the tiny model's sizes, 2 layers, torch backend)."""
    import argparse
    import warnings

    from ds4.bench import model
    parser = argparse.ArgumentParser()
    model.add_args(parser, on_gpu=False)
    args = parser.parse_args(["--mix", "q2", "--layers", "2", "--tiny", "--prompt", "3", "--decode", "2",
                              "--backend", "torch", "--parallel", parallel])
    args.reps = 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.rows(args, torch.device("cpu"))


def rank_main(rank: int, port: int, models: dict[str, tuple[str, str]], other: tuple[str, str], out_dir: str) -> None:
    """One rank: a start-up with mismatched files (every rank must refuse), the runs on each model, then rank 1
    stops answering and rank 0's next collective must fail, not hang."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS4_DIST_CHECK="1", DS4_DIST_TIMEOUT="20")
    torch.set_num_threads(1)
    out = {}
    try:
        ds4.load(*(other if rank == 1 else models["tiny"]), parallel="ep")
    except ParallelError as e:
        out["mismatch"] = str(e)
    for mode in MODES:
        for name, paths in models.items():
            out[mode, name] = generations(paths, mode)
        out[mode, "no_host_reads"] = steps_read_nothing_back(models["tiny"], mode)
        out[mode, "bench"] = bench_rows(mode)
    world = distributed.start("ep", None)[0]
    if rank == 1:
        torch.save(out, f"{out_dir}/rank1.pt")
        os._exit(0)   # a rank that dies
    try:
        distributed.check_same(world, 1, "after rank 1 stopped")
    except ParallelError as e:
        out["dead_rank"] = str(e)
    torch.save(out, f"{out_dir}/rank0.pt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def models(tiny_gguf, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """The tiny model (8 experts of 2 per token) and a small V4 with 16 experts of 4 per token (F32: writing a
    quantized mix costs a minute; the quantized expert paths are checked by the moe test above)."""
    from ds4.tiny.build import write_tiny
    d = tmp_path_factory.mktemp("ep")
    paths = (str(d / "e16.gguf"), str(d / "e16-mtp.gguf"))
    write_tiny(*paths, mix="f32", seed=1, n_experts=16, n_experts_used=4)
    return {"tiny": tiny_gguf, "experts16": paths}


@pytest.fixture(scope="module")
def two_ranks(models, tmp_path_factory) -> dict[int, dict]:
    """What each of two spawned gloo ranks saw."""
    from ds4.tiny.build import write_tiny
    d = tmp_path_factory.mktemp("other")
    other = (str(d / "other.gguf"), str(d / "other-mtp.gguf"))
    write_tiny(*other, mix="f32", seed=5)   # same shapes as the tiny model, other weights
    port, out_dir = free_port(), tmp_path_factory.mktemp("ranks")
    procs = [mp.get_context("spawn").Process(target=rank_main, args=(r, port, models, other, str(out_dir)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    return {r: torch.load(out_dir / f"rank{r}.pt") for r in range(2)}


SPLIT = {"ep": {"experts"}, "tp": {"experts", "attention", "indexer", "shared expert", "embedding", "LM head"}}


@pytest.fixture(scope="module")
def one_process(models) -> dict[str, dict]:
    """Every model's runs in this process alone."""
    return {name: generations(paths, None) for name, paths in models.items()}


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_match_one_process(models, one_process, two_ranks, mode):
    for name in models:
        single = one_process[name]
        # every rank sees the same logits (tp: after the head's all_gather), so every rank decides alike
        assert torch.equal(two_ranks[0][mode, name]["logits"], two_ranks[1][mode, name]["logits"])
        for rank in (0, 1):
            got = two_ranks[rank][mode, name]
            for run in RUNS:
                assert got[run] == single[run], (name, rank, run)
            ref = single["logits"]
            torch.testing.assert_close(got["logits"], ref, rtol=0, atol=1e-4 * ref.abs().max().item())
            for part, held in got["bytes"].items():   # the split parts halve, the rest is replicated
                assert held * (2 if part in SPLIT[mode] else 1) == single["bytes"][part], (name, rank, part)


@pytest.mark.parametrize("mode", MODES)
def test_parallel_steps_read_nothing_back(two_ranks, mode):
    """The collectives add no host read to a decode or verify step (the sync guard on the model's code)."""
    assert two_ranks[0][mode, "no_host_reads"] and two_ranks[1][mode, "no_host_reads"]


@pytest.mark.parametrize("mode", MODES)
def test_bench_model_parallel_smoke(two_ranks, mode):
    """Rank 0 prints one row with the ranks and its expert bytes (half the tiny model's); rank 1 prints nothing."""
    assert two_ranks[1][mode, "bench"] == []
    (row,) = two_ranks[0][mode, "bench"]
    assert row["ranks"] == 2 and float(row["decode_tok_s"]) > 0 and float(row["peak_rss_GB"]) > 0
    import warnings

    from ds4.cost import tensor_bytes
    from ds4.tiny.random_model import random_args
    from models.args import model_shapes
    from models.deepseek_v4 import ROUTED
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = sum(tensor_bytes(n, s, "q2") for n, s in model_shapes(random_args(2, tiny=True)).items()
                   if n.endswith(ROUTED))
    assert float(row["expert_GB"]) * 1e9 == pytest.approx(full / 2, rel=1e-3)
    if mode == "tp":   # the vocabulary, heads and shared expert split too
        assert float(row["weight_GB"]) < float(two_ranks[0]["ep", "bench"][0]["weight_GB"])


def test_mismatched_files_fail_on_every_rank(two_ranks):
    for rank in (0, 1):
        assert "the ranks of this run disagree on model file" in two_ranks[rank]["mismatch"]


def test_a_dead_rank_fails_the_next_collective(two_ranks):
    assert "rank 0 of 2: a collective failed" in two_ranks[0]["dead_rank"]
