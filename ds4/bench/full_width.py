"""`bench.py cpu --full-layers N`: ds4py against llama.cpp on one GGUF of V4 Flash at full width, truncated
to its first N layers (real vocabulary and tokenizer, random weights in the ds4 q2 or q4 mix).

The file is written once per (mix, N) with the seed-rows trick of ds4/tiny/random_model.py (every byte at its
own address, generated in seconds). ds4py prefills a prompt and decodes greedily (once per `--cpu-dot` given, and
per `--weights` given: the file mapped or read into memory, opened once per round; `load_s` is that opening; read
into memory and under `--cpu-dot q8` with `ds4.load`'s repacks of the weights, restored after each run);
when `LLAMA_BENCH` names a llama-bench binary, it runs on the same file (`-p` prompt, `-n` tokens) right after,
for each thread count, in interleaved rounds. The table gives the median tok/s, the weight bytes a decode token
reads per second and that as a share of this machine's one-thread copy bandwidth, and ds4py / llama.cpp.
`--op-times` prints instead where ds4py's prefill and decode steps go: each op's wall time and calls (and the time
outside op calls), and the median wall time of one call (which other jobs' preemptions leave alone), per thread count
and `--cpu-dot`.
"""
from __future__ import annotations

import functools
import gc
import json
import os
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.cpu import kernels
from backends.registry import OpSet
from ds4.bench.common import copy_bandwidth, greedy
from ds4.errors import UsageError
from ds4.formats import gguf
from ds4.formats.quant_mix import tensor_type
from ds4.formats.vocab import real_v4_metadata
from ds4.session import Session
from ds4.tiny.build import FLASH_SIZES, TINY, tiny_metadata
from ds4.tiny.random_model import random_weight
from ds4.weights import repack_at_load, unpack_all
from models.args import ModelArgs, model_shapes
from ops.quants import get

LLAMACPP_RATIOS = (0, 0) + (4, 128) * 21     # llama.cpp loads ratios 0, 4 and 128 only


@dataclass(frozen=True)
class Timing:
    """One run: prefill and decode tokens per second, and the seconds opening the file took (0: not measured)."""

    prefill_tok_s: float
    decode_tok_s: float
    load_s: float = 0.0


def metadata(layers: int, tiny: bool) -> dict:
    """GGUF metadata of the first `layers` layers of V4 Flash (real vocabulary), or of the tiny sizes (tiny vocab)."""
    sizes = {**(TINY if tiny else FLASH_SIZES), "n_layers": layers, "n_hash_layers": min(3, layers),
             "compress_ratios": LLAMACPP_RATIOS[:layers]}
    md = tiny_metadata(**sizes)
    return md if tiny else md | real_v4_metadata()


def write_model(path: Path, layers: int, mix: str, tiny: bool = False) -> None:
    """Write the truncated random model of `mix` to `path` (one tensor in memory at a time)."""
    md = metadata(layers, tiny)
    args = ModelArgs.from_metadata(md)
    g = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    tensors = {name: gguf.LazyTensor(tensor_type(name, shape, mix), shape,
                                     functools.partial(random_weight, name, shape, args, mix, cpu, g))
               for name, shape in model_shapes(args).items()}
    gguf.write(path, md, tensors)


def decode_bytes(path: Path) -> int:
    """Weight bytes one decode token reads: every tensor, the routed experts' share of the chosen ones, one row
    of the embedding."""
    f = gguf.open(path)
    args = ModelArgs.from_metadata(f.metadata)
    total = 0
    for name in f.tensors:
        t = f.raw(name)
        nbytes = t.data.numel()
        if "_exps" in name:
            nbytes = nbytes * args.n_experts_used // args.n_experts
        elif name == "token_embd.weight":
            nbytes = get(t.qtype.name).row_bytes(t.shape[-1])
        total += nbytes
    return total


def open_timed(path: Path, weights: str) -> tuple[gguf.GGUFFile, float]:
    """The file opened with `weights` (mmap | memory) and the seconds that took."""
    gc.collect()   # the previous copy in memory goes before the next is read: never two at once
    t0 = time.perf_counter()
    f = gguf.open(path, weights)
    return f, time.perf_counter() - t0


