"""The Anthropic Messages route, POST /v1/messages: system, content blocks (text, thinking, tool_use,
tool_result), tools, streaming events (docs/server.md). Requests become the OpenAI-shaped messages ds4/chat.py
renders; replies are parsed by the same CompletionParser and regrouped into content blocks."""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from ds4.chat import ChatFormatError, CompletionParser, Delta, prompt_ids
from ds4.engine import Engine
from ds4.errors import UsageError
from ds4.formats.vocab import THINK_END
from ds4.grammar import Constraint, tool_call_grammar
from ds4.sampling import SamplingParams
from ds4.server.guards import json_body
from ds4.server.schemas import MAX_STOPS, ApiError, validation_message
from ds4.server.streaming import StopMatcher, cut_texts
from ds4.server.worker import Finished, Job, Worker

ANTHROPIC_PREFIX = "/v1/messages"


class Thinking(BaseModel):
    """`thinking`: enabled (with Anthropic's budget, which must stay below max_tokens) or disabled."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["enabled", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1024)] | None = None


class Tool(BaseModel):
    """One client tool: name, description, JSON schema of its input."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict


class ToolChoice(BaseModel):
    """`tool_choice`: auto, none, any (some tool must be called) or tool (the one named)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["auto", "none", "any", "tool"]
    name: str | None = None


class MessagesRequest(BaseModel):
    """POST /v1/messages."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    model: str
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[dict], Field(min_length=1)]
    system: str | list[dict] | None = None
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    thinking: Thinking | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict | None = None


def text_of(where: str, content) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text blocks", param=where.split(".")[0])
    parts = []
    for i, block in enumerate(content):
        if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
            raise ApiError(400, f"{where}[{i}] must be {{'type': 'text', 'text': str}}", param=where.split(".")[0])
        parts.append(block["text"])
    return "".join(parts)


def user_messages(n: int, blocks: list) -> list[dict]:
    """A user turn's blocks: tool results (as tool messages) and text."""
    out, texts = [], []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(text_of(f"messages[{n}].content", [block]))
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            content = block.get("content", "")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": text_of(f"messages[{n}].content[{i}].content", content)})
        else:
            raise ApiError(400, f"messages[{n}].content[{i}]: user blocks must be text or tool_result "
                                f"(with tool_use_id), got {kind!r}", param="messages")
    return out + ([{"role": "user", "content": "".join(texts)}] if texts or not out else [])


def assistant_message(n: int, blocks: list) -> dict:
    """An assistant turn's blocks: thinking, text and tool_use."""
    reasoning, texts, calls = [], [], []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" or kind == "thinking" and isinstance(block.get("thinking"), str):
            (texts if kind == "text" else reasoning).append(block["thinking"] if kind == "thinking" else
                                                             text_of(f"messages[{n}].content", [block]))
        elif kind == "tool_use" and isinstance(block.get("name"), str) and isinstance(block.get("input"), dict):
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        else:
            raise ApiError(400, f"messages[{n}].content[{i}]: assistant blocks must be text, thinking or tool_use "
                                f"(with name and an input object), got {kind!r}", param="messages")
    return {"role": "assistant", "content": "".join(texts), "reasoning_content": "".join(reasoning),
            **({"tool_calls": calls} if calls else {})}


def chat_messages(body: MessagesRequest) -> list[dict]:
    """The request as the OpenAI-shaped messages ds4/chat.py renders."""
    out = [{"role": "system", "content": text_of("system", body.system)}] if body.system else []
    for n, msg in enumerate(body.messages):
        role, content = (msg.get("role"), msg.get("content")) if isinstance(msg, dict) else (None, None)
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if role not in ("user", "assistant") or not isinstance(blocks, list):
            raise ApiError(400, f"messages[{n}]: role must be user or assistant and content a string or a list of "
                                "blocks", param="messages")
        out += user_messages(n, blocks) if role == "user" else [assistant_message(n, blocks)]
    return out


