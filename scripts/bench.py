"""Benchmarks: `python scripts/bench.py <op> [options]`; each op is one entry in COMMANDS (`cpu`: the
end-to-end CPU benchmark against transformers, scripts/bench_cpu.py).

qmatmul: per quant type, weight shape N x K (out x in) and row count M, the time of one call, the
effective bandwidth (weight bytes / time), its share of the device's copy bandwidth measured in the
same run (bytes read + written by a device-to-device copy, per second), and the speed-up over the
PyTorch baseline (dequantize, then one torch.matmul). On CUDA, calls are replayed in a CUDA graph
over enough weight copies to defeat L2, so the figures are kernel time from DRAM. On a machine
without CUDA only the torch reference runs, in a quick mode by default; Triton figures need a GPU.
`--backend mlx` times the MLX qmatmul (weights in their MLX format, each call evaluated) on MLX's default
device, against the same torch CPU baseline.

moe, indexer, argmax: the Triton kernels of those ops at V4 Flash sizes (routed experts with the q2
mix's stacks and the shared expert; index scores and top-512; verify argmax over the vocabulary), each
with the PyTorch reference's time beside it and the ratio. Without CUDA only the reference runs, at
smaller sizes in quick mode.

model: the whole model at V4 Flash shapes (or its first `--layers N`) with random weights stored in a
mix (q2, q4), built on the device from the shape schema (ds4/random_model.py): prefill tokens/s for a
`--prompt`-token prompt, decode tokens/s over `--decode` one-token steps (fixed token ids, so no
sampling readback), the decode step's weight bytes (ds4/cost.py) and the roofline they imply at the
copy bandwidth measured in the same run (tokens/s = copy bytes per second / step bytes), and the
decode time per layer. Kernels are compiled by a warm-up run on separate caches before timing.
"""
from __future__ import annotations

import argparse
import csv
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `scripts.*` from any working directory

import torch  # noqa: E402

from ds4.errors import Ds4Error, UsageError  # noqa: E402
from ops.quants import QTensor, get  # noqa: E402

QMATMUL_TYPES = ("F16", "BF16", "Q8_0", "Q4_K", "Q2_K", "IQ2_XXS", "MXFP4", "FP8_E4M3")
QMATMUL_SHAPES = ("4096x2048", "2048x4096", "4096x1024", "4096x129280")
QMATMUL_M = (1, 2, 4, 8, 16, 512)
QMATMUL_QUICK_SHAPES, QMATMUL_QUICK_M = ("4096x2048",), (1, 8, 512)  # --quick defaults (CPU)


def machine(device: torch.device) -> str:
    """One line naming the device, driver and library versions."""
    try:
        import triton
        versions = f"torch {torch.__version__}, triton {triton.__version__}"
    except ImportError:  # the torch reference needs no triton (e.g. on macOS)
        versions = f"torch {torch.__version__}, no triton"
    if device.type != "cuda":
        return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads), {versions}"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                check=False, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        driver = "unknown"
    return f"{torch.cuda.get_device_name(device)}, driver {driver}, CUDA {torch.version.cuda}, {versions}"


def seconds(calls: list[Callable[[], object]], device: torch.device, reps: int) -> float:
    """Median time of one call.

    On CUDA all `calls` (the same work on distinct buffers, together larger than L2) are replayed
    in a CUDA graph, so neither Python launch overhead nor a warm L2 inflates the figure; if the
    work cannot be captured, triton's do_bench times the first call (it flushes L2 between calls).
    On CPU: one warm-up call, then `reps` timed calls of the first.
    """
    if device.type == "cuda":
        import triton.testing

        try:
            total = triton.testing.do_bench_cudagraph(lambda: [call() for call in calls], return_mode="median")
            return total / 1e3 / len(calls)
        except RuntimeError as e:
            print(f"# CUDA graph capture failed ({e}); timing with do_bench", file=sys.stderr)
            return triton.testing.do_bench(calls[0], return_mode="median") / 1e3
    calls[0]()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        calls[0]()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def l2_copies(nbytes: int, device: torch.device) -> int:
    """How many copies of an `nbytes` buffer it takes to exceed four times the L2 cache (1 on CPU)."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return min(64, -(-4 * l2 // nbytes))


def copy_bandwidth(device: torch.device, reps: int) -> float:
    """Bytes per second moved (read + written) by a device-to-device copy of a large buffer."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds([lambda: dst.copy_(src)], device, reps)


def emit(rows: list[dict], as_csv: bool) -> None:
    """Print rows as an aligned table, or as CSV."""
    if as_csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        return
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in rows[0]}
    print("  ".join(c.rjust(w) for c, w in widths.items()))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in widths.items()))


