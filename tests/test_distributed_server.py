"""The server across ranks (docs/distributed.md, "Serving"): `python -m ds4.server --parallel ep` on two gloo
ranks (rank 0 serves, rank 1 follows) answers like one process, and rank 0's shutdown or death ends rank 1."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch.multiprocessing as mp

import ds4
from ds4.errors import ParallelError
from ds4.server.app import create_app

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = [  # (path, body): greedy and seeded sampling, streaming and not, a second turn reusing the first's prefix,
    # a stop string (it cancels the job a few tokens on, when the server sees it), a JSON-constrained request
    ("/v1/completions", {"prompt": "def read_config(path):", "max_tokens": 16, "temperature": 0}),
    ("/v1/completions", {"prompt": "import os\n", "max_tokens": 12, "stream": True, "temperature": 0.9, "seed": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": True,
                              "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
                                           {"role": "user", "content": "more"}], "max_tokens": 12,
                              "temperature": 0.7, "top_k": 20, "seed": 11, "logprobs": True}),
    ("/v1/completions", {"prompt": "def read_config(path):", "max_tokens": 40, "stop": ["\n"], "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a JSON object"}], "max_tokens": 12,
                              "response_format": {"type": "json_object"}, "temperature": 0}),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    """The answer's text, finish reason and token count (a stream's chunks joined)."""
    request = urllib.request.Request(url, json.dumps({"model": "deepseek-v4-flash", **body}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        if not body.get("stream"):
            answer = json.loads(response.read())
            choice = answer["choices"][0]
            text = choice.get("text", choice.get("message", {}).get("content"))
            logprobs = choice.get("logprobs") and [t["token"] for t in choice["logprobs"]["content"]]
            tokens = None if body.get("stop") else answer["usage"]["completion_tokens"]  # a stop string: timing
            return {"text": text, "finish": choice["finish_reason"], "tokens": tokens, "logprobs": logprobs}
        text, finish = "", None
        for line in response:
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                finish = choice.get("finish_reason") or finish
        return {"text": text, "finish": finish}


def answers(base: str) -> list[dict]:
    return [post(base + path, body) for path, body in REQUESTS]


def wait_healthy(base: str, procs: list[subprocess.Popen], logs: Path) -> None:
    """Return once rank 0 answers /health (both ranks still running)."""
    deadline = time.monotonic() + 90
    while True:
        assert all(p.poll() is None for p in procs), [(logs / f"rank{r}.log").read_text() for r in (0, 1)]
        assert time.monotonic() < deadline, "the ranks did not start"
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return
        except OSError:
            time.sleep(0.2)


@pytest.fixture
def ranks(tmp_path):
    """Two ranks of `python -m ds4.server --parallel ep` (rank 0 on a free port), starting."""
    port, master = free_port(), free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "DS4_DIST_CHECK": "1",
               "DS4_DIST_TIMEOUT": "30", "PYTHONPATH": str(ROOT)}
        with open(tmp_path / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "ds4.server", "--parallel", "ep", "--port",
                                           str(port), "--ctx", "256", "--threads", "1"], env=env, stdout=log,
                                          stderr=log))
    yield f"http://127.0.0.1:{port}", procs, tmp_path
    for p in procs:
        if p.poll() is None:
            p.kill()


def test_two_ranks_serve_like_one_process(ranks):
    """Every request answers with the same tokens as one process (asked while the ranks start); then rank 0's
    shutdown (SIGTERM) ends rank 1 cleanly."""
    from test_serve import LiveServer
    base, procs, logs = ranks
    single = LiveServer(create_app(ds4.load(ctx=256)))
    try:
        want = answers(single.url.removesuffix("/v1"))
    finally:
        single.close()
    wait_healthy(base, procs, logs)
    got = answers(base)
    procs[0].send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=30) for p in procs]
    assert got == want
    assert got[3]["logprobs"] and got[0]["finish"] == "length" and got[4]["finish"] == "stop"
    # rank 0 ends as uvicorn does after a graceful shutdown (re-raising the signal it handled)
    assert codes[0] in (0, -signal.SIGTERM) and codes[1] == 0, [(logs / f"rank{r}.log").read_text()[-2000:]
                                                                 for r in (0, 1)]


def compile_then_die(rank: int, port: int, out_dir: str) -> None:
    """Both ranks run a compiled function holding `ops.all_reduce` (the functional collective); then
    rank 0 sends one heartbeat and dies, and rank 1 follows until its next receive fails."""
    import torch

    from backends.registry import OpSet
    from ds4 import distributed
    from ds4.server.ranks import Heartbeat, Link
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS4_DIST_TIMEOUT="20")
    torch.set_num_threads(1)
    link = Link(distributed.start("ep", None)[0])
    ops = OpSet("torch", parallel="ep")
    # traced whole (fullgraph) through AOTAutograd; inductor's lowering of it runs in the once-run check of
    # docs/distributed.md (compiling with inductor here would cost half a minute)
    step = torch.compile(lambda x: ops.all_reduce(x * 2.0) + 1.0, backend="aot_eager", fullgraph=True)
    summed = step(torch.full((2, 3), float(rank + 1)))
    if rank == 0:
        link.send(Heartbeat())
        os._exit(0)
    assert isinstance(link.receive(), Heartbeat)
    started = time.monotonic()
    try:
        link.receive()
    except ParallelError as e:
        Path(out_dir, "rank1.txt").write_text(f"{summed.tolist()}|{time.monotonic() - started:.1f}|{e}")


def test_compiled_all_reduce_then_a_follower_whose_rank_0_dies_gets_a_parallel_error(tmp_path):
    port = free_port()
    procs = [mp.get_context("spawn").Process(target=compile_then_die, args=(r, port, str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    summed, seconds, message = (tmp_path / "rank1.txt").read_text().split("|", 2)
    assert summed == str([[7.0] * 3] * 2)   # 2·1 + 2·2 summed over the ranks, plus 1
    assert message.startswith("rank 1 of 2: a collective failed") and float(seconds) < 20


def test_bench_ranks_smoke():
    """`bench.py ranks` in one process: a row of memory and speed, and a row per collective size."""
    import argparse

    from ds4.bench import ranks
    parser = argparse.ArgumentParser()
    ranks.add_args(parser, on_gpu=False)
    args = parser.parse_args(["--prompt", "3", "--decode", "2", "--collectives", "8"])
    args.reps = 1
    memory, collective = ranks.rows(args, None)
    assert memory["ranks"] == 1 and float(memory["expert_GB"]) > 0 and float(memory["peak_rss_GB"]) > 0
    assert collective["collective_rows"] == 8 and collective["all_reduce_MB_sent"] == "0"


def test_what_does_not_run_across_ranks_is_one_error_line(tmp_path, capsys):
    from ds4.server.app import main
    assert main(["--parallel", "ep", "--kv-disk-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: --kv-disk-dir does not run across ranks yet: drop it with --parallel\n"
