"""compile: every Triton kernel compiled offline for sm_80, sm_89 and sm_90a (no GPU needed), per quant type of
the registry and shape class: registers, spill bytes, shared memory, and the blocks and warps per SM they allow
(backends/triton/compile_report.py; the same table as scripts/compile_triton.py). `--check` fails on any spill
or on fewer resident warps per SM than the stated floor. Run without TRITON_INTERPRET.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from ds4.bench.common import emit
from ds4.errors import Ds4Error, UsageError


def rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Compile each configuration for each architecture asked for; with --check, print and fail on a bad one."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise UsageError("compile: unset TRITON_INTERPRET (the interpreter's kernels cannot be compiled)")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default, stated (silences its warning)
    from backends.triton.compile_report import MIN_WARPS_PER_SM, report
    print(f"# offline compile (triton's ptxas); check floor: no spills, >= {MIN_WARPS_PER_SM} warps per SM",
          file=sys.stderr)
    table = list(report(args.arch, args.kernel, args.types))
    if not table:
        raise UsageError(f"compile: no kernel configuration matches --kernel {args.kernel!r} --types {args.types}")
    bad = [r for r in table if r["ok"] != "yes"]
    if args.check and bad:
        emit(table, args.csv)
        raise Ds4Error(f"compile --check: {len(bad)} configurations fail: "
                       + "; ".join(f"{r['kernel']} on {r['arch']}: {r['ok']}" for r in bad))
    return table


def add_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the compile report."""
    p.add_argument("--arch", nargs="+", default=["sm_80", "sm_89", "sm_90a"], choices=["sm_80", "sm_89", "sm_90a"])
    p.add_argument("--kernel", default=None, help="only configurations whose label contains this text")
    p.add_argument("--types", nargs="+", default=None, metavar="TYPE", help="only these quant types")
    p.add_argument("--check", action="store_true", help="fail on any spill or occupancy under the floor")