def fmt(value: float) -> str:
    """A figure with three significant digits at least, without exponent notation."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3f}"


def parse_shape(text: str) -> tuple[int, int]:
    """'4096x2048' -> (4096, 2048), meaning N (out) x K (in)."""
    try:
        n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--shapes: {text!r} is not NxK (out x in), e.g. 4096x2048") from None
    if n < 1 or k < 1:
        raise UsageError(f"--shapes: {text!r} needs positive N and K")
    return n, k


def random_weight(qtype: str, n: int, k: int, device: torch.device) -> QTensor:
    """An [n, k] weight made of blocks drawn at random from a small pool of quantized random blocks."""
    try:
        qt = get(qtype)
    except KeyError as e:
        raise UsageError(f"--types: {e.args[0]}") from None
    if k % qt.block_size:
        raise UsageError(f"--shapes: K={k} is not a multiple of the {qtype} block size {qt.block_size}")
    g = torch.Generator().manual_seed(0)
    pool = qt.quantize(torch.randn(256, qt.block_size, generator=g))
    picks = torch.randint(len(pool), (n * (k // qt.block_size),), generator=g)
    data = pool[picks].reshape(n, qt.row_bytes(k)).to(device)
    return QTensor(qt, (n, k), data, name=f"bench.{qtype}.{n}x{k}")


def qmatmul_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Time qmatmul for every (type, shape, M) asked for."""
    from backends.registry import OpSet

    if args.backend == "triton" and device.type != "cuda":
        raise UsageError("--backend triton: Triton figures need a CUDA GPU; on this machine use --backend torch")
    shapes = args.shapes or (QMATMUL_QUICK_SHAPES if args.quick else QMATMUL_SHAPES)
    ms = args.m or (QMATMUL_QUICK_M if args.quick else QMATMUL_M)
    opset = OpSet(backend=args.backend, strict=True, device="mlx" if args.backend == "mlx" else str(device))
    op = opset.resolve("qmatmul")[0].fn
    if args.backend == "mlx":  # weights repacked into their MLX format; a call is timed up to its evaluation
        import mlx.core as mx
        device, kernel = torch.device("cpu"), op
        op = lambda x, w: mx.eval(kernel(x, w))  # noqa: E731
        print(f"# MLX {mx.__version__} on {mx.default_device()}; baseline: torch on the CPU")
    copy_bw = copy_bandwidth(device, args.reps)
    print(f"# {machine(device)}\n# device-to-device copy: {copy_bw / 1e9:.1f} GB/s; backend {args.backend}"
          f"{'' if device.type == 'cuda' or args.backend == 'mlx' else ' (Triton figures need a GPU)'}", flush=True)
    rows = []
    for qtype in args.types:
        for n, k in map(parse_shape, shapes):
            w = random_weight(qtype, n, k, device)
            weights = [w] + [QTensor(w.qtype, w.shape, w.data.clone(), w.name)
                             for _ in range(l2_copies(w.data.numel(), device) - 1)]
            placed = [opset.place(c) for c in weights]
            for m in ms:
                x = torch.randn(m, k, device=device)
                xo = opset.array(x, "float32")
                t = seconds([lambda c=c, x=xo: op(x, c) for c in placed], device, args.reps)
                baseline = seconds([lambda c=c, x=x: x @ c.dequantize().T for c in weights], device, args.reps)
                gbps = w.data.numel() / t / 1e9
                rows.append({"type": qtype, "N": n, "K": k, "M": m, "backend": args.backend,
                             "time_us": f"{t * 1e6:.1f}", "GB/s": fmt(gbps),
                             "%copy": fmt(100 * gbps * 1e9 / copy_bw), "x_baseline": f"{baseline / t:.2f}"})
            del w, weights
    return rows


