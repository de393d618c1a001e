"""scripts/bench.py model at smoke size (the tiny model's sizes, 3 layers, CPU, torch backend): one CSV
row with every column and a PNG; the random full-size weights are checked for their stored types and
byte counts on a 1-layer V4 Flash slice without running it."""
import csv
import io

import pytest

from ds4.cost import PassCost
from ds4.errors import UsageError
from ds4.formats.quant_mix import tensor_type
from ds4.tiny.random_model import random_args, random_weight
from models.args import model_shapes
from tests.script_modules import script

COLUMNS = ["device", "mix", "layers", "prompt", "prefill_tok_s", "decode_tok_s", "ms_per_layer", "step_GB",
           "copy_GB_s", "roofline_tok_s", "pct_roofline"]


def load_bench():
    """scripts/bench.py as a module."""
    return script("bench")


def test_bench_model_smoke(capsys, tmp_path):
    png = tmp_path / "model.png"
    load_bench().main(["model", "--tiny", "--layers", "3", "--prompt", "5", "--decode", "2", "--backend", "torch",
                       "--csv", "--reps", "1", "--png", str(png)])
    captured = capsys.readouterr()
    rows = list(csv.DictReader(io.StringIO(captured.out)))
    assert len(rows) == 1 and list(rows[0]) == COLUMNS
    row = rows[0]
    assert row["device"] == "cpu" and row["layers"] == "3" and row["mix"] == "q2"
    assert float(row["decode_tok_s"]) > 0 and float(row["prefill_tok_s"]) > 0
    assert float(row["pct_roofline"]) == pytest.approx(
        100 * float(row["decode_tok_s"]) / float(row["roofline_tok_s"]), rel=0.01)
    assert "sparse_attention" in captured.err             # the backends report goes to stderr
    assert png.stat().st_size > 0


def test_bench_model_rejects_bad_sizes():
    bench = load_bench()
    with pytest.raises(UsageError, match=">= 1"):
        bench.run(["model", "--tiny", "--layers", "0"])


def test_random_flash_layer_has_the_stored_types_and_bytes():
    """One V4 Flash layer under q2: every tensor in the mix's type; the dense bytes equal ds4/cost.py's."""
    import torch
    args = random_args(1)
    g = torch.Generator().manual_seed(0)
    shapes = {n: s for n, s in model_shapes(args).items() if n.startswith("blk.0.attn_") or n.endswith("norm.weight")}
    for name, shape in list(shapes.items())[:6]:
        w = random_weight(name, shape, args, "q2", torch.device("cpu"), g)
        assert w.qtype.name == tensor_type(name, shape, "q2") and w.shape == shape
        assert w.data.shape[:-1] == shape[:-1] and w.data.shape[-1] == w.qtype.row_bytes(shape[-1])
    experts = random_weight("blk.0.ffn_down_exps.weight", (4, 4096, 2048), args, "q2", torch.device("cpu"), g)
    assert experts.qtype.name == "Q2_K" and experts.data.shape == (4, 4096, experts.qtype.row_bytes(2048))
    flat = experts.data.reshape(-1, experts.data.shape[-1])    # large: seed rows repeated down the tensor
    assert torch.equal(flat[64:128], flat[:64]) and not torch.equal(flat[1], flat[0])
    assert PassCost(args, "q2").target_pass(1) > 0


def test_bench_model_repacks_as_load_does(capsys, monkeypatch):
    """On the CPU under --cpu-dot q8 the random weights (in this process's memory) get ds4.load's load-time repacks;
    the exact run gets none."""
    from ds4.bench import model
    calls = []
    monkeypatch.setattr(model, "repack_at_load", lambda m: calls.append(m.ops.cpu_dot))
    for dot in ("q8", "exact"):
        load_bench().main(["model", "--tiny", "--layers", "1", "--prompt", "3", "--decode", "1", "--backend", "cpu",
                           "--cpu-dot", dot, "--csv", "--reps", "1"])
    assert calls == ["q8"]
    assert capsys.readouterr().out.count("\ncpu,q2,1,3,") == 2     # both runs' rows
