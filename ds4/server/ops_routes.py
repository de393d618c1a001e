"""Operations routes: /health, /metrics, /tokenize and /detokenize (docs/server.md)."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from ds4.chat import ChatFormatError, prompt_ids
from ds4.engine import Engine
from ds4.server.guards import json_body
from ds4.server.metrics import Metrics
from ds4.server.schemas import ApiError, validation_message
from ds4.server.worker import Worker


class TokenizeRequest(BaseModel):
    """POST /tokenize: plain text (`prompt`), or `messages` rendered with the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids back to text."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: Annotated[list[int], Field(max_length=1 << 20)]


def validated(kind: type[BaseModel], data: dict, model_name: str):
    """`data` as `kind`, else ApiError 400 (404 for another model)."""
    try:
        body = kind.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e)
        raise ApiError(400, message, param=param) from None
    if body.model not in (None, model_name):
        raise ApiError(404, f"the model {body.model!r} does not exist; this server has {model_name!r}",
                       code="model_not_found", param="model")
    return body


def ops_router(engine: Engine, worker: Worker, metrics: Metrics, model_name: str) -> APIRouter:
    """The operations routes of a server."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict:
        alive = worker.thread.is_alive() and not worker.closing
        if not alive:
            raise ApiError(503, "the worker has stopped")
        return {"status": "ok", "model": model_name, "busy": worker.current is not None,
                "queued": worker.jobs.qsize()}

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type=metrics.content_type)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = validated(TokenizeRequest, await json_body(request), model_name)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt (plain text) and messages (chat)", param="prompt")
        try:
            ids = await run_in_threadpool(engine.tokenizer.encode, body.prompt) if body.prompt is not None else \
                await run_in_threadpool(prompt_ids, engine.tokenizer, body.messages, tools=body.tools)
        except ChatFormatError as e:
            raise ApiError(400, str(e), param="messages") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.ctx}

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = validated(DetokenizeRequest, await json_body(request), model_name)
        bad = [t for t in body.tokens if not 0 <= t < engine.args.vocab_size]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} are outside [0, {engine.args.vocab_size})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return router
