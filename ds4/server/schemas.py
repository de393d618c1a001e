"""Request bodies of the OpenAI routes, validated by pydantic, and the OpenAI-style error every route raises."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ANTHROPIC_ERRORS = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                    503: "overloaded_error"}
MAX_STOPS = 16  # stop strings (and stop token ids) a request may give
MAX_N = 8  # choices one request may ask for
MAX_TOP_LOGPROBS = 20  # alternatives per token (chat; completions: 5, as OpenAI)


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self, anthropic: bool = False) -> JSONResponse:
        """The JSON body OpenAI clients expect (or, with `anthropic`, Anthropic's)."""
        if anthropic:
            kind = ANTHROPIC_ERRORS.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
            return JSONResponse({"type": "error", "error": {"type": kind, "message": self.message}},
                                status_code=self.status)
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


class StreamOptions(BaseModel):
    """`stream_options`."""

    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: a named schema."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: text, json_object, or json_schema with its schema."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def schema_given(self) -> ResponseFormat:
        """A json_schema format needs its schema."""
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs json_schema: {name, schema}")
        return self


class FunctionName(BaseModel):
    """`{"name": ...}` of a named tool choice."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(BaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: that function must be called."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionName


class SamplingFields(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: Annotated[str, Field(min_length=1)] | \
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOPS)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] = 1.0
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=1024)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOPS)] | None = None

    def stops(self) -> list[str]:
        """The stop strings as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    reasoning_effort: Literal["low", "medium", "high", "max"] | None = None
    response_format: dict | None = None  # checked as a ResponseFormat; the dict is what the prompt shows
    thinking: dict | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def logprob_count(self) -> int | None:
        """None when logprobs are off, else the alternatives per token."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("response_format")
    @classmethod
    def known_format(cls, value: dict | None) -> dict | None:
        """A response_format must be a valid ResponseFormat."""
        if value is not None:
            try:
                ResponseFormat.model_validate(value)
            except ValidationError as e:
                raise ValueError(validation_message(e, keys=True)[0]) from None
        return value

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
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    def logprob_count(self) -> int | None:
        """None when logprobs are off, else the alternatives per token."""
        return self.logprobs


def validation_message(e: ValidationError, keys: bool = False) -> tuple[str, str]:
    """(message, param) of the first problem pydantic found, preferring a broken limit over a wrong type; the
    path names list indices, and with `keys` nested keys too (off where union members tag the path)."""
    errors = e.errors()
    err = next((x for x in errors if not x["type"].endswith("_type")), errors[0])
    field_name = str(err["loc"][0]) if err["loc"] else "body"
    where = field_name + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"][1:]
                                 if keys or isinstance(p, int))
    return f"{where}: {err['msg']}", field_name


def parse_body(data: dict, kind: type[SamplingFields], model_name: str) -> Any:
    """A JSON body (guards.json_body) validated as `kind`, for the model this server has."""
    try:
        body = kind.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e)
        raise ApiError(400, message, param=param) from None
    if body.model != model_name:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server has {model_name!r}",
                       code="model_not_found", param="model")
    return body
