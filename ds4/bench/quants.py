"""quants: requantize a model into each mix (with and without an imatrix) and tabulate bits/weight, file size,
perplexity, KL divergence from the model as given, top-1 agreement and decode tokens/s against the model's;
`--png` plots KLD against bits per weight."""
from __future__ import annotations

import argparse
import difflib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ds4 import weights
from ds4.bench.common import fmt, machine
from ds4.engine import Engine, load
from ds4.errors import UsageError
from ds4.formats import gguf
from ds4.formats import imatrix as imatrix_file
from ds4.formats.requantize import parse_mix, requantize
from ds4.research import imatrix, perplexity

DEFAULT_MIXES = ("Q8_0", "q4", "q2", "MXFP4_MOE", "Q4_K_M")
PROMPT = "def read_config(path):\n"


@dataclass(frozen=True)
class Measured:
    """One model file's figures: perplexity scores on the text and decode speed."""

    scores: perplexity.Scores
    tok_s: float


def measure(path: str, ids: list[int], args: argparse.Namespace) -> Measured:
    """Score `ids` in chunks of --ctx and time a greedy decode of --tokens tokens (no MTP)."""
    engine = load(path, ctx=max(args.ctx, 256), prefill_chunk=args.ctx, weights=args.weights)
    scores = perplexity.score(engine, ids, args.ctx)
    return Measured(scores, decode_tok_s(engine, args.tokens, args.runs))


def decode_tok_s(engine: Engine, tokens: int, runs: int = 3) -> float:
    """Greedy decode speed (tokens/s) after a short prompt, without speculation: the fastest of `runs` runs."""
    list(engine.generate(PROMPT, raw=True, max_tokens=2, mtp_draft=0))  # warm-up
    best = 0.0
    for _ in range(runs):
        start = time.perf_counter()
        n = sum(1 for t in engine.generate(PROMPT, raw=True, max_tokens=tokens, mtp_draft=0) if t.id >= 0)
        best = max(best, n / (time.perf_counter() - start))
    return best


def tokens_of(path: str, text_path: str | None, default: str, limit: int) -> list[int]:
    """The model's tokens of a text file (default: the source of a standard-library module), cut to `limit`."""
    text = Path(text_path or default).read_text(encoding="utf-8")
    return load(path, ctx=2).tokenizer.encode(text)[:limit]


def rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """One row per (mix, imatrix) plus the model as given; the KLD is measured against the model as given."""
    if args.ctx < 4 or min(args.chunks, args.tokens, args.threads, args.runs) < 1:
        raise UsageError("--ctx must be >= 4, --chunks, --tokens, --threads and --runs >= 1")
    torch.set_num_threads(args.threads)
    ids = tokens_of(args.model, args.text, argparse.__file__, args.ctx * args.chunks)
    base = measure(args.model, ids, args)
    print(f"# {machine(device)}; model {args.model}; {len(base.scores.targets)} scored tokens", flush=True)
    with tempfile.TemporaryDirectory(prefix="ds4-quants-") as tmp:
        out = [_row("(as given)", "-", args.model, base, base)] + mix_rows(args, ids, base, Path(args.workdir or tmp))
    if args.png:
        plot(out, args.png)
    return out


def mix_rows(args: argparse.Namespace, ids: list[int], base: Measured, work: Path) -> list[dict]:
    """Requantize into each mix, without and with the imatrix (computed over --imatrix-text unless given)."""
    work.mkdir(parents=True, exist_ok=True)
    im_path = args.imatrix
    if im_path is None and not args.no_imatrix:
        im_path = str(work / "imatrix.gguf")
        calib = tokens_of(args.model, args.imatrix_text, difflib.__file__, args.ctx * args.imatrix_chunks)
        imatrix_file.write(im_path, imatrix.collect(load(args.model, ctx=args.ctx), calib, args.ctx,
                                                        dataset=args.imatrix_text or difflib.__file__))
    out = []
    for i, spec in enumerate(args.mixes):
        mix = parse_mix(spec)
        for im in ([None, im_path] if im_path else [None]):
            dst = work / f"mix{i}{'-imatrix' if im else ''}.gguf"
            try:
                requantize(args.model, dst, mix, imatrix_path=im)
            except UsageError as e:
                out.append(_skipped(spec, im, str(e)))
                continue
            out.append(_row(spec, "yes" if im else "no", str(dst), measure(str(dst), ids, args), base))
    return out


