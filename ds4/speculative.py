"""MTP speculative decoding: draft with the MTP head, verify in one target pass, commit, roll back exactly.

One cycle (continuous, the default): the token `first` the target chose last is not yet in the session;
the drafter proposes d1..dk from the trunk state the previous pass left; the target runs
[first, d1..dk] as ONE forward; row i's top-1 (the registry's `verify_argmax`, one per row) is compared
with d_{i+1}; the longest matching prefix is committed plus the target's own next token, which becomes
the next cycle's `first`. The session is truncated to the committed tokens (MTP cache included), so its
state equals a session that only ever saw them.

Modes:
- fast (default): batched verify; commits the argmax of batched logits. With batch-invariant ops (the
  reference ops for verifies of <= SMALL_M rows) these equal one-row decode bit for bit; otherwise they
  can differ from plain greedy only at exact-tie precision (near-greedy).
- strict: committed tokens are bit-identical to plain greedy decode at every depth and prefill chunk.
  When the session's forwards are batch-invariant (`Session.batch_invariant()`: every op is, and no
  compiled step runs), the verify is the same single batched pass (<= SMALL_M rows); otherwise it falls
  back to exact per-token verification — one one-row decode per row, stopping at the first mismatch (no
  passes saved).
- `continuous=False`: ds4's older cycle, a standalone one-row decode of `first` before every draft.
- sampled (temperature > 0): speculative sampling, accept d with probability min(1, p(d)/q(d)), resample
  from max(0, p − q) on reject — the committed stream has exactly the target's filtered distribution.
  A draft with no accepted token arms a skip of the next 15 probes (ds4 #385); an accepted one resets it.
  Until one is accepted, probes are verified one row at a time with the MTP catch-up paused, so sampled
  decoding whose drafts go unused reads <= 1% more weight bytes than without the MTP (ds4/cost.py).
- `draft="auto"`: depth from live per-position acceptance.
- `transform(logits_row, prefix)` (logit adjustments, a grammar mask): applied to every target row — the
  decode row and each verify row, with the generated tokens and the drafts before it as its prefix — and
  to each MTP draft row, before argmax, sampling and acceptance. A draft the transform forbids is
  rejected (its verify row gives it no mass), so the output equals non-speculative transformed decoding.
Draft depth is clamped to the verify capacity (min(session chunk, SMALL_M) − 1 for a batched verify,
the chunk for per-token strict verify), the context left and the token budget.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Protocol

import torch

from ds4.errors import UsageError
from ds4.sampling import Sampler
from ops.qmatmul import SMALL_M

MAX_DRAFT = 16        # deepest draft a cycle may verify
PROBE_SKIP = 15       # probes skipped after a sampled draft is rejected whole (ds4 #385)
AUTO_MAX_DRAFT = 8    # deepest draft the adaptive depth considers
AUTO_PRIOR = 0.5      # adaptive depth's prior P(draft 1 accepted); position i's prior is position i-1's estimate
AUTO_PRIOR_WEIGHT = 2.0   # the prior counts as this many observations
AUTO_MEMORY = 0.9     # per-cycle decay of past observations (a memory of about 10 cycles)
AUTO_DRAFT_COST = 0.01    # target passes charged per drafted token (its MTP step and verify row)


@dataclass
class SpecMetrics:
    """Counters of one or more generations (vLLM's names where vLLM has one)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    target_forward_passes: int = 0   # decode passes (prefill excluded)
    target_rows: int = 0
    target_pass_rows: dict[int, int] = field(default_factory=dict)   # decode passes by rows
    prefill_passes: int = 0
    mtp_passes: int = 0              # MTP draft steps (one row each, with the LM head)
    mtp_catch_up_rows: dict[int, int] = field(default_factory=dict)  # MTP catch-ups (no LM head) by rows
    probes_skipped: int = 0
    generated_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verified draft: 1 + accepted / drafts (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def passes_per_token(self) -> float:
        """Target decode passes per generated token (plain decode: 1)."""
        return self.target_forward_passes / self.generated_tokens if self.generated_tokens else 0.0

    def __add__(self, other: SpecMetrics) -> SpecMetrics:
        """The counters of both runs together (lists add position by position, dicts key by key)."""
        total = SpecMetrics()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, list):
                n = max(len(a), len(b))
                a = [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)), strict=True)]
            elif isinstance(a, dict):
                a = {k: a.get(k, 0) + b.get(k, 0) for k in sorted(a.keys() | b.keys())}
            else:
                a = a + b
            setattr(total, f.name, a)
        return total

    def as_dict(self) -> dict:
        """All counters plus the derived rates, JSON-ready."""
        return asdict(self) | {"mean_acceptance_length": self.mean_acceptance_length,
                               "passes_per_token": self.passes_per_token}

    def summary(self) -> str:
        """One short line for stderr."""
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return (f"spec: {self.generated_tokens} tokens, {self.target_forward_passes} target passes "
                f"({self.passes_per_token:.2f}/token, {self.target_rows} rows), {self.mtp_passes} MTP passes, "
                f"drafts {self.num_drafts}, accepted {self.num_accepted_tokens}/{self.num_draft_tokens} "
                f"({rate:.0%}), mean acceptance length {self.mean_acceptance_length:.2f}, "
                f"per position {self.accepted_per_position}, probes skipped {self.probes_skipped}")


