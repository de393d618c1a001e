"""`scripts/bench.py cpu` at smoke size: it converts, runs every engine and prints its table (timings are
not checked; tests never time)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location("bench", Path(__file__).parents[1] / "scripts" / "bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


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
