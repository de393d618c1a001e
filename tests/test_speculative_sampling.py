"""Speculative sampling keeps the target's distribution exactly; the probe gate (ds4 #385) and what sampled
decoding with the MTP loaded costs on the real model (ds4/cost.py)."""
from __future__ import annotations

import pytest
import torch

from backends.registry import OpSet
from ds4 import speculative
from ds4.cost import PassCost, flash_args, tensor_bytes
from ds4.sampling import Sampler, SamplingParams
from ds4.session import Session
from ds4.speculative import (
    PROBE_SKIP,
    Draft,
    ProbeGate,
    SpecMetrics,
    accept_or_resample,
    generate_ids,
)
from ds4.tiny.build import tiny_model_weights
from models.args import ModelArgs, model_shapes, mtp_shapes
from models.deepseek_v4 import DeepseekV4
from models.mtp import MTPHead

TRIALS = 40_000
TOLERANCE = 0.02   # total-variation distance; sampling noise at 40k draws over 6 tokens is about 0.005


def run_cycles(p: torch.Tensor, q: torch.Tensor, accept) -> torch.Tensor:
    """Empirical distribution [2, V] of the first two committed tokens of TRIALS speculative cycles
    (context-free target rows p [3, V], drafter rows q [2, V]); `accept` is the acceptance rule."""
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1234))
    counts = torch.zeros(2, p.shape[1])
    for _ in range(TRIALS):
        out = []
        for i in range(2):
            draft = sampler.draw(q[i])
            choice = accept(p[i], q[i], draft, sampler)
            out.append(draft if choice is None else choice)
            if choice is not None:
                break
        if len(out) < 2:
            out.append(sampler.draw(p[len(out)]))
        counts[0, out[0]] += 1
        counts[1, out[1]] += 1
    return counts / TRIALS


def distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target p [3, 6] and a deliberately different drafter q [2, 6], one of q's tokens impossible under p."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(3, 6, generator=g), -1)
    p[:, 5] = 0
    q = torch.softmax(2 * torch.randn(2, 6, generator=g), -1)
    return p / p.sum(-1, keepdim=True), q


def test_speculative_sampling_keeps_target_distribution():
    """Committed tokens follow p at both positions within TOLERANCE (total variation)."""
    p, q = distributions(0)
    empirical = run_cycles(p, q, accept_or_resample)
    tv = 0.5 * (empirical - p[:2]).abs().sum(-1)
    assert float(tv.max()) <= TOLERANCE, tv


def test_distribution_check_catches_a_wrong_rule():
    """Accepting every draft (no p/q test) produces q, which the same check rejects."""
    p, q = distributions(0)
    empirical = run_cycles(p, q, lambda p_row, q_row, token, sampler: None)
    assert float(0.5 * (empirical - p[:2]).abs().sum(-1).max()) > 5 * TOLERANCE


def test_probe_gate_follows_ds4_385():
    """A sampled draft with nothing accepted skips the next 15 probes (and marks the gate `missed`); an
    accepted one resets both; greedy never arms it."""
    metrics, gate = SpecMetrics(), ProbeGate()
    gate.record(greedy=True, accepted=0)
    assert gate.allow(metrics) and metrics.probes_skipped == 0 and not gate.missed
    gate.record(greedy=False, accepted=0)
    assert gate.missed
    assert [gate.allow(metrics) for _ in range(PROBE_SKIP + 1)] == [False] * PROBE_SKIP + [True]
    assert metrics.probes_skipped == PROBE_SKIP
    gate.record(greedy=False, accepted=0)
    gate.allow(metrics)
    gate.record(greedy=False, accepted=2)
    assert gate.allow(metrics) and not gate.missed


SAMPLED_TOKENS = 320
MTP_BUDGET = 0.01   # issue 4 item 8: sampled decoding with the MTP loaded costs <= 1% more


@pytest.fixture(scope="module")
def model():
    md, base, mtp = tiny_model_weights(n_layers=2, compress_ratios=(4, 16), n_hash_layers=1)
    trunk = DeepseekV4(ModelArgs.from_metadata(md), base, OpSet("torch"))
    return trunk, MTPHead(trunk, mtp)


@pytest.mark.parametrize("shapes, mix, published_gib", ((model_shapes, "q2", 81), (model_shapes, "q4", 153),
                                                        (mtp_shapes, "q4", 3.5)))
