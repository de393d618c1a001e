"""`scripts/bench.py cpu --full-layers N` at smoke size (the tiny sizes, `--full-tiny`): it writes the truncated
GGUF, runs ds4py (the file mapped and read into memory) and a stand-in llama-bench (a script printing llama-bench's
JSON) and prints the table with the ratios and the PNG, and `--op-times`' per-op table (timings are not checked;
tests never time)."""
from __future__ import annotations

import stat
import warnings

from tests.script_modules import script

bench = script("bench")

FAKE_LLAMA_BENCH = """#!/bin/sh
echo '[{"n_prompt": 6, "n_gen": 0, "avg_ts": 12.5}, {"n_prompt": 0, "n_gen": 2, "avg_ts": 4.0}]'
"""


def test_bench_full_width_smoke(tmp_path, capsys, monkeypatch):
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("LLAMA_BENCH", str(fake))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # tiny rows fall back to F16 with a warning each
        bench.main(["cpu", "--full-layers", "4", "--full-tiny", "--full-mixes", "q2", "--threads", "1",
                    "--rounds", "1", "--prompt", "6", "--tokens", "2", "--workdir", str(tmp_path),
                    "--png", str(tmp_path / "threads.png"), "--weights", "mmap", "memory"])
    out = capsys.readouterr().out
    assert "ds4py" in out and "llama.cpp" in out and "decode_x_llama" in out and "pct_copy_1thread" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["q2"]]
    assert sorted(r[3] for r in rows if r[2] == "ds4py") == ["memory", "mmap"]   # one row per --weights
    assert (tmp_path / "v4flash-tiny-4L-q2.gguf").exists() and (tmp_path / "threads.png").stat().st_size > 0


def test_bench_full_width_op_times_smoke(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        bench.main(["cpu", "--full-layers", "2", "--full-tiny", "--full-mixes", "q2", "--threads", "1", "2",
                    "--prompt", "6", "--tokens", "2", "--workdir", str(tmp_path), "--op-times",
                    "--cpu-dot", "exact", "q8"])
    out = capsys.readouterr().out
    assert "decode_ms" in out and "ffn" in out and "qmatmul" in out and "(outside op calls)" in out
    assert "decode_call_ms" in out and "prefill_call_ms" in out
    assert " exact " in out and " q8 " in out        # one block per cpu dot product
    assert " mmap " in out and " memory " not in out    # --weights defaults to mmap
    assert "llama.cpp" not in out