@contextmanager
def as_loaded(f: gguf.GGUFFile, ops: OpSet) -> Iterator:
    """The trunk model of the opened file on `ops`, with `ds4.load`'s load-time repacks where it makes them (the file
    read into memory, `--cpu-dot q8`; docs/cpu.md "Weights in memory"), the file's stored bytes restored after (the
    same opened file serves the other runs of a round)."""
    from ds4.engine import open_model
    model = open_model(f, ops)
    repacked = f.weights == "memory" and ops.cpu_dot == "q8"
    if repacked:
        repack_at_load(model)
    try:
        yield model
    finally:
        if repacked:
            unpack_all(model)


def run_ds4(f: gguf.GGUFFile, prompt: list[int], tokens: int, cpu_dot: str = "exact") -> Timing:
    """ds4py on the opened file (`as_loaded`): after an untimed prefill of `prompt`, prefill it again in one chunk,
    then `tokens` greedy decode steps (`cpu_dot`: the cpu backend's dot product, docs/cpu.md)."""
    with as_loaded(f, OpSet("auto", cpu_dot=cpu_dot)) as model:
        Session(model, len(prompt) + 1, len(prompt)).prefill(prompt)     # warm-up, as llama-bench's (see op_times)
        s = Session(model, len(prompt) + tokens + 1, len(prompt))
        t0 = time.perf_counter()
        tok = greedy(s, s.prefill(prompt))
        t1 = time.perf_counter()
        for _ in range(tokens):
            tok = greedy(s, s.decode(tok))
        return Timing(len(prompt) / (t1 - t0), tokens / (time.perf_counter() - t1))


def engine_name(cpu_dot: str) -> str:
    """The table's name of ds4py with the cpu dot product `cpu_dot`."""
    return "ds4py" if cpu_dot == "exact" else f"ds4py --cpu-dot {cpu_dot}"


