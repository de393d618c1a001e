"""`scripts/bench.py cpu --gemv` at smoke size: a row per type and row count, GB/s against the copy and read
bandwidths, 1 and 2 threads (timings are not checked; tests never time)."""
from __future__ import annotations

from backends.cpu import kernels
from tests.script_modules import script

bench = script("bench")


def test_bench_gemv_smoke(capsys, monkeypatch):
    monkeypatch.setattr(kernels, "_pool_threads", 0)     # the bench sets the pool's threads; restored after
    bench.main(["cpu", "--gemv", "--size", "smoke", "--rounds", "1"])
    out = capsys.readouterr().out
    for qtype in ("IQ2_XXS", "Q2_K", "Q4_K", "Q8_0", "F16", "IQ3_XXS", "IQ1_M", "TQ1_0", "MXFP4", "BF16", "Q3_K",
                  "Q6_K", "IQ4_XS", "Q5_1"):
        assert qtype in out
    assert "pct_copy" in out and "x_M1" in out and "q8_pct_copy" in out and "x_ref" in out
    assert "read_GB_s" in out and "pct_read_2t" in out and "q8_GB_s_2t" in out
