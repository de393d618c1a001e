"""Perplexity and KL divergence over a text, scored as `llama-perplexity` does: the token stream is cut into
independent chunks of `ctx` tokens and only the second half of each chunk is scored (every scored token
then has at least ctx/2 tokens of context). With the log-probabilities of a base model on the same tokens,
`kl_stats` gives what `llama-perplexity --kl-divergence` reports (llama.cpp #5076).
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ds4.engine import Engine
from ds4.errors import ModelFileError, UsageError


@dataclass(frozen=True)
class Scores:
    """The scored positions of a run: `targets` [N] (the token each row predicts), `logprobs` [N, V] float32."""

    ctx: int
    targets: torch.Tensor
    logprobs: torch.Tensor

    @property
    def nll(self) -> torch.Tensor:
        """Negative log-likelihood of each target, float64 [N]."""
        return -self.logprobs.gather(1, self.targets[:, None])[:, 0].to(torch.float64)

    def perplexity(self) -> tuple[float, float]:
        """exp(mean NLL) and its standard error (propagated from the NLL's)."""
        nll = self.nll
        ppl = math.exp(nll.mean().item())
        err = nll.std().item() / math.sqrt(len(nll)) if len(nll) > 1 else 0.0
        return ppl, ppl * err


def score(engine: Engine, ids: Sequence[int], ctx: int, on_chunk: Callable[[int], None] = lambda i: None,
          batch: int = 0) -> Scores:
    """Log-probabilities of the second half of every full chunk of `ctx` tokens of `ids`, each chunk fed in
    forwards of `batch` tokens (0: the whole chunk at once)."""
    n_chunks = len(ids) // ctx
    if ctx < 4 or n_chunks < 1:
        raise UsageError(f"the text has {len(ids)} tokens: too few for one chunk of {ctx} (lower --ctx)")
    if batch < 0:
        raise UsageError(f"the batch must be 0 (the whole chunk) or a number of tokens, got {batch}")
    first, step = ctx // 2, batch or ctx
    targets, logprobs = [], []
    for i in range(n_chunks):
        chunk = list(ids[i * ctx:(i + 1) * ctx])
        session = engine.session(ctx=ctx, prefill_chunk=step)
        parts = []
        for start in range(0, ctx, step):
            rows = [r - start for r in range(max(first, start), min(ctx - 1, start + step))]
            logits = session.forward(chunk[start:start + step], logit_rows=rows or None, eager=True)
            if rows:
                parts.append(logits)
        logprobs.append(torch.log_softmax(torch.cat(parts).to(torch.float32), -1))
        targets.append(torch.tensor(chunk[first + 1:], dtype=torch.int64))
        on_chunk(i)
    return Scores(ctx, torch.cat(targets), torch.cat(logprobs))


@dataclass(frozen=True)
class KLStats:
    """`llama-perplexity --kl-divergence`'s summary of a model against a base on the same tokens."""

    n_tokens: int
    ppl: float
    base_ppl: float
    mean_kld: float
    kld_err: float
    median_kld: float
    p99_kld: float
    max_kld: float
    rms_dp: float      # RMS over tokens of p(target) - p_base(target)
    same_top: float    # fraction of tokens whose most likely next token is the base's

    def lines(self) -> list[str]:
        """The summary as `name value` lines, in llama-perplexity's wording."""
        return [f"tokens scored     {self.n_tokens}",
                f"Mean PPL(Q)       {self.ppl:.4f}", f"Mean PPL(base)    {self.base_ppl:.4f}",
                f"Mean KLD          {self.mean_kld:.6f} ± {self.kld_err:.6f}",
                f"Maximum KLD       {self.max_kld:.6f}", f"99.0%   KLD       {self.p99_kld:.6f}",
                f"Median  KLD       {self.median_kld:.6f}",
                f"RMS Δp            {100 * self.rms_dp:.3f} %", f"Same top p        {100 * self.same_top:.3f} %"]


def kl_stats(scores: Scores, base: Scores) -> KLStats:
    """KL(base ‖ model) per scored token and the probability-difference statistics, as llama-perplexity."""
    if scores.ctx != base.ctx or not torch.equal(scores.targets, base.targets):
        raise UsageError(f"the base was scored on other tokens (ctx {base.ctx}, {len(base.targets)} tokens) than "
                         f"this run (ctx {scores.ctx}, {len(scores.targets)} tokens): use the same text and --ctx")
    if scores.logprobs.shape != base.logprobs.shape:
        raise UsageError(f"vocabularies differ: {tuple(base.logprobs.shape)} vs {tuple(scores.logprobs.shape)}")
    lp, lb = scores.logprobs.to(torch.float64), base.logprobs.to(torch.float64)
    kld = (lb.exp() * (lb - lp)).sum(-1).clamp(min=0)
    t = scores.targets[:, None]
    dp = lp.gather(1, t).exp() - lb.gather(1, t).exp()
    n = len(kld)
    return KLStats(n, scores.perplexity()[0], base.perplexity()[0], kld.mean().item(),
                   kld.std().item() / math.sqrt(n) if n > 1 else 0.0, kld.median().item(),
                   torch.quantile(kld, 0.99).item(), kld.max().item(), dp.pow(2).mean().sqrt().item(),
                   (lp.argmax(-1) == lb.argmax(-1)).to(torch.float64).mean().item())


def save(path: str | os.PathLike[str], scores: Scores) -> None:
    """Write a run's targets and log-probabilities (.npz; atomic)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    np.savez(tmp, ctx=np.int64(scores.ctx), targets=scores.targets.numpy(), logprobs=scores.logprobs.numpy())
    os.replace(tmp, path)


def load(path: str | os.PathLike[str]) -> Scores:
    """Read a file written by `save`; ModelFileError when it is not one."""
    try:
        with np.load(path) as z:
            return Scores(int(z["ctx"]), torch.from_numpy(z["targets"]), torch.from_numpy(z["logprobs"]))
    except (OSError, KeyError, ValueError) as e:
        raise ModelFileError(f"{path}: not a logits file of scripts/perplexity.py --save-logits ({e})") from None
