"""Speculative decoding on a tiny random model: strict = greedy, teacher-forced oracle, exact rollback,
ds4 #381 clamps, ds4 #385 probe skips, ds4 #371 pass counts.

Random MTP heads almost never agree with the trunk, so most tests draft with `OracleDrafter`: it proposes
the target's own greedy continuation with errors on a fixed schedule, so that full, partial and zero
accepts all occur at every depth.
"""
from __future__ import annotations

import copy

import pytest
import torch

from backends.registry import OpSet
from ds4 import speculative
from ds4.sampling import LogitAdjustments, Sampler, SamplingParams
from ds4.session import Session
from ds4.speculative import Draft, SpecMetrics, generate_ids
from ds4.tiny.build import tiny_model_weights
from models.args import ModelArgs
from models.deepseek_v4 import DeepseekV4
from models.mtp import MTPHead
from ops.qmatmul import SMALL_M

SIZES = {"n_layers": 2, "compress_ratios": (4, 16), "n_hash_layers": 1}
DEFAULT_CHUNK = 16


@pytest.fixture(scope="module")
def model():
    md, base, mtp = tiny_model_weights(**SIZES)
    trunk = DeepseekV4(ModelArgs.from_metadata(md), base, OpSet("torch"))   # the reference ops
    return trunk, MTPHead(trunk, mtp)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """`n` random prompts of 6..20 tokens (crossing the 16-token window and compression blocks)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(torch.randint(6, 21, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def clone(session: Session) -> Session:
    """An independent copy of a session's state (the model is shared)."""
    return copy.deepcopy(session, memo={id(session.model): session.model, id(session.mtp): session.mtp})


def plain_greedy(session: Session, first_logits: torch.Tensor, max_tokens: int, eos_id: int | None) -> list[int]:
    """Reference decode written without the speculative module: one row at a time, argmax."""
    out = [int(first_logits.argmax())]
    while len(out) < max_tokens and out[-1] != eos_id and session.pos < session.ctx:
        out.append(int(session.decode(out[-1]).argmax()))
    return out


class OracleDrafter:
    """Drafts the target's greedy continuation `truth` (generated ids), wrong from position c % (n+1)
    in cycle c; with `use_mtp` it also runs the MTP head on its guesses (speculative MTP rows)."""

    def __init__(self, truth: list[int], prompt_len: int, use_mtp: bool = False, errors: bool = True):
        self.truth, self.prompt_len, self.uses_mtp, self.errors, self.cycle = truth, prompt_len, use_mtp, errors, 0

    def propose(self, session, first, n, sampler, eos_id):
        done = session.pos - self.prompt_len + 1          # generated tokens so far, `first` included
        right = self.cycle % (n + 1) if self.errors else n
        self.cycle += 1
        tokens, state = [], None
        for i in range(n):
            true = self.truth[done + i] if done + i < len(self.truth) else 0
            tokens.append(true if i < right else (true + 1 + i) % session.model.args.vocab_size)
            if self.uses_mtp:
                _, state = session.mtp_draft(first if i == 0 else tokens[i - 1], state)
            if tokens[-1] == eos_id:
                break
        return Draft(tokens)


def accept_kinds(log: list[dict]) -> set[str]:
    """Which of full / partial / zero accepts the spec_log records show."""
    return {"zero" if r["accepted"] == 0 else "full" if r["accepted"] == len(r["draft"]) else "partial"
            for r in log if r["draft"]}


def per_token_verify(monkeypatch) -> None:
    """Make the reference ops look not batch-invariant, so strict mode falls back to per-token verify."""
    monkeypatch.setattr(OpSet, "batch_invariant", lambda self: False)


@pytest.mark.parametrize("chunk, verify", ((1, "per-token"), (3, "batched"), (3, "per-token"),
                                           (DEFAULT_CHUNK, "batched")))