def add_qmatmul_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the qmatmul benchmark."""
    p.add_argument("--types", nargs="+", default=list(QMATMUL_TYPES), metavar="TYPE")
    p.add_argument("--shapes", nargs="+", default=None, metavar="NxK",
                   help=f"weight shapes, out x in (default: {' '.join(QMATMUL_SHAPES)}; "
                        f"--quick: {' '.join(QMATMUL_QUICK_SHAPES)})")
    p.add_argument("--m", nargs="+", type=int, default=None,
                   help=f"rows of x (default: {' '.join(map(str, QMATMUL_M))}; --quick: "
                        f"{' '.join(map(str, QMATMUL_QUICK_M))})")
    p.add_argument("--backend", choices=("torch", "triton", "mlx"), default="triton" if on_gpu else "torch")


def stacked_weight(qtype: str, e: int, n: int, k: int, device: torch.device) -> QTensor:
    """An expert stack [e, n, k] of random blocks (see random_weight)."""
    w = random_weight(qtype, e * n, k, device)
    return QTensor(w.qtype, (e, n, k), w.data.reshape(e, n, -1), name=f"bench.{qtype}.{e}x{n}x{k}")


# spec: raw code prompts for the embedded model, five copy-heavy ones (a passage written several times, so the MTP
# can copy it) and four free ones; each row sums the counters of its kind's prompts
SPEC_PASSAGE = "    for key, value in sorted(items.items()):\n        print(key, value)\n"
SPEC_PROMPTS = {
    "copy": ("def show(items):\n" + SPEC_PASSAGE * 3 + "\n\ndef show_again(items):\n" + SPEC_PASSAGE,
             "def add(a, b):\n    return a + b\n\n" * 3 + "def add(a, b):\n",
             "import os\nimport sys\nimport re\n" * 3 + "import os\n",
             "    if name is None:\n        raise ValueError('name')\n" * 3,
             "x = self.data[key]\ny = self.data[value]\n" * 4),
    "free": ('class Reader:\n    """Read records from a file."""\n\n    def __init__(self, path):\n',
             'def read_config(path):\n    """Read the configuration file at path."""\n',
             "import os\n\n\ndef main():\n",
             "    def __repr__(self):\n"),
}
SPEC_MODES = {"plain": dict(mtp_draft=0), "draft-2 cycle": dict(mtp_draft=2, continuous=False),
              "continuous d1": dict(mtp_draft=1), "d2": dict(mtp_draft=2), "d3": dict(mtp_draft=3),
              "d4": dict(mtp_draft=4), "auto": dict(mtp_draft="auto")}


def spec_row(engine, prompts: tuple[str, ...], kind: str, mode: str, max_tokens: int, **options) -> dict:
    """Generate raw from each of `prompts` and sum the speculative counters, the decode time and cost."""
    from ds4.cost import PassCost
    from ds4.speculative import SpecMetrics
    m, decode_s = SpecMetrics(), 0.0
    for prompt in prompts:
        list(engine.generate(prompt, raw=True, max_tokens=max_tokens, **options))
        m, decode_s = m + engine.stats.spec, decode_s + engine.stats.decode_s
    n = max(m.generated_tokens, 1)
    per_position = [round(a / m.num_drafts, 2) for a in m.accepted_per_position] if m.num_drafts else []
    return {"prompt": kind, "mode": mode, "tokens": m.generated_tokens, "passes/token": f"{m.passes_per_token:.3f}",
            "mean_accept_len": f"{m.mean_acceptance_length:.2f}",
            "accept": f"{m.num_accepted_tokens / m.num_draft_tokens:.0%}" if m.num_draft_tokens else "-",
            "accept_per_pos": " ".join(map(str, per_position)) or "-",
            "tok/s": f"{m.generated_tokens / decode_s:.1f}" if decode_s else "-",
            "MB/token": f"{PassCost(engine.args, 'q2').decode(m) / n / 1e6:.2f}"}


def spec_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Greedy decoding of the copy-heavy and free prompts in every speculative mode, then sampled with/without MTP."""
    import ds4
    if args.tokens < 1 or args.threads < 1:
        raise UsageError(f"--tokens and --threads must be >= 1 (got {args.tokens}, {args.threads})")
    torch.set_num_threads(args.threads)
    engine = ds4.load(args.model, args.mtp, ctx=1024)
    print(f"# {machine(device)}; model {engine.paths[0]}", flush=True)
    rows = [spec_row(engine, SPEC_PROMPTS[kind], kind, mode, args.tokens, **options)
            for kind in SPEC_PROMPTS for mode, options in SPEC_MODES.items()]
    for mode, draft in (("sampled plain", 0), ("sampled MTP d1", 1)):
        rows += [spec_row(engine, SPEC_PROMPTS[kind], kind, mode, args.tokens, mtp_draft=draft, temperature=0.8,
                          seed=0) for kind in SPEC_PROMPTS]
    if args.png:
        plot_spec(rows, args.png)
    return rows


