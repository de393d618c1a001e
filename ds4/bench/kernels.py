"""moe, indexer, argmax: the Triton kernels of those ops beside their PyTorch references.

The Triton kernels of those ops at V4 Flash sizes (routed experts with the q2 mix's
stacks and the shared expert; index scores and top-512; verify argmax over the vocabulary), each with the
PyTorch reference's time beside it and the ratio. Without CUDA only the reference runs, at smaller sizes in
quick mode; `--smoke` takes tiny sizes (a check that the pipeline runs, not a figure). `--backend cpu` times the
cpu backend's C kernels instead, with the op's ideal bytes per second beside this machine's copy bandwidth."""
from __future__ import annotations

import argparse

import torch

from backends.registry import implementations
from ds4.bench.common import copy_bandwidth, fmt, machine, random_weight, seconds, stacked_weight
from ops.ideal_bytes import ideal_bytes
from ops.moe import Experts


def kernel_cases(op: str, quick: bool, device: torch.device, smoke: bool = False) -> list[tuple[str, int, str, tuple]]:
    """(case, M, registry op, arguments) of the moe / indexer / argmax benchmarks."""
    cases = []
    ms = (1, 8) if quick else (1, 2, 8, 16, 512)
    if op == "moe":
        n_exp, d, inter = (4, 256, 256) if smoke else (16, 1024, 512) if quick else (256, 4096, 2048)
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
        heads, dim, k = (4, 32, 16) if smoke else (64, 128, 512)
        for n in (256,) if smoke else (2048,) if quick else (2048, 16384, 65536):
            keys = torch.randn(n, dim, device=device)
            for m in (1, 16) if quick else (1, 2, 8, 16):
                q, w = torch.randn(m, heads, dim, device=device), torch.randn(m, heads, device=device)
                visible = tuple(n - m + 1 + r for r in range(m))
                scores = torch.randn(m, n, device=device)
                cases.append((f"{heads}x{dim} over {n} rows", m, "index_scores", (q, keys, w, visible)))
                cases.append((f"top-{k} of {n}", m, "indexer_topk",
                              (scores, k, torch.tensor(visible, device=device))))
    else:
        vocab = 4096 if smoke else 129280
        for m in (1, 16) if quick else (1, 2, 8, 16):
            cases.append((f"vocab {vocab}", m, "verify_argmax", (torch.randn(m, vocab, device=device),)))
    return cases


def rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Time the kernel of `args.backend` (Triton: CUDA only; cpu: the C kernels) and the reference of each case."""
    if args.backend == "cpu":
        return cpu_rows(args)
    where = "" if device.type == "cuda" else " (reference alone here)"
    print(f"# {machine(device)}\n# {args.op}: Triton on CUDA only{where}", flush=True)
    rows = []
    for case, m, op, op_args in kernel_cases(args.op, args.quick, device, args.smoke):
        impls = implementations(op)
        ref = seconds([lambda f=impls["torch"].fn, a=op_args: f(*a)], device, args.reps)
        kernel = None
        if device.type == "cuda" and "triton" in impls:
            kernel = seconds([lambda f=impls["triton"].fn, a=op_args: f(*a)], device, args.reps)
        rows.append({"op": op, "case": case, "M": m,
                     "triton_us": "-" if kernel is None else f"{kernel * 1e6:.1f}", "reference_us": f"{ref * 1e6:.1f}",
                     "x_reference": "-" if kernel is None else f"{ref / kernel:.2f}"})
    return rows


def cpu_rows(args: argparse.Namespace) -> list[dict]:
    """The C kernels against the reference and the copy bandwidth (the op's ideal bytes per second of kernel)."""
    device = torch.device("cpu")
    copy_bw = copy_bandwidth(device, args.reps)
    print(f"# {machine(device)}\n# {args.op}: cpu backend (C kernels); device-to-device copy: {copy_bw / 1e9:.1f} GB/s",
          flush=True)
    rows = []
    for case, m, op, op_args in kernel_cases(args.op, args.quick, device, args.smoke):
        impls = implementations(op)
        ref = seconds([lambda f=impls["torch"].fn, a=op_args: f(*a)], device, args.reps)
        kernel = gbps = None
        if "cpu" in impls:
            kernel = seconds([lambda f=impls["cpu"].fn, a=op_args: f(*a)], device, args.reps)
            gbps = ideal_bytes(op, impls["cpu"].fn(*op_args), *op_args) / kernel
        rows.append({"op": op, "case": case, "M": m, "cpu_us": "-" if kernel is None else f"{kernel * 1e6:.1f}",
                     "reference_us": f"{ref * 1e6:.1f}",
                     "x_reference": "-" if kernel is None else f"{ref / kernel:.2f}",
                     "ideal_GB/s": "-" if gbps is None else fmt(gbps / 1e9),
                     "%copy": "-" if gbps is None else fmt(100 * gbps / copy_bw)})
    return rows


def add_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """The moe / indexer / argmax benchmarks: the backend beside the reference, and --smoke."""
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that the benchmark runs (no figure)")
    p.add_argument("--backend", choices=("triton", "cpu"), default="triton",
                   help="triton (CUDA only; the reference alone elsewhere) or cpu (the C kernels)")
