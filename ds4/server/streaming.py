"""Streaming helpers: stop strings, a job's events with disconnect cancellation, server-sent events, usage."""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import Request

from ds4.chat import Delta, held_back
from ds4.server.schemas import ApiError
from ds4.server.worker import Failed, Finished, Job, TokenLogprob
from ds4.speculative import SpecMetrics
from ds4.tokenizer import Tokenizer

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there


class StopMatcher:
    """Cuts generated text at the first stop string, holding back text that may start one."""

    def __init__(self, stops: list[str]):
        self.stops, self.buffer, self.hit = stops, "", None  # hit: the stop string that ended the text

    def feed(self, text: str) -> str:
        """The text that is safe to emit now."""
        if self.hit:
            return ""
        self.buffer += text
        found = [(self.buffer.find(s), s) for s in self.stops if s in self.buffer]
        if found:
            at, self.hit = min(found)
            out, self.buffer = self.buffer[:at], ""
            return out
        keep = held_back(self.buffer, self.stops)
        out, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return out

    def flush(self) -> str:
        """Whatever is held back at the end."""
        out, self.buffer = self.buffer, ""
        return out


async def job_events(job: Job, request: Request) -> AsyncIterator[str | Finished]:
    """The texts of a job, then its Finished; a client that disconnects (or a consumer that stops) cancels it."""
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if loop.time() >= check_at:
                if await request.is_disconnected():
                    raise ApiError(499, "the client closed the request")
                check_at = loop.time() + DISCONNECT_POLL_S
            if event is None:
                continue
            if isinstance(event, Failed):
                raise ApiError(event.status, event.message)
            yield event
            if isinstance(event, Finished):
                return
    finally:
        job.cancel.set()


async def cut_texts(job: Job, request: Request, stopper: StopMatcher) -> AsyncIterator[str | TokenLogprob | Finished]:
    """The job's texts (and logprobs) cut at the first stop string (which ends the generation), then its
    Finished (reason "stop" after a stop string)."""
    async for event in job_events(job, request):
        if isinstance(event, Finished):
            yield stopper.flush()
            yield replace(event, reason="stop") if stopper.hit else event
        elif isinstance(event, TokenLogprob):
            if not stopper.hit:
                yield event
        else:
            yield stopper.feed(event)
            if stopper.hit:
                job.cancel.set()


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def usage(done: list[Finished]) -> dict:
    """OpenAI's usage block of a request's choices (the prompt counted once) plus the cached prefix and the
    speculative decoding counters."""
    prompt, completion = done[0].prompt_tokens, sum(d.completion_tokens for d in done)
    spec = sum((d.spec for d in done), SpecMetrics())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": done[0].cached_tokens}, "speculative": spec.as_dict()}


def token_text(tokenizer: Tokenizer, token: int) -> tuple[str, list[int]]:
    """A token's text (U+FFFD for a partial character) and its bytes."""
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer: Tokenizer, records: list[TokenLogprob]) -> dict:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(token: int, logprob: float) -> dict:
        text, raw = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                        for r in records]}


def completion_logprobs(tokenizer: Tokenizer, records: list[TokenLogprob]) -> dict:
    """Completions' `logprobs`: parallel lists of tokens, their logprobs, the top alternatives, text offsets."""
    texts = [token_text(tokenizer, r.token)[0] for r in records]
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [r.logprob for r in records], "text_offset": offsets,
            "top_logprobs": [{token_text(tokenizer, t)[0]: lp for t, lp in r.top} for r in records]}


@dataclass
class Reply:
    """A chat reply as it accumulates: reasoning, content and tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, delta: Delta) -> dict:
        """Fold a delta in; return it as an OpenAI streaming delta."""
        if delta.tool_call:
            call = delta.tool_call.openai(f"call_{uuid.uuid4().hex[:24]}")
            self.tool_calls.append(call)
            return {"tool_calls": [{"index": len(self.tool_calls) - 1, **call}]}
        self.reasoning += delta.reasoning
        self.content += delta.content
        return {"reasoning_content": delta.reasoning} if delta.reasoning else {"content": delta.content}

    def finish_reason(self, done: Finished) -> str:
        """OpenAI's finish_reason."""
        return "tool_calls" if self.tool_calls and done.reason == "stop" else done.reason


async def sse_stream(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events of `events`, an error event if the job failed, then [DONE]."""
    try:
        async for data in events:
            yield sse(data)
    except ApiError as e:
        yield sse(e.response().body.decode())
        return
    yield sse("[DONE]")