def plot_spec(rows: list[dict], path: str) -> None:
    """Bar chart of target passes per committed token by mode, one bar group per prompt kind."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = list(SPEC_MODES)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for i, kind in enumerate(SPEC_PROMPTS):
        values = [float(r["passes/token"]) for mode in modes for r in rows if r["mode"] == mode and r["prompt"] == kind]
        ax.bar([x + 0.4 * i for x in range(len(modes))], values, width=0.4, label=f"{kind} prompt")
    ax.set_xticks([x + 0.2 for x in range(len(modes))], modes)
    ax.set_ylabel("target passes / committed token")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_spec_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the speculative-decoding benchmark."""
    p.add_argument("--model", help="base GGUF (default: the embedded model)")
    p.add_argument("--mtp", help="MTP GGUF (default: the embedded model's)")
    p.add_argument("--tokens", type=int, default=96, help="tokens generated per run")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--png", help="also write a bar chart of passes per token here")



def kernel_cases(op: str, quick: bool, device: torch.device) -> list[tuple[str, int, str, tuple]]:
    """(case, M, registry op, arguments) of the moe / indexer / argmax benchmarks."""
    from ops.moe import Experts

    cases = []
    ms = (1, 8) if quick else (1, 2, 8, 16, 512)
    if op == "moe":
        n_exp, d, inter = (16, 1024, 512) if quick else (256, 4096, 2048)
        ex = Experts(router=random_weight("F16", n_exp, d, device), bias=torch.zeros(n_exp, device=device),
                     tid2eid=None, gate=stacked_weight("IQ2_XXS", n_exp, inter, d, device),
                     up=stacked_weight("IQ2_XXS", n_exp, inter, d, device),
                     down=stacked_weight("Q2_K", n_exp, d, inter, device),
                     top_k=6, route_scale=1.5, normalize=True, clamp=10.0)
        shared = (random_weight("Q8_0", inter, d, device), random_weight("Q8_0", inter, d, device),
                  random_weight("Q8_0", d, inter, device), 10.0)
        for m in ms:
            x = torch.randn(m, d, device=device)
            ids = torch.zeros(m, dtype=torch.int64, device=device)
            cases.append((f"E={n_exp} D={d} I={inter} top6 iq2/q2k", m, "moe", (x, ids, ex)))
            cases.append((f"shared D={d} I={inter} q8_0", m, "shared_expert", (x, *shared)))
    elif op == "indexer":
        heads, dim, k = 64, 128, 512
        for n in (2048,) if quick else (2048, 16384, 65536):
            keys = torch.randn(n, dim, device=device)
            for m in (1, 16) if quick else (1, 2, 8, 16):
                q, w = torch.randn(m, heads, dim, device=device), torch.randn(m, heads, device=device)
                visible = tuple(n - m + 1 + r for r in range(m))
                scores = torch.randn(m, n, device=device)
                cases.append((f"64x128 over {n} rows", m, "index_scores", (q, keys, w, visible)))
                cases.append((f"top-{k} of {n}", m, "indexer_topk",
                              (scores, k, torch.tensor(visible, device=device))))
    else:
        for m in (1, 16) if quick else (1, 2, 8, 16):
            cases.append(("vocab 129280", m, "verify_argmax", (torch.randn(m, 129280, device=device),)))
    return cases


def kernel_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Time the Triton kernel (CUDA only) and the reference of each case of `args.op`."""
    from backends.registry import implementations

    where = "" if device.type == "cuda" else " (reference alone here)"
    print(f"# {machine(device)}\n# {args.op}: Triton on CUDA only{where}", flush=True)
    rows = []
    for case, m, op, op_args in kernel_cases(args.op, args.quick, device):
        impls = implementations(op)
        ref = seconds([lambda f=impls["torch"].fn, a=op_args: f(*a)], device, args.reps)
        kernel = None
        if device.type == "cuda" and "triton" in impls:
            kernel = seconds([lambda f=impls["triton"].fn, a=op_args: f(*a)], device, args.reps)
        rows.append({"op": op, "case": case, "M": m,
                     "triton_us": "-" if kernel is None else f"{kernel * 1e6:.1f}", "reference_us": f"{ref * 1e6:.1f}",
                     "x_reference": "-" if kernel is None else f"{ref / kernel:.2f}"})
    return rows


def add_kernel_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """The moe / indexer / argmax benchmarks take only the common options."""


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Prefill and decode speed of the random-weight model against its decode roofline."""
    from backends.registry import OpSet
    from ds4.cost import PassCost
    from ds4.random_model import random_args, random_model

    with warnings.catch_warnings():
        if args.tiny:  # tiny rows are too short for the block types: stored as F16, as the mix warns
            warnings.simplefilter("ignore", UserWarning)
        margs = random_args(args.layers, tiny=args.tiny)
        ops = OpSet(args.backend, device="mlx" if args.backend == "mlx" else str(device))
        model = random_model(margs, args.mix, ops, seed=0)
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

    def run(n_decode: int) -> tuple[float, float]:
        caches = model.new_caches(ctx, max(args.prompt, 16))
        synchronize(device)
        start = time.perf_counter()
        finish(caches, model.forward(prompt, 0, caches, [args.prompt - 1])[1])
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for i, tok in enumerate(steps[:n_decode]):
            finish(None, model.forward([tok], args.prompt + i, caches, [0])[1])
        finish(caches)
        return prefill, time.perf_counter() - start

    run(min(2, args.decode))                                   # warm-up: compile every kernel
    prefill_s, decode_s = run(args.decode)
    print(ops.format_report(), file=sys.stderr)
    copy = copy_bandwidth(device, args.reps)
    decode_tok_s = args.decode / decode_s
    roofline = copy / step_bytes
    print(f"# {machine(device)}", file=sys.stderr)
    name = torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"
    name = ops.device if ops.arrays.family == "mlx" else name
    return [{"device": name, "mix": args.mix, "layers": margs.n_layers,
             "prompt": args.prompt, "prefill_tok_s": fmt(args.prompt / prefill_s), "decode_tok_s": fmt(decode_tok_s),
             "ms_per_layer": fmt(1e3 * decode_s / args.decode / margs.n_layers),
             "step_GB": f"{step_bytes / 1e9:.4g}", "copy_GB_s": fmt(copy / 1e9), "roofline_tok_s": fmt(roofline),
             "pct_roofline": fmt(100 * decode_tok_s / roofline)}]


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