class TimedOps(OpSet):
    """An OpSet that adds the wall time and the process's CPU time (all threads) of each op call to
    `seconds[op]` and `cpu_seconds[op]`, and keeps each call's wall time in `each[op]` (the calls are counted in
    `calls`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds: Counter[str] = Counter()
        self.cpu_seconds: Counter[str] = Counter()
        self.each: dict[str, list[float]] = {}

    def __getattr__(self, op: str):
        fn = super().__getattr__(op)

        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                wall = time.perf_counter() - t0
                self.seconds[op] += wall
                self.cpu_seconds[op] += time.process_time() - c0
                self.each.setdefault(op, []).append(wall)

        return timed


@dataclass(frozen=True)
class PhaseTimes:
    """Wall and CPU seconds per op and calls per op of a prefill or of one decode step (a mean over steps), and the
    median wall seconds of one call of each op (other jobs' preemptions, which the means take in, leave it alone);
    the whole phase's times under the name TOTAL."""

    wall: dict[str, float]
    cpu: dict[str, float]
    calls: dict[str, float]
    median_call: dict[str, float]


TOTAL, OUTSIDE = "(whole prefill / decode step)", "(outside op calls)"


def timed_phase(ops: TimedOps, run: Callable[[], None], steps: int = 1) -> PhaseTimes:
    """The op times of `run()`, divided by `steps`, with TOTAL and OUTSIDE (the time outside op calls)."""
    for counter in (ops.seconds, ops.cpu_seconds, ops.calls, ops.each):
        counter.clear()
    t0, c0 = time.perf_counter(), time.process_time()
    run()
    wall = {op: t / steps for op, t in ops.seconds.items()}
    cpu = {op: t / steps for op, t in ops.cpu_seconds.items()}
    wall[OUTSIDE] = (time.perf_counter() - t0) / steps - sum(wall.values())
    cpu[OUTSIDE] = (time.process_time() - c0) / steps - sum(cpu.values())
    wall[TOTAL], cpu[TOTAL] = sum(wall.values()), sum(cpu.values())
    return PhaseTimes(wall, cpu, {op: n / steps for op, n in ops.calls.items()},
                      {op: statistics.median(each) for op, each in ops.each.items()})


def op_times(f: gguf.GGUFFile, prompt: list[int], tokens: int, threads: int, cpu_dot: str = "exact") -> list[dict]:
    """Per op: wall and CPU ms (the process's, all threads) and calls of a prefill of `prompt` and of a decode
    step (the mean of `tokens` greedy steps), and the median wall ms of one call, on the opened file `f`, after one
    untimed warm-up run, with the cpu dot product `cpu_dot`.
    The warm-up matters: a freshly opened model's first prefill also pays a page fault per newly touched range
    of the mapped file (~60,000 on the 2-layer q4 file at 32 tokens, ~0.12 s of a ~1.1 s prefill), which
    run_ds4's warm-up prefill takes too, so the totals here match its figures."""
    ops = TimedOps("auto", cpu_dot=cpu_dot)
    with as_loaded(f, ops) as model:
        for _ in range(2):         # the first run warms the page cache and the kernels up
            s = Session(model, len(prompt) + tokens + 1, len(prompt))
            last: list[int] = []
            prefill = timed_phase(ops, lambda: last.append(greedy(s, s.prefill(prompt))))  # noqa: B023

            def decode_all():
                for _ in range(tokens):
                    last.append(greedy(s, s.decode(last[-1])))  # noqa: B023

            decode = timed_phase(ops, decode_all, tokens)
    out = []
    last_rows = {OUTSIDE: 1, TOTAL: 2}
    names = prefill.wall.keys() | decode.wall.keys()
    for op in sorted(names, key=lambda o: (last_rows.get(o, 0), -prefill.wall.get(o, 0) - decode.wall.get(o, 0))):
        out.append({"weights": f.weights, "threads": threads, "dot": cpu_dot, "op": op,
                    "prefill_ms": f"{1e3 * prefill.wall.get(op, 0):.1f}",
                    "prefill_cpu_ms": f"{1e3 * prefill.cpu.get(op, 0):.1f}",
                    "prefill_pct": f"{100 * prefill.wall.get(op, 0) / prefill.wall[TOTAL]:.1f}",
                    "prefill_calls": f"{prefill.calls.get(op, 0):g}",
                    "prefill_call_ms": f"{1e3 * prefill.median_call[op]:.2f}" if op in prefill.median_call else "-",
                    "decode_ms": f"{1e3 * decode.wall.get(op, 0):.2f}",
                    "decode_cpu_ms": f"{1e3 * decode.cpu.get(op, 0):.2f}",
                    "decode_pct": f"{100 * decode.wall.get(op, 0) / decode.wall[TOTAL]:.1f}",
                    "decode_calls": f"{decode.calls.get(op, 0):g}",
                    "decode_call_ms": f"{1e3 * decode.median_call[op]:.3f}" if op in decode.median_call else "-"})
    return out


def run_llama(binary: str, path: Path, prompt: int, tokens: int, threads: int, extra: list[str]) -> Timing:
    """llama-bench on the file (one repetition of a `prompt`-token prefill and a `tokens`-token decode)."""
    cmd = [binary, "-m", str(path), "-p", str(prompt), "-n", str(tokens), "-t", str(threads), "-r", "1", "-o", "json",
           *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise UsageError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    results = json.loads(done.stdout)
    rate = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in results}
    return Timing(rate["prefill"], rate["decode"])


def rows(a) -> list[dict]:
    """Interleaved rounds of ds4py and llama-bench per mix and thread count; medians, GB/s and ratios."""
    binary = os.environ.get("LLAMA_BENCH")
    if binary and not Path(binary).is_file():
        raise UsageError(f"LLAMA_BENCH={binary} is not a file")
    workdir = Path(a.workdir or Path.home() / ".cache" / "ds4py" / "bench-full")
    workdir.mkdir(parents=True, exist_ok=True)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    copy = copy_bandwidth(torch.device("cpu"), 5)
    torch.set_num_threads(before)
    print(f"# one-thread copy bandwidth {copy / 1e9:.1f} GB/s (read + written); "
          f"{'llama-bench ' + binary if binary else 'no LLAMA_BENCH: ds4py only'}", flush=True)
    out = []
    for mix in a.full_mixes:
        path = workdir / f"v4flash-{'tiny' if a.full_tiny else 'full'}-{a.full_layers}L-{mix}.gguf"
        if not path.exists():
            t0 = time.perf_counter()
            write_model(path, a.full_layers, mix, a.full_tiny)
            size = path.stat().st_size / 1e9
            print(f"# wrote {path} ({size:.2f} GB) in {time.perf_counter() - t0:.0f} s", flush=True)
        step = decode_bytes(path)
        vocab = ModelArgs.from_metadata(gguf.open(path).metadata).vocab_size
        prompt = torch.randint(0, vocab, (a.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        if a.op_times:
            try:
                for weights in a.weights or ["mmap"]:
                    f, _ = open_timed(path, weights)
                    for threads in a.threads:
                        kernels.set_threads(threads)
                        for dot in a.cpu_dot:
                            out += [{"mix": mix, **r} for r in op_times(f, prompt, a.tokens, threads, dot)]
                    del f
                    gc.collect()
            finally:
                torch.set_num_threads(before)
            continue
        times: dict[tuple[str, str, int], list[Timing]] = {}
        try:
            for r in range(a.rounds + 1):          # round 0 warms up (page cache, kernels) and is not counted
                for weights in a.weights or ["mmap"]:
                    f, load_s = open_timed(path, weights)
                    for threads in a.threads:
                        kernels.set_threads(threads)
                        for dot in a.cpu_dot:
                            t = run_ds4(f, prompt, a.tokens, dot)
                            if r:
                                times.setdefault((engine_name(dot), weights, threads), []).append(
                                    Timing(t.prefill_tok_s, t.decode_tok_s, load_s))
                    del f
                    gc.collect()
                for threads in a.threads if binary else ():
                    llama = run_llama(binary, path, a.prompt, a.tokens, threads, a.llama_args.split())
                    if r:
                        times.setdefault(("llama.cpp", "-", threads), []).append(llama)
        finally:
            torch.set_num_threads(before)
        for (engine, weights, threads), ts in times.items():
            decode = statistics.median(t.decode_tok_s for t in ts)
            prefill = statistics.median(t.prefill_tok_s for t in ts)
            load = f"{statistics.median(t.load_s for t in ts):.2f}" if weights != "-" else "-"
            row = {"mix": mix, "layers": a.full_layers, "engine": engine, "weights": weights, "load_s": load,
                   "threads": threads, "prefill_tok_s": f"{prefill:.2f}", "decode_tok_s": f"{decode:.2f}",
                   "decode_GB_s": f"{decode * step / 1e9:.2f}",
                   "pct_copy_1thread": f"{100 * decode * step / copy:.0f}"}
            if binary:
                ref = times[("llama.cpp", "-", threads)]
                row["decode_x_llama"] = f"{decode / statistics.median(t.decode_tok_s for t in ref):.2f}"
                row["prefill_x_llama"] = f"{prefill / statistics.median(t.prefill_tok_s for t in ref):.2f}"
            out.append(row)
    if a.png:
        plot(out, a.png)
    return out


def plot(table: list[dict], path: str) -> None:
    """Decode and prefill tok/s against threads, one line per (mix, engine, weights)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for key in sorted({(r["mix"], r["engine"], r["weights"]) for r in table}):
        rs = sorted((r for r in table if (r["mix"], r["engine"], r["weights"]) == key), key=lambda r: r["threads"])
        for ax, field in zip(axes, ("decode_tok_s", "prefill_tok_s"), strict=True):
            ax.plot([r["threads"] for r in rs], [float(r[field]) for r in rs], marker="o",
                    label=" ".join(k for k in key if k != "-"))
    for ax, title in zip(axes, ("decode", "prefill"), strict=True):
        ax.set_xlabel("threads")
        ax.set_ylabel("tokens/s")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