def test_strict_equals_plain_greedy(model, chunk, verify, monkeypatch):
    """Strict mode commits exactly plain greedy's tokens: 20 prompts x depths 1,2,3,4,8, with EOS inside
    drafts, context end and max-tokens end; full, partial and zero accepts occur at every depth. The
    reference ops are batch-invariant, so strict verifies [first, d1..dk] in one batched pass; with
    `per-token` they claim not to be and strict falls back to one-row passes. (A batched verify cannot
    fit a 1-row chunk: there strict is plain decode, see test_prefill_chunk_1_clamps_draft.)"""
    trunk, _ = model
    assert trunk.ops.batch_invariant()
    if verify == "per-token":
        per_token_verify(monkeypatch)
    metrics = SpecMetrics()
    kinds = {depth: set() for depth in (1, 2, 3, 4, 8)}
    for i, prompt in enumerate(prompts(20)):
        ctx = len(prompt) + 4 if i % 3 == 1 else 64          # i % 3 == 1: the context ends first
        base = Session(trunk, ctx, chunk)
        base.prefill(prompt[:-1])
        s = clone(base)
        truth = plain_greedy(s, s.prefill(prompt[-1:]), 7, None)
        eos = truth[3] if i % 3 == 0 else None                # i % 3 == 0: EOS, usually inside a draft
        expected = truth[:truth.index(eos) + 1] if eos is not None else truth
        for depth in kinds:
            log = []
            got = list(generate_ids(clone(base), prompt[-1:], max_tokens=7, sampler=Sampler(), eos_id=eos,
                                    draft=depth, strict=True, spec_log=log.append, metrics=metrics,
                                    drafter=OracleDrafter(truth, len(prompt))))
            assert got == expected, (i, chunk, depth)
            # ds4 #381 clamp: a batched verify fits the chunk, per-token verify the MTP ring slack
            assert all(len(r["draft"]) <= (chunk - 1 if verify == "batched" else chunk) for r in log)
            kinds[depth] |= accept_kinds(log)
    # batched: passes of several rows; per-token: one row per pass
    assert (metrics.target_rows > metrics.target_forward_passes) == (verify == "batched")
    if chunk == DEFAULT_CHUNK:
        assert kinds[1] == {"full", "zero"}
        assert all(kinds[d] == {"full", "partial", "zero"} for d in (2, 3, 4, 8)), kinds


def teacher_forced_gaps(trunk, prompt: list[int], stream: list[int]) -> list[float]:
    """Replay `stream` through plain decode: how far below the argmax each committed token sits."""
    s = Session(trunk, 128)
    logits, gaps = s.prefill(prompt), []
    for k, token in enumerate(stream):
        gaps.append(float(logits.max() - logits[token]))
        if k + 1 < len(stream):
            logits = s.decode(token)
    return gaps


def swapped_row_tops(ops, logits):
    """ds4 #358's bug: the top-M tokens of row 0 instead of the top-1 of each of the M rows."""
    return torch.topk(logits[0], logits.shape[0]).indices.tolist()


@pytest.mark.parametrize("depth", (4, 8))
def test_fast_mode_teacher_forced_oracle(model, depth, monkeypatch):
    """Every token fast (batched) verify commits is the argmax at its position under plain decode
    (gap <= 1e-3); the same check fails when verify reads row 0's top-k (ds4 #358's swap)."""
    trunk, _ = model
    worst, swapped_worst, multi = 0.0, 0.0, 0
    for prompt in prompts(3, seed=1):
        s = Session(trunk, 128)
        truth = plain_greedy(s, s.prefill(prompt), 30, None)
        log = []
        out = list(generate_ids(Session(trunk, 128), prompt, max_tokens=30, sampler=Sampler(), eos_id=None,
                                draft=depth, spec_log=log.append, drafter=OracleDrafter(truth, len(prompt))))
        worst = max(worst, *teacher_forced_gaps(trunk, prompt, out))
        multi += sum(len(r["committed"]) > 2 for r in log)
        with monkeypatch.context() as m:
            m.setattr(speculative, "row_tops", swapped_row_tops)
            bad = list(generate_ids(Session(trunk, 128), prompt, max_tokens=30, sampler=Sampler(), eos_id=None,
                                    draft=depth, drafter=OracleDrafter(truth, len(prompt))))
        swapped_worst = max(swapped_worst, *teacher_forced_gaps(trunk, prompt, bad))
    assert multi > 0 and worst <= 1e-3
    assert swapped_worst > 0.1


