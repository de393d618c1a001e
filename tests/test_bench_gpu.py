"""scripts/bench.py gpu: the dry run goes through every stage at smoke size and writes its Markdown, CSV and PNG;
without --dry-run a CPU machine gets one usage error; pytest's summary is read into counts and failing ids."""
from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest

from ds4.bench import gpu
from ds4.bench.gpu import test_summary as summarize
from ds4.errors import UsageError
from tests.script_modules import script

TABLES = ["native kernel tests", "qmatmul", "moe", "indexer", "argmax", "model q2", "model q4",
          "model q2 cuda graphs", "model q4 cuda graphs", "speculative frontier", "compile report"]


@pytest.mark.interpreter_only(reason="the dry run is the CPU's stand-in for the GPU run")
def test_dry_run_writes_every_table(tmp_path, capsys):
    assert script("bench").main(["gpu", "--dry-run", "--out", str(tmp_path), "--csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index("table,rows,seconds,status")
    summary = [line.split(",") for line in lines[header + 1:]]
    assert [row[0] for row in summary] == TABLES and {row[3] for row in summary} == {"ok"}
    md = (tmp_path / "gpu.md").read_text()
    assert md.startswith("## GPU check") and "Dry run: smoke sizes, no GPU figure." in md
    assert all(f"### {title}" in md for title in TABLES)
    with (tmp_path / "gpu.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["table"] for r in rows if r["table"] == "native kernel tests"] == ["native kernel tests"]
    tests = next(r for r in rows if r["table"] == "native kernel tests")
    assert int(tests["passed"]) >= 1 and tests["failed"] == "0" and tests["exit"] == "0"
    assert {r["table"] for r in rows} == set(TABLES)
    assert (tmp_path / "gpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "passed" in (tmp_path / "tests.log").read_text()


@pytest.mark.interpreter_only(reason="a CUDA machine runs the real check")
def test_without_a_gpu_the_real_run_is_refused(tmp_path):
    with pytest.raises(UsageError, match="bench.py gpu needs a CUDA GPU.*--dry-run"):
        script("bench").run(["gpu", "--out", str(tmp_path)])


def test_pytest_summary_is_read_into_counts_and_failing_ids():
    out = ("..F.s\nFAILED tests/test_qmatmul.py::test_x[Q4_K] - AssertionError: max error\n"
           "ERROR tests/test_native_gpu.py::test_y - RuntimeError\n"
           "==== 1 failed, 3 passed, 1 skipped, 1 error in 12.5s ====")
    got = summarize(out, 1)
    assert (got["exit"], got["passed"], got["failed"], got["errors"], got["skipped"]) == (1, 3, 1, 1, 1)
    assert got["failing"] == "tests/test_qmatmul.py::test_x[Q4_K] tests/test_native_gpu.py::test_y"
    assert got["summary"].startswith("1 failed, 3 passed")


def test_compile_report_reads_registers_spills_and_shared_memory(monkeypatch):
    """From each compiled variant's metadata; occupancy limited by registers, shared memory or threads."""
    def compiled(regs: int, shared: int):
        meta = SimpleNamespace(num_warps=4, num_stages=2, shared=shared)
        return SimpleNamespace(n_regs=regs, n_spills=8, metadata=meta, _init_handles=lambda: None)
    kernel = SimpleNamespace(device_caches={0: ({"a": compiled(128, 0), "b": compiled(32, 100_000)}, {}, None)})
    monkeypatch.setattr(gpu, "jit_kernels", lambda: [("norms.fake_kernel", kernel)])
    h100 = SimpleNamespace(warp_size=32, max_threads_per_multi_processor=2048, shared_memory_per_multiprocessor=233472)
    rows = gpu.compile_report(h100)
    assert [(r["registers"], r["spills"], r["shared_B"], r["occupancy"]) for r in rows] == [
        (128, 8, 0, "25%"), (32, 8, 100_000, "12%")]   # 4 blocks of 128 threads by registers; 2 by shared memory
    assert rows[0]["kernel"] == "norms.fake_kernel" and rows[0]["warps"] == 4


def test_every_triton_kernel_is_found():
    names = {name for name, _ in gpu.jit_kernels()}
    assert {"norms.rms_norm_kernel", "qmatmul.qmatmul_kernel", "moe.route_kernel", "hyper.hc_pre_kernel"} <= names