class Transform(Protocol):
    """Reshapes one row of logits [V] given the generated tokens before it (a prefix; its state may roll back)."""

    def __call__(self, logits: torch.Tensor, prefix: list[int]) -> torch.Tensor:
        """The row to choose from (float32, host)."""


@dataclass
class Draft:
    """Proposed tokens and, for sampled decoding, the distributions q [k, V] they were drawn from."""

    tokens: list[int]
    q: torch.Tensor | None = None


class Drafter(Protocol):
    """Proposes tokens to follow `first` (chosen by the target, not yet in the session); `uses_mtp` says
    whether it reads the session's MTP window (else the session skips the MTP catch-up)."""

    uses_mtp: bool

    def propose(self, session, first: int, n: int, sampler: Sampler, eos_id: int | None) -> Draft:
        """Up to `n` guesses; stops after an EOS guess."""


def row_tops(ops, logits: torch.Tensor) -> list[int]:
    """The greedy token of EACH row of `logits` [M, V] (ds4 #358: one top-1 per row, not top-M of row 0)."""
    top1, _ = ops.verify_argmax(logits)
    return top1.tolist()


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, token: int, sampler: Sampler) -> int | None:
    """Speculative sampling for one drafted `token` drawn from q [V], target distribution p [V]: None when
    accepted (probability min(1, p/q)), else a token drawn from the normalized residual max(0, p − q)."""
    if sampler.uniform() * float(q[token]) < float(p[token]):
        return None
    residual = (p - q).clamp(min=0)
    return sampler.draw(residual / residual.sum() if residual.sum() > 0 else p)