@pytest.mark.parametrize("verify", ("batched", "per-token"))
def test_rollback_state_equals_committed_only(model, verify, monkeypatch):
    """After every cycle of a long run (partial accepts included) the session state — trunk rings,
    compressor state, compressed and indexer rows, MTP cache, positions — equals, tensor for tensor and
    bit for bit, a session that only ever saw the committed tokens, fed one at a time by plain decode:
    after fast mode's batched verifies (batch-invariant ops) and strict mode's per-token fallback."""
    trunk, mtp = model
    if verify == "per-token":
        per_token_verify(monkeypatch)
    prompt = prompts(1, seed=2)[0]
    s = Session(trunk, 128, 16, mtp)
    truth = plain_greedy(s, s.prefill(prompt), 60, None)
    spec, ref = Session(trunk, 128, 16, mtp), Session(trunk, 128, 16, mtp)
    ref.prefill(prompt)
    partial = 0

    def check(record):
        nonlocal partial
        for token in [record["first"]] + record["committed"][:-1]:
            ref.decode(token)
        partial += 0 < record["accepted"] < len(record["draft"])
        a, b = spec.state_tensors(), ref.state_tensors()
        assert a.keys() == b.keys() and int(a["pos"]) == int(b["pos"])
        for name in a:
            assert torch.equal(a[name], b[name]), name

    list(generate_ids(spec, prompt, max_tokens=60, sampler=Sampler(), eos_id=None, draft=4,
                      strict=verify == "per-token",
                      spec_log=check, drafter=OracleDrafter(truth, len(prompt), use_mtp=True)))
    assert partial >= 5


@pytest.mark.parametrize("depth", (2, 3, 8))
def test_prefill_chunk_1_clamps_draft(model, depth, monkeypatch):
    """ds4 #381: `--prefill-chunk 1 --mtp-draft N` runs; fast and strict mode clamp to a 1-row verify
    (plain decode), strict's per-token fallback drafts one token per cycle, and all equal plain greedy."""
    trunk, mtp = model
    prompt = prompts(1, seed=3)[0]
    s = Session(trunk, 64, 1, mtp)
    expected = plain_greedy(s, s.prefill(prompt), 8, None)
    for strict, drafted in ((False, 0), (True, 0), ("per-token", 1)):
        if strict == "per-token":
            per_token_verify(monkeypatch)
        log, metrics = [], SpecMetrics()
        got = list(generate_ids(Session(trunk, 64, 1, mtp), prompt, max_tokens=8, sampler=Sampler(),
                                eos_id=None, draft=depth, strict=bool(strict), spec_log=log.append,
                                metrics=metrics))
        assert got == expected
        assert max(len(r["draft"]) for r in log) == drafted
        assert metrics.target_rows == metrics.target_forward_passes


def test_verify_fits_chunk_and_batch_invariant_rows(model):
    """With a 3-row prefill chunk a depth-8 verify is clamped to [first, d1, d2]; with a large chunk a
    depth-16 verify to SMALL_M rows (15 drafts), the regime where the ops are batch-invariant."""
    trunk, mtp = model
    prompt = prompts(1, seed=4)[0]
    s = Session(trunk, 64)
    truth = plain_greedy(s, s.prefill(prompt), 18, None)
    for chunk, depth, deepest in ((3, 8, 2), (2048, 16, SMALL_M - 1)):
        log = []
        list(generate_ids(Session(trunk, 64, chunk, mtp), prompt, max_tokens=18, sampler=Sampler(), eos_id=None,
                          draft=depth, spec_log=log.append, drafter=OracleDrafter(truth, len(prompt), errors=False)))
        assert max(len(r["draft"]) for r in log) == deepest


def passes_per_token(trunk, prompt, truth, errors: bool = False, **kw) -> SpecMetrics:
    """Metrics of a 24-token greedy run with a drafter that is always right (or wrong on a schedule)."""
    metrics = SpecMetrics()
    out = list(generate_ids(Session(trunk, 128), prompt, max_tokens=24, sampler=Sampler(), eos_id=None,
                            metrics=metrics, drafter=OracleDrafter(truth, len(prompt), errors=errors), **kw))
    assert out == truth
    return metrics


def test_continuous_depth_1_pass_counts(model):
    """ds4 #371: continuous depth-1 verifies [first, draft] in one pass with no standalone decode —
    0.5 target passes per token with a perfect drafter, against ~0.67 for the old draft-2 cycle
    (decode, then verify) and 1 for plain decode."""
    trunk, _ = model
    prompt = prompts(1, seed=5)[0]
    s = Session(trunk, 128)
    truth = plain_greedy(s, s.prefill(prompt), 24, None)
    plain = passes_per_token(trunk, prompt, truth)
    continuous = passes_per_token(trunk, prompt, truth, draft=1)
    old_cycle = passes_per_token(trunk, prompt, truth, draft=1, continuous=False)
    deep = passes_per_token(trunk, prompt, truth, draft=4)
    assert plain.target_forward_passes == plain.target_rows == 23
    # every pass is [first, draft] except the budget's last, a lone [first]
    assert continuous.target_rows == 2 * continuous.target_forward_passes - 1
    assert continuous.passes_per_token == pytest.approx(12 / 24)
    assert old_cycle.passes_per_token == pytest.approx(16 / 24)
    assert deep.passes_per_token == pytest.approx(5 / 24)


