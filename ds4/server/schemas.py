"""Request bodies of the OpenAI routes, validated by pydantic, and the OpenAI-style error every route raises."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError


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


async def parse_body(request: Request, kind: type[SamplingFields], model_name: str) -> Any:
    """The request's JSON body validated as `kind`, for the model this server has."""
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
