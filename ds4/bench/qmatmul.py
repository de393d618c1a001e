"""qmatmul: time, GB/s and share of copy bandwidth of one call per quant type, shape and row count.

Per quant type, weight shape N x K (out x in) and row count M, the time of one call, the
effective bandwidth (weight bytes / time), its share of the device's copy bandwidth measured in the
same run (bytes read + written by a device-to-device copy, per second), and the speed-up over the
PyTorch baseline (dequantize, then one torch.matmul). On CUDA, calls are replayed in a CUDA graph
over enough weight copies to defeat L2, so the figures are kernel time from DRAM. On a machine
without CUDA only the torch reference runs, in a quick mode by default; Triton figures need a GPU.
`--backend cpu` times the cpu backend's C kernel (backends/cpu/qgemv.c) against the same baseline and this
machine's copy bandwidth, so an edit to the C file shows at once. `--backend mlx` times the MLX qmatmul
(weights in their MLX format, each call evaluated) on MLX's default device, against the same torch CPU baseline.
"""
from __future__ import annotations

import argparse

import torch

from backends.registry import UNSUPPORTED_HERE, OpSet, quant_support
from ds4.bench.common import copy_bandwidth, fmt, l2_copies, machine, parse_shape, random_weight, seconds
from ds4.errors import UsageError
from ops.quants import QTensor

NOT_WEIGHT_TYPES = ("F32", "I32")  # F32 is the baseline's own product; I32 holds indices


def default_types(backend: str) -> list[str]:
    """Every registered weight type `backend` serves (the registry's order)."""
    return [t for t, how in quant_support(backend).items() if how != UNSUPPORTED_HERE and t not in NOT_WEIGHT_TYPES]


QMATMUL_SHAPES = ("4096x2048", "2048x4096", "4096x1024", "4096x129280")
QMATMUL_M = (1, 2, 4, 8, 16, 512)
QMATMUL_QUICK_SHAPES, QMATMUL_QUICK_M = ("4096x2048",), (1, 8, 512)  # --quick defaults (CPU)


def rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Time qmatmul for every (type, shape, M) asked for."""
    if any(m < 1 for m in args.m or ()):
        raise UsageError(f"--m: row counts must be >= 1, got {args.m}")
    if args.backend == "triton" and device.type != "cuda":
        raise UsageError("--backend triton: Triton figures need a CUDA GPU; on this machine use --backend torch")
    shapes = args.shapes or (QMATMUL_QUICK_SHAPES if args.quick else QMATMUL_SHAPES)
    ms = args.m or (QMATMUL_QUICK_M if args.quick else QMATMUL_M)
    if args.backend == "cpu":
        device = torch.device("cpu")   # the C kernels take CPU tensors
    opset = OpSet(backend=args.backend, strict=True, device="mlx" if args.backend == "mlx" else str(device))
    op = opset.resolve("qmatmul")[0].fn
    if args.backend == "mlx":  # weights repacked into their MLX format; a call is timed up to its evaluation
        import mlx.core as mx
        device, kernel = torch.device("cpu"), op
        op = lambda x, w: mx.eval(kernel(x, w))  # noqa: E731
        print(f"# MLX {mx.__version__} on {mx.default_device()}; baseline: torch on the CPU")
    copy_bw = copy_bandwidth(device, args.reps)
    print(f"# {machine(device)}\n# device-to-device copy: {copy_bw / 1e9:.1f} GB/s; backend {args.backend}"
          f"{' (Triton figures need a GPU)' if args.backend == 'torch' and device.type != 'cuda' else ''}", flush=True)
    rows = []
    for qtype in args.types or default_types(args.backend):
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


def add_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the qmatmul benchmark."""
    p.add_argument("--types", nargs="+", default=None, metavar="TYPE",
                   help="quant types (default: every registered weight type the backend serves)")
    p.add_argument("--shapes", nargs="+", default=None, metavar="NxK",
                   help=f"weight shapes, out x in (default: {' '.join(QMATMUL_SHAPES)}; "
                        f"--quick: {' '.join(QMATMUL_QUICK_SHAPES)})")
    p.add_argument("--m", nargs="+", type=int, default=None,
                   help=f"rows of x (default: {' '.join(map(str, QMATMUL_M))}; --quick: "
                        f"{' '.join(map(str, QMATMUL_QUICK_M))})")
    p.add_argument("--backend", choices=("torch", "triton", "mlx", "cpu"), default="triton" if on_gpu else "torch")
