"""traffic: the memory traffic of every Triton kernel, counted exactly under TRITON_INTERPRET=1 (no GPU needed).

A model (the tiny one, or V4 Flash's shapes with `--layers N` and random weights) runs a prefill, a decode step
(M=1) and a verify step (M=8) with every op on Triton, each followed by the verify_argmax of its logits; each op
call's kernel launches are metered (backends/triton/traffic.py) and set against the op's ideal bytes
(ops/ideal_bytes.py: each needed byte read once, each output byte written once). Per op and shape class:
launches, bytes moved (each load/store's distinct bytes, summed over every load/store executed), distinct bytes
(per launch), ideal bytes, moved/ideal (the re-read ratio) and the floor time of the distinct bytes at the copy
bandwidth of named GPUs: a lower bound, not a prediction. `--op qmatmul` alone meters qmatmul for every quant
type of the registry at one weight shape."""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from backends.registry import OpSet
from ds4.bench.common import random_weight
from ds4.errors import UsageError
from ops.ideal_bytes import ideal_bytes
from ops.quants import TYPES

GPUS = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12, "RTX4090": 1.0e12, "M3Max": 0.4e12}  # copy B/s
VERIFY_M = 8
STEPS = ("prefill", "decode", "verify")


@dataclass
class OpTraffic:
    """What one op's calls of one shape class moved: summed over calls and their launches."""

    calls: int = 0
    launches: int = 0
    moved: int = 0
    distinct: int = 0
    lane: int = 0
    ideal: int = 0
    kernels: set[str] = field(default_factory=set)

    def add(self, launches, ideal: int) -> None:
        """Count one op call: its launches and ideal bytes."""
        self.calls += 1
        self.launches += len(launches)
        self.moved += sum(launch.total("requested") for launch in launches)
        self.distinct += sum(launch.total("distinct") for launch in launches)
        self.lane += sum(launch.total("lane") for launch in launches)
        self.ideal += ideal
        self.kernels |= {launch.kernel for launch in launches}


class MeteredOps(OpSet):
    """An OpSet on Triton that charges each op call's metered launches and ideal bytes to `totals[op]`."""

    def __init__(self, meter, device: str = "cpu"):
        super().__init__("triton", strict=True, device=device)
        self.meter = meter
        self.totals: dict[str, OpTraffic] = defaultdict(OpTraffic)

    def __getattr__(self, op: str):
        call = super().__getattr__(op)

        def metered(*args, **kwargs):
            first = len(self.meter.launches)
            out = call(*args, **kwargs)
            self.totals[op].add(self.meter.launches[first:], ideal_bytes(op, out, *args, **kwargs))
            return out

        return metered


def interpreter_meter():
    """A TrafficMeter, after turning the Triton interpreter on (it must be on before the kernels are imported)."""
    if "backends.triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise UsageError("traffic: the Triton kernels were imported without TRITON_INTERPRET=1; rerun with it set")
    os.environ["TRITON_INTERPRET"] = "1"
    import backends.triton  # noqa: F401  (registers the kernels, interpreted)
    from backends.triton.traffic import TrafficMeter
    return TrafficMeter()


def table_row(op: str, shape: str, t: OpTraffic) -> dict:
    """One printed row: bytes in MB, ratios, and the floor time of the distinct bytes on each GPU."""
    row = {"op": op, "shape": shape, "calls": t.calls, "launches": t.launches, "moved_MB": f"{t.moved / 1e6:.4f}",
           "distinct_MB": f"{t.distinct / 1e6:.4f}", "ideal_MB": f"{t.ideal / 1e6:.4f}",
           "x_ideal": f"{t.moved / t.ideal:.2f}" if t.ideal else "-",
           "distinct_x_ideal": f"{t.distinct / t.ideal:.2f}" if t.ideal else "-"}
    row.update({f"floor_us_{gpu}": f"{t.distinct / bw * 1e6:.2f}" for gpu, bw in GPUS.items()})
    return row


