"""`scripts/bench.py amx-rows` at smoke size: a row per weight and row count, with the three settings' times (and the
repacked Q4_K's, Q2_K's, Q8_0's and IQ2_XXS's)."""
from __future__ import annotations

import pytest

from backends.cpu import kernels
from tests.script_modules import script

bench = script("bench")


@pytest.mark.skipif(not kernels.built(), reason="the cpu kernel library cannot be built here")
def test_bench_amx_rows_smoke(capsys, monkeypatch):
    """Every weight of the suite at M = 1 and 3, one timed round (timings are not checked; tests never time)."""
    monkeypatch.setattr(kernels, "_pool_threads", 0)     # the bench sets the pool's threads; restored after
    assert bench.main(["amx-rows", "--smoke", "--rows", "1", "3", "--rounds", "1", "--csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("type,shape,weight,M,amx,off_ms,off_x_M1,default_ms")
    assert len(lines) == 1 + 7 * 2 and lines[1].split(",")[6] == "1.00"
    assert lines[0].endswith("repacked_ms,repacked_x_M1")
    repacked = [line.split(",")[-2] for line in lines[1:]]
    with_layout = ("Q4_K", "Q2_K", "Q8_0", "IQ2_XXS")
    assert [v != "-" for v in repacked] == [line.split(",")[0] in with_layout for line in lines[1:]]


def test_bench_amx_rows_rejects_too_many_rows(capsys):
    """M above 16 is a one-line usage error."""
    assert bench.main(["amx-rows", "--smoke", "--rows", "17"]) == 2
    assert "--rows must be in 1..16" in capsys.readouterr().err