def test_cost_model_sizes_match_published_files(shapes, mix, published_gib):
    """The cost model's V4 Flash shapes and types add up to ds4's published files (docs/model.md §2: q2
    about 81 GB, q4 about 153 GB, MTP with Q4_K experts about 3.5 GB; sizes as `ls -h` gives them)."""
    total = sum(tensor_bytes(name, shape, mix) for name, shape in shapes(flash_args()).items())
    assert total / 2**30 == pytest.approx(published_gib, rel=0.02)


class LeastLikelyDrafter:
    """Reads the MTP window and runs the MTP head with its LM head (all of an MTP drafter's work) but
    proposes, as a certain draft (q one-hot), the token the head finds least likely: under a small top_k
    the target nearly always gives it probability 0, so its drafts go unused (the tests check)."""

    uses_mtp = True

    def propose(self, session, first, n, sampler, eos_id):
        tokens, state, token = [], None, first
        for _ in range(n):
            logits, state = session.mtp_draft(token, state)
            token = int(logits.argmin())
            tokens.append(token)
        q = torch.nn.functional.one_hot(torch.tensor(tokens), session.model.args.vocab_size).float()
        return Draft(tokens, q)


def sampled_run(model, with_mtp: bool) -> SpecMetrics:
    """Metrics of SAMPLED_TOKENS seeded sampled tokens (temperature 1, top_k 4), plain without the MTP,
    or with it loaded and depth-1 speculation from LeastLikelyDrafter."""
    trunk, mtp = model
    prompt = list(range(40, 52))
    params = SamplingParams(temperature=1.0, top_k=4, seed=11)
    metrics = SpecMetrics()
    session = Session(trunk, len(prompt) + SAMPLED_TOKENS, 16, mtp if with_mtp else None)
    list(generate_ids(session, prompt, max_tokens=SAMPLED_TOKENS, sampler=Sampler(params), eos_id=None,
                      draft=1 if with_mtp else None, drafter=LeastLikelyDrafter() if with_mtp else None,
                      metrics=metrics))
    assert metrics.generated_tokens == SAMPLED_TOKENS
    return metrics


def test_sampled_decoding_with_mtp_costs_at_most_one_percent(model, monkeypatch):
    """ds4 #385 on the real model's weight bytes: sampled decoding whose drafts are never used reads
    <= 1% more than decoding without the MTP (the probe gate runs one MTP draft per 16 tokens); with the
    gate off (PROBE_SKIP = 0) the same run reads far more than 1% extra."""
    cost = PassCost(flash_args(), "q2")
    plain = sampled_run(model, with_mtp=False)
    assert plain.target_pass_rows == {1: SAMPLED_TOKENS - 1} and plain.mtp_passes == 0
    gated = sampled_run(model, with_mtp=True)
    assert gated.num_drafts > 0 and gated.num_accepted_tokens == 0           # every draft unused
    # each probe is one MTP draft step and arms PROBE_SKIP skips: probes = cycles / (PROBE_SKIP + 1)
    cycles = gated.num_drafts + gated.probes_skipped
    assert gated.mtp_passes == gated.num_drafts == -(-cycles // (PROBE_SKIP + 1))
    # only the first draft is verified in a batch; later probes one row at a time, with no MTP catch-up
    assert gated.target_pass_rows == {2: 1, 1: SAMPLED_TOKENS - 2}
    assert sum(gated.mtp_catch_up_rows.values()) == 2                          # the prefill and that verify
    extra = cost.decode(gated) / cost.decode(plain) - 1
    monkeypatch.setattr(speculative, "PROBE_SKIP", 0)
    ungated = sampled_run(model, with_mtp=True)
    assert ungated.probes_skipped == 0 and ungated.mtp_passes == SAMPLED_TOKENS - 2
    ungated_extra = cost.decode(ungated) / cost.decode(plain) - 1
    print(f"plain {cost.decode(plain) / (SAMPLED_TOKENS - 1) / 1e9:.2f} GB/token, MTP loaded: "
          f"{extra:+.2%} gated, {ungated_extra:+.2%} ungated")
    assert extra <= MTP_BUDGET
    assert ungated_extra > 5 * MTP_BUDGET