def test_sampled_decoding_mtp_work(model):
    """ds4 #385 with the random MTP head: a sampled draft with nothing accepted arms the probe skip, so
    unused MTP probes stay <= 1/16 of target passes, and target passes never exceed plain sampled
    decoding's (accepted drafts save some); greedy decoding never skips a probe."""
    trunk, mtp = model
    prompt = prompts(1, seed=6)[0]
    params = SamplingParams(temperature=1.0, seed=7)
    plain, spec = SpecMetrics(), SpecMetrics()
    list(generate_ids(Session(trunk, 128, 16, mtp), prompt, max_tokens=48, sampler=Sampler(params),
                      eos_id=None, metrics=plain))
    list(generate_ids(Session(trunk, 128, 16, mtp), prompt, max_tokens=48, sampler=Sampler(params),
                      eos_id=None, draft=1, metrics=spec))
    assert spec.target_forward_passes <= plain.target_forward_passes == 47
    assert spec.probes_skipped > 0
    unused = spec.num_drafts - spec.num_accepted_tokens        # depth 1: drafts with nothing accepted
    assert unused * 16 <= spec.target_forward_passes + 16
    greedy = SpecMetrics()
    list(generate_ids(Session(trunk, 128, 16, mtp), prompt, max_tokens=16, sampler=Sampler(), eos_id=None,
                      draft=1, metrics=greedy))
    assert greedy.probes_skipped == 0 and greedy.num_drafts >= 7


def test_strict_verify_saves_passes(model, monkeypatch):
    """Strict mode's batched verify costs exactly fast mode's target passes: with the error-schedule
    drafter fewer than plain decode at depths 1, 2, 4 (23 passes for 24 tokens), with a perfect drafter
    12, 8 and 5; the per-token fallback needs at least one pass per generated token."""
    trunk, _ = model
    prompt = prompts(1, seed=5)[0]
    s = Session(trunk, 128)
    truth = plain_greedy(s, s.prefill(prompt), 24, None)
    for depth, perfect in ((1, 12), (2, 8), (4, 5)):
        for errors in (True, False):
            strict = passes_per_token(trunk, prompt, truth, errors, draft=depth, strict=True)
            fast = passes_per_token(trunk, prompt, truth, errors, draft=depth)
            assert strict.as_dict() == fast.as_dict()
            if errors:   # measured 16, 12, 10 passes
                assert perfect < strict.target_forward_passes < 23
            else:
                assert strict.target_forward_passes == perfect
    per_token_verify(monkeypatch)
    assert passes_per_token(trunk, prompt, truth, draft=4, strict=True).target_forward_passes >= 23


def shaped_reference(session: Session, prompt: list[int], transform, max_tokens: int) -> list[int]:
    """Plain greedy decode with `transform(row, generated)` applied before every argmax."""
    out, logits = [], session.prefill(prompt)
    while len(out) < max_tokens:
        out.append(int(transform(logits, out).argmax()))
        logits = session.decode(out[-1])
    return out


class ForbiddenDrafter:
    """Always drafts `token` (sampled: from a one-hot q), one the transform forbids."""

    uses_mtp = False

    def __init__(self, token: int):
        self.token = token

    def propose(self, session, first, n, sampler, eos_id):
        vocab = session.model.args.vocab_size
        q = None if sampler.params.greedy else torch.nn.functional.one_hot(torch.tensor([self.token] * n), vocab)
        return Draft([self.token] * n, None if q is None else q.float())


