"""The worker thread: it owns the engine and one session and runs generations one at a time, in arrival order.

A request whose prompt starts with tokens the session already holds (a continuing conversation) rolls back to
that common prefix and prefills only the rest; with a disk prefix cache (prefix_cache.py) a longer stored prefix
is loaded instead, and long prompts are saved there.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ds4.engine import Engine
from ds4.errors import Ds4Error, UsageError
from ds4.grammar import Constraint
from ds4.sampling import LogitAdjustments, Sampler, SamplingParams
from ds4.server.prefix_cache import PrefixCache
from ds4.session import Session, Snapshot
from ds4.speculative import SpecMetrics, check_draft, generate_ids
from ds4.tokenizer import StreamDecoder

log = logging.getLogger("ds4.server")


@dataclass
class Finished:
    """How a generation ended: reason stop | length | cancelled, and its counts."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    spec: SpecMetrics
    first_token_s: float | None = None  # from submission to the first token
    decode_s: float = 0.0                # from the first token to the last


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the model (before any sampling filter or adjustment)
    and the `top` most likely tokens with theirs."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Failed:
    """A generation that raised: the message for the client."""

    status: int
    message: str


@dataclass
class Job:
    """One queued generation; its events (token texts, each token's TokenLogprob first when `logprobs` is a
    count, then Finished or Failed) go to an asyncio queue."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    adjust: LogitAdjustments = LogitAdjustments()
    logprobs: int | None = None      # None: off; else how many top alternatives each token reports
    stop_ids: frozenset[int] = frozenset()  # tokens that end the generation (their text is not emitted)
    constraint: Constraint | None = None  # the grammar the output must follow
    constrain_after: int | None = None   # a token (</think>) before which the output is free; None: from the start
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)

    def emit(self, event: str | TokenLogprob | Finished | Failed) -> None:
        """Hand an event to the request's event loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is going down
            self.cancel.set()