def _row(mix: str, with_imatrix: str, path: str, m: Measured, base: Measured) -> dict:
    f = gguf.open(path)
    n_bytes = sum(t.nbytes for t in f.tensors.values())
    n_values = sum(torch.Size(t.shape).numel() for t in f.tensors.values())
    kl = perplexity.kl_stats(m.scores, base.scores)
    return {"mix": mix, "imatrix": with_imatrix, "bits/weight": f"{8 * n_bytes / n_values:.3f}",
            "MiB": f"{n_bytes / 2**20:.2f}", "PPL": fmt(kl.ppl), "mean KLD": f"{kl.mean_kld:.5f}",
            "p99 KLD": f"{kl.p99_kld:.5f}", "top-1": f"{100 * kl.same_top:.2f}%", "RMS dp": f"{100 * kl.rms_dp:.2f}%",
            "tok/s": fmt(m.tok_s), "tok/s vs given": f"{m.tok_s / base.tok_s:.2f}x", "note": ""}


def _skipped(mix: str, im: str | None, why: str) -> dict:
    return {"mix": mix, "imatrix": "yes" if im else "no", "bits/weight": "-", "MiB": "-", "PPL": "-",
            "mean KLD": "-", "p99 KLD": "-", "top-1": "-", "RMS dp": "-", "tok/s": "-", "tok/s vs given": "-",
            "note": f"not written: {why}"}


def plot(table: list[dict], path: str) -> None:
    """KLD against bits per weight, one point per written mix (circles without imatrix, crosses with)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labelled = set()
    for r in table:
        if r["bits/weight"] == "-" or r["imatrix"] == "-":
            continue
        x, y = float(r["bits/weight"]), max(float(r["mean KLD"]), 1e-6)
        with_im = r["imatrix"] == "yes"
        ax.scatter([x], [y], marker="x" if with_im else "o", color="C1" if with_im else "C0")
        if r["mix"] not in labelled:
            labelled.add(r["mix"])
            ax.annotate(r["mix"][:32], (x, y), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (whole file)")
    ax.set_ylabel("mean KL divergence from the model as given")
    ax.set_title("o: no imatrix, x: with imatrix")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the quantization benchmark."""
    p.add_argument("model", help="model GGUF to requantize (its own outputs are the KLD reference)")
    p.add_argument("--mixes", nargs="+", default=list(DEFAULT_MIXES),
                   help="mixes as scripts/quantize.py --mix takes them (llama.cpp names, q2|q4|f32, or rules)")
    p.add_argument("--text", help="evaluation text (default: the standard library's argparse.py)")
    p.add_argument("--imatrix", help="use this imatrix file instead of computing one")
    p.add_argument("--imatrix-text", help="calibration text (default: the standard library's difflib.py)")
    p.add_argument("--imatrix-chunks", type=int, default=16, help="calibration chunks of --ctx tokens")
    p.add_argument("--no-imatrix", action="store_true", help="only the mixes without an imatrix")
    p.add_argument("--ctx", type=int, default=256, help="tokens per perplexity chunk")
    p.add_argument("--chunks", type=int, default=16, help="evaluation chunks")
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded for tok/s")
    p.add_argument("--runs", type=int, default=3, help="decode runs per file; tok/s is the fastest")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--weights", choices=weights.CHOICES, default="auto", help=weights.HELP)
    p.add_argument("--workdir", help="keep the requantized files here (default: a temporary folder)")
    p.add_argument("--png", help="also write the KLD / bits-per-weight plot here")
