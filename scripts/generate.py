"""Generate text with DeepSeek V4 Flash (default: the embedded tiny model, trained on code). Thin CLI over ds4.load."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ds4  # noqa: E402
from ds4 import distributed, weights  # noqa: E402
from ds4.errors import Ds4Error, UsageError  # noqa: E402
from ds4.sampling import SamplingParams  # noqa: E402

SWITCHES = ("indexer_fp4_sim", "kv_fp8_sim", "shared_swiglu_clamp")
MAX_PROMPT_BYTES = 64 << 20  # a prompt file beyond this is refused (an endless file such as /dev/zero)
# The embedded model learned raw Python source (no chat turns): without --prompt it continues this, raw.
DEFAULT_CODE_PROMPT = 'def read_config(path):\n    """Read a configuration file and return its sections."""\n'


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", help="base GGUF (default: the embedded tiny model, trained on Python code)")
    p.add_argument("--mtp", help="MTP GGUF for speculative decoding (default model: its own tiny MTP)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="user message (chat template applied unless --raw)")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    src.add_argument("--prompt-ids", help="comma-separated token ids fed as they are, e.g. 1,2,3")
    p.add_argument("--system", help="system prompt")
    think = p.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_true", help="thinking mode (<think>)")
    think.add_argument("--nothink", dest="think", action="store_false", help="non-thinking mode (default)")
    p.add_argument("--raw", action="store_true", help="no chat template: tokenize the prompt as it is")
    p.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, help="sampling seed (reproducible runs)")
    p.add_argument("--ctx", type=int, default=4096, help="context length in tokens (default 4096)")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prefill chunk (default 2048)")
    p.add_argument("--threads", type=int,
                   help="CPU threads of the kernels (torch's own ops run on one; default: torch's choice; 1 for the "
                        "tiny model)")
    p.add_argument("--backend", default=None, help="auto | torch | triton | mlx | cpu (default: $DS4_BACKEND or auto)")
    p.add_argument("--device", default=None,
                   help="where weights and caches live: cpu | cuda | cuda:N | mlx | mlx:cpu | mlx:gpu "
                        "(default: mlx with --backend mlx, else the best available)")
    p.add_argument("--ops", help="per-op overrides, e.g. qmatmul:torch,moe:triton")
    p.add_argument("--cpu-dot", choices=("exact", "q8"), default="exact",
                   help="cpu backend's quantized products: exact float (default) or q8, activations rounded to 8 bits "
                        "per block as llama.cpp does (faster on 2-bit types, other numbers; not with --strict)")
    p.add_argument("--weights", choices=weights.CHOICES, default="auto", help=weights.HELP)
    p.add_argument("--parallel", choices=("ep", "tp"),
                   help="split the model over the ranks torchrun starts: ep = routed experts by index; tp = also "
                        "vocabulary, attention and indexer heads and the shared expert "
                        "(torchrun --nproc-per-node N scripts/generate.py ... --parallel ep; docs/distributed.md)")
    p.add_argument("--mtp-draft", default=None,
                   help="speculative draft depth N (1..16; a batched verify takes at most 15) or 'auto'; "
                        "0 = off (default with an MTP head: 1, continuous)")
    p.add_argument("--strict", action="store_true", help="speculation bit-identical to plain greedy")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="run decode/verify/MTP steps compiled by torch.compile (CPU; each row count compiles once, "
                        "about a minute of CPU, saved in $DS4_CACHE/inductor/steps; a later run with the same model "
                        "shapes, code and torch loads the saved steps, ~3-4 s of CPU more than eager for importing "
                        "torch.compile's runtime; docs/cpu.md; default off)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="record decode/verify/MTP steps in CUDA graphs and replay them (CUDA only; untested on "
                        "hardware so far, see docs/kernels.md)")
    p.add_argument("--no-continuous", dest="continuous", action="store_false",
                   help="decode `first` alone before each draft (ds4's older cycle)")
    p.add_argument("--spec-log", action="store_true", help="per-cycle speculative trace on stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of streaming")
    p.add_argument("--dump-logits", metavar="PATH", help="save the logits used for each generated token (.npy)")
    p.add_argument("--explain-backends", action="store_true", help="print which implementation ran each op")
    for name in SWITCHES:
        flag = name.replace("_", "-")
        p.add_argument(f"--{flag}", dest=name, action="store_true", default=None)
        p.add_argument(f"--no-{flag}", dest=name, action="store_false")
    p.add_argument("--mtp-pairing", choices=("official", "ds4"), help="MTP input pairing (default official)")
    return p.parse_args(argv)


def read_prompt(a: argparse.Namespace) -> str | list[int]:
    """The prompt as text or ids, from whichever flag gave it (none, default model: a raw code prompt)."""
    if a.prompt_ids is not None:
        try:
            return [int(t) for t in a.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise UsageError(f"--prompt-ids must be comma-separated integers, got {a.prompt_ids!r}") from None
    if a.prompt_file is not None:
        try:
            with open(a.prompt_file, "rb") as f:
                data = f.read(MAX_PROMPT_BYTES + 1)
        except OSError as e:
            raise UsageError(f"--prompt-file {a.prompt_file}: {e.strerror or e}") from None
        if len(data) > MAX_PROMPT_BYTES:
            raise UsageError(f"--prompt-file {a.prompt_file}: longer than {MAX_PROMPT_BYTES >> 20} MiB")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"--prompt-file {a.prompt_file}: not UTF-8 text "
                             f"(invalid byte at offset {e.start})") from None
    if a.prompt is not None:
        return a.prompt
    if a.model is None:
        a.raw = True  # the embedded model continues code; it never saw a chat template
        return DEFAULT_CODE_PROMPT
    return "Write a haiku about fast kernels."


def mtp_draft(value: str | None) -> int | str | None:
    """--mtp-draft as an int, 'auto' or None."""
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"--mtp-draft must be an integer or 'auto', got {value!r}") from None


def run(a: argparse.Namespace) -> int:
    """Load, generate, report."""
    prompt = read_prompt(a)
    cpus = os.cpu_count() or 1
    if a.threads is not None and a.threads < 0:
        raise UsageError(f"--threads must be >= 0 (0: the default), got {a.threads}")
    if a.threads is not None and a.threads > cpus:
        raise UsageError(f"--threads {a.threads} exceeds the {cpus} CPUs here")
    SamplingParams(a.temp, a.top_k, a.top_p, a.min_p, a.seed)  # bad sampling flags fail before loading
    if a.strict and a.cpu_dot != "exact":
        raise UsageError(f"--strict promises the reference's tokens; --cpu-dot {a.cpu_dot} rounds activations to "
                         "8 bits (drop one of them)")
    if a.dump_logits:
        check_writable("--dump-logits", Path(a.dump_logits))
    threads = a.threads or (1 if a.model is None else 0)
    if threads:
        from backends.cpu import kernels
        kernels.set_threads(threads)    # the kernel pool; torch's own ops on one thread
    switches = {k: getattr(a, k) for k in SWITCHES if getattr(a, k) is not None}
    if a.mtp_pairing:
        switches["mtp_pairing"] = a.mtp_pairing
    from backends.registry import parse_overrides
    engine = ds4.load(a.model, a.mtp, a.backend, ops=parse_overrides(a.ops), ctx=a.ctx,
                      prefill_chunk=a.prefill_chunk, device=a.device, compile=a.compile,
                      cuda_graphs=a.cuda_graphs, parallel=a.parallel, cpu_dot=a.cpu_dot, weights=a.weights,
                      **switches)
    quiet = engine.world is not None and not engine.world.is_main   # across ranks only rank 0 prints
    logits = []
    spec_log = (lambda cycle: print(json.dumps(cycle), file=sys.stderr)) if a.spec_log else None
    tokens = engine.generate(prompt, max_tokens=a.max_tokens, temperature=a.temp, top_k=a.top_k, top_p=a.top_p,
                             min_p=a.min_p, seed=a.seed, system=a.system, think=a.think, raw=a.raw,
                             mtp_draft=mtp_draft(a.mtp_draft), strict=a.strict, continuous=a.continuous,
                             spec_log=spec_log, on_logits=logits.append if a.dump_logits else None)
    ids, text = [], []
    for tok in tokens:
        if tok.id >= 0:
            ids.append(tok.id)
        text.append(tok.text)
        if not (a.json or quiet):
            print(tok.text, end="", flush=True)
    if quiet:
        return 0
    if not a.json:
        print()
    if a.dump_logits:
        import numpy as np
        import torch
        try:
            with open(a.dump_logits, "wb") as f:  # a file object: exactly this path (np.save would add .npy)
                np.save(f, torch.stack(logits).float().numpy() if logits else np.zeros((0, engine.args.vocab_size)))
        except OSError as e:
            raise UsageError(f"--dump-logits {a.dump_logits}: {e.strerror or e}") from None
    stats = engine.stats
    if a.json:
        out = {"model": engine.paths[0], "mtp": engine.paths[1], "weights": engine.weights.line(),
               "generated_ids": ids, "text": "".join(text),
               **stats.as_dict(), "backends": engine.ops.report()}
        print(json.dumps(out, ensure_ascii=False))
    print(f"[ds4py] {stats.prompt_tokens} prompt tokens in {stats.prefill_s:.2f}s, {stats.generated_tokens} "
          f"generated in {stats.decode_s:.2f}s; {stats.spec.summary()}", file=sys.stderr)
    if a.explain_backends:
        print(engine.ops.format_report(), file=sys.stderr)
    return 0


def check_writable(flag: str, path: Path) -> None:
    """Refuse, before any work, an output path that is a directory or cannot be written."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file path")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: the directory {path.parent} does not exist")
    existed = path.exists()
    try:  # really open it (permission bits say nothing for root or on read-only mounts); change nothing
        with open(path, "ab"):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot be written ({e.strerror or e})") from None
    if not existed:
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point: clear one-line errors for anything the user can get wrong."""
    a = parse_args(argv)
    try:
        return run(a)
    except Ds4Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if a.parallel:
            distributed.stop()


if __name__ == "__main__":
    sys.exit(main())
