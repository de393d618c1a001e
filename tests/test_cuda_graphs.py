"""CUDA graphs of decode and verify steps (ds4/cuda_graphs.py) as far as a CPU goes: the fixed plan copied into
each step's static buffers, one recorded step per (row count, LM-head rows), the session's results unchanged,
and `--cuda-graphs` refused off CUDA. Recording and replaying on a GPU: tests/test_native_gpu.py."""
from __future__ import annotations

import pytest
import torch

from backends.registry import OpSet
from ds4.cuda_graphs import StepGraphs, cloned, layout, tensors
from ds4.errors import UsageError
from ds4.session import Session, check_cuda_graphs, step_graphs
from ds4.tiny.build import tiny_model_weights
from models.args import ModelArgs
from models.deepseek_v4 import DeepseekV4
from models.mtp import MTPHead
from tests.script_modules import script


@pytest.fixture(scope="module")
def tiny():
    """A tiny trunk and MTP head on the cpu backend (whose fixed plan equals the eager one bit for bit)."""
    md, base, mtp = tiny_model_weights(mix="f32", seed=5)
    trunk = DeepseekV4(ModelArgs.from_metadata(md), base, OpSet("cpu"))
    return trunk, MTPHead(trunk, mtp)


def test_static_buffers_give_the_eager_session_bit_for_bit(tiny):
    trunk, mtp = tiny
    eager, graphed = Session(trunk, 128, 16, mtp), Session(trunk, 128, 16, mtp)
    graphed.graphs = step_graphs(trunk, mtp, capture=False)  # what --cuda-graphs records, without recording
    prompt = list(range(5, 30))
    assert torch.equal(eager.prefill(prompt), graphed.prefill(prompt))  # prefill is never graphed
    buffers = None
    for i, tok in enumerate([7, 9, 11, 13, 40, 41, 42, 43, 44]):      # crosses ratio-4 and ratio-16 blocks
        assert torch.equal(eager.decode(tok), graphed.decode(tok)), f"decode {i}"
        steps = graphed.graphs["trunk"].steps
        buffers = buffers or [t.data_ptr() for t in next(iter(steps.values())).inputs]
    assert [t.data_ptr() for t in next(iter(steps.values())).inputs] == buffers  # the same static buffers
    assert torch.equal(eager.forward([50, 61, 3]), graphed.forward([50, 61, 3]))  # a verify
    assert torch.equal(eager.mtp_draft(5)[0], graphed.mtp_draft(5)[0])
    state, want = graphed.state_tensors(), eager.state_tensors()
    assert all(torch.equal(state[k], want[k]) for k in want)
    trunk_steps = graphed.graphs["trunk"]
    assert len(trunk_steps.steps) == 2 and trunk_steps.replays == 8  # decode (1 row) and verify (3 rows)
    assert graphed.counters["graph_rows"] == 9 + 3 and eager.counters["graph_rows"] == 0
    assert graphed.batch_invariant() == eager.batch_invariant()  # a graph replays the eager kernels


def test_step_inputs_are_copied_and_the_state_argument_is_not():
    calls = []

    def run(x, state, rows):
        calls.append((x, state))
        state += x.sum()
        return x * 2, rows

    graphs = StepGraphs(run, state_arg=1, capture=False)
    state = torch.zeros(1)
    a = torch.tensor([1.0, 2.0])
    out, rows = graphs(a, state, (3,))
    assert torch.equal(out, torch.tensor([2.0, 4.0])) and rows == (3,)
    assert calls[0][0] is not a and calls[0][1] is state               # input copied, state passed as is
    a[0] = 100.0                                                       # the caller's tensor is not the buffer
    out, _ = graphs(torch.tensor([5.0, 6.0]), state, (3,))
    assert torch.equal(out, torch.tensor([10.0, 12.0])) and calls[1][0] is calls[0][0]
    graphs(torch.tensor([1.0, 1.0, 1.0]), state, (3,))                 # another shape: another step
    graphs(torch.tensor([1.0, 1.0]), state, (4,))                      # another host value: another step
    assert len(graphs.steps) == 3 and graphs.replays == 1 and float(state) == 3 + 11 + 3 + 2


def test_tree_helpers_walk_dataclasses_dicts_and_sequences(tiny):
    trunk, _ = tiny
    plans = trunk.plan(7, 2, trunk.new_caches(64, 16), fixed=True)
    copy = cloned(plans)
    assert layout(copy) == layout(plans) and len(tensors(copy)) == len(tensors(plans)) > 10
    pairs = zip(tensors(copy), tensors(plans), strict=True)
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in pairs)
    assert layout(trunk.plan(40, 2, trunk.new_caches(64, 16), fixed=True)) == layout(plans)  # any position
    assert layout(trunk.plan(7, 3, trunk.new_caches(64, 16), fixed=True)) != layout(plans)


def test_cuda_graphs_are_refused_off_cuda(tiny, capsys):
    trunk, mtp = tiny
    with pytest.raises(UsageError, match="--cuda-graphs records CUDA kernels, but the model is on 'cpu'"):
        Session(trunk, 64, 16, mtp, cuda_graphs=True)
    with pytest.raises(UsageError, match="--cuda-graphs and --compile are exclusive"):
        check_cuda_graphs("cuda:0", compile=True)
    assert script("generate").main(["--prompt-ids", "0,1", "-n", "1", "--cuda-graphs"]) == 2
    assert "--cuda-graphs records CUDA kernels" in capsys.readouterr().err
    from ds4.server.app import main as serve
    assert serve(["--cuda-graphs"]) == 2
    assert "--cuda-graphs records CUDA kernels" in capsys.readouterr().err