class Shaper:
    """A job's logit adjustments, then its grammar's mask (from the first token, or after `constrain_after`),
    for the row that follows `generated` (a speculative transform: the grammar follows rolled-back prefixes)."""

    def __init__(self, job: Job):
        self.job = job

    def grammar_output(self, generated: list[int]) -> list[int] | None:
        """The part of `generated` the grammar covers (None: the grammar has not started), the parser put after it."""
        job = self.job
        if job.constraint is None or (job.constrain_after is not None and job.constrain_after not in generated):
            return None
        output = generated if job.constrain_after is None else \
            generated[generated.index(job.constrain_after) + 1:]
        job.constraint.follow(output)
        return output

    def __call__(self, logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        """The row [V] (float32, host) the job chooses from after `generated`."""
        job = self.job
        out = job.adjust.apply(logits, job.ids, generated) if job.adjust.active else logits
        return out if self.grammar_output(generated) is None else job.constraint.mask_forced(out)

    def forced(self, generated: list[int]) -> list[int]:
        """The tokens the grammar forces after `generated` (none before it starts, or after EOS)."""
        return [] if self.grammar_output(generated) is None else self.job.constraint.forced()


class Worker:
    """Owns the engine and one session; runs jobs one at a time in arrival order (FIFO, so fair)."""

    def __init__(self, engine: Engine, mtp_draft: int | str | None = None, prefix_cache: PrefixCache | None = None):
        self.engine, self.prefix_cache = engine, prefix_cache
        self.mtp_draft = check_draft(mtp_draft if mtp_draft is not None else (1 if engine.mtp else None))
        if self.mtp_draft and engine.mtp is None:
            raise UsageError("--mtp-draft needs an MTP head: pass --mtp PATH")
        self.session: Session | None = None
        self.snapshot: Snapshot | None = None  # the session at the end of the last prompt (minus one token)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.finished: list[Finished] = []   # the last 100 outcomes, newest last
        self.current: Job | None = None
        self.closing = False
        self.on_finished: Callable[[Finished], None] | None = None  # e.g. the server's metrics
        self.rows: deque[torch.Tensor] = deque()  # the logits each token yielded by tokens() was chosen from
        self.thread = threading.Thread(target=self._run, name="ds4-worker", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Job:
        """Queue a job behind the ones already waiting."""
        self.jobs.put(job)
        return job

    def close(self) -> None:
        """Cancel the running job, refuse the waiting ones, stop the thread."""
        self.closing = True
        if self.current:
            self.current.cancel.set()
        self.jobs.put(None)
        self.thread.join()
        if self.prefix_cache:
            self.prefix_cache.close()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            self.current = job
            try:
                if self.closing:
                    raise Ds4Error("the server is shutting down")
                outcome = self._generate(job)
                self.finished = [*self.finished[-99:], outcome]
                if self.on_finished:
                    self.on_finished(outcome)
            except Ds4Error as e:
                self.session, outcome = None, Failed(503 if self.closing else 400, str(e))
            except Exception as e:  # a bug: log it here, tell the client only that it happened
                log.exception("generation failed")
                self.session, outcome = None, Failed(500, f"internal error ({type(e).__name__})")
            job.emit(outcome)
            self.current = None

    def _reuse(self, ids: list[int]) -> int:
        """Load the disk cache's longest prefix of `ids` when it beats the session's; else roll the session back to
        its longest common prefix with `ids` (keeping one token to feed), or to the snapshot taken at the end of
        the last prompt when the prefix reaches past it but the states needed to truncate there are gone; else
        start a fresh session. Returns the number of tokens kept."""
        held, common = self.session.tokens if self.session else [], 0
        while common < min(len(held), len(ids) - 1) and held[common] == ids[common]:
            common += 1
        stored = self.prefix_cache.longest(ids, len(ids) - 1) if self.prefix_cache else None
        if stored is not None and stored.tokens > common:  # the disk holds a longer prefix than this session
            self.session = self.snapshot = None  # one session's KV state in memory at a time
            self.session = self.prefix_cache.load(ids, common)
            if self.session is not None:
                return self.session.pos
        if self.session is None:
            self.session, self.snapshot = self.engine.session(), None
        try:
            self.session.truncate(common)
            return common
        except UsageError:
            pass
        if self.snapshot and self.snapshot.pos <= common:
            try:
                self.session.restore(self.snapshot)
                return self.snapshot.pos
            except UsageError:
                pass
        self.session, self.snapshot = self.engine.session(), None
        return 0

    def tokens(self, job: Job, cached: int, spec: SpecMetrics) -> Iterator[int]:
        """The generated ids of a job (the session holds ids[:cached]); snapshots the session before the last
        prompt token, so the next turn of this conversation can come back here. A job's logit adjustments and
        grammar shape every target and draft row (`Shaper`), so speculation stays exact."""
        session, fresh = self.session, job.ids[cached:-1]
        if fresh:
            session.mtp_paused = not self.mtp_draft  # as generate_ids' own prefill would
            session.forward(fresh, None, mtp_min=session.pos + len(fresh) + 1 - self.engine.args.window)
            session.mtp_paused = False
        self.snapshot = session.snapshot()
        if self.prefix_cache:
            self.prefix_cache.maybe_save(session)
        keep = self.rows.append if job.logprobs is not None else None
        shaper = Shaper(job) if job.adjust.active or job.constraint else None
        return generate_ids(session, job.ids[-1:], max_tokens=job.max_tokens, sampler=Sampler(job.sampling),
                            eos_id=self.engine.tokenizer.eos_id, draft=self.mtp_draft, metrics=spec, on_logits=keep,
                            transform=shaper, forced=shaper.forced if shaper else None)

    def logprob(self, job: Job, token: int) -> TokenLogprob | None:
        """The TokenLogprob of a token just yielded, when the job asked for them."""
        if job.logprobs is None or not self.rows:
            return None
        logprobs = torch.log_softmax(self.rows.popleft().to("cpu", torch.float32).reshape(-1), -1)
        top = torch.topk(logprobs, job.logprobs) if job.logprobs else None
        return TokenLogprob(token, float(logprobs[token]),
                            list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else [])

    def _generate(self, job: Job) -> Finished:
        spec, count, reason, first_at = SpecMetrics(), 0, "length", None
        if job.cancel.is_set():
            return Finished("cancelled", len(job.ids), 0, 0, spec)
        cached = self._reuse(job.ids)
        decoder = StreamDecoder(self.engine.tokenizer)
        self.rows.clear()
        stream = self.tokens(job, cached, spec)
        try:
            for token in stream:
                count += 1
                first_at = first_at or time.monotonic()
                logprob = self.logprob(job, token)
                if token == self.engine.tokenizer.eos_id or token in job.stop_ids:
                    reason = "stop"
                    break
                if logprob:
                    job.emit(logprob)
                piece = decoder.push(token)
                if piece:
                    job.emit(piece)
                if job.cancel.is_set():
                    reason = "cancelled"
                    break
        finally:
            stream.close()
        tail = decoder.flush()
        if tail:
            job.emit(tail)
        first_token_s = first_at - job.submitted if first_at else None
        return Finished(reason, len(job.ids), count, cached, spec, first_token_s,
                        time.monotonic() - first_at if first_at else 0.0)