def model_traffic(args: argparse.Namespace, meter) -> dict[str, dict[str, OpTraffic]]:
    """Per shape class (prefill, decode, verify), the traffic of each op of one model step."""
    from ds4.tiny.random_model import random_args, random_model
    ops = MeteredOps(meter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tiny rows are too short for block types: F16, as warned
        sliced = {"vocab_size": args.vocab} if args.vocab else {}
        margs = random_args(args.layers, tiny=args.model == "tiny", **sliced)
        model = random_model(margs, args.mix, ops, seed=0)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, margs.vocab_size, (args.prompt,), generator=g).tolist()
    more = torch.randint(1, margs.vocab_size, (1 + VERIFY_M,), generator=g).tolist()
    caches = model.new_caches(args.prompt + 1 + VERIFY_M, max(args.prompt, 16))
    steps = {}
    for shape, ids, start, rows in ((f"prefill M={args.prompt}", prompt, 0, [args.prompt - 1]),
                                    ("decode M=1", more[:1], args.prompt, [0]),
                                    (f"verify M={VERIFY_M}", more[1:], args.prompt + 1, list(range(VERIFY_M)))):
        if STEPS.index(shape.split()[0]) > max(STEPS.index(s) for s in args.steps):
            break  # a step runs after the ones before it (their cache rows)
        if not ids:
            continue  # --prompt 0: decode from an empty cache
        ops.totals = defaultdict(OpTraffic)
        print(f"# {args.model} model, {margs.n_layers} layers, {args.mix}: {shape}", file=sys.stderr, flush=True)
        ops.verify_argmax(model.forward(ids, start, caches, rows)[1])   # the top-1 a greedy or verify step takes
        if shape.split()[0] in args.steps:
            steps[shape] = dict(ops.totals)
    return steps


def qmatmul_traffic(args: argparse.Namespace, meter) -> dict[str, dict[str, OpTraffic]]:
    """qmatmul of every quant type the registry and the Triton kernel share, at decode, verify and prefill."""
    from backends.triton.quants import SUPPORTED
    ops = MeteredOps(meter)
    n, k = args.shape
    out = defaultdict(dict)
    for qtype in TYPES:
        if qtype not in SUPPORTED:
            print(f"# qmatmul {qtype}: no Triton kernel, left out", file=sys.stderr)
            continue
        w = random_weight(qtype, n, k, torch.device("cpu"))
        for shape, m in (("decode M=1", 1), (f"verify M={VERIFY_M}", VERIFY_M), (f"prefill M={args.prompt}",
                                                                                 args.prompt)):
            ops.totals = defaultdict(OpTraffic)
            ops.qmatmul(torch.randn(m, k), w)
            out[shape][f"qmatmul {qtype} {n}x{k}"] = ops.totals["qmatmul"]
    return out


def step_rows(steps: dict[str, dict[str, OpTraffic]], only: str | None) -> list[dict]:
    """Rows per (shape class, op), then a total row per shape class."""
    rows = []
    for shape, totals in steps.items():
        total = OpTraffic()
        for op, t in sorted(totals.items()):
            for name in ("calls", "launches", "moved", "distinct", "lane", "ideal"):
                setattr(total, name, getattr(total, name) + getattr(t, name))
            if only is None or op.split()[0] == only:
                rows.append(table_row(op, shape, t))
        if only is None:
            rows.append(table_row("step total", shape, total))
    return rows


def rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Meter a model's prefill, decode and verify steps (or qmatmul alone) and tabulate bytes against ideal."""
    if args.layers is not None and args.layers < 1 or args.prompt < 0 or args.vocab is not None and args.vocab < 16:
        raise UsageError("--layers must be >= 1, --prompt >= 0, --vocab >= 16")
    meter = interpreter_meter()
    print(f"# traffic under TRITON_INTERPRET=1; floor_us = distinct bytes / copy bandwidth (a lower bound), "
          f"bandwidths TB/s: {', '.join(f'{g} {bw / 1e12:g}' for g, bw in GPUS.items())}", file=sys.stderr)
    with meter:
        if args.only == "qmatmul" and args.model is None:
            return step_rows(qmatmul_traffic(args, meter), "qmatmul")
        args.model = args.model or "tiny"
        if args.model == "full" and args.layers is None:
            raise UsageError("--model full needs --layers N (the interpreter is slow: try 1 or 2)")
        return step_rows(model_traffic(args, meter), args.only)


def shape_arg(text: str) -> tuple[int, int]:
    """'512x4096' -> (512, 4096)."""
    from ds4.bench.common import parse_shape
    return parse_shape(text)


def add_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the traffic meter."""
    p.add_argument("--op", dest="only", default=None, metavar="OP",
                   help="only this op's rows; 'qmatmul' without --model: every quant type at --shape")
    p.add_argument("--model", choices=("tiny", "full"), default=None, help="model shapes (default tiny)")
    p.add_argument("--layers", type=int, default=None, help="first N layers (needed with --model full)")
    p.add_argument("--mix", choices=("q2", "q4"), default="q2", help="tensor-type mix (default q2)")
    p.add_argument("--prompt", type=int, default=32, help="prefill rows (default 32; 0: decode from an empty cache)")
    p.add_argument("--vocab", type=int, default=None,
                   help="slice the vocabulary (embedding, LM head) to this many rows so the interpreter finishes")
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS),
                   help="model steps to meter, in order (default all three; a later step runs the earlier ones)")
    p.add_argument("--shape", type=shape_arg, default=(512, 4096), metavar="NxK",
                   help="qmatmul weight shape for --op qmatmul (default 512x4096)")
