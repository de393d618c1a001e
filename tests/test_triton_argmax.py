"""verify_argmax: the Triton kernel (interpreter) equals the PyTorch reference exactly, and is batch-invariant.

Both results are exact: the top-1 id is an integer and the margin a single float32 subtraction of two
copied logits, so the kernel must match the reference bit for bit (tolerance 0).
"""
import pytest
import torch

from backends.registry import implementations
from ops.qmatmul import SMALL_M
from ops.verify_argmax import verify_argmax as reference
from tests.script_modules import script

pytestmark = pytest.mark.on_device  # CUDA when present, else the interpreter (tests/devices.py)


def kernel():
    """The registered Triton verify_argmax."""
    return implementations("verify_argmax")["triton"].fn


def logits(m: int, v: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Random logits [m, v]."""
    return (torch.randn(m, v, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)


@pytest.mark.parametrize("v", [2, 1000, 2053])  # one partial tile; several tiles with a partial last one
def test_matches_reference_and_is_batch_invariant(v):
    """M = 1..17 equal the reference exactly; rows of M <= 16 equal the 1-row calls bitwise."""
    x = logits(SMALL_M + 1, v)
    top1, margin = kernel()(x)
    ref1, ref_margin = reference(x)
    assert torch.equal(top1, ref1) and torch.equal(margin, ref_margin)
    single = [kernel()(x[r:r + 1]) for r in range(SMALL_M)]
    for m in range(1, SMALL_M + 1):
        t, g = kernel()(x[:m])
        assert torch.equal(t, torch.cat([s[0] for s in single[:m]]))
        assert torch.equal(g, torch.cat([s[1] for s in single[:m]]))


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf - inf in the interpreter
def test_ties_go_to_the_lowest_id_with_margin_zero():
    """A maximum repeated within a tile, across tiles, at the last id, and a constant row."""
    x = logits(5, 2053, seed=1)
    x[0, [7, 3, 900]] = 50.0                  # same tile: id 3
    x[1, [2050, 1500]] = 50.0                 # different tiles: id 1500
    x[2, 2052] = 50.0                         # last id, margin over the runner-up
    x[3] = 1.5                                # constant row: id 0, margin 0
    x[4, 0], x[4, 1] = float("inf"), float("inf")
    top1, margin = kernel()(x)
    ref1, ref_margin = reference(x)
    assert top1.tolist() == [3, 1500, 2052, 0, 0] == ref1.tolist()
    assert margin[[0, 1, 3]].tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(margin, ref_margin, rtol=0, atol=0, equal_nan=True)


def test_float16_logits():
    """float16 logits are compared after the exact widening to float32."""
    x = logits(3, 777, seed=2, dtype=torch.float16)
    top1, margin = kernel()(x)
    ref1, ref_margin = reference(x)
    assert torch.equal(top1, ref1) and torch.equal(margin, ref_margin)


@pytest.mark.interpreter_only(reason="on a GPU the Triton columns are timed")
def test_bench_argmax_prints_the_reference_beside_the_kernel(capsys):
    """scripts/bench.py argmax on a CPU: the reference's time, the Triton columns empty (CUDA only)."""
    bench = script("bench")
    bench.main(["argmax", "--csv", "--reps", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "op,case,M,triton_us,reference_us,x_reference"
    assert [line.split(",")[:4] for line in lines[3:]] == [["verify_argmax", "vocab 129280", "1", "-"],
                                                         ["verify_argmax", "vocab 129280", "16", "-"]]
