"""cpu: ds4py against transformers' `deepseek_v4` on the same random checkpoint, end to end on the CPU.

A random transformers checkpoint (ds4/tiny/hf.py's initialisation) is saved, converted (ds4/formats/convert.py)
to the f32, q4 and q2 mixes, and each engine prefills a prompt then greedily decodes, for
1 and 2 threads, in interleaved rounds (every engine once per round); the table gives the median
tokens/s and ratios (`--compile` adds each mix with the compiled decode step). `--full-layers N` runs
ds4/bench/full_width.py instead: V4 Flash at full width, N layers, ds4py against llama-bench; `--gemv`
ds4/bench/cpu_gemv.py: the fused kernel's GB/s per type. The tiny default model
adds ds4py's 1-row decode against a 2-row verify, on the cpu backend and on the reference (torch)
backend (and compiled, with `--compile`). With `LLAMA_BENCH=/path/to/llama-bench`, llama-bench runs on each mix's
GGUF in the same rounds and the ds4py rows get their ratio to it (`--size small-llama`: the 89M model with the head
sizes and compression ratios llama.cpp's deepseek4 graph accepts).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.registry import OpSet
from ds4.bench import cpu_gemv, full_width
from ds4.bench.common import greedy, machine
from ds4.engine import open_model
from ds4.errors import UsageError
from ds4.formats import gguf
from ds4.formats.convert import convert
from ds4.formats.vocab import real_v4_tokenizer_json
from ds4.session import Session
from ds4.tiny.build import tiny_model_weights
from models.args import ModelArgs
from models.deepseek_v4 import DeepseekV4
from models.mtp import MTPHead

SMALL = {"head_dim": 80, "hidden_size": 256, "vocab_size": 129280, "n_routed_experts": 16, "num_experts_per_tok": 4,
         "moe_intermediate_size": 256, "sliding_window": 128}
# llama.cpp's deepseek4 graph loads compression ratios 0, 4 and 128 only, and its Hadamard rotation of the
# compressed and indexer rows cuts them into rows of 64: head sizes must be multiples of 64 (V4 Flash: 512, 128)
LLAMACPP_SHAPES = {"head_dim": 128, "qk_rope_head_dim": 64, "index_head_dim": 128,
                   "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}}
SIZES = {  # keyword overrides of ds4.tiny.hf.tiny_config
    "smoke": {"head_dim": 80},
    "small": SMALL,
    "small-llama": SMALL | LLAMACPP_SHAPES,
}
REAL_VOCAB = 129280   # the real V4 tokenizer goes into these GGUFs (llama.cpp loads no file without one)


@dataclass(frozen=True)
class Engine:
    """One timed engine: transformers ("hf"), a ds4py model ("ds4"; compiled decode if `compile`) or llama-bench
    ("llama", `model` the GGUF path), on the file of `mix` ("" for transformers and the reference)."""

    kind: str
    model: object
    compile: bool
    mix: str


def checkpoint(size: str, tmp: Path, mixes: tuple[str, ...]):
    """The transformers model and its GGUF paths per mix (files already in `tmp` are reused)."""
    from ds4.tiny.hf import tiny_config, tiny_model  # transformers: a test extra
    model = tiny_model(tiny_config(**SIZES[size]), seed=0)
    real_vocab = model.config.vocab_size == REAL_VOCAB
    if not (tmp / "hf" / "config.json").exists():
        model.save_pretrained(tmp / "hf")
        if real_vocab:
            shutil.copy(real_v4_tokenizer_json(), tmp / "hf" / "tokenizer.json")
    paths = {}
    for mix in mixes:
        paths[mix] = str(tmp / f"{mix}.gguf")
        if not Path(paths[mix]).exists():
            convert(tmp / "hf", paths[mix], outtype=mix, tokenizer=real_vocab)
    return model, paths


def run_hf(model, prompt: list[int], n: int) -> tuple[float, float]:
    """Prefill and greedy decode seconds of transformers (eager, F32, its own KV cache)."""
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(torch.tensor([prompt]), use_cache=True)
        t1 = time.perf_counter()
        past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
        for _ in range(n):
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def run_ds4(model, prompt: list[int], n: int, compile: bool = False) -> tuple[float, float]:
    """Prefill and greedy decode seconds of a ds4py trunk (decode through the compiled step if `compile`)."""
    s = Session(model, len(prompt) + n + 1, 2048, compile=compile)
    t0 = time.perf_counter()
    tok = greedy(s, s.prefill(prompt))
    t1 = time.perf_counter()
    for _ in range(n):
        tok = greedy(s, s.decode(tok))
    return t1 - t0, time.perf_counter() - t1


def verify_vs_decode(backend: str, steps: int, compile: bool = False) -> tuple[float, float]:
    """Seconds of a 1-row decode and of a 2-row verify on the tiny default model after a 40-token prompt
    (compiled steps: compiled by an untimed first pair)."""
    md, base, mtp = tiny_model_weights()
    trunk = DeepseekV4(ModelArgs.from_metadata(md), base, OpSet(backend))
    s = Session(trunk, 256, 16, MTPHead(trunk, mtp), compile=compile)
    s.prefill(list(range(3, 43)))
    one, two = [], []
    for i in range(-1 if compile else 0, steps):
        snap = s.snapshot()
        t0 = time.perf_counter()
        s.decode(50 + i)
        one.append(time.perf_counter() - t0)
        s.restore(snap)
        t0 = time.perf_counter()
        s.forward([50 + i, 60 + i], "all")
        two.append(time.perf_counter() - t0)
        s.restore(snap)
    return statistics.median(one[1:] if compile else one), statistics.median(two[1:] if compile else two)


def rows(a: argparse.Namespace, device: torch.device) -> list[dict]:
    """Interleaved rounds of every engine and thread count; medians and ratios."""
    if a.gemv:
        return cpu_gemv.rows(a.rounds, a.size == "smoke")
    if a.full_layers:
        return full_width.rows(a)
    mixes = tuple(a.mixes)
    binary = os.environ.get("LLAMA_BENCH")
    if binary and not Path(binary).is_file():
        raise UsageError(f"LLAMA_BENCH={binary} is not a file")
    weights = a.weights or ["memory"]          # what `--weights auto` gives files of this size
    with tempfile.TemporaryDirectory() as d, contextlib.ExitStack() as held:
        hf, paths = checkpoint(a.size, Path(a.workdir or d), mixes)
        engines = {"transformers f32": Engine("hf", hf, False, "")}

        def trunk(mix: str, dot: str, how: str) -> DeepseekV4:
            """The model as `ds4.load` holds it: its own copy of the file, repacked at load where ds4.load does."""
            return held.enter_context(full_width.as_loaded(gguf.open(paths[mix], how), OpSet(a.backend, cpu_dot=dot)))

        for mix in mixes:
            for how in weights:
                held_as = f" --weights {how}" if len(weights) > 1 else ""
                engines[f"ds4py {mix}{held_as}"] = Engine("ds4", trunk(mix, "exact", how), False, mix)
                for dot in sorted(set(a.cpu_dot) - {"exact"}):
                    engines[f"ds4py {mix} --cpu-dot {dot}{held_as}"] = Engine("ds4", trunk(mix, dot, how), False, mix)
            if a.compile:
                exact = f"ds4py {mix}" + (f" --weights {weights[0]}" if len(weights) > 1 else "")
                engines[f"ds4py {mix} compiled"] = Engine("ds4", engines[exact].model, True, mix)
            if binary:
                engines[f"llama.cpp {mix}"] = Engine("llama", Path(paths[mix]), False, mix)
        if a.reference:
            engines["ds4py f32 (torch ref)"] = Engine("ds4", open_model(paths[mixes[0]], OpSet("torch")), False, "")
        vocab = hf.config.vocab_size
        prompt = torch.randint(0, vocab, (a.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        times: dict[tuple[str, int], list[tuple[float, float]]] = {}
        before = torch.get_num_threads()
        print(f"# {machine(device)}; size {a.size}; prompt {a.prompt}, decode {a.tokens}; {a.rounds} rounds",
              flush=True)
        try:
            for r in range(a.rounds + 1):          # round 0 warms up and is not counted
                for threads in a.threads:
                    torch.set_num_threads(threads)
                    for name, e in engines.items():
                        if e.kind == "hf":
                            t = run_hf(e.model, prompt, a.tokens)
                        elif e.kind == "llama":
                            rate = full_width.run_llama(binary, e.model, a.prompt, a.tokens, threads, [])
                            t = (a.prompt / rate.prefill_tok_s, a.tokens / rate.decode_tok_s)
                        else:
                            t = run_ds4(e.model, prompt, a.tokens, e.compile)
                        if r:
                            times.setdefault((name, threads), []).append(t)
        finally:
            torch.set_num_threads(before)
    rows = []
    for threads in a.threads:
        base = statistics.median(a.tokens / t[1] for t in times[("transformers f32", threads)])
        first = f"ds4py {mixes[0]}" + (f" --weights {weights[0]}" if len(weights) > 1 else "")
        f32 = statistics.median(a.tokens / t[1] for t in times[(first, threads)])
        for name, e in engines.items():
            ts = times[(name, threads)]
            prefill = statistics.median(a.prompt / t[0] for t in ts)
            decode = statistics.median(a.tokens / t[1] for t in ts)
            row = {"engine": name, "threads": threads, "prefill_tok_s": f"{prefill:.1f}",
                   "decode_tok_s": f"{decode:.1f}", "decode_x_transformers": f"{decode / base:.2f}",
                   f"decode_x_ds4py_{mixes[0]}": f"{decode / f32:.2f}"}
            if binary:
                llama = times.get((f"llama.cpp {e.mix}", threads))
                row["prefill_x_llama"] = f"{prefill / statistics.median(a.prompt / t[0] for t in llama):.2f}" \
                    if llama else "-"
                row["decode_x_llama"] = f"{decode / statistics.median(a.tokens / t[1] for t in llama):.2f}" \
                    if llama else "-"
            rows.append(row)
    if a.tiny_steps:
        torch.set_num_threads(1)
        for backend, compile in [(a.backend, False), ("torch", False)] + [(a.backend, True)] * a.compile:
            one, two = verify_vs_decode(backend, a.tiny_steps, compile)
            label = f"{backend}{' compiled' if compile else ''}"
            rows.append({"engine": f"tiny default, {label}: 1-row decode / 2-row verify", "threads": 1,
                         "prefill_tok_s": "-", "decode_tok_s": f"{1 / one:.1f} / {2 / two:.1f} (rows/s)",
                         "decode_x_transformers": "-", f"decode_x_ds4py_{mixes[0]}": f"verify/decode {two / one:.2f}",
                         **dict.fromkeys(("prefill_x_llama", "decode_x_llama") if binary else (), "-")})
        torch.set_num_threads(before)
    return rows


def add_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the CPU end-to-end benchmark."""
    p.add_argument("--size", choices=sorted(SIZES), default="small",
                   help="small: hidden 256, 16 experts top-4, 129,280 vocabulary (the issue's model); small-llama: "
                        "the same with the head sizes and ratios llama.cpp loads (LLAMA_BENCH=path adds llama-bench "
                        "on each mix's file); smoke: tiny")
    p.add_argument("--mixes", nargs="+", default=["f32", "q4", "q2"])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--prompt", type=int, default=100, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens decoded")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (after one warm-up round)")
    p.add_argument("--tiny-steps", type=int, default=30, help="decode/verify pairs timed on the tiny model (0: skip)")
    p.add_argument("--backend", default="auto", help="ds4py backend (auto = cpu on this machine)")
    p.add_argument("--workdir", help="keep the checkpoint and GGUFs here and reuse them (default: a temp dir)")
    p.add_argument("--reference", action="store_true", help="also time the f32 file on the torch reference backend")
    p.add_argument("--gemv", action="store_true",
                   help="instead: the fused kernel per type at V4 Flash's decode shapes, GB/s against copy bandwidth")
    p.add_argument("--full-layers", type=int, default=0,
                   help="instead: V4 Flash at full width truncated to N layers, ds4py against llama-bench "
                        "(LLAMA_BENCH=path) on the same GGUF (written once into --workdir)")
    p.add_argument("--full-mixes", nargs="+", choices=("q2", "q4"), default=["q2", "q4"], help="mixes of --full-layers")
    p.add_argument("--llama-args", default="", help="--full-layers: extra llama-bench arguments, e.g. '-ub 1'")
    p.add_argument("--cpu-dot", nargs="+", choices=("exact", "q8"), default=["exact"],
                   help="ds4py's cpu dot products to time, interleaved (e.g. exact q8; docs/cpu.md)")
    p.add_argument("--weights", nargs="+", choices=("mmap", "memory"),
                   help="how ds4py holds the file, interleaved (e.g. mmap memory: mapped, or read into memory with "
                        "huge pages, and under --cpu-dot q8 repacked at load as ds4.load does; docs/cpu.md); default "
                        "mmap with --full-layers, else memory (what --weights auto gives these small files)")
    p.add_argument("--full-tiny", action="store_true", help="--full-layers at the tiny model's sizes (smoke test)")
    p.add_argument("--png", help="--full-layers: also plot tok/s against threads into this PNG")
    p.add_argument("--op-times", action="store_true",
                   help="--full-layers: instead of the comparison, ds4py's wall time per op at prefill and per decode "
                        "step, and the median of one call, per --threads count")
    p.add_argument("--compile", action="store_true",
                   help="also time each mix with the compiled decode step (compiled in the warm-up round)")
