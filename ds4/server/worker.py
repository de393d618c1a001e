"""The worker thread: it owns the engine and one session and runs generations one at a time, in arrival order.

A request whose prompt starts with tokens the session already holds (a continuing conversation) rolls back to
that common prefix and prefills only the rest; with a disk prefix cache (prefix_cache.py) a longer stored prefix
is loaded instead, and long prompts are saved there.

Across ranks (`--parallel`) rank 0's worker sends each job to the other ranks (ds4/server/ranks.py), whose
workers run it in `follow` with the same engine calls.
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
from ds4.errors import Ds4Error, ParallelError, UsageError
from ds4.grammar import Constraint
from ds4.sampling import LogitAdjustments, Sampler, SamplingParams
from ds4.server.prefix_cache import PrefixCache
from ds4.server.ranks import Heartbeat, Link, Shutdown, Work, seeded
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
    loop: asyncio.AbstractEventLoop | None   # None: a follower rank's copy of a job, whose events go nowhere
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
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is going down
            self.cancel.set()

    def work(self, fresh_session: bool) -> Work:
        """The job as the other ranks repeat it."""
        grammar = self.constraint.grammar if self.constraint else None
        return Work(self.ids, self.max_tokens, self.sampling, self.adjust, self.stop_ids, grammar, self.constrain_after,
                    fresh_session)


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


def followed_job(engine: Engine, work: Work) -> Job:
    """A follower rank's copy of rank 0's job (its own grammar parser; its events go nowhere)."""
    constraint = Constraint(engine.tokenizer, engine.args.vocab_size, work.grammar) if work.grammar else None
    return Job(work.ids, work.max_tokens, work.sampling, None, work.adjust, None, work.stop_ids, constraint,
               work.constrain_after)


class Worker:
    """Owns the engine and one session; runs jobs one at a time in arrival order (FIFO, so fair).

    With a `link` (across ranks), rank 0's worker thread sends each job to the other ranks, and on every other
    rank no thread starts: `follow` runs their jobs on the caller's thread."""

    def __init__(self, engine: Engine, mtp_draft: int | str | None = None, prefix_cache: PrefixCache | None = None,
                 link: Link | None = None):
        if link is not None and prefix_cache is not None:
            raise UsageError("--kv-disk-dir does not run across ranks yet: drop it with --parallel")
        self.engine, self.prefix_cache, self.link = engine, prefix_cache, link
        self.mtp_draft = check_draft(mtp_draft if mtp_draft is not None else (1 if engine.mtp else None))
        if self.mtp_draft and engine.mtp is None:
            raise UsageError("--mtp-draft needs an MTP head: pass --mtp PATH")
        self.session: Session | None = None
        self.snapshot: Snapshot | None = None  # the session at the end of the last prompt (minus one token)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.finished: list[Finished] = []   # the last 100 outcomes, newest last
        self.current: Job | None = None
        self.closing = False
        self.ranks_lost = False  # across ranks: a collective with the other ranks failed, none is tried again
        self.on_finished: Callable[[Finished], None] | None = None  # e.g. the server's metrics
        self.rows: deque[torch.Tensor] = deque()  # the logits each token yielded by tokens() was chosen from
        self.thread = threading.Thread(target=self._run, name="ds4-worker", daemon=True)
        if link is None or link.world.is_main:
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

    def _next_job(self) -> Job | None:
        """The next job (None: close); across ranks, a heartbeat goes to the other ranks while none comes."""
        while self.link is not None and not self.ranks_lost:
            try:
                job = self.jobs.get(timeout=self.link.idle_s)
            except queue.Empty:
                self._tell_ranks(Heartbeat())
                continue
            if job is None:
                self._tell_ranks(Shutdown())
            return job
        return self.jobs.get()

    def _tell_ranks(self, message: Heartbeat | Shutdown) -> None:
        """Send the other ranks a message; when they are gone, later jobs fail with 503 (the server shuts down)."""
        try:
            self.link.send(message)
        except ParallelError as e:  # e.g. Ctrl-C under torchrun reaches every rank, and they stop first
            log.error("%s", e)
            self.ranks_lost = self.closing = True

    def _run(self) -> None:
        while (job := self._next_job()) is not None:
            self.current = job
            try:
                if self.closing:
                    raise Ds4Error("the other ranks of this run stopped: restart every rank" if self.ranks_lost
                                   else "the server is shutting down")
                outcome = self._generate(job)
                self.finished = [*self.finished[-99:], outcome]
                if self.on_finished:
                    self.on_finished(outcome)
            except ParallelError as e:  # the other ranks are gone or out of step: this worker cannot go on
                log.error("%s", e)
                self.ranks_lost = self.closing = True
                outcome = Failed(503, str(e))
            except Ds4Error as e:
                self.session, outcome = None, Failed(503 if self.closing else 400, str(e))
            except Exception as e:  # a bug: log it here, tell the client only that it happened
                log.exception("generation failed")
                self.session, outcome = None, Failed(500, f"internal error ({type(e).__name__})")
            job.emit(outcome)
            self.current = None

    def follow(self) -> None:
        """A follower rank: run rank 0's jobs as they come until it shuts down (ParallelError when it stops
        answering for $DS4_DIST_TIMEOUT)."""
        while not isinstance(message := self.link.receive(), Shutdown):
            if isinstance(message, Heartbeat):
                continue
            job = followed_job(self.engine, message)
            if message.fresh_session:
                self.session = self.snapshot = None
            try:
                cached = self._reuse(job.ids)
                stream = self.tokens(job, cached, SpecMetrics())
                try:
                    for token in stream:
                        if not self.link.agree(token):
                            break
                finally:
                    stream.close()
            except ParallelError:
                raise
            except Ds4Error:  # rank 0 met the same error at the same point
                self.session = None

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
        if self.link:
            job.sampling = seeded(job.sampling)
            self.link.send(job.work(fresh_session=self.session is None))
        cached = self._reuse(job.ids)
        decoder = StreamDecoder(self.engine.tokenizer)
        self.rows.clear()
        stream = self.tokens(job, cached, spec)
        undecided = False   # across ranks: a token whose go-on flag the other ranks still wait for
        try:
            for token in stream:
                count += 1
                undecided = self.link is not None
                first_at = first_at or time.monotonic()
                logprob = self.logprob(job, token)
                if token == self.engine.tokenizer.eos_id or token in job.stop_ids:
                    reason = "stop"
                else:
                    if logprob:
                        job.emit(logprob)
                    piece = decoder.push(token)
                    if piece:
                        job.emit(piece)
                    reason = "cancelled" if job.cancel.is_set() else reason
                if self.link:
                    undecided = False
                    self.link.agree(token, go=reason == "length")
                if reason != "length":
                    break
        finally:
            if undecided:  # this rank failed between two tokens: the others stop too
                self.link.agree(token)
            stream.close()
        tail = decoder.flush()
        if tail:
            job.emit(tail)
        first_token_s = first_at - job.submitted if first_at else None
        return Finished(reason, len(job.ids), count, cached, spec, first_token_s,
                        time.monotonic() - first_at if first_at else 0.0)