class Blocks:
    """The reply's content blocks as they accumulate, and the stream events that build them."""

    def __init__(self):
        self.content: list[dict] = []
        self.open: str | None = None  # the type of the block being written

    def add(self, delta: Delta) -> list[dict]:
        """Fold a parsed delta in; the stream events it makes."""
        if delta.tool_call:
            try:
                arguments = json.loads(delta.tool_call.arguments)
            except ValueError:  # a non-JSON value: kept as one string, as ds4/chat.py renders it back
                arguments = {"arguments": delta.tool_call.arguments}
            block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": delta.tool_call.name,
                     "input": arguments}
            events = self.close()
            self.content.append(block)
            index = len(self.content) - 1
            return events + [{"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                             {"type": "content_block_delta", "index": index,
                              "delta": {"type": "input_json_delta", "partial_json": json.dumps(arguments)}},
                             {"type": "content_block_stop", "index": index}]
        kind, text = ("thinking", delta.reasoning) if delta.reasoning else ("text", delta.content)
        if not text:
            return []
        events = []
        if self.open != kind:
            events = self.close()
            self.content.append({"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})})
            self.open = kind
            events.append({"type": "content_block_start", "index": len(self.content) - 1,
                           "content_block": dict(self.content[-1])})
        self.content[-1][kind] += text
        return events + [{"type": "content_block_delta", "index": len(self.content) - 1,
                          "delta": {"type": f"{kind}_delta", kind: text}}]

    def close(self) -> list[dict]:
        """The event closing the open text or thinking block, if any."""
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]


def stop_reason(done: Finished, stopper: StopMatcher, blocks: Blocks) -> str:
    """Anthropic's stop_reason."""
    if done.reason == "length":
        return "max_tokens"
    if stopper.hit:
        return "stop_sequence"
    return "tool_use" if any(b["type"] == "tool_use" for b in blocks.content) else "end_turn"


def forced_call(engine: Engine, tools: list[dict] | None, choice: ToolChoice | None) -> Constraint | None:
    """The grammar state making the reply a tool call, for tool_choice any or tool (None otherwise)."""
    if choice is None or choice.type in ("auto", "none"):
        return None
    functions = [t["function"] for t in tools or [] if choice.type == "any" or t["function"]["name"] == choice.name]
    if not functions:
        raise ApiError(400, f"tool_choice {choice.type!r} needs tools" if choice.type == "any" else
                       f"tool_choice names {choice.name!r}, which is not in tools", param="tool_choice")
    try:
        return Constraint(engine.tokenizer, engine.args.vocab_size, tool_call_grammar(functions))
    except UsageError as e:
        raise ApiError(400, str(e), param="tools") from None


def anthropic_router(engine: Engine, worker: Worker, model_name: str) -> APIRouter:
    """The Anthropic Messages route serving `engine` through `worker` under `model_name`."""
    router = APIRouter()

    @router.post(ANTHROPIC_PREFIX)
    async def messages(request: Request):
        try:
            body = MessagesRequest.model_validate(await json_body(request))
        except ValidationError as e:
            message, param = validation_message(e)
            raise ApiError(400, message, param=param) from None
        if body.model != model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server has {model_name!r}")
        thinking = body.thinking is not None and body.thinking.type == "enabled"
        if thinking and (body.thinking.budget_tokens or 0) >= body.max_tokens:
            raise ApiError(400, "thinking.budget_tokens must be less than max_tokens")
        mode = "thinking" if thinking else "chat"
        tools = None if body.tool_choice and body.tool_choice.type == "none" else [
            {"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in body.tools or []]
        try:
            ids = await run_in_threadpool(prompt_ids, engine.tokenizer, chat_messages(body), mode, tools=tools)
        except ChatFormatError as e:
            raise ApiError(400, str(e), param="messages") from None
        if len(ids) >= engine.ctx:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the context is {engine.ctx} tokens")
        sampling = SamplingParams(body.temperature, body.top_k, body.top_p)
        state = await run_in_threadpool(forced_call, engine, tools, body.tool_choice)
        think_end = engine.tokenizer.encode(THINK_END, specials=True)[0]
        job = worker.submit(Job(ids, min(body.max_tokens, engine.ctx - len(ids)), sampling, asyncio.get_running_loop(),
                                constraint=state, constrain_after=think_end if state and thinking else None))
        names = frozenset(t["function"]["name"] for t in tools or [])
        parser, blocks, stopper = CompletionParser(mode, tools=names), Blocks(), StopMatcher(body.stop_sequences or [])
        message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model_name}

        def usage(done: Finished | None) -> dict:
            cached = done.cached_tokens if done else 0
            return {"input_tokens": len(ids) - cached, "cache_read_input_tokens": cached,
                    "output_tokens": done.completion_tokens if done else 0}

        async def events() -> AsyncIterator[dict]:
            yield {"type": "message_start", "message": {**message, "content": [], "stop_reason": None,
                                                        "stop_sequence": None, "usage": usage(None)}}
            async for event in cut_texts(job, request, stopper):
                if isinstance(event, Finished):
                    for delta in parser.finish():
                        for out in blocks.add(delta):
                            yield out
                    for out in blocks.close():
                        yield out
                    yield {"type": "message_delta", "usage": usage(event), "delta": {
                        "stop_reason": stop_reason(event, stopper, blocks), "stop_sequence": stopper.hit}}
                    yield {"type": "message_stop"}
                elif isinstance(event, str):
                    for delta in parser.feed(event):
                        for out in blocks.add(delta):
                            yield out

        if not body.stream:
            last = [event async for event in events()][-2]
            return {**message, "content": blocks.content, **last["delta"], "usage": last["usage"]}

        async def stream() -> AsyncIterator[str]:
            try:
                async for event in events():
                    yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
            except ApiError as e:
                yield f"event: error\ndata: {e.response(anthropic=True).body.decode()}\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return router
