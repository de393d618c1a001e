"""Benchmarks: `python scripts/bench.py SUITE [options]`; each suite is a module of ds4/bench/ (its docstring
says what it measures): qmatmul, moe, indexer, argmax, model, spec, cpu, traffic, compile."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # ds4 from any working directory

import torch  # noqa: E402

from ds4.bench import SUITES, suite  # noqa: E402
from ds4.bench.common import emit  # noqa: E402
from ds4.errors import Ds4Error, UsageError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run one suite, print its table or CSV; a bad flag is one line, status 2."""
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
    """Parse the command line, run one suite, print its table or CSV."""
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="op", required=True)
    for name in SUITES:
        p = sub.add_parser(name, help=suite(name).__doc__.splitlines()[0])
        suite(name).add_args(p, on_gpu)
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
    emit(suite(args.op).rows(args, torch.device("cuda" if on_gpu else "cpu")), args.csv)


if __name__ == "__main__":
    sys.exit(main())
