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


def test_bench_cpu_holds_models_as_load_does(tmp_path, capsys, monkeypatch):
    """The small models run as `ds4.load` holds them: each engine's own copy of the file in memory (the default) and,
    under q8, the load-time repacks; `--weights mmap` maps the file and repacks nothing; the copies' bytes are the
    file's again after the run."""
    from backends.cpu import repack
    from ds4.bench import cpu
    from ops.quants import QTensor
    seen, real = {}, cpu.run_ds4
    monkeypatch.setattr(cpu, "run_ds4", lambda m, *rest: seen.setdefault((m.ops.cpu_dot, m.output.data.data_ptr()),
                                                                        (type(m.output), m)) and real(m, *rest))
    bench.main(["cpu", "--size", "smoke", "--mixes", "q4", "--threads", "1", "--rounds", "1", "--prompt", "6",
                "--tokens", "2", "--tiny-steps", "0", "--cpu-dot", "exact", "q8", "--weights", "mmap", "memory",
                "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "ds4py q4 --cpu-dot q8 --weights memory" in out and "ds4py q4 --weights mmap" in out
    kinds = sorted((dot, t.__name__) for (dot, _), (t, _) in seen.items())
    q8_memory = "RepackedQ8_0" if repack.worthwhile() else "QTensor"
    assert kinds == sorted([("exact", "QTensor")] * 2 + [("q8", "QTensor"), ("q8", q8_memory)])
    assert all(type(m.output) is QTensor for _, m in seen.values())   # unpacked when the bench ended
