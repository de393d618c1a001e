"""The worker thread: it owns the engine and one session and runs generations one at a time, in arrival order.

A request whose prompt starts with tokens the session already holds (a continuing conversation) rolls back to
that common prefix and prefills only the rest; with a disk prefix cache (prefix_cache.py) a longer stored prefix
is loaded instead, and long prompts are saved there.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field

from ds4.engine import Engine
from ds4.errors import Ds4Error, UsageError
from ds4.sampling import Sampler, SamplingParams
from ds4.server.prefix_cache import PrefixCache
from ds4.session import Session, Snapshot
from ds4.speculative import SpecMetrics, check_draft, generate_ids
from ds4.tokenizer import StreamDecoder


@dataclass
class Finished:
    """How a generation ended: reason stop | length | cancelled, and its counts."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    spec: SpecMetrics


@dataclass
class Failed:
    """A generation that raised: the message for the client."""

    status: int
    message: str


@dataclass
class Job:
    """One queued generation; its events (token texts, then Finished or Failed) go to an asyncio queue."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: str | Finished | Failed) -> None:
        """Hand an event to the request's event loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is going down
            self.cancel.set()


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
            except Ds4Error as e:
                self.session, outcome = None, Failed(503 if self.closing else 400, str(e))
            except Exception as e:  # a bug: log it here, tell the client only that it happened
                traceback.print_exc()
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
        prompt token, so the next turn of this conversation can come back here."""
        session, fresh = self.session, job.ids[cached:-1]
        if fresh:
            session.mtp_paused = not self.mtp_draft  # as generate_ids' own prefill would
            session.forward(fresh, None, mtp_min=session.pos + len(fresh) + 1 - self.engine.args.window)
            session.mtp_paused = False
        self.snapshot = session.snapshot()
        if self.prefix_cache:
            self.prefix_cache.maybe_save(session)
        return generate_ids(session, job.ids[-1:], max_tokens=job.max_tokens, sampler=Sampler(job.sampling),
                            eos_id=self.engine.tokenizer.eos_id, draft=self.mtp_draft, metrics=spec)

    def _generate(self, job: Job) -> Finished:
        spec, count, reason = SpecMetrics(), 0, "length"
        if job.cancel.is_set():
            return Finished("cancelled", len(job.ids), 0, 0, spec)
        cached = self._reuse(job.ids)
        decoder = StreamDecoder(self.engine.tokenizer)
        stream = self.tokens(job, cached, spec)
        try:
            for token in stream:
                count += 1
                if token == self.engine.tokenizer.eos_id:
                    reason = "stop"
                    break
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
        return Finished(reason, len(job.ids), count, cached, spec)
