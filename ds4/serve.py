"""OpenAI-compatible HTTP server: `python -m ds4.serve` (docs/server.md).

One worker thread owns the model and one session and runs requests one at a time in arrival order. A request
whose prompt starts with tokens the session already holds (a continuing conversation) rolls back to that
common prefix and prefills only the rest. A client that goes away cancels its generation at the next token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import queue
import sys
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from ds4.chat import ChatFormatError, CompletionParser, Delta, held_back, prompt_ids
from ds4.engine import Engine, load
from ds4.errors import Ds4Error, UsageError
from ds4.sampling import Sampler, SamplingParams
from ds4.session import Session, Snapshot
from ds4.speculative import MAX_DRAFT, SpecMetrics, check_draft, generate_ids
from ds4.tokenizer import StreamDecoder

DEFAULT_MODEL_NAME = "deepseek-v4-flash"
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
EFFORTS = {"low": None, "medium": None, "high": "high", "max": "max"}  # OpenAI names -> the V4 encoding's


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> JSONResponse:
        """The JSON body OpenAI clients expect."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


# ---- requests -------------------------------------------------------------------------------------------

class SamplingFields(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    model: str
    stream: bool = False
    stream_options: dict | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)] | None = None
    n: Literal[1] = 1
    frequency_penalty: Literal[0] = 0
    presence_penalty: Literal[0] = 0
    logprobs: Literal[False] | None = None  # not supported: refused rather than ignored, as below
    top_logprobs: Literal[0] | None = None
    logit_bias: Annotated[dict, Field(max_length=0)] | None = None

    def stops(self) -> list[str]:
        """The stop strings as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    reasoning_effort: Literal["low", "medium", "high", "max"] | None = None
    response_format: dict | None = None
    thinking: dict | None = None

    def thinking_mode(self) -> str:
        """DeepSeek's switch: `thinking: {"type": "enabled"}` or any reasoning_effort turns thinking on."""
        kind = (self.thinking or {}).get("type", "disabled")
        if kind not in ("enabled", "disabled"):
            raise ApiError(400, f"thinking.type must be 'enabled' or 'disabled', got {kind!r}", param="thinking")
        return "thinking" if kind == "enabled" or self.reasoning_effort else "chat"


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a raw prompt (plain text, or token ids fed as they are)."""

    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    echo: Literal[False] = False
    suffix: None = None
    best_of: Literal[1] | None = None


def validation_message(e: ValidationError) -> tuple[str, str]:
    """(message, param) of the first problem pydantic found, preferring a broken limit over a wrong type."""
    errors = e.errors()
    err = next((x for x in errors if not x["type"].endswith("_type")), errors[0])
    field_name = str(err["loc"][0]) if err["loc"] else "body"
    where = field_name + "".join(f"[{p}]" for p in err["loc"][1:] if isinstance(p, int))
    return f"{where}: {err['msg']}", field_name


# ---- the worker ---------------------------------------------------------------------------------------

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

    def __init__(self, engine: Engine, mtp_draft: int | str | None = None):
        self.engine = engine
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
        """Roll the session back to its longest common prefix with `ids` (keeping one token to feed), or to the
        snapshot taken at the end of the last prompt when the prefix reaches past it but the states needed to
        truncate there are gone; else start a fresh session. Returns the number of tokens kept."""
        if self.session is None:
            self.session, self.snapshot = self.engine.session(), None
        held, common = self.session.tokens, 0
        while common < min(len(held), len(ids) - 1) and held[common] == ids[common]:
            common += 1
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


# ---- streaming helpers -----------------------------------------------------------------------------------

class StopMatcher:
    """Cuts generated text at the first stop string, holding back text that may start one."""

    def __init__(self, stops: list[str]):
        self.stops, self.buffer, self.hit = stops, "", False

    def feed(self, text: str) -> str:
        """The text that is safe to emit now."""
        if self.hit:
            return ""
        self.buffer += text
        found = [(self.buffer.find(s), s) for s in self.stops if s in self.buffer]
        if found:
            self.hit = True
            out, self.buffer = self.buffer[:min(found)[0]], ""
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


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def usage(done: Finished) -> dict:
    """OpenAI's usage block plus the cached prefix and the speculative decoding counters."""
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}, "speculative": done.spec.as_dict()}


@dataclass
class Reply:
    """A chat reply as it accumulates: reasoning, content and tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

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


# ---- the app ------------------------------------------------------------------------------------------

async def sse_stream(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events of `events`, an error event if the job failed, then [DONE]."""
    try:
        async for data in events:
            yield sse(data)
    except ApiError as e:
        yield sse(e.response().body.decode())
        return
    yield sse("[DONE]")


def create_app(engine: Engine, model_name: str = DEFAULT_MODEL_NAME, worker: Worker | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under `model_name` (the worker stops with the app)."""
    worker = worker or Worker(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        worker.close()

    app = FastAPI(title="ds4py", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.worker = worker

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        traceback.print_exc()
        return ApiError(500, f"internal error ({type(e).__name__})").response()

    async def parse(request: Request, kind: type[SamplingFields]) -> Any:
        try:
            data = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            body = kind.model_validate(data)
        except ValidationError as e:
            message, param = validation_message(e)
            raise ApiError(400, message, param=param) from None
        if body.model != model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server has {model_name!r}",
                           code="model_not_found", param="model")
        return body

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

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name}")
    async def model(name: str) -> dict:
        if name != model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server has {model_name!r}",
                           code="model_not_found", param="model")
        return card

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body: ChatRequest = await parse(request, ChatRequest)
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
        parser, reply = CompletionParser(mode), Reply()

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

    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = await parse(request, CompletionRequest)
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

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="base GGUF (default: the embedded tiny model, trained on Python code)")
    p.add_argument("--mtp", help="MTP GGUF for speculative decoding (default model: its own tiny MTP)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--served-model-name", default=DEFAULT_MODEL_NAME, help=f"model id (default {DEFAULT_MODEL_NAME})")
    p.add_argument("--ctx", type=int, default=4096, help="context length in tokens (default 4096)")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prefill chunk (default 2048)")
    p.add_argument("--backend", default="auto", help="auto | torch | triton | mlx")
    p.add_argument("--mtp-draft", choices=["auto", *map(str, range(MAX_DRAFT + 1))],
                   help="speculative draft depth (0 = off) or 'auto' (default 1 with an MTP head)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: 1 for the tiny model)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="compiled decode/verify steps (CPU; about a minute per row count on first use, then "
                        "faster steps for the server's lifetime; docs/cpu.md)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Load the model and serve until Ctrl-C; bad options print one `error:` line and exit 2."""
    a = parse_args(argv)
    try:
        if not 0 <= a.port < 65536:
            raise UsageError(f"--port must be in 0..65535 (0: any free port), got {a.port}")
        if a.threads is not None and a.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {a.threads}")
        if a.threads or a.model is None:
            torch.set_num_threads(a.threads or 1)
        engine = load(a.model, a.mtp, a.backend, ctx=a.ctx, prefill_chunk=a.prefill_chunk, compile=a.compile)
        draft = int(a.mtp_draft) if a.mtp_draft not in (None, "auto") else a.mtp_draft
        app = create_app(engine, a.served_model_name, Worker(engine, draft))
    except Ds4Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=a.host, port=a.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
