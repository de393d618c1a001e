"""`--mtp-draft auto` (AdaptiveDepth) on synthetic acceptance: it follows the acceptance it sees, matches or
beats the best fixed depth's target passes per token, and tracks a change of acceptance."""
from __future__ import annotations

import random

import pytest

from ds4.speculative import AdaptiveDepth, SpecMetrics

# P(draft i accepted | drafts before it accepted): shaped like the embedded model's measured acceptance
# (copy / free prompt), a head that stays good deep, one that is rarely right, one that is always right
PROFILES = {
    "copy-like": [0.58, 0.36, 0.43, 0.0, 0.0, 0.0, 0.0, 0.0],
    "free-like": [0.71, 0.45, 0.56, 0.0, 0.0, 0.0, 0.0, 0.0],
    "deep": [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1],
    "poor": [0.1] * 8,
    "perfect": [1.0] * 8,
}


def accepted_of(hits: list[bool], depth: int) -> int:
    """Leading accepted drafts of a `depth`-token draft whose positions would hit as `hits` says."""
    n = 0
    while n < depth and hits[n]:
        n += 1
    return n


def simulate(profile: list[float], policy, tokens: int, seed: int, draft_cost: float) -> tuple[float, float]:
    """(target passes per committed token, passes + draft_cost per drafted token, per committed token) of
    `policy` (a fixed depth or an AdaptiveDepth) on cycles whose per-position hits are drawn from `profile`."""
    rng = random.Random(seed)
    committed = passes = drafted = 0
    while committed < tokens:
        hits = [rng.random() < p for p in profile]
        depth = policy if isinstance(policy, int) else policy.depth()
        accepted = accepted_of(hits, depth)
        if not isinstance(policy, int):
            policy.update(depth, accepted)
        committed, passes, drafted = committed + accepted + 1, passes + 1, drafted + depth
    return passes / committed, (passes + draft_cost * drafted) / committed


def test_adaptive_depth_follows_acceptance():
    """Depth grows to the maximum while every draft is accepted, falls when drafts miss, and stops at or
    one past the last position that is accepted."""
    auto = AdaptiveDepth()
    assert 1 < auto.depth() < len(auto.rates)        # the prior alone: some depth, not the maximum
    for _ in range(5):
        auto.update(auto.depth(), auto.depth())
    assert auto.depth() == len(auto.rates)
    for _ in range(60):
        auto.update(auto.depth(), 0)
    assert auto.depth() <= 2 and auto.rates[0] < 0.1
    depths = []
    for _ in range(60):                      # first two positions always right, the third always wrong
        depths.append(auto.depth())
        auto.update(depths[-1], min(2, depths[-1]))
    assert set(depths[-30:]) <= {2, 3}
    assert auto.rates[0] > 0.9 and auto.rates[1] > 0.9 and auto.rates[2] < 0.2


@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize("tokens", [64, 2000])
def test_adaptive_depth_at_or_below_best_fixed_depth(name, tokens):
    """Same draws for every policy (paired): auto's passes per token are at most the best fixed depth's
    (1-4, the depths the spec benchmark runs) + 1%, and its cost with the draft charge at most the best
    fixed depth's (1-8) + 10% (+ 3% once past the first few cycles)."""
    seeds, cost = range(10), AdaptiveDepth().draft_cost
    runs = {k: [simulate(PROFILES[name], k, tokens, s, cost) for s in seeds] for k in range(1, 9)}
    runs["auto"] = [simulate(PROFILES[name], AdaptiveDepth(), tokens, s, cost) for s in seeds]
    mean = {k: [sum(r[i] for r in v) / len(v) for i in range(2)] for k, v in runs.items()}
    assert mean["auto"][0] <= min(mean[k][0] for k in range(1, 5)) * 1.01
    assert mean["auto"][1] <= min(mean[k][1] for k in range(1, 9)) * (1.10 if tokens < 100 else 1.03)


def test_adaptive_depth_tracks_a_change():
    """When every draft starts to miss, the depth never grows and is down to 2 within 35 cycles (the memory
    of about 10 cycles, then the stale deeper estimates fade); it is back at the maximum within 5 cycles of
    drafts being accepted again."""
    auto = AdaptiveDepth()
    for _ in range(20):
        auto.update(auto.depth(), auto.depth())
    depths = [auto.depth()]
    for _ in range(35):
        auto.update(depths[-1], 0)
        depths.append(auto.depth())
    assert depths[0] == len(auto.rates) and depths == sorted(depths, reverse=True) and depths[-1] <= 2
    for _ in range(5):
        auto.update(auto.depth(), auto.depth())
    assert auto.depth() == len(auto.rates)


def test_adaptive_depth_memory_forgets_old_cycles():
    """With memory m, a cycle n cycles back weighs m**n: the rate after a long run of misses no longer
    remembers earlier hits, and equals what the prior and the misses alone give."""
    a, b = AdaptiveDepth(), AdaptiveDepth()
    for _ in range(50):
        a.update(1, 1)
    for _ in range(200):
        a.update(1, 0)
        b.update(1, 0)
    assert a.rates[0] == pytest.approx(b.rates[0], abs=1e-6) and a.rates[0] < 0.1


def test_spec_metrics_add_counter_by_counter():
    a = SpecMetrics(num_drafts=2, num_accepted_tokens=1, accepted_per_position=[1], target_pass_rows={1: 3, 2: 1},
                    generated_tokens=5)
    b = SpecMetrics(num_drafts=1, num_accepted_tokens=2, accepted_per_position=[1, 1], target_pass_rows={2: 2},
                    generated_tokens=4)
    total = a + b
    assert (total.num_drafts, total.num_accepted_tokens, total.generated_tokens) == (3, 3, 9)
    assert total.accepted_per_position == [2, 1] and total.target_pass_rows == {1: 3, 2: 3}
    assert a.accepted_per_position == [1] and b.target_pass_rows == {2: 2}   # operands unchanged
