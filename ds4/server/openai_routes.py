"""The OpenAI routes: /v1/models, /v1/chat/completions and /v1/completions, streaming or not (docs/server.md)."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ds4.chat import ChatFormatError, CompletionParser, prompt_ids, prompt_task
from ds4.engine import Engine
from ds4.errors import UsageError
from ds4.sampling import SamplingParams
from ds4.server.schemas import ApiError, ChatRequest, CompletionRequest, SamplingFields, parse_body
from ds4.server.streaming import Reply, StopMatcher, job_events, sse_stream, usage
from ds4.server.worker import Finished, Job, Worker

EFFORTS = {"low": None, "medium": None, "high": "high", "max": "max"}  # OpenAI names -> the V4 encoding's


def openai_router(engine: Engine, worker: Worker, model_name: str) -> APIRouter:
    """The OpenAI routes serving `engine` through `worker` under `model_name`."""
    router = APIRouter()

    def queue_job(body: SamplingFields, ids: list[int]) -> Job:
        if len(ids) >= engine.ctx:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the context is {engine.ctx} tokens",
                           code="context_length_exceeded", param="messages")
        wanted = body.max_completion_tokens or body.max_tokens or engine.ctx
        try:
            sampling = SamplingParams(body.temperature, body.top_k, body.top_p, body.min_p, body.seed)
        except UsageError as e:
            raise ApiError(400, str(e)) from None
        return worker.submit(Job(ids, min(wanted, engine.ctx - len(ids)), sampling, asyncio.get_running_loop()))

    async def texts(job: Job, request: Request, stops: list[str]) -> AsyncIterator[str | Finished]:
        """The job's texts cut at the first stop string (which ends the generation), then its Finished."""
        stopper = StopMatcher(stops)
        async for event in job_events(job, request):
            if isinstance(event, Finished):
                yield stopper.flush()
                yield replace(event, reason="stop") if stopper.hit else event
            else:
                yield stopper.feed(event)
                if stopper.hit:
                    job.cancel.set()

    def usage_chunk(body: SamplingFields, head: dict, done: Finished) -> list[dict]:
        wanted = (body.stream_options or {}).get("include_usage")
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
        body: ChatRequest = await parse_body(request, ChatRequest, model_name)
        mode = body.thinking_mode()
        tools = body.tools if body.tool_choice != "none" else None
        try:
            fmt = body.response_format if (body.response_format or {}).get("type", "text") != "text" else None
            ids = prompt_ids(engine.tokenizer, body.messages, mode, tools=tools, response_format=fmt,
                             reasoning_effort=EFFORTS[body.reasoning_effort] if body.reasoning_effort else None)
        except ChatFormatError as e:
            raise ApiError(400, str(e), param="messages") from None
        job = queue_job(body, ids)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model_name}
        parser, reply = CompletionParser(mode, prompt_task(body.messages)), Reply()

        async def events() -> AsyncIterator[tuple[list[dict], Finished | None]]:
            """(OpenAI deltas, None) as text arrives, then ([], Finished)."""
            async for event in texts(job, request, body.stops()):
                if isinstance(event, Finished):
                    yield [reply.add(d) for d in parser.finish()], None
                    yield [], event
                else:
                    yield [reply.add(d) for d in parser.feed(event)], None

        if not body.stream:
            done = [event async for _, event in events() if event][0]
            message = {"role": "assistant", "content": reply.content if reply.content or not reply.tool_calls else None}
            if mode == "thinking":
                message["reasoning_content"] = reply.reasoning
            if reply.tool_calls:
                message["tool_calls"] = reply.tool_calls
            return {**head, "object": "chat.completion", "usage": usage(done), "choices": [
                {"index": 0, "message": message, "finish_reason": reply.finish_reason(done), "logprobs": None}]}

        def chunk(delta: dict, finish: str | None = None) -> dict:
            return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

        async def chunks() -> AsyncIterator[dict]:
            yield chunk({"role": "assistant", "content": ""})
            async for deltas, done in events():
                for delta in deltas:
                    yield chunk(delta)
                if done:
                    yield chunk({}, reply.finish_reason(done))
                    for extra in usage_chunk(body, head, done):
                        yield extra

        return StreamingResponse(sse_stream(chunks()), media_type="text/event-stream")

    @router.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = await parse_body(request, CompletionRequest, model_name)
        if isinstance(body.prompt, list):
            bad = [t for t in body.prompt if not 0 <= t < engine.args.vocab_size]
            if bad:
                raise ApiError(400, f"prompt token ids {bad[:5]} are outside [0, {engine.args.vocab_size})",
                               param="prompt")
        ids = list(body.prompt) if isinstance(body.prompt, list) else engine.tokenizer.encode(body.prompt)
        job = queue_job(body, ids)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}

        def choice(text: str, finish: str | None = None) -> dict:
            return {**head, "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}

        if not body.stream:
            events = [event async for event in texts(job, request, body.stops())]
            done = events[-1]
            return {**choice("".join(events[:-1]), done.reason), "usage": usage(done)}

        async def chunks() -> AsyncIterator[dict]:
            async for event in texts(job, request, body.stops()):
                if isinstance(event, Finished):
                    yield choice("", event.reason)
                    for extra in usage_chunk(body, head, event):
                        yield extra
                elif event:
                    yield choice(event)

        return StreamingResponse(sse_stream(chunks()), media_type="text/event-stream")

    return router
