"""`python -m ds4.formats FILE`: which GGUF layout FILE has, how its keys were read, or FILE rewritten in the
other layout (docs/gguf-layouts.md)."""
from __future__ import annotations

import argparse
import sys

from ds4.errors import ModelFileError, UsageError
from ds4.formats import gguf, layouts


def main(argv: list[str] | None = None) -> int:
    """`python -m ds4.formats FILE [--explain] [--to ds4|llama.cpp OUT [--mtp MTP MTP_OUT]]`: say which layout
    FILE has (ds4 / llama.cpp, base / MTP); --explain adds how each ds4 metadata key was read or derived;
    --to rewrites FILE (and its MTP GGUF) in the other layout. Bad input: one error line, exit status 2."""
    ap = argparse.ArgumentParser(prog="python -m ds4.formats", description=main.__doc__.splitlines()[0])
    ap.add_argument("file", help="a DeepSeek V4 GGUF (base or MTP) of either layout")
    ap.add_argument("--explain", action="store_true", help="how each ds4 metadata key was read or derived")
    ap.add_argument("--to", nargs=2, metavar=("LAYOUT", "OUT"), help="rewrite FILE in LAYOUT (ds4 | llama.cpp)")
    ap.add_argument("--mtp", nargs=2, metavar=("MTP", "MTP_OUT"), help="with --to: also rewrite this MTP GGUF")
    args = ap.parse_args(argv)
    try:
        if args.to:
            layouts.convert_files(args.file, args.to[1], *(args.mtp or (None, None)), to=args.to[0])
            print(f"wrote {args.to[1]}" + (f" and {args.mtp[1]}" if args.mtp else ""))
        elif args.explain:
            print(layouts.explain(args.file))
        else:
            f = gguf.open(args.file)
            print(f"{f.path}: {layouts.detect(f.metadata, f.tensors).describe()}")
    except (ModelFileError, UsageError, OSError) as e:
        print(f"ds4.formats: error: {e}", file=sys.stderr)
        return 2  # as the other commands (and argparse) do for bad input
    return 0


if __name__ == "__main__":
    sys.exit(main())
