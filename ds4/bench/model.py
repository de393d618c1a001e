"""model: prefill and decode tokens/s of a random-weight V4 Flash against its decode roofline.

The whole model at V4 Flash shapes (or its first `--layers N`) with random weights stored in a
mix (q2, q4), built on the device from the shape schema (ds4/tiny/random_model.py): prefill tokens/s for a
`--prompt`-token prompt, decode tokens/s over `--decode` one-token steps (fixed token ids, so no
sampling readback), the decode step's weight bytes (ds4/cost.py) and the roofline they imply at the
copy bandwidth measured in the same run (tokens/s = copy bytes per second / step bytes), and the
decode time per layer. Kernels are compiled by a warm-up run on separate caches before timing.
`--cuda-graphs` replays each decode step from a CUDA graph on the fixed plan (ds4/cuda_graphs.py), recorded by
the warm-up run on the same caches; without CUDA the steps go through the graphs' static buffers unrecorded
(a check that the path runs, said on stderr, not a figure).

With `--parallel ep` (under torchrun: `torchrun --nproc-per-node N scripts/bench.py model --parallel ep`) each
rank builds and runs only its share of the routed experts (`tp`: also of the vocabulary, the heads and the shared
expert); rank 0 prints the row, with the ranks, the threads per rank, and the largest expert bytes, weight
bytes and peak resident memory of any rank.
"""
from __future__ import annotations

import argparse
import dataclasses
import resource
import sys
import time
import warnings
from collections.abc import Iterator

import torch

from backends.registry import OpSet
from ds4 import distributed
from ds4.bench.common import copy_bandwidth, fmt, machine, synchronize
from ds4.cost import PassCost
from ds4.cuda_graphs import StepGraphs
from ds4.errors import UsageError
from ds4.tiny.random_model import random_args, random_model
from ds4.weights import repack_at_load
from ops.quants import QTensor


def rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Prefill and decode speed of the random-weight model against its decode roofline."""
    if args.layers is not None and args.layers < 1 or args.prompt < 1 or args.decode < 1:
        raise UsageError("--layers, --prompt and --decode must be >= 1")
    with warnings.catch_warnings():
        if args.tiny:  # tiny rows are too short for the block types: stored as F16, as the mix warns
            warnings.simplefilter("ignore", UserWarning)
        margs = random_args(args.layers, tiny=args.tiny)
        world = None
        if args.parallel:
            world, where = distributed.start(args.parallel, None if device.type == "cpu" else str(device))
            device = torch.device(where)
        ops = OpSet(args.backend, device="mlx" if args.backend == "mlx" else str(device), parallel=args.parallel,
                    cpu_dot=args.cpu_dot)
        model = random_model(margs, args.mix, ops, seed=0)
        if device.type == "cpu" and args.cpu_dot == "q8" and not (args.parallel or args.cuda_graphs):
            repack_at_load(model)    # the weights are in this process's memory: ds4.load's load-time repacks
        step_bytes = PassCost(margs, args.mix).target_pass(1)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, margs.vocab_size, (args.prompt,), generator=g).tolist()
    steps = torch.randint(1, margs.vocab_size, (args.decode,), generator=g).tolist()
    ctx = args.prompt + args.decode + 1

    def finish(caches, logits=None) -> None:
        """Wait for queued work: the CUDA stream; on MLX, evaluate the lazy graph (the logits, as the decoder's
        read would, or, with `caches`, every cache array too)."""
        if ops.arrays.family != "mlx":
            if caches is not None:
                synchronize(device)
            return
        import mlx.core as mx
        mx.eval(logits, *[a for c in caches or [] for a in vars(c).values() if isinstance(a, mx.array)])

    graphs, kept = None, None
    if args.cuda_graphs:  # graphs record the caches' addresses: one set of caches for the warm-up and the timing
        if ops.arrays.family == "mlx":
            raise UsageError("--cuda-graphs records CUDA kernels; it does not apply to --backend mlx")
        graphs = StepGraphs(model.run, state_arg=2, capture=device.type == "cuda")
        kept = model.new_caches(ctx, max(args.prompt, 16))
        if device.type != "cuda":
            print("# --cuda-graphs without CUDA: steps run through the static buffers, nothing is recorded",
                  file=sys.stderr)
    step = {"step": "fixed", "runner": graphs} if graphs else {}

    def run(n_decode: int) -> tuple[float, float]:
        caches = kept or model.new_caches(ctx, max(args.prompt, 16))
        synchronize(device)
        start = time.perf_counter()
        finish(caches, model.forward(prompt, 0, caches, [args.prompt - 1])[1])
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for i, tok in enumerate(steps[:n_decode]):
            finish(None, model.forward([tok], args.prompt + i, caches, [0], **step)[1])
        finish(caches)
        return prefill, time.perf_counter() - start

    run(min(2, args.decode))                                   # warm-up: compile every kernel
    prefill_s, decode_s = run(args.decode)
    if world is not None:
        shares = distributed.gather(world, (expert_bytes(model), weight_bytes(model),
                                            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
        if not world.is_main:
            return []   # rank 0 prints
    print(ops.format_report(), file=sys.stderr)
    copy = copy_bandwidth(device, args.reps)
    decode_tok_s = args.decode / decode_s
    roofline = copy / step_bytes
    print(f"# {machine(device)}", file=sys.stderr)
    name = torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"
    name = ops.device if ops.arrays.family == "mlx" else name
    rows = [{"device": name, "mix": args.mix, "layers": margs.n_layers,
             "prompt": args.prompt, "prefill_tok_s": fmt(args.prompt / prefill_s), "decode_tok_s": fmt(decode_tok_s),
             "ms_per_layer": fmt(1e3 * decode_s / args.decode / margs.n_layers),
             "step_GB": f"{step_bytes / 1e9:.4g}", "copy_GB_s": fmt(copy / 1e9), "roofline_tok_s": fmt(roofline),
             "pct_roofline": fmt(100 * decode_tok_s / roofline)}]
    if world is not None:
        rows[0] |= {"ranks": world.size, "threads": torch.get_num_threads(),
                    "expert_GB": f"{max(b for b, _, _ in shares) / 1e9:.4g}",
                    "weight_GB": f"{max(b for _, b, _ in shares) / 1e9:.4g}",
                    "peak_rss_GB": f"{max(kb for _, _, kb in shares) / 1e6:.4g}"}   # ru_maxrss: KiB on Linux
    if args.png:
        plot_model(rows, args.png)
    return rows


def expert_bytes(model) -> int:
    """Bytes of the routed expert stacks a model (or an expert-parallel rank of it) holds."""
    return sum(w.data.nbytes for L in model.layers for w in (L.experts.gate, L.experts.up, L.experts.down))


def weight_bytes(model) -> int:
    """Bytes of every quantized weight a model (or a parallel rank of it) holds."""
    return sum(w.data.nbytes for w in quantized([model.embedding, model.output, model.head, model.layers]))


def quantized(obj) -> Iterator[QTensor]:
    """Every QTensor in `obj` and the records (dataclasses), lists and tuples it holds."""
    if isinstance(obj, QTensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from quantized(item)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from quantized(getattr(obj, f.name))


def plot_model(rows: list[dict], path: str) -> None:
    """Bar chart of decode tokens/s against the roofline, one pair per row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['device']} {r['mix']} {r['layers']}L" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.5 + 1.6 * len(rows), 3.5))
    ax.bar([i - 0.2 for i in x], [float(r["decode_tok_s"]) for r in rows], 0.4, label="decode")
    ax.bar([i + 0.2 for i in x], [float(r["roofline_tok_s"]) for r in rows], 0.4, label="roofline (copy bandwidth)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def add_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the model benchmark."""
    p.add_argument("--mix", choices=("q2", "q4"), default="q2", help="tensor-type mix (default q2)")
    p.add_argument("--layers", type=int, default=None, help="first N layers only (default: all 43)")
    p.add_argument("--tiny", action="store_true", help="the tiny model's sizes instead of V4 Flash's (smoke test)")
    p.add_argument("--prompt", type=int, default=512 if on_gpu else 16, help="prefill tokens")
    p.add_argument("--decode", type=int, default=64 if on_gpu else 4, help="decode steps timed")
    p.add_argument("--backend", default="auto", help="auto (Triton on CUDA) | torch | triton | mlx")
    p.add_argument("--parallel", choices=("ep", "tp"), default=None,
                   help="split the routed experts (ep), and also the vocabulary, heads and shared expert (tp), over "
                        "the ranks torchrun started (docs/distributed.md)")
    p.add_argument("--png", default=None, help="also draw decode vs roofline into this PNG")
    p.add_argument("--cuda-graphs", action="store_true", help="replay decode steps from CUDA graphs (CUDA)")
    p.add_argument("--cpu-dot", choices=("exact", "q8"), default="exact",
                   help="cpu backend's quantized products: exact (default) or q8 activations (docs/cpu.md)")
