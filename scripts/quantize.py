"""Requantize a DeepSeek V4 GGUF (ds4py's or llama.cpp's layout) into a tensor-type mix.

    python scripts/quantize.py IN.gguf OUT.gguf --mix Q4_K_M|q2|'ffn_down_exps=Q6_K,attn_*=Q8_0,*=Q4_K' \
        [--imatrix FILE]

--mix takes a llama.cpp mix name (Q4_K_M, Q5_K_S, Q8_0, IQ4_XS, ... with llama-quantize's per-tensor choices),
one of ds4's mixes (q2, q4, f32), or rules PATTERN=TYPE matched in order against each tensor's name or role.
--imatrix (from scripts/imatrix.py or llama-imatrix) weights the quantizers that take importance weights.
The output keeps the input's layout; the write is atomic and prints the file's bits per weight.
docs/quantization.md.
"""
from __future__ import annotations

import argparse
import sys

import torch
from tqdm import tqdm

from ds4.errors import Ds4Error
from ds4.formats.requantize import parse_mix, requantize


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, requantize, and report errors as one line on stderr (exit status 2)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input", help="GGUF to read (ds4 or llama.cpp layout, base or MTP)")
    ap.add_argument("output", help="GGUF to write (never the input)")
    ap.add_argument("--mix", required=True, help="llama.cpp mix name, ds4 mix (q2|q4|f32) or PATTERN=TYPE,... rules")
    ap.add_argument("--imatrix", help="importance matrix (llama.cpp's GGUF or legacy .dat format)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    def progress(items):
        return tqdm(list(items), desc="quantizing", unit="tensor", file=sys.stderr)

    try:
        result = requantize(args.input, args.output, parse_mix(args.mix), imatrix_path=args.imatrix,
                            progress=progress, report=lambda line: print(f"note: {line}", file=sys.stderr))
    except (Ds4Error, OSError) as e:
        print(f"quantize: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("quantize: interrupted; the output was not written", file=sys.stderr)
        return 130
    counts: dict[str, int] = {}
    for c in result.choices:
        counts[c.target] = counts.get(c.target, 0) + 1
    types = ", ".join(f"{t}: {n}" for t, n in sorted(counts.items()))
    print(f"wrote {result.path}: {result.tensor_bytes / 2**20:.2f} MiB of tensors, "
          f"{result.bits_per_weight:.3f} bits per weight ({types})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
