"""The OpSet owns the device: weights (in their stored blocks), caches and every activation live on it.
PyTorch's `meta` device stands in for a GPU here — a single op that allocates on the CPU, or a weight or
index array left behind there, fails to mix with meta tensors."""
from __future__ import annotations

import pytest

from backends.registry import OpSet
from ds4.session import Session
from ds4.tiny.build import tiny_model_weights
from models.args import ModelArgs
from models.deepseek_v4 import DeepseekV4
from models.mtp import MTPHead


@pytest.mark.parametrize("mix", ["f32", "q2"])
def test_the_model_runs_on_the_opset_device(mix):
    md, base, mtp = tiny_model_weights(mix=mix)
    trunk = DeepseekV4(ModelArgs.from_metadata(md), base, OpSet("torch", device="meta"))
    assert {trunk.output.data.device.type, trunk.layers[2].experts.gate.data.device.type,
            trunk.layers[2].freqs.device.type} == {"meta"}
    s = Session(trunk, 64, 16, MTPHead(trunk, mtp))
    assert s.caches[2].index_rows.device.type == "meta" and s.mtp_cache.rows.device.type == "meta"
    assert s.prefill(list(range(3, 23))).device.type == "meta"                 # two chunks
    assert s.forward(list(range(3, 8)), "all").shape == (5, 512)               # a verify
    logits, state = s.mtp_draft(4)
    assert logits.device.type == "meta" and state.device.type == "meta"
