"""Token sampling: greedy, temperature, top-k, top-p, min-p; seeded and reproducible."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ds4.errors import UsageError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token; temperature 0 means greedy (lowest index wins ties)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        for name, flag in (("temperature", "--temp"), ("top_p", "--top-p"), ("min_p", "--min-p")):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise UsageError(f"{flag} must be a finite number, got {value!r}")
        if not isinstance(self.top_k, numbers.Integral) or isinstance(self.top_k, bool):
            raise UsageError(f"--top-k must be an integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**64):
            raise UsageError(f"--seed must be an integer in [0, 2^64), got {self.seed!r}")
        if self.temperature < 0:
            raise UsageError(f"--temp must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise UsageError(f"--min-p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    """Turns logits into tokens; the generator makes a seeded run reproducible."""

    def __init__(self, params: SamplingParams = SamplingParams()):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampling draws from: `[V]` float32 summing to 1 (one-hot when greedy)."""
        logits = logits.to("cpu", torch.float32).reshape(-1)  # the generator (and the draw) live on the host
        if self.params.greedy:
            return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).float()
        scaled = logits / self.params.temperature
        if not bool(torch.isfinite(scaled).all()):  # a tiny temperature overflows: shift first (same softmax)
            scaled = ((logits.double() - logits.max()) / self.params.temperature).float()
        p = torch.softmax(scaled, dim=-1)
        keep = torch.ones_like(p, dtype=torch.bool)
        order = torch.argsort(p, descending=True, stable=True)
        sorted_p = p[order]
        if self.params.top_k:
            keep[order[self.params.top_k:]] = False
        if self.params.top_p < 1:
            before = torch.cumsum(sorted_p, 0) - sorted_p  # mass strictly above each token
            keep[order[before >= self.params.top_p]] = False
        if self.params.min_p > 0:
            keep &= p >= self.params.min_p * sorted_p[0]
        p = torch.where(keep, p, torch.zeros_like(p))
        return p / p.sum()

    def draw(self, probs: torch.Tensor) -> int:
        """One token drawn from `probs` with this sampler's generator."""
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        """A uniform number in [0, 1) from this sampler's generator (speculative acceptance)."""
        return float(torch.rand((), generator=self.generator))

    def sample(self, logits: torch.Tensor) -> int:
        """The next token for these logits."""
        if self.params.greedy:
            return int(logits.reshape(-1).argmax())
        return self.draw(self.probs(logits))


@dataclass(frozen=True)
class LogitAdjustments:
    """Changes to the logits before sampling (vLLM's definitions): presence and frequency penalties over the
    generated tokens, a repetition penalty over prompt and generated tokens (divides positive logits,
    multiplies negative ones), additive `logit_bias` (token id, bias), `early` tokens (EOS, stop token ids)
    forced to -inf while fewer than `min_tokens` tokens were generated, and `never` tokens always
    (ignore_eos)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    early: tuple[int, ...] = ()
    min_tokens: int = 0
    never: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("presence", "frequency", "repetition"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise UsageError(f"the {name} penalty must be a finite number, got {value!r}")
        if self.repetition <= 0:
            raise UsageError(f"the repetition penalty must be > 0, got {self.repetition}")

    @property
    def active(self) -> bool:
        """Whether any adjustment changes the logits."""
        return bool(self.presence or self.frequency or self.repetition != 1 or self.logit_bias or self.never
                    or (self.early and self.min_tokens))

    def apply(self, logits: torch.Tensor, prompt: list[int], generated: list[int]) -> torch.Tensor:
        """The adjusted logits [V] (float32, on the host) for the token after `prompt + generated`."""
        out = logits.to("cpu", torch.float32).reshape(-1).clone()
        if self.repetition != 1:
            seen = torch.tensor(sorted(set(prompt) | set(generated)), dtype=torch.long)
            values = out[seen]
            out[seen] = torch.where(values > 0, values / self.repetition, values * self.repetition)
        if generated and (self.presence or self.frequency):
            ids, counts = torch.tensor(generated, dtype=torch.long).unique(return_counts=True)
            out[ids] -= self.presence + self.frequency * counts.float()
        for token, bias in self.logit_bias:
            out[token] += bias
        if self.early and len(generated) < self.min_tokens:
            out[list(self.early)] = float("-inf")
        if self.never:
            out[list(self.never)] = float("-inf")
        return out