class AdaptiveDepth:
    """`--mtp-draft auto`: the depth with the least expected target passes per committed token (docs/speculative.md)."""

    # Per position i it estimates r_i = P(draft i accepted | drafts before it accepted) from counts that decay
    # by `memory` every cycle plus `prior_weight` observations of a prior: `prior` for position 1, r_(i-1)
    # after it, so a position seldom reached is assumed no better than the one before it. A depth-k draft
    # then commits 1 + r_1 + r_1 r_2 + ... (k terms) tokens per target pass on average; each drafted token
    # is charged `draft_cost` passes, so positions almost never reached are not drafted.

    def __init__(self, max_depth: int = AUTO_MAX_DRAFT, prior: float = AUTO_PRIOR,
                 prior_weight: float = AUTO_PRIOR_WEIGHT, memory: float = AUTO_MEMORY,
                 draft_cost: float = AUTO_DRAFT_COST):
        self.prior, self.prior_weight, self.memory, self.draft_cost = prior, prior_weight, memory, draft_cost
        self.hits = [0.0] * max_depth     # decayed accepted drafts at position i
        self.trials = [0.0] * max_depth   # decayed decided drafts at position i (drafts before it accepted)

    @property
    def rates(self) -> list[float]:
        """Estimated P(draft i accepted | drafts before it accepted), i = 1..max_depth."""
        rates, before, w = [], self.prior, self.prior_weight
        for h, n in zip(self.hits, self.trials, strict=True):
            before = (h + w * before) / (n + w)
            rates.append(before)
        return rates

    def expected_costs(self) -> list[float]:
        """Expected (target passes + draft cost) per committed token for depths 1..max_depth."""
        costs, reach, tokens = [], 1.0, 1.0
        for depth, rate in enumerate(self.rates, start=1):
            reach *= rate
            tokens += reach
            costs.append((1 + self.draft_cost * depth) / tokens)
        return costs

    def depth(self) -> int:
        """The depth to draft next (ties to the shallower)."""
        costs = self.expected_costs()
        return 1 + costs.index(min(costs))

    def update(self, drafted: int, accepted: int) -> None:
        """Fold in one verified cycle: older counts decay, positions 1..accepted hit, accepted+1 missed."""
        for i in range(len(self.hits)):
            self.hits[i] *= self.memory
            self.trials[i] *= self.memory
            if i < min(drafted, accepted + 1):
                self.trials[i] += 1
                self.hits[i] += i < accepted


class ProbeGate:
    """ds4 #385: a sampled draft none of whose tokens is used arms a skip of the next PROBE_SKIP probes;
    a used draft resets it; greedy never arms it. Until a draft is used again, the next probe is
    verified one row at a time and the MTP catch-up stays paused, so an unused probe costs one MTP draft
    step and no target work beyond plain decoding."""

    def __init__(self):
        self.skip = 0
        self.missed = False   # the last sampled draft went unused

    def allow(self, metrics: SpecMetrics) -> bool:
        """Whether this cycle may run the drafter (counts a skipped probe when not)."""
        if self.skip:
            self.skip -= 1
            metrics.probes_skipped += 1
            return False
        return True

    def record(self, greedy: bool, accepted: int) -> None:
        """Arm or reset after a verified draft."""
        self.missed = not greedy and not accepted
        self.skip = PROBE_SKIP if self.missed else 0


def check_draft(draft) -> int | str | None:
    """Validate `--mtp-draft`: None/0 (no speculation), 1..MAX_DRAFT, or "auto"."""
    if draft is None or draft == "auto" or (isinstance(draft, int) and not isinstance(draft, bool)
                                            and 0 <= draft <= MAX_DRAFT):
        return draft or None
    raise UsageError(f"--mtp-draft must be an integer 0..{MAX_DRAFT} or 'auto', got {draft!r}")


