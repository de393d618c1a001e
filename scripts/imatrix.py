"""Compute an importance matrix (mean squared activation per input column of every matmul weight) over a text.

    python scripts/imatrix.py MODEL.gguf TEXT.txt -o imatrix.gguf [--ctx 512] [--chunks N]

The file is llama.cpp's imatrix GGUF (what llama-imatrix writes), so llama-quantize --imatrix reads it and
scripts/quantize.py --imatrix reads llama-imatrix's. The text is cut into independent chunks of --ctx tokens.
docs/quantization.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import ds4
from ds4 import weights
from ds4.errors import Ds4Error
from ds4.formats import imatrix as imatrix_file
from ds4.research.imatrix import collect


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, run the model over the text, write the imatrix; errors as one line (exit status 2)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="model GGUF (ds4 or llama.cpp layout)")
    ap.add_argument("text", help="calibration text file (UTF-8)")
    ap.add_argument("-o", "--output", required=True, help="imatrix file to write (llama.cpp's GGUF format)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512, as llama-imatrix)")
    ap.add_argument("--chunks", type=int, default=0, help="use at most this many chunks (default: all)")
    ap.add_argument("--process-output", action="store_true", help="also collect output.weight (as llama-imatrix)")
    ap.add_argument("--backend", default="auto", help="backend running the model (default auto)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--weights", choices=weights.CHOICES, default="auto", help=weights.HELP)
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        engine = ds4.load(args.model, backend=args.backend, ctx=args.ctx, prefill_chunk=args.ctx,
                          weights=args.weights)
        ids = engine.tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))
        if args.chunks > 0:
            ids = ids[:args.chunks * args.ctx]
        with tqdm(total=len(ids) // args.ctx, desc="imatrix", unit="chunk", file=sys.stderr) as bar:
            im = collect(engine, ids, args.ctx, process_output=args.process_output, dataset=args.text,
                         on_chunk=lambda i: bar.update())
        imatrix_file.write(args.output, im)
    except (Ds4Error, OSError, UnicodeDecodeError) as e:
        print(f"imatrix: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {len(im.entries)} entries, {im.chunk_count} chunks of {im.chunk_size} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
