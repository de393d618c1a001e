"""Sampling: greedy tie rule, filters, reproducibility, and the drawn distribution."""
import pytest
import torch

from ds4.errors import UsageError
from ds4.sampling import Sampler, SamplingParams


def test_greedy_takes_lowest_index_on_ties():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert Sampler().sample(logits) == 1
    assert Sampler(SamplingParams(temperature=0.7, top_k=1)).sample(logits) == 1


@pytest.mark.parametrize("params, kept", [
    (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
    (SamplingParams(temperature=1.0, top_p=0.6), {0, 1}),
    (SamplingParams(temperature=1.0, top_p=0.4), {0}),
    (SamplingParams(temperature=1.0, min_p=0.5), {0, 1}),
    (SamplingParams(temperature=1.0, min_p=0.1), {0, 1, 2}),
])
def test_filters_keep_the_expected_support(params, kept):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = Sampler(params).probs(probs.log())
    assert {i for i in range(4) if p[i] > 0} == kept
    assert torch.isclose(p.sum(), torch.tensor(1.0))
    for i in kept:
        assert torch.isclose(p[i], probs[i] / probs[list(kept)].sum())


def test_seed_reproduces_and_differs():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    a = Sampler(SamplingParams(temperature=1.0, seed=7))
    b = Sampler(SamplingParams(temperature=1.0, seed=7))
    c = Sampler(SamplingParams(temperature=1.0, seed=8))
    def seq(s):
        return [s.sample(logits) for _ in range(40)]
    sa, sb, sc = seq(a), seq(b), seq(c)
    assert sa == sb and sa != sc


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    s = Sampler(SamplingParams(temperature=0.8, seed=1))
    counts = torch.bincount(torch.tensor([s.sample(logits) for _ in range(20000)]), minlength=4).float()
    expected = torch.softmax(logits / 0.8, -1)
    assert torch.allclose(counts / counts.sum(), expected, atol=0.015)


@pytest.mark.parametrize("kwargs, flag", [({"temperature": -1}, "--temp"), ({"top_p": 0}, "--top-p"),
                                          ({"min_p": 2}, "--min-p"), ({"top_k": -3}, "--top-k")])
def test_bad_parameters_name_the_flag(kwargs, flag):
    with pytest.raises(UsageError, match=flag):
        SamplingParams(**kwargs)