def generate_ids(session, prompt_ids: list[int], *, max_tokens: int, sampler: Sampler, eos_id: int | None,
                 draft: int | str | None = None, strict: bool = False, continuous: bool = True,
                 spec_log: Callable[[dict], None] | None = None, metrics: SpecMetrics | None = None,
                 drafter: Drafter | None = None,
                 on_logits: Callable[[torch.Tensor], None] | None = None,
                 transform: Transform | None = None,
                 forced: Callable[[list[int]], list[int]] | None = None) -> Iterator[int]:
    """Prefill `prompt_ids` and yield up to `max_tokens` generated ids as they are committed, speculating
    with `drafter` (the session's MTP head by default) when `draft` is a depth or "auto"; `on_logits`
    gets the target logits [V] each committed token was chosen from (before `transform`), in order;
    `forced(generated)` names tokens the transform will force next, verified in one pass like a draft."""
    draft = check_draft(draft)
    metrics = metrics if metrics is not None else SpecMetrics()
    generated: list[int] = []
    if drafter is None and draft and session.mtp is not None:
        drafter = MTPDrafter((lambda row, drafted: transform(row, generated + drafted)) if transform else None)
    if drafter is None:
        draft = None
    greedy = sampler.params.greedy
    batched = not strict or session.batch_invariant()   # strict batches only when that is exact
    adaptive = AdaptiveDepth() if draft == "auto" else None
    gate = ProbeGate()
    if max_tokens <= 0:
        return
    uses_mtp = bool(draft) and drafter.uses_mtp
    session.mtp_paused = not uses_mtp   # ds4 #385: no MTP work that no draft will read
    try:
        catch_up_from = session.counters["mtp_rows"]
        logits = session.prefill(prompt_ids)
        record_catch_up(session, metrics, catch_up_from)
        metrics.prefill_passes += -(-len(prompt_ids) // session.prefill_chunk)
        first = pick(session, logits[None], sampler, greedy, transform)
        generated.append(first)
        metrics.generated_tokens += 1
        if on_logits:
            on_logits(logits)
        yield first
        left = max_tokens - 1
        plain_next = not continuous   # the older cycle: a standalone decode of `first`, then a verify
        while left > 0 and first != eos_id and session.pos < session.ctx:
            # ds4 #381: a batched verify of depth+1 rows must fit the prefill chunk (the rings' slack),
            # and SMALL_M rows (the batch-invariant regime)
            capacity = min(session.prefill_chunk, SMALL_M) - 1 if batched else session.prefill_chunk
            room = max(0, min(capacity, left - 1, session.ctx - session.pos - 1))
            must = forced(generated)[:room] if forced else []   # verified like a draft, not counted as one
            depth = len(must)
            if draft and not must and not plain_next and gate.allow(metrics):
                depth = min(adaptive.depth() if adaptive else draft, room)
            session.mtp_paused = not uses_mtp or gate.missed   # catch up only while drafts are used
            drafts_from = session.counters["mtp_lm_head_rows"]
            proposal = Draft(must, forced_q(must, session.model.args.vocab_size, greedy)) if must else \
                drafter.propose(session, first, depth, sampler, eos_id) if depth else Draft([])
            metrics.mtp_passes += session.counters["mtp_lm_head_rows"] - drafts_from
            start = session.pos
            rows_per_pass = depth + 1 if batched and (must or not gate.missed) else 1   # a probe wastes no rows
            accepted, nxt, decided = verify(session, first, proposal, sampler, greedy, rows_per_pass, metrics,
                                            transform, generated)
            committed = proposal.tokens[:accepted]
            if proposal.tokens and not must:
                record_cycle(metrics, len(proposal.tokens), accepted)
                gate.record(greedy, accepted)
                if adaptive:
                    adaptive.update(len(proposal.tokens), accepted)
            if eos_id in committed:
                committed = committed[:committed.index(eos_id) + 1]
            out = committed if eos_id in committed else committed + [nxt]
            out = out[:left]
            session.truncate(start + len(out))
            if spec_log:
                spec_log({"pos": start, "first": first, "draft": proposal.tokens, "accepted": accepted,
                          "committed": out})
            for token, row in zip(out, decided, strict=False):
                generated.append(token)
                metrics.generated_tokens += 1
                if on_logits:
                    on_logits(row)
                yield token
            left -= len(out)
            first = out[-1]
            plain_next = not continuous and not plain_next
    finally:
        session.mtp_paused = False


def record_cycle(metrics: SpecMetrics, drafted: int, accepted: int) -> None:
    """Count one verified draft."""
    metrics.num_drafts += 1
    metrics.num_draft_tokens += drafted
    metrics.num_accepted_tokens += accepted
    if len(metrics.accepted_per_position) < drafted:
        metrics.accepted_per_position += [0] * (drafted - len(metrics.accepted_per_position))
    for i in range(accepted):
        metrics.accepted_per_position[i] += 1


def tally(histogram: dict[int, int], rows: int) -> None:
    """Add one call of `rows` rows to a rows -> calls histogram."""
    histogram[rows] = histogram.get(rows, 0) + 1


def record_catch_up(session, metrics: SpecMetrics, mtp_rows_before: int) -> None:
    """Count the MTP catch-up of the forward just run (a multi-chunk prefill counts as one call)."""
    rows = session.counters["mtp_rows"] - mtp_rows_before
    if rows:
        tally(metrics.mtp_catch_up_rows, rows)


def pick(session, logits: torch.Tensor, sampler: Sampler, greedy: bool, transform: Transform | None = None) -> int:
    """The target's own choice from a one-row `logits` [1, V] (transformed with an empty prefix)."""
    if transform:
        return choose(transform(logits[0], []), sampler, greedy)
    return row_tops(session.model.ops, logits)[0] if greedy else sampler.draw(sampler.probs(logits[0]))


def forced_q(tokens: list[int], vocab: int, greedy: bool) -> torch.Tensor | None:
    """The draft distributions of forced tokens: one-hot (None when greedy)."""
    return None if greedy else torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def choose(row: torch.Tensor, sampler: Sampler, greedy: bool) -> int:
    """A choice from one transformed row [V]: its argmax (lowest index on ties) or a draw."""
    return int(row.argmax()) if greedy else sampler.draw(sampler.probs(row))


def verify(session, first: int, proposal: Draft, sampler: Sampler, greedy: bool, rows_per_pass: int,
           metrics: SpecMetrics, transform: Transform | None, generated: list[int]) -> tuple[int, int, torch.Tensor]:
    """Run [first, d1..dk] through the target `rows_per_pass` rows at a time (stopping at the first
    rejected draft) and return (drafts accepted, the target's token after them, the logits rows that
    decided each committed token). `transform` reshapes row i with prefix `generated` + d1..di, computed
    only for rows reached. Rows of rejected drafts are left in the session for the caller to truncate."""
    drafts = proposal.tokens
    tokens = [first] + drafts
    decided = []
    for lo in range(0, len(tokens), rows_per_pass):
        catch_up_from = session.counters["mtp_rows"]
        logits = session.forward(tokens[lo:lo + rows_per_pass])
        record_catch_up(session, metrics, catch_up_from)
        decided.append(logits)
        metrics.target_forward_passes += 1
        metrics.target_rows += logits.shape[0]
        tally(metrics.target_pass_rows, logits.shape[0])
        tops = row_tops(session.model.ops, logits) if greedy and not transform else None
        for r in range(logits.shape[0]):
            i = lo + r
            row = transform(logits[r], [*generated, *drafts[:i]]) if transform else logits[r]
            if greedy:
                top = int(row.argmax()) if transform else tops[r]
                choice = top if i == len(drafts) or top != drafts[i] else None
            else:
                p = sampler.probs(row)
                choice = sampler.draw(p) if i == len(drafts) else \
                    accept_or_resample(p, proposal.q[i], drafts[i], sampler)
            if choice is not None:
                return i, choice, torch.cat(decided)[:i + 1]
    raise AssertionError("unreachable: the last row always decides")


class MTPDrafter:
    """Drafts with the session's MTP head, recursively on its own state (greedy or sampled from q); a
    `transform(row, drafted)` reshapes each draft row given the drafts before it."""

    uses_mtp = True

    def __init__(self, transform: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None):
        self.transform = transform

    def propose(self, session, first: int, n: int, sampler: Sampler, eos_id: int | None) -> Draft:
        """Up to `n` MTP guesses for the tokens after `first`; stops after an EOS guess."""
        tokens, qs, state, token = [], [], None, first
        for _ in range(n):
            logits, state = session.mtp_draft(token, state)
            if self.transform:
                logits = self.transform(logits, tokens)
            if sampler.params.greedy and self.transform:
                token = int(logits.argmax())
            elif sampler.params.greedy:
                token = row_tops(session.model.ops, logits[None])[0]
            else:
                qs.append(sampler.probs(logits))
                token = sampler.draw(qs[-1])
            tokens.append(token)
            if token == eos_id:
                break
        return Draft(tokens, torch.stack(qs) if qs else None)
