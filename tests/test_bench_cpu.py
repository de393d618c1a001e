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
