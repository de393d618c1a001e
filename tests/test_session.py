"""Session: chunked prefill equals decode, exact O(1) rollback, LM head only where needed, MTP pairing."""
import pytest
import torch

from backends.registry import OpSet
from ds4.errors import UsageError
from ds4.session import Session
from ds4.tiny.build import tiny_model_weights
from models.args import ModelArgs
from models.deepseek_v4 import DeepseekV4
from models.mtp import MTPHead
from ops.qmatmul import SMALL_M

CTX = 96
TOL = 1e-5  # fp32: chunks > SMALL_M vs one-token forwards differ only by rounding order (measured ~3e-6)
MTP_TOL = 1e-4  # the same through the MTP, whose state feeds back into itself (measured 5.6e-5)

TORCH = OpSet("torch")  # the reference; Triton kernels under the interpreter are tested elsewhere


def build(**switches):
    md, base, mtp = tiny_model_weights(seed=3)
    model = DeepseekV4(ModelArgs.from_metadata(md, **switches), base, TORCH)
    return model, MTPHead(model, mtp)


@pytest.fixture(scope="module")
def tiny():
    return build()


@pytest.fixture(scope="module")
def prompt():
    # 52 tokens: beyond the 16-token window, 3 ratio-16 blocks, 13 ratio-4 rows > indexer top-k 4
    return torch.randint(0, 512, (53,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def decoded(tiny, prompt):
    """Token-by-token reference: logits after the prompt, after one more token, and the next draft."""
    model, mtp = tiny
    s = Session(model, CTX, prefill_chunk=16, mtp=mtp)
    last = [s.decode(t) for t in prompt[:-1]][-1]
    return last, s.decode(prompt[-1]), s.mtp_draft(5)[0]


@pytest.mark.parametrize("chunk", [1, 3, 16, 2048])
def test_chunked_prefill_matches_token_by_token_decode(tiny, prompt, decoded, chunk):
    """Chunks of <= SMALL_M rows are batch-invariant, so equal decode bit for bit; larger ones within TOL."""
    model, mtp = tiny
    last, after, draft = decoded

    def same(a, b):
        return torch.equal(a, b) if chunk <= SMALL_M else (a - b).abs().max() < TOL

    s = Session(model, CTX, prefill_chunk=chunk, mtp=mtp)
    assert same(s.prefill(prompt[:-1]), last)
    assert s.counters["lm_head_rows"] == 1
    assert same(s.decode(prompt[-1]), after)
    assert same(s.mtp_draft(5)[0], draft)


def assert_same_state(a: Session, b: Session):
    sa, sb = a.state_tensors(), b.state_tensors()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_snapshot_restore_and_truncate_are_exact(tiny, prompt):
    model, mtp = tiny
    prefix, suffix = prompt[:45], prompt[45:51]  # the suffix emits ratio-4 and ratio-16 rows (pos 47)
    clean = Session(model, CTX, prefill_chunk=8, mtp=mtp)
    clean.prefill(prefix)
    s = Session(model, CTX, prefill_chunk=8, mtp=mtp)
    s.prefill(prefix)
    assert_same_state(s, clean)
    snap = s.snapshot()
    s.forward(suffix, "all")
    _, state = s.mtp_draft(3)
    s.mtp_draft(4, state)
    s.restore(snap)
    assert_same_state(s, clean)
    assert torch.equal(s.decode(prompt[45]), clean.decode(prompt[45]))
    assert torch.equal(s.mtp_draft(9)[0], clean.mtp_draft(9)[0])
    s.forward(suffix[1:], "all")
    s.truncate(46)
    clean.truncate(46)
    assert_same_state(s, clean)
    assert torch.equal(s.decode(1), clean.decode(1))


def test_rollback_beyond_the_ring_slack_is_refused(tiny, prompt):
    model, _ = tiny
    s = Session(model, CTX, prefill_chunk=4)
    s.prefill(prompt[:12])
    with pytest.raises(UsageError):
        s.truncate(5)
    with pytest.raises(UsageError):
        s.forward([0] * (CTX - 11), None)


def test_lm_head_runs_only_on_requested_rows(tiny, prompt, monkeypatch):
    model, mtp = tiny
    seen = []
    real = model.logits
    monkeypatch.setattr(model, "logits", lambda X, head: seen.append(X.shape[0]) or real(X, head))
    s = Session(model, CTX, prefill_chunk=16, mtp=mtp)
    s.prefill(prompt[:40])          # 3 chunks, MTP catch-up on the last window: one head row in total
    assert seen == [1]
    assert s.forward(prompt[40:45], "all").shape == (5, 512)
    s.forward(prompt[45:47], None)
    s.mtp_draft(1)
    assert seen == [1, 5, 1]
    assert s.counters["lm_head_rows"] == 6 and s.counters["mtp_lm_head_rows"] == 1


@pytest.mark.parametrize("pairing", ["official", "ds4"])
def test_mtp_pairing_is_explicit(pairing, prompt):
    model, mtp = build(mtp_pairing=pairing)
    ids = prompt[:20]
    s = Session(model, CTX, prefill_chunk=8, mtp=mtp)
    s.prefill(ids)
    draft, _ = s.mtp_draft(11)
    H, _ = model.forward(ids, 0, model.new_caches(CTX, 32))
    cache = mtp.new_cache(CTX, 32)
    t = ids + [11]
    if pairing == "official":   # row j = (H_{j-1}, t_j) predicts t_{j+1}
        _, logits = mtp.forward(H, t[1:], 1, cache, 1, [-1])
    else:                       # row j = (H_j, t_j); the draft continues from the MTP's own state
        Y, _ = mtp.forward(H, t[:-1], 0, cache)
        _, logits = mtp.forward(Y[-1:], t[-1:], 20, cache, 0, [0])
    assert (draft - logits[0]).abs().max() < MTP_TOL * logits.abs().max()  # different batching


def test_kept_states_are_appended_in_place(tiny, prompt):
    """The last KEPT_STATES output states stay each position's state across decode steps, buffer refills and a
    rollback, while a decode step writes its one row into the session's buffer instead of copying all of them."""
    from ds4.session import KEPT_STATES
    model, _ = tiny
    s = Session(model, CTX, prefill_chunk=16)
    states = {}
    for i, t in enumerate(prompt[:50]):
        s.decode(t)
        states[i] = s.trunk_tail.clone()
        start, rows = s.recent["trunk"]
        assert rows.shape[0] == min(i + 1, KEPT_STATES) and start == i + 1 - rows.shape[0]
        assert all(torch.equal(rows[p - start], states[p]) for p in range(start, i + 1))
        if i:   # from the second step on, a view of the session's buffer
            assert rows.untyped_storage().data_ptr() == s.recent_buffers["trunk"].untyped_storage().data_ptr()
    s.truncate(45)
    s.decode(prompt[45])
    start, rows = s.recent["trunk"]
    assert start + rows.shape[0] == 46 and torch.equal(rows[-1], s.trunk_tail) and torch.equal(rows[-2], states[44])
