"""Convert a Hugging Face DeepSeek V4 checkpoint (official or transformers naming) to ds4-layout GGUFs.

    python scripts/convert_hf.py HF_DIR --out base.gguf [--mtp-out mtp.gguf [--mtp-layout ds4|llama.cpp]] \
        --outtype q2|q4|f32

The base GGUF carries ds4's metadata and the keys llama.cpp requires, so ds4py, antirez/ds4 and
llama.cpp load it; --mtp-layout picks the MTP file's layout (docs/gguf-layouts.md).

Tensors are converted and written one at a time (the bar counts them), so memory stays about one
output tensor (an expert stack or the embedding) above the mapped safetensors pages.
"""
from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from ds4.errors import Ds4Error
from ds4.formats.convert import convert
from ds4.formats.quant_mix import MIXES


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, convert, and report errors as one line on stderr."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hf_dir", help="directory with config.json, *.safetensors and tokenizer.json")
    ap.add_argument("--out", required=True, help="base model GGUF to write")
    ap.add_argument("--mtp-out", help="also write the MTP head (mtp.0.*) to this GGUF")
    ap.add_argument("--mtp-layout", choices=("ds4", "llama.cpp"), default="ds4",
                    help="MTP GGUF layout: ds4 (mtp.0.*) or llama.cpp (blk.L.nextn.*, one eh_proj)")
    ap.add_argument("--outtype", choices=MIXES, default="q2", help="tensor-type mix (see ds4/formats/quant_mix.py)")
    ap.add_argument("--no-tokenizer", action="store_true", help="convert without tokenizer.json (no vocab in the GGUF)")
    args = ap.parse_args(argv)

    def progress(items):
        return tqdm(items, desc="converting", unit="tensor", file=sys.stderr)

    try:
        convert(args.hf_dir, args.out, args.mtp_out, args.outtype, tokenizer=not args.no_tokenizer, progress=progress,
                mtp_layout=args.mtp_layout)
    except (Ds4Error, OSError) as e:
        print(f"convert_hf: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("convert_hf: interrupted; the output was not written", file=sys.stderr)
        return 130
    print(f"wrote {args.out}" + (f" and {args.mtp_out}" if args.mtp_out else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
