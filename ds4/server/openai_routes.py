"""The OpenAI routes: /v1/models, /v1/chat/completions and /v1/completions, streaming or not (docs/server.md)."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from ds4.chat import ChatFormatError, CompletionParser, prompt_ids, prompt_task
from ds4.engine import Engine
from ds4.errors import UsageError
from ds4.formats.vocab import THINK_END
from ds4.grammar import Constraint, json_grammar, tool_call_grammar
from ds4.sampling import LogitAdjustments, SamplingParams
from ds4.server.guards import json_body
from ds4.server.schemas import ApiError, ChatRequest, CompletionRequest, SamplingFields, parse_body
from ds4.server.streaming import Reply, StopMatcher, chat_logprobs, completion_logprobs, cut_texts, sse_stream, usage
from ds4.server.worker import Finished, Job, TokenLogprob, Worker

EFFORTS = {"low": None, "medium": None, "high": "high", "max": "max"}  # OpenAI names -> the V4 encoding's


def tool_names(tools: list[dict] | None) -> frozenset[str]:
    """The function names a reply may call: only these become tool_calls (none without tools)."""
    return frozenset(t["function"]["name"] for t in tools or [] if isinstance(t, dict)
                     and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str))


def chat_grammar(body: ChatRequest, tools: list[dict] | None) -> str | None:
    """The grammar a chat reply must follow: tool calls for tool_choice required or named, JSON for a
    json_object / json_schema response_format, else none."""
    choice = body.tool_choice
    if choice == "required" or choice is not None and not isinstance(choice, str):
        functions = [t["function"] for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)]
        if not isinstance(choice, str):
            functions = [f for f in functions if f.get("name") == choice.function.name]
        if not functions:
            raise ApiError(400, "tool_choice names a function that is not in tools" if not isinstance(choice, str)
                           else "tool_choice 'required' needs tools", param="tool_choice")
        return tool_call_grammar(functions)
    kind = (body.response_format or {}).get("type")
    if kind == "json_object":
        return json_grammar()
    if kind == "json_schema":
        return json_grammar(body.response_format["json_schema"]["schema"])
    return None


def cancel(jobs: list[Job]) -> None:
    """Cancel a request's jobs (a choice not yet read when the client left, or after an error)."""
    for job in jobs:
        job.cancel.set()


