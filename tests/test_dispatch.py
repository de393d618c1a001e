"""Per-step overhead: the OpSet's bound calls, the cheap logits check, and the compiled-step cache on disk."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.precompiled import compile_cache_dir
from backends.registry import OpSet
from ds4.errors import NonFiniteError
from ds4.session import check_finite

ROOT = Path(__file__).resolve().parents[1]


def test_opset_binds_each_op_once_and_still_counts():
    ops = OpSet("torch")
    x = torch.randn(2, 8)
    ops.rms_norm(x)
    assert "rms_norm" in vars(ops)       # later lookups are plain attribute reads, no __getattr__
    first = ops.rms_norm
    assert ops.rms_norm is first
    ops.rms_norm(x)
    assert ops.report()["rms_norm"]["calls"] == 2
    with pytest.raises(AttributeError, match="no op named"):
        ops.not_an_op   # noqa: B018


def test_a_subclass_that_wraps_calls_is_asked_every_time():
    seen = []

    class Wrapping(OpSet):
        def __getattr__(self, op):
            call = super().__getattr__(op)
            return lambda *a, **k: seen.append(op) or call(*a, **k)

    ops = Wrapping("torch")
    for _ in range(3):
        ops.rms_norm(torch.randn(1, 8))
    assert seen == ["rms_norm"] * 3 and "rms_norm" not in vars(ops)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_names_the_row(bad):
    logits = torch.randn(3, 1000)
    logits[1, 17] = bad
    with pytest.raises(NonFiniteError, match="position 8"):
        check_finite(logits, [7, 8, 9], "logits")


def test_check_finite_accepts_huge_finite_rows():
    """A row whose sum overflows is still finite: the fast sum check falls back to the exact one."""
    logits = torch.full((2, 1000), 3e38)
    check_finite(logits, [0, 1], "logits")


def test_compile_cache_dir_follows_ds4_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("DS4_CACHE", str(tmp_path))
    assert compile_cache_dir() == tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache_dir() == tmp_path / "mine"


COMPILE_ONCE = """
import json, sys, torch
from backends.arrays import TorchArrays
from backends.cpu import kernels
from ops.quants import QTensor
w = QTensor.quantize(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)), "Q8_0", "w")
step = TorchArrays("cpu").compile(lambda x: torch.softmax(kernels.qgemv(x, w) * 2, dim=-1).sum(0))
x = torch.randn(1, 256, generator=torch.Generator().manual_seed(1))
y = step(x)
print(json.dumps({"loaded": step.loaded, "compiled": step.compiled, "dynamo": "torch._dynamo" in sys.modules,
                  "inductor": "torch._inductor" in sys.modules, "y": y.tolist(),
                  "eager": torch.softmax(kernels.qgemv(x, w) * 2, dim=-1).sum(0).tolist()}))
"""


def test_a_second_process_loads_the_compiled_step_without_tracing(tmp_path):
    """The compiled step is saved under $TORCHINDUCTOR_CACHE_DIR; a fresh process with the same function and arguments
    loads the package (inductor's code calling the fused kernel's custom op) with torch's C++ loader: neither dynamo
    nor inductor imported."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": str(ROOT)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", COMPILE_ONCE], env=env, cwd=ROOT, check=True,
                                      capture_output=True, text=True).stdout.splitlines()[-1]) for _ in range(2)]
    assert (runs[0]["compiled"], runs[0]["loaded"]) == (1, 0) and runs[0]["inductor"]
    assert (runs[1]["compiled"], runs[1]["loaded"]) == (0, 1)
    assert not runs[1]["dynamo"] and not runs[1]["inductor"]
    for run in runs:
        assert torch.allclose(torch.tensor(run["y"]), torch.tensor(run["eager"]), atol=1e-6)
    assert len(list((tmp_path / "inductor" / "steps").glob("*.pt2"))) == 1