def test_forbidden_draft_is_rejected(model):
    """A draft the transform forbids is rejected by its verify row (greedy and sampled, every depth), and
    the greedy output equals plain transformed decoding."""
    trunk, _ = model
    prompt = prompts(1, seed=8)[0]
    s = Session(trunk, 128)
    forbidden = plain_greedy(s, s.prefill(prompt), 4, None)[1]
    adjust = LogitAdjustments(never=(forbidden,))

    def transform(row, prefix):
        return adjust.apply(row, prompt, prefix)
    expected = shaped_reference(Session(trunk, 128), prompt, transform, 12)
    assert forbidden not in expected
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
        for depth in (1, 2, 3):
            log = []
            got = list(generate_ids(Session(trunk, 128), prompt, max_tokens=12, sampler=Sampler(params), eos_id=None,
                                    draft=depth, strict=True, spec_log=log.append,
                                    drafter=ForbiddenDrafter(forbidden), transform=transform))
            assert log and all(r["accepted"] == 0 for r in log) and forbidden not in got
            if params.greedy:
                assert got == expected, depth


def test_transformed_strict_equals_transformed_greedy(model):
    """Penalties and a bias shape every verify row (prefix: the drafts before it) and every MTP draft row:
    strict speculation at depths 1..3 commits exactly plain transformed greedy's tokens, with the error-
    schedule oracle and with the MTP head (whose shaped drafts are then often accepted)."""
    trunk, mtp = model
    prompt = prompts(1, seed=9)[0]
    s = Session(trunk, 128)
    favourite = plain_greedy(s, s.prefill(prompt), 4, None)[2]
    adjust = LogitAdjustments(presence=0.5, frequency=4.0, repetition=1.3, logit_bias=((favourite, 30.0),))

    def transform(row, prefix):
        return adjust.apply(row, prompt, prefix)
    expected = shaped_reference(Session(trunk, 128), prompt, transform, 16)
    assert 1 < expected.count(favourite) < 16
    for depth in (1, 2, 3):
        oracle = list(generate_ids(Session(trunk, 128), prompt, max_tokens=16, sampler=Sampler(), eos_id=None,
                                   draft=depth, strict=True, drafter=OracleDrafter(expected, len(prompt)),
                                   transform=transform))
        metrics = SpecMetrics()
        drafted = list(generate_ids(Session(trunk, 128, 16, mtp), prompt, max_tokens=16, sampler=Sampler(),
                                    eos_id=None, draft=depth, strict=True, metrics=metrics, transform=transform))
        assert oracle == drafted == expected, depth
        assert metrics.num_accepted_tokens > 0


def test_mtp_draft_rows_are_shaped_with_their_prefix(model):
    """The MTP drafter shapes each draft row with the generated tokens and drafts before it: when the
    transform allows one token per prefix length, every draft (greedy or sampled) is that token and accepted."""
    trunk, mtp = model
    prompt = prompts(1, seed=10)[0]

    def only(prefix):
        return (7 * len(prefix) + 5) % 500

    def transform(row, prefix):
        out = torch.full((row.numel(),), float("-inf"))
        out[only(prefix)] = 0.0
        return out
    expected = [only(range(i)) for i in range(12)]
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=4)):
        metrics = SpecMetrics()
        got = list(generate_ids(Session(trunk, 128, 16, mtp), prompt, max_tokens=12, sampler=Sampler(params),
                                eos_id=None, draft=3, strict=True, metrics=metrics, transform=transform))
        assert got == expected
        assert metrics.num_accepted_tokens == metrics.num_draft_tokens > 0


@pytest.mark.parametrize("strict", (False, True))
def test_forced_tokens_are_verified_like_drafts(model, strict):
    """Tokens `forced` names are verified in one pass (no MTP head needed) and committed only where the
    transformed rows choose them: a wrong forced token is rejected and the output is still the reference."""
    trunk, _ = model
    prompt = prompts(1, seed=11)[0]
    adjust = LogitAdjustments(frequency=3.0)

    def transform(row, prefix):
        return adjust.apply(row, prompt, prefix)
    expected = shaped_reference(Session(trunk, 128), prompt, transform, 16)
    for lie in (False, True):
        def forced(prefix, lie=lie):
            ahead = expected[len(prefix):len(prefix) + 4]
            return [t + 1 for t in ahead] if lie and len(prefix) % 2 else ahead
        metrics = SpecMetrics()
        got = list(generate_ids(Session(trunk, 128), prompt, max_tokens=16, sampler=Sampler(), eos_id=None,
                                strict=strict, metrics=metrics, transform=transform, forced=forced))
        assert got == expected and metrics.num_drafts == 0
        assert metrics.target_forward_passes < (10 if lie else 5)
