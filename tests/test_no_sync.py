"""A decode step and a 2..16-row verify step read nothing back from the device: positions are planned
on the host and the indexer's top-k flows straight into attention. Every host read a tensor can make
(item, tolist, int/float/bool, index, nonzero, unique, boolean-mask indexing, numpy, cpu) raises inside
the trunk and MTP forwards; the session reads the logits afterwards, outside them."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from backends.registry import OpSet
from ds4.session import Session
from ds4.tiny.build import tiny_model_weights
from models.args import ModelArgs
from models.deepseek_v4 import DeepseekV4
from models.mtp import MTPHead
from ops.qmatmul import SMALL_M

HOST_READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero", "argwhere",
              "unique", "unique_consecutive", "masked_select", "numpy", "cpu"}
INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}


def has_bool_index(args) -> bool:
    """Whether an indexing call uses a boolean tensor (its result's shape depends on the data)."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple | list) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class NoHostReads(TorchFunctionMode):
    """Raise on every torch call that would read a tensor back to the host."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS or (name in INDEXING and has_bool_index(args)):
            raise AssertionError(f"host read inside a forward: {name}")
        return func(*args, **(kwargs or {}))


def guarded(forward):
    """`forward` run under NoHostReads."""
    def run(*args, **kwargs):
        with NoHostReads():
            return forward(*args, **kwargs)
    return run


@pytest.fixture(scope="module", params=["f32", "q2"])
def session(request):
    """A tiny trunk + MTP (every layer kind: raw, ratio 4 with the indexer, ratio 16) after a prompt that
    crosses the window, compression blocks and the indexer's top-k."""
    md, base, mtp = tiny_model_weights(mix=request.param, seed=3)
    trunk = DeepseekV4(ModelArgs.from_metadata(md), base, OpSet("torch"))
    s = Session(trunk, 128, SMALL_M, MTPHead(trunk, mtp))
    s.prefill(list(range(5, 40)))
    return s


@pytest.mark.parametrize("step", ["eager", "fixed"])  # "fixed": the plan of a compiled step
def test_decode_verify_and_drafts_read_nothing_back(session, monkeypatch, step):
    monkeypatch.setattr(DeepseekV4, "forward", guarded(DeepseekV4.forward))
    monkeypatch.setattr(MTPHead, "forward", guarded(MTPHead.forward))
    monkeypatch.setattr(session, "step_for", lambda rows, eager=False: "eager" if eager else step)
    logits = session.decode(7)                                   # decode: 1 row + MTP catch-up
    assert logits.shape == (512,)
    _, state = session.mtp_draft(9)                             # an MTP draft step
    session.mtp_draft(11, state)
    for M in range(2, SMALL_M + 1):                             # verify widths
        snap = session.snapshot()
        assert session.forward(list(range(40, 40 + M)), "all").shape == (M, 512)
        session.restore(snap)


def test_the_guard_catches_a_host_read(session, monkeypatch):
    """The check can fail: a forward that reads a tensor back (as the model did before planning
    positions on the host) raises."""
    real = DeepseekV4.logits
    monkeypatch.setattr(DeepseekV4, "logits", lambda self, X, head: int(X.abs().max()) and real(self, X, head))
    monkeypatch.setattr(DeepseekV4, "forward", guarded(DeepseekV4.forward))
    with pytest.raises(AssertionError, match="host read inside a forward: __int__"):
        session.decode(7)
    with pytest.raises(AssertionError, match="__getitem__"), NoHostReads():  # boolean-mask indexing
        torch.arange(4)[torch.arange(4) > 1]