def add_model_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the model benchmark."""
    p.add_argument("--mix", choices=("q2", "q4"), default="q2", help="tensor-type mix (default q2)")
    p.add_argument("--layers", type=int, default=None, help="first N layers only (default: all 43)")
    p.add_argument("--tiny", action="store_true", help="the tiny model's sizes instead of V4 Flash's (smoke test)")
    p.add_argument("--prompt", type=int, default=512 if on_gpu else 16, help="prefill tokens")
    p.add_argument("--decode", type=int, default=64 if on_gpu else 4, help="decode steps timed")
    p.add_argument("--backend", default="auto", help="auto (Triton on CUDA) | torch | triton | mlx")
    p.add_argument("--png", default=None, help="also draw decode vs roofline into this PNG")


def _cpu_command() -> tuple[Callable, Callable]:
    """The end-to-end CPU benchmark (scripts/bench_cpu.py), imported lazily (it needs transformers)."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("bench_cpu", Path(__file__).parent / "bench_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.add_cpu_args, module.cpu_rows


COMMANDS: dict[str, tuple[Callable, Callable]] = {"qmatmul": (add_qmatmul_args, qmatmul_rows),
                                                  "moe": (add_kernel_args, kernel_rows),
                                                  "indexer": (add_kernel_args, kernel_rows),
                                                  "argmax": (add_kernel_args, kernel_rows),
                                                  "model": (add_model_args, model_rows),
                                                  "spec": (add_spec_args, spec_rows),
                                                  "cpu": _cpu_command()}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run one benchmark, print its table or CSV; a bad flag is one line, status 2."""
    try:
        run(argv)
    except Ds4Error as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench.py: interrupted", file=sys.stderr)
        return 130
    return 0


def run(argv: list[str] | None = None) -> None:
    """Parse the command line, run one benchmark, print its table or CSV."""
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="op", required=True)
    for name, (add_args, _) in COMMANDS.items():
        p = sub.add_parser(name)
        add_args(p, on_gpu)
        p.add_argument("--csv", action="store_true", help="print CSV instead of a table")
        p.add_argument("--quick", action=argparse.BooleanOptionalAction, default=not on_gpu,
                       help="one repetition and fewer shapes and row counts (default on CPU)")
        p.add_argument("--reps", type=int, default=None,
                       help="timed calls per measurement on CPU (on CUDA do_bench picks them)")
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 1 if args.quick else 50
    if args.reps < 1:
        raise UsageError(f"--reps must be >= 1, got {args.reps}")
    if any(m < 1 for m in getattr(args, "m", None) or ()):
        raise UsageError(f"--m: row counts must be >= 1, got {args.m}")
    device = torch.device("cuda" if on_gpu else "cpu")
    if args.op == "model" and (args.layers is not None and args.layers < 1 or args.prompt < 1 or args.decode < 1):
        raise UsageError("--layers, --prompt and --decode must be >= 1")
    rows = COMMANDS[args.op][1](args, device)
    emit(rows, args.csv)
    if args.op == "model" and args.png:
        plot_model(rows, args.png)


if __name__ == "__main__":
    sys.exit(main())
