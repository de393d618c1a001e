"""Model: metadata and weight validation, GGUF round trip, switches, routing tie rule."""

import pytest
import torch

from backends.registry import OpSet
from ds4.engine import open_model
from ds4.errors import ModelFileError, UsageError
from ds4.formats import gguf
from ds4.tiny.build import tiny_metadata, tiny_model_weights, write_tiny
from models.args import ModelArgs
from models.deepseek_v4 import DeepseekV4
from ops.moe import Experts, route
from ops.quants import QTensor
from tests.script_modules import script

TORCH = OpSet("torch")  # the reference; Triton kernels under the interpreter are tested elsewhere


@pytest.fixture(scope="module")
def tiny():
    return tiny_model_weights(seed=5, n_layers=4, compress_ratios=(0, 4, 16, 4))


make_tiny = script("make_tiny")


def logits_of(model, ids):
    _, logits = model.forward(torch.tensor(ids), 0, model.new_caches(64, 64), torch.tensor([len(ids) - 1]))
    return logits[0]


def test_metadata_errors_name_the_key(tiny):
    md, _, _ = tiny
    with pytest.raises(ModelFileError, match="deepseek4.attention.sliding_window"):
        ModelArgs.from_metadata({k: v for k, v in md.items() if k != "deepseek4.attention.sliding_window"})
    with pytest.raises(ModelFileError, match="deepseek4.attention.head_count_kv"):
        ModelArgs.from_metadata({**md, "deepseek4.attention.head_count_kv": 2})
    with pytest.raises(ModelFileError, match="deepseek4.attention.compress_ratios"):
        ModelArgs.from_metadata({**md, "deepseek4.attention.compress_ratios": [0, 4]})
    args = ModelArgs.from_metadata(md)
    assert (args.n_layers, args.dim, args.head_dim, args.compress_ratios[:4]) == (4, 128, 80, [0, 4, 16, 4])


def test_weight_errors_name_the_tensor(tiny):
    md, base, _ = tiny
    args = ModelArgs.from_metadata(md)
    with pytest.raises(ModelFileError, match="blk.1.indexer.proj.weight is missing"):
        DeepseekV4(args, {k: v for k, v in base.items() if k != "blk.1.indexer.proj.weight"})
    with pytest.raises(ModelFileError, match="blk.2.attn_sinks.weight has shape"):
        DeepseekV4(args, {**base, "blk.2.attn_sinks.weight": base["blk.2.attn_norm.weight"]})


def test_gguf_round_trip_gives_the_same_logits(tiny, tmp_path):
    md, base, _ = tiny
    write_tiny(str(tmp_path / "t.gguf"), str(tmp_path / "m.gguf"), seed=5, n_layers=4, compress_ratios=(0, 4, 16, 4))
    ids = list(range(3, 40))
    from_file = open_model(str(tmp_path / "t.gguf"), TORCH)
    in_memory = DeepseekV4(ModelArgs.from_metadata(md), base, TORCH)
    assert torch.equal(logits_of(from_file, ids), logits_of(in_memory, ids))


def test_switches_change_the_result(tiny):
    md, base, _ = tiny
    ids = list(range(7, 45))
    ref = logits_of(DeepseekV4(ModelArgs.from_metadata(md), base, TORCH), ids)
    for switch in ("kv_fp8_sim", "indexer_fp4_sim"):
        other = logits_of(DeepseekV4(ModelArgs.from_metadata(md, **{switch: False}), base, TORCH), ids)
        assert not torch.equal(ref, other), switch


def test_expert_ties_go_to_the_lower_id():
    """Router outputs with exact ties (an identity router on one-hot-ish rows) pick the lower expert id."""
    x = torch.tensor([[0.0, 2.0, 2.0, 2.0], [0.5, 0.5, 0.5, 0.5]])
    router = QTensor.quantize(torch.eye(4), "F32")
    stack = QTensor.quantize(torch.zeros(4, 4, 4), "F32")

    def chosen(bias):
        return route(x, torch.zeros(2, dtype=torch.int64), Experts(router, bias, None, stack, stack, stack, 2,
                                                                    1.0, True, 10.0))[0].tolist()
    assert chosen(None) == [[1, 2], [0, 1]]
    assert chosen(torch.tensor([0.0, 0.0, 0.0, 1.0])) == [[3, 1], [3, 0]]


def test_make_tiny_reports_bad_sizes_in_one_line(tmp_path, capsys):
    assert make_tiny.main(["--out", str(tmp_path / "t.gguf"), "--head-dim", "70"]) == 2
    assert capsys.readouterr().err.strip() == ("make_tiny: error: GGUF metadata key deepseek4.rope.dimension_count: "
                                               "16 RoPE dims of 70: the rest must be a multiple of 64")
    assert make_tiny.main(["--out", str(tmp_path / "t.gguf"), "--n-layers", "2", "--compress-ratios", "0,4"]) == 0
    assert ModelArgs.from_metadata(gguf.open(tmp_path / "t.gguf").metadata).n_layers == 2

    with pytest.raises(UsageError, match=r"unknown tiny model sizes \['n_layer'\]"):
        tiny_metadata(n_layer=2)
