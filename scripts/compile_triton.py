"""Compile every Triton kernel offline for sm_80, sm_89 and sm_90a (no GPU needed) and print registers, spills,
shared memory and occupancy: `python scripts/compile_triton.py [--arch sm_90a] [--kernel NAME] [--check]`.

Uses the ptxas and cuobjdump shipped in the Triton wheel; the configurations are those the op wrappers launch at
V4 Flash sizes, for every quant type of the registry the Triton dequantizers support and every shape class
(backends/triton/compile_report.py). `--check` exits 1 on any register spill or on fewer resident warps per SM
than the floor. The same table: `python scripts/bench.py compile`. Run it without TRITON_INTERPRET.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # backends from any working directory

WIDTHS = {"kernel": 100, "shape": 13, "arch": 6, "ok": 4}  # other columns: 8


def main(argv: list[str] | None = None) -> int:
    """Compile, print the table, return 1 when --check finds a spill or low occupancy."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", nargs="+", default=["sm_80", "sm_89", "sm_90a"], choices=["sm_80", "sm_89", "sm_90a"])
    p.add_argument("--kernel", default=None, help="only configurations whose label contains this text")
    p.add_argument("--types", nargs="+", default=None, metavar="TYPE", help="only these quant types")
    p.add_argument("--check", action="store_true", help="exit 1 on any spill or occupancy under the floor")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_triton.py: unset TRITON_INTERPRET (the interpreter's kernels cannot be compiled)",
              file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default, stated (silences its warning)
    from backends.triton.compile_report import MIN_WARPS_PER_SM, report
    rows = []
    for row in report(args.arch, args.kernel, args.types):  # printed as each compiles: a full run takes minutes
        if not rows:
            print("  ".join(c.ljust(WIDTHS.get(c, 8)) for c in row))
        rows.append(row)
        print("  ".join(str(v).ljust(WIDTHS.get(c, 8)) for c, v in row.items()), flush=True)
    bad = [r for r in rows if r["ok"] != "yes"]
    if args.check and bad:
        print(f"compile_triton.py: {len(bad)} configurations spill or keep fewer than {MIN_WARPS_PER_SM} warps "
              f"per SM resident", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
