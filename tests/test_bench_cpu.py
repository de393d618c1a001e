"""`scripts/bench.py cpu` at smoke size: it converts, runs every engine and prints its table (timings are
not checked; tests never time)."""
from __future__ import annotations

import pytest

from tests.script_modules import script

pytest.importorskip("transformers")

bench = script("bench")


def test_bench_cpu_smoke(tmp_path, capsys):
    bench.main(["cpu", "--size", "smoke", "--mixes", "f32", "q4", "--threads", "1", "--rounds", "1",
                "--prompt", "6", "--tokens", "2", "--tiny-steps", "1", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    for engine in ("transformers f32", "ds4py f32", "ds4py q4", "2-row verify"):
        assert engine in out
    assert "decode_x_transformers" in out


def test_bench_cpu_compiled_smoke(tmp_path, capsys):
    bench.main(["cpu", "--size", "smoke", "--mixes", "f32", "--threads", "1", "--rounds", "1", "--prompt", "6",
                "--tokens", "2", "--tiny-steps", "0", "--compile", "--workdir", str(tmp_path)])
    assert "ds4py f32 compiled" in capsys.readouterr().out


FAKE_LLAMA_BENCH = """#!/bin/sh
echo '[{"n_prompt": 6, "n_gen": 0, "avg_ts": 12.5}, {"n_prompt": 0, "n_gen": 2, "avg_ts": 4.0}]'
"""


def test_bench_cpu_llama_smoke(tmp_path, capsys, monkeypatch):
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH)
    fake.chmod(0o755)
    monkeypatch.setenv("LLAMA_BENCH", str(fake))
    bench.main(["cpu", "--size", "smoke", "--mixes", "q4", "--threads", "1", "--rounds", "1", "--prompt", "6",
                "--tokens", "2", "--tiny-steps", "1", "--cpu-dot", "exact", "q8", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "ds4py q4 --cpu-dot q8" in out and "llama.cpp q4" in out
    assert "decode_x_llama" in out and "prefill_x_llama" in out


def test_bench_cpu_llama_shapes():
    from ds4.bench import cpu
    from ds4.tiny.hf import tiny_config
    cfg = tiny_config(**cpu.SIZES["small-llama"])
    assert cfg.head_dim % 64 == 0 and cfg.index_head_dim % 64 == 0
    assert set(cfg.compress_rates.values()) <= {4, 128}
