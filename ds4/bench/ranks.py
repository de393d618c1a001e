"""ranks: a GGUF file on N ranks: memory and speed per rank, and the prefill collective (all_reduce vs all-to-all).

`torchrun --nproc-per-node N scripts/bench.py ranks --model FILE --parallel ep` (N = 1 also under torchrun, or
plain `python scripts/bench.py ranks --model FILE` in one process) maps the file on every rank (each places only
its share), then rank 0 prints one row per rank: expert bytes held, resident memory after the load and at its
peak after a `--prompt`-token prefill and `--decode` greedy steps, and the prefill and decode speed.

With `--collectives M,M,...` it also prints, per prefill of M rows, the two ways of combining the ranks' routed-expert
outputs of one MoE layer ([M, dim] float32), timed over `--reps` calls after one warm-up:
- `all_reduce`: what the model does; a ring all_reduce sends 2(N-1)/N of the M rows from every rank;
- `all_to_all`: each rank sends only the rows routed to at least one expert it owns (the routing of the file's
  first MoE layer on the embeddings of random token ids) to every other rank, which adds them at their indices
  (`all_to_all_single` with uneven splits; the row indices are known everywhere: the router is replicated).
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist

import ds4
from backends.registry import PARALLEL
from ds4 import distributed
from ds4.bench.common import fmt
from ds4.errors import UsageError
from models.deepseek_v4 import owned_experts
from ops import moe as moe_ref


def rss_gb() -> float:
    """This process's resident memory now (GB)."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb * 1024 / 1e9


def expert_bytes(engine: ds4.Engine) -> int:
    """Bytes of the routed expert stacks this rank holds (trunk and MTP block)."""
    blocks = [layer.experts for layer in engine.model.layers] + ([engine.mtp.block.experts] if engine.mtp else [])
    return sum(w.data.nbytes for ex in blocks for w in (ex.gate, ex.up, ex.down))


def rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """One row per rank (memory, speed), then the collective rows."""
    if args.prompt < 1 or args.decode < 1:
        raise UsageError("--prompt and --decode must be >= 1")
    sizes = [int(m) for m in args.collectives.split(",")] if args.collectives else []
    engine = ds4.load(args.model, args.mtp, args.backend, ctx=args.prompt + args.decode + 2, parallel=args.parallel)
    world = engine.world
    loaded = rss_gb()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, engine.args.vocab_size, (args.prompt,), generator=g).tolist()
    t0 = time.perf_counter()
    stream = engine.generate(prompt, max_tokens=args.decode + 1, mtp_draft=0)
    next(stream)
    t1 = time.perf_counter()
    decoded = sum(1 for _ in stream)
    t2 = time.perf_counter()
    mine = {"rank": world.rank if world else 0, "ranks": world.size if world else 1,
            "threads": torch.get_num_threads(), "expert_GB": f"{expert_bytes(engine) / 1e9:.4g}",
            "rss_loaded_GB": f"{loaded:.4g}",
            "peak_rss_GB": f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.4g}",  # KiB on Linux
            "prefill_tok_s": fmt(args.prompt / (t1 - t0)), "decode_tok_s": fmt(decoded / (t2 - t1))}
    every = distributed.gather(world, mine) if world else [mine]
    table = every + [collective_row(engine, m, args.reps) for m in sizes]
    columns = list(dict.fromkeys(c for row in table for c in row))   # one table: "-" where a kind has no figure
    return [{c: row.get(c, "-") for c in columns} for row in table] if world is None or world.is_main else []


def collective_row(engine: ds4.Engine, m: int, reps: int) -> dict:
    """The two ways of combining an M-row prefill's expert outputs across the ranks: bytes sent and time."""
    world, dim = engine.world, engine.args.dim
    size = world.size if world else 1
    rank = world.rank if world else 0
    ids = torch.randint(1, engine.args.vocab_size, (m,), generator=torch.Generator().manual_seed(m))
    ex = engine.model.layers[0].experts
    x = torch.randn(m, dim, generator=torch.Generator().manual_seed(2))   # hash layers route by `ids` alone
    chosen, _ = moe_ref.route(x, ids, ex)
    owner = torch.tensor([r for r in range(size) for _ in owned_experts(engine.args.n_experts, r, size)])
    owners = owner[chosen]                                            # [M, top_k] the rank owning each choice
    rows_of = [torch.nonzero((owners == r).any(-1)).flatten() for r in range(size)]
    partial = torch.randn(m, dim)
    reduce_s = timed(lambda: dist.all_reduce(partial.clone()) if world else None, reps)

    def exchange() -> torch.Tensor:
        send = partial[rows_of[rank]].repeat(size - 1, 1) if size > 1 else partial[:0]
        splits_in = [0 if r == rank else len(rows_of[rank]) for r in range(size)]
        splits_out = [0 if r == rank else len(rows_of[r]) for r in range(size)]
        got = torch.empty(sum(splits_out), dim)
        if world:
            dist.all_to_all_single(got, send, splits_out, splits_in)
        out = partial.clone()
        for r, chunk in zip(range(size), got.split(splits_out), strict=True):
            if r != rank:
                out.index_add_(0, rows_of[r], chunk)
        return out

    a2a_s = timed(exchange, reps)
    bytes_row = dim * 4
    return {"ranks": size, "collective_rows": m,
            "all_reduce_MB_sent": f"{2 * (size - 1) / size * m * bytes_row / 1e6:.4g}",
            "all_reduce_ms": fmt(reduce_s * 1e3),
            "all_to_all_MB_sent": f"{(size - 1) * len(rows_of[rank]) * bytes_row / 1e6:.4g}",
            "all_to_all_ms": fmt(a2a_s * 1e3), "all_to_all_vs_all_reduce": f"{reduce_s / a2a_s:.2f}x"}


def timed(call, reps: int) -> float:
    """Median seconds of `call` over `reps` calls after one warm-up."""
    call()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def add_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the ranks benchmark."""
    p.add_argument("--model", help="base GGUF (default: the embedded tiny model)")
    p.add_argument("--mtp", help="MTP GGUF (default: none with --model)")
    p.add_argument("--backend", default="auto", help="auto | torch | cpu | triton")
    p.add_argument("--prompt", type=int, default=16, help="prefill tokens (default 16)")
    p.add_argument("--decode", type=int, default=4, help="greedy decode steps timed (default 4)")
    p.add_argument("--collectives", default="", metavar="M,M,...",
                   help="also time the prefill collective for these row counts (e.g. 64,512,2048)")
    p.add_argument("--parallel", choices=PARALLEL, default=None,
                   help="split the model over the ranks torchrun started (docs/distributed.md)")