def openai_router(engine: Engine, worker: Worker, model_name: str) -> APIRouter:
    """The OpenAI routes serving `engine` through `worker` under `model_name`."""
    router = APIRouter()
    vocab, eos = engine.args.vocab_size, engine.tokenizer.eos_id
    think_end = engine.tokenizer.encode(THINK_END, specials=True)[0]

    def token_ids(ids: list[int], param: str) -> list[int]:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"{param}: token ids {bad[:5]} are outside [0, {vocab})", param=param)
        return ids

    def adjustments(body: SamplingFields) -> LogitAdjustments:
        keys = list((body.logit_bias or {}).items())
        if any(not key.isdigit() for key, _ in keys):
            raise ApiError(400, "logit_bias keys must be token ids (decimal strings)", param="logit_bias")
        bias = tuple(zip(token_ids([int(k) for k, _ in keys], "logit_bias"), [v for _, v in keys], strict=True))
        stop_ids = tuple(body.stop_token_ids or ())
        return LogitAdjustments(body.presence_penalty, body.frequency_penalty, body.repetition_penalty, bias,
                                (eos, *stop_ids), body.min_tokens, (eos,) if body.ignore_eos else ())

    def constraints(grammar: str | None, n: int) -> list[Constraint | None]:
        """One grammar state per choice (ApiError when the grammar cannot be enforced)."""
        try:
            return [Constraint(engine.tokenizer, vocab, grammar) if grammar else None for _ in range(n)]
        except UsageError as e:
            raise ApiError(400, str(e), param="response_format") from None

    def queue_jobs(body: SamplingFields, ids: list[int], states: list[Constraint | None] | None = None,
                   after: int | None = None) -> list[Job]:
        """The request's n jobs (choice i seeded with seed + i), queued; `states` constrain their outputs (after
        the token `after`, when given)."""
        if len(ids) >= engine.ctx:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the context is {engine.ctx} tokens",
                           code="context_length_exceeded", param="messages")
        wanted = body.max_completion_tokens or body.max_tokens or engine.ctx
        adjust = adjustments(body)
        stop_ids = frozenset(token_ids(body.stop_token_ids or [], "stop_token_ids"))
        jobs, states = [], states or [None] * body.n
        for i in range(body.n):
            seed = None if body.seed is None else (body.seed + i) % 2**63
            try:
                sampling = SamplingParams(body.temperature, body.top_k, body.top_p, body.min_p, seed)
            except UsageError as e:
                raise ApiError(400, str(e)) from None
            jobs.append(Job(ids, min(wanted, engine.ctx - len(ids)), sampling, asyncio.get_running_loop(), adjust,
                            body.logprob_count(), stop_ids, states[i], after))
        return [worker.submit(job) for job in jobs]

    def texts(job: Job, request: Request, stops: list[str]) -> AsyncIterator[str | TokenLogprob | Finished]:
        return cut_texts(job, request, StopMatcher(stops))

    def usage_chunk(body: SamplingFields, head: dict, done: list[Finished]) -> list[dict]:
        wanted = body.stream_options and body.stream_options.include_usage
        return [{**head, "choices": [], "usage": usage(done)}] if wanted else []

    card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "ds4py"}

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @router.get("/v1/models/{name}")
    async def model(name: str) -> dict:
        if name != model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server has {model_name!r}",
                           code="model_not_found", param="model")
        return card

    @router.post("/v1/chat/completions")
    async def chat(request: Request):
        body: ChatRequest = parse_body(await json_body(request), ChatRequest, model_name)
        mode = body.thinking_mode()
        tools = body.tools if body.tool_choice != "none" else None
        try:
            fmt = body.response_format if body.response_format and body.response_format["type"] != "text" else None
            ids = await run_in_threadpool(
                prompt_ids, engine.tokenizer, body.messages, mode, tools=tools, response_format=fmt,
                reasoning_effort=EFFORTS[body.reasoning_effort] if body.reasoning_effort else None)
        except ChatFormatError as e:
            raise ApiError(400, str(e), param="messages") from None
        try:
            grammar = chat_grammar(body, tools)
        except UsageError as e:
            raise ApiError(400, str(e), param="response_format" if body.response_format else "tools") from None
        states = await run_in_threadpool(constraints, grammar, body.n) if grammar else None
        jobs = queue_jobs(body, ids, states, think_end if mode == "thinking" else None)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model_name}
        replies = [Reply() for _ in jobs]

        async def events(i: int) -> AsyncIterator[tuple[list[dict], list[TokenLogprob], Finished | None]]:
            """Choice i's (OpenAI deltas, logprobs, None) as text arrives, then ([], [], Finished)."""
            parser = CompletionParser(mode, prompt_task(body.messages), tool_names(tools))
            reply, pending = replies[i], []
            async for event in texts(jobs[i], request, body.stops()):
                if isinstance(event, TokenLogprob):
                    pending.append(event)
                    continue
                pieces = parser.finish() if isinstance(event, Finished) else parser.feed(event)
                deltas = [reply.add(d) for d in pieces]
                if deltas or isinstance(event, Finished):
                    reply.logprobs += pending
                    yield deltas, pending, None
                    pending = []
                if isinstance(event, Finished):
                    yield [], [], event

        def logprobs(records: list[TokenLogprob]) -> dict | None:
            return chat_logprobs(engine.tokenizer, records) if body.logprobs else None

        if not body.stream:
            done, choices = [], []
            try:
                for i in range(len(jobs)):
                    done.append([event async for _, _, event in events(i) if event][0])
            finally:
                cancel(jobs)
            for i, reply in enumerate(replies):
                message = {"role": "assistant", "content": reply.content if reply.content or not reply.tool_calls
                           else None}
                if mode == "thinking":
                    message["reasoning_content"] = reply.reasoning
                if reply.tool_calls:
                    message["tool_calls"] = reply.tool_calls
                choices.append({"index": i, "message": message, "finish_reason": reply.finish_reason(done[i]),
                                "logprobs": logprobs(reply.logprobs)})
            return {**head, "object": "chat.completion", "usage": usage(done), "choices": choices}

        def chunk(i: int, delta: dict, finish: str | None = None, records: list | None = None) -> dict:
            return {**head, "choices": [{"index": i, "delta": delta, "finish_reason": finish,
                                         "logprobs": logprobs(records or [])}]}

        async def chunks() -> AsyncIterator[dict]:
            done = []
            try:
                for i in range(len(jobs)):
                    yield chunk(i, {"role": "assistant", "content": ""})
                    async for deltas, records, finished in events(i):
                        for n, delta in enumerate(deltas):
                            yield chunk(i, delta, records=records if n == 0 else [])
                        if not deltas and records:
                            yield chunk(i, {"content": ""}, records=records)
                        if finished:
                            done.append(finished)
                            yield chunk(i, {}, replies[i].finish_reason(finished))
            finally:
                cancel(jobs)
            for extra in usage_chunk(body, head, done):
                yield extra

        return StreamingResponse(sse_stream(chunks()), media_type="text/event-stream")

    @router.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = parse_body(await json_body(request), CompletionRequest, model_name)
        ids = token_ids(list(body.prompt), "prompt") if isinstance(body.prompt, list) else \
            await run_in_threadpool(engine.tokenizer.encode, body.prompt)
        jobs = queue_jobs(body, ids)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}

        def choice(i: int, text: str, finish: str | None = None, records: list | None = None) -> dict:
            lp = completion_logprobs(engine.tokenizer, records or []) if body.logprobs is not None else None
            return {"index": i, "text": text, "finish_reason": finish, "logprobs": lp}

        if not body.stream:
            done, choices = [], []
            try:
                for i, job in enumerate(jobs):
                    events = [event async for event in texts(job, request, body.stops())]
                    records = [e for e in events if isinstance(e, TokenLogprob)]
                    done.append(events[-1])
                    text = "".join(e for e in events[:-1] if isinstance(e, str))
                    choices.append(choice(i, text, done[-1].reason, records))
            finally:
                cancel(jobs)
            return {**head, "choices": choices, "usage": usage(done)}

        async def chunks() -> AsyncIterator[dict]:
            done = []
            try:
                for i, job in enumerate(jobs):
                    pending = []
                    async for event in texts(job, request, body.stops()):
                        if isinstance(event, TokenLogprob):
                            pending.append(event)
                        elif isinstance(event, Finished):
                            done.append(event)
                            yield {**head, "choices": [choice(i, "", event.reason, pending)]}
                        elif event or pending:
                            yield {**head, "choices": [choice(i, event, None, pending)]}
                            pending = []
            finally:
                cancel(jobs)
            for extra in usage_chunk(body, head, done):
                yield extra

        return StreamingResponse(sse_stream(chunks()), media_type="text/event-stream")

    return router
