"""kvdisk: time to first token of a long conversation's next turn in a fresh server process, without the disk
prefix cache and with the cache an earlier server process filled (`--kv-disk-dir`)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ds4.engine import default_model_paths
from ds4.errors import UsageError
from ds4.formats import gguf
from ds4.tokenizer import Tokenizer

START_TIMEOUT_S = 300
SERVED_NAME = "kvdisk-bench"


class Server:
    """`python -m ds4.server` in a child process on a free loopback port, stopped as Ctrl-C stops it."""

    def __init__(self, flags: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        command = [sys.executable, "-m", "ds4.server", "--port", str(port), "--served-model-name", SERVED_NAME]
        self.proc = subprocess.Popen([*command, *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise UsageError(f"the server did not start: {self.proc.stderr.read()[-500:]}")
            try:
                urllib.request.urlopen(f"{self.url}/models", timeout=2).close()
                return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise UsageError(f"the server did not answer within {START_TIMEOUT_S} s") from None
                time.sleep(0.2)

    def complete(self, ids: list[int], max_tokens: int) -> tuple[float, str, int]:
        """Greedy streamed completion of `ids`: (seconds to the first text, the whole text, cached prompt tokens)."""
        body = json.dumps({"model": SERVED_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}})
        request = urllib.request.Request(f"{self.url}/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        start, first, pieces, cached = time.perf_counter(), None, [], 0
        with urllib.request.urlopen(request, timeout=3600) as response:
            for line in response:
                line = line.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                text = chunk["choices"][0]["text"] if chunk["choices"] else ""
                if text and first is None:
                    first = time.perf_counter() - start
                pieces.append(text)
                cached = (chunk.get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens", cached)
        return (first if first is not None else time.perf_counter() - start), "".join(pieces), cached

    def stop(self) -> None:
        """SIGINT, as Ctrl-C: the server finishes its cache writes and exits."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def conversation(model: str, first: int, more: int) -> tuple[list[int], list[int]]:
    """Token ids of a raw code conversation: the first turn, and the next turn that extends it."""
    tokenizer = Tokenizer.from_metadata(gguf.open(model).metadata)
    text = "".join(Path(m.__file__).read_text() for m in (argparse, json, subprocess, tempfile))
    ids = tokenizer.encode(text)
    if len(ids) < first + more:
        raise UsageError(f"--first + --more must be at most {len(ids)} tokens")
    return ids[:first], ids[:first + more]


def rows(args: argparse.Namespace, device) -> list[dict]:
    """Turn 1 on a cache-filling server; turn 2 on a fresh server without the cache, then on one with it."""
    if args.first < 2 or args.more < 1 or args.tokens < 1:
        raise UsageError("--first must be >= 2, --more and --tokens >= 1")
    model = args.model or default_model_paths()[0]
    turn1, turn2 = conversation(model, args.first, args.more)
    flags = ["--ctx", str(args.ctx), "--prefill-chunk", str(args.prefill_chunk), "--threads", str(args.threads)]
    if args.model:
        flags += ["--model", args.model] + (["--mtp", args.mtp] if args.mtp else [])
    with tempfile.TemporaryDirectory() as cache_dir:
        cache = ["--kv-disk-dir", cache_dir]
        out = []
        for name, extra, ids in (("turn 1, fills the cache", cache, turn1), ("turn 2, no cache", [], turn2),
                                 ("turn 2, new process, warm cache", cache, turn2)):
            server = Server(flags + extra)
            try:
                server.complete([1, 2, 3], 1)  # warm-up: the first request's one-time costs are not prefill
                ttft, text, cached = server.complete(ids, args.tokens)
            finally:
                server.stop()
            out.append({"run": name, "prompt_tokens": len(ids), "cached_tokens": cached, "ttft_s": round(ttft, 3),
                        "text": text,
                        "cache_files": len(os.listdir(cache_dir))})
    cold = out[1]
    for row in out:
        row["no_cache/this"] = f"{cold['ttft_s'] / max(row['ttft_s'], 1e-9):.2f}x" if row is not out[0] else "-"
        row["same_output"] = "-" if row is out[0] else row["text"] == cold["text"]
    print(f"# {os.cpu_count()} CPUs, {args.threads} torch threads; model {model}", flush=True)
    for row in out:
        row["text"] = f"{len(row.pop('text'))} chars"
    return out


def add_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the disk-cache benchmark."""
    p.add_argument("--model", help="base GGUF (default: the embedded model)")
    p.add_argument("--mtp", help="MTP GGUF (default: the embedded model's)")
    p.add_argument("--first", type=int, default=3000, help="tokens of the conversation's first turn")
    p.add_argument("--more", type=int, default=200, help="tokens the next turn adds")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--ctx", type=int, default=4096, help="server --ctx")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="server --prefill-chunk")
    p.add_argument("--threads", type=int, default=1, help="server --threads")
