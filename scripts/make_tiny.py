"""Write a tiny random DeepSeek V4 base GGUF and its MTP GGUF (same architecture, small sizes)."""
from __future__ import annotations

import argparse
import sys

from ds4.errors import Ds4Error, UsageError
from ds4.formats.quant_mix import MIXES
from ds4.tiny.build import TINY, write_tiny


def main(argv: list[str] | None = None) -> int:
    """Parse flags and write the files; bad sizes or paths are one line on stderr."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="base model GGUF to write")
    p.add_argument("--mtp-out", help="MTP GGUF to write (mtp.0.* tensors)")
    p.add_argument("--mtp-layout", choices=("ds4", "llama.cpp"), default="ds4",
                   help="MTP GGUF layout: ds4 (mtp.0.*) or llama.cpp (blk.L.nextn.*); llama.cpp's loader "
                        "also needs --compress-ratios of 0, 4 and 128 only")
    p.add_argument("--mix", choices=MIXES, default="f32", help="tensor-type mix (default f32)")
    p.add_argument("--seed", type=int, default=0)
    for name, default in TINY.items():
        if name == "compress_ratios":
            p.add_argument("--compress-ratios", type=lambda s: tuple(int(x) for x in s.split(",")),
                           help=f"per-layer ratios, comma separated (default {default})")
        else:
            p.add_argument("--" + name.replace("_", "-"), type=int, help=f"(default {default})")
    a = vars(p.parse_args(argv))
    out, mtp_out, mix, seed = a.pop("out"), a.pop("mtp_out"), a.pop("mix"), a.pop("seed")
    mtp_layout = a.pop("mtp_layout")
    a = {k: v for k, v in a.items() if v is not None}
    try:
        for name, value in a.items():
            low = 0 if name in ("n_hash_layers", "compress_ratios") else 1
            if any(v < low for v in (value if isinstance(value, tuple) else [value])):
                raise UsageError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
        write_tiny(out, mtp_out, mix, seed, mtp_layout, **a)
    except (Ds4Error, OSError) as e:
        print(f"make_tiny: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("make_tiny: interrupted", file=sys.stderr)
        return 130
    print(f"wrote {out}" + (f" and {mtp_out}" if mtp_out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
