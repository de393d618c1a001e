"""Perplexity of a model over a text, and its KL divergence from a base model, as llama-perplexity scores them.

    python scripts/perplexity.py MODEL.gguf TEXT.txt [--ctx 512] [--kl-base BASE.gguf | --kl-logits FILE]
    python scripts/perplexity.py BASE.gguf TEXT.txt --save-logits FILE
    python scripts/perplexity.py MODEL.gguf TEXT.txt --cpu-dot q8 --batch 16 --kl-base MODEL.gguf

The text is cut into independent chunks of --ctx tokens; the second half of each chunk is scored. With a
base (a model, or the log-probabilities --save-logits wrote from one) it prints the mean and p99 KL
divergence, RMS of the probability difference of the right token and top-1 agreement. docs/quantization.md.
`--cpu-dot q8` scores the model (not the base) with 8-bit activations (docs/cpu.md); `--batch 16` feeds each chunk
16 tokens at a time, the rows where q8 applies (the third line: q8's divergence from exact on the same file).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

import ds4
from ds4 import weights
from ds4.errors import Ds4Error
from ds4.research import perplexity


def _load(path: str, args: argparse.Namespace, cpu_dot: str = "exact") -> ds4.Engine:
    return ds4.load(path, backend=args.backend, ctx=args.ctx, prefill_chunk=args.ctx, cpu_dot=cpu_dot,
                    weights=args.weights)


def _score(engine: ds4.Engine, ids: list[int], args: argparse.Namespace, what: str) -> perplexity.Scores:
    with tqdm(total=len(ids) // args.ctx, desc=what, unit="chunk", file=sys.stderr) as bar:
        return perplexity.score(engine, ids, args.ctx, on_chunk=lambda i: bar.update(), batch=args.batch)


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, score the text, print the results; errors as one line (exit status 2)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="model GGUF (ds4 or llama.cpp layout)")
    ap.add_argument("text", help="text file (UTF-8)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512, as llama-perplexity)")
    ap.add_argument("--chunks", type=int, default=0, help="use at most this many chunks (default: all)")
    base = ap.add_mutually_exclusive_group()
    base.add_argument("--kl-base", help="base model GGUF to compare against (scored on the same tokens)")
    base.add_argument("--kl-logits", help="base log-probabilities written by --save-logits")
    base.add_argument("--save-logits", help="write this model's log-probabilities here, to be a later --kl-logits")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ap.add_argument("--backend", default="auto", help="backend running the model(s) (default auto)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--cpu-dot", choices=("exact", "q8"), default="exact",
                    help="the model's cpu dot products (the base always exact; docs/cpu.md)")
    ap.add_argument("--weights", choices=weights.CHOICES, default="auto", help=weights.HELP)
    ap.add_argument("--batch", type=int, default=0, help="tokens per forward within a chunk (default: the whole chunk)")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        engine = _load(args.model, args, args.cpu_dot)
        ids = engine.tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))
        if args.chunks > 0:
            ids = ids[:args.chunks * args.ctx]
        scores = _score(engine, ids, args, "scoring")
        ppl, err = scores.perplexity()
        out = {"tokens": len(scores.targets), "ctx": args.ctx, "ppl": ppl, "ppl_err": err}
        lines = [f"PPL = {ppl:.4f} ± {err:.4f} over {len(scores.targets)} tokens (chunks of {args.ctx})"]
        if args.save_logits:
            perplexity.save(args.save_logits, scores)
            lines.append(f"wrote {args.save_logits}")
        base_scores = (_score(_load(args.kl_base, args), ids, args, "scoring base") if args.kl_base
                       else perplexity.load(args.kl_logits) if args.kl_logits else None)
        if base_scores is not None:
            stats = perplexity.kl_stats(scores, base_scores)
            out["kl"] = asdict(stats)
            lines += stats.lines()
    except (Ds4Error, OSError, UnicodeDecodeError) as e:
        print(f"perplexity: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out) if args.json else "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
