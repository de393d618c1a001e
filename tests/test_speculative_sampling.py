"""Speculative sampling keeps the target's distribution exactly; adaptive depth and the seed-002 probe gate."""
from __future__ import annotations

import torch

from ds4.sampling import Sampler, SamplingParams
from ds4.speculative import (
    PROBE_SKIP,
    AdaptiveDepth,
    ProbeGate,
    SpecMetrics,
    accept_or_resample,
)

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


def test_probe_gate_follows_seed_002():
    """A sampled draft with nothing accepted skips the next 15 probes; an accepted one resets the
    counter; greedy never arms it."""
    metrics, gate = SpecMetrics(), ProbeGate()
    gate.record(greedy=True, accepted=0)
    assert gate.allow(metrics) and metrics.probes_skipped == 0
    gate.record(greedy=False, accepted=0)
    assert [gate.allow(metrics) for _ in range(PROBE_SKIP + 1)] == [False] * PROBE_SKIP + [True]
    assert metrics.probes_skipped == PROBE_SKIP
    gate.record(greedy=False, accepted=0)
    gate.allow(metrics)
    gate.record(greedy=False, accepted=2)
    assert gate.allow(metrics)


def test_adaptive_depth_follows_acceptance():
    """Depth grows while each next position is likely reached, and falls back to 1 when drafts miss."""
    auto = AdaptiveDepth()
    assert auto.depth() == 1
    for _ in range(60):
        auto.update(auto.depth(), auto.depth())
    assert auto.depth() == len(auto.rates)
    for _ in range(60):
        auto.update(auto.depth(), 0)
    assert auto.depth() == 1
    for _ in range(60):                      # first two positions always right, the third always wrong
        auto.update(auto.depth(), min(2, auto.depth()))
    assert auto.depth() == 3
