"""The OpenAI HTTP API's shapes, as bmoe-server speaks them: request bodies (pydantic, strict
types), response objects and stream chunks (`Shape`), and errors as OpenAI error objects
(`ServeError`). No engine and no routes here: bmoe.server.app joins these to the scheduler.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.sse import format_sse_event
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from bmoe.api import Chunk, GenerationStats
from bmoe.base import ConfigError, telemetry
from bmoe.chat import STOPS_MAX, Delta, Reply
from bmoe.server.scheduler import GenerationFailed, QueueFull, ShuttingDown

# ---- errors ----------------------------------------------------------------------------------------


class ServeError(Exception):
    """An error answered as an OpenAI error object with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def shutting_down() -> ServeError:
    return ServeError(503, "the server is shutting down; send the request again when it is back",
                      "server_error", "shutting_down")


def serve_error(e: Exception) -> ServeError:
    """What a request hears of a scheduler's exception (bmoe.server.scheduler)."""
    if isinstance(e, ShuttingDown):
        return shutting_down()
    if isinstance(e, QueueFull):
        return ServeError(429, f"the server is busy: {e}; send it again later", "rate_limit_error", "queue_full")
    if isinstance(e, ConfigError):
        return ServeError(400, str(e))
    assert isinstance(e, GenerationFailed), e
    return ServeError(500, f"generation failed: {e}", "server_error", "internal_error")


def http_error(exc: HTTPException) -> ServeError:
    code = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed"}
    return ServeError(exc.status_code, str(exc.detail), "server_error" if exc.status_code >= 500
                      else "invalid_request_error", code.get(exc.status_code))


def validation_error(exc: RequestValidationError) -> ServeError:
    first = exc.errors()[0]
    where = ".".join(str(x) for x in first.get("loc", ())[1:])
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return ServeError(400, f"the body is not valid JSON ({detail}); send a JSON object", code="invalid_json")
    msg = f"{where}: {first.get('msg')}" if where else f"the body: {first.get('msg')}"
    more = len(exc.errors()) - 1
    return ServeError(400, msg + (f" (and {more} more)" if more else ""), param=where or None)


# ---- request bodies --------------------------------------------------------------------------------


class BmoeOptions(BaseModel):
    """bmoe's extension of a request body, `"bmoe": {...}` (the openai client's `extra_body`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lossless: bool = False  # plain llama.cpp's output whatever lossy routing the server loaded with


class RequestBody(BaseModel):
    """What /v1/completions and /v1/chat/completions share; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, max_length=STOPS_MAX)
    stream: bool = False
    n: Literal[1] = 1
    bmoe: BmoeOptions = BmoeOptions()


class CompletionBody(RequestBody):
    prompt: str | list[str] = Field(min_length=1)
    response_format: dict[str, Any] | None = None  # json_object / json_schema (bmoe.chat.grammar)
    grammar: str | None = None  # GBNF, as llama-server takes it


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # null: an assistant's turn that only called tools
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message for bmoe.chat.request (which checks what the roles need)."""
        text = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        for key in ("tool_calls", "tool_call_id", "name", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatBody(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    think: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    grammar: str | None = None


# ---- responses -------------------------------------------------------------------------------------


class Shape:
    """The OpenAI object of one endpoint: a whole response, a streamed chunk, the last chunk."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, s: GenerationStats, ahead: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": s.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(s), "bmoe": {**dataclasses.asdict(s), "queue_position": ahead}}

    def chunk(self, delta: dict[str, Any] | str, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice],
                **extra}

    def token(self, c: Chunk) -> dict[str, Any]:
        return self.chunk({"content": c.text} if self.chat else c.text, **self._progress(c))

    @staticmethod
    def _progress(c: Chunk | None) -> dict[str, Any]:
        """The `bmoe` field of a chunk that came with a token; none for the text held back to the end
        (a possible stop string, a partial UTF-8 sequence), which comes without one."""
        return {"bmoe": telemetry.progress_fields(c.token)} if c is not None and c.token is not None else {}

    def message(self, m: Reply, s: GenerationStats, ahead: int) -> dict[str, Any]:
        """A whole chat answer read into reasoning, content and tool calls (bmoe.chat.output)."""
        out = self.whole(m.content, s, ahead)
        msg = out["choices"][0]["message"]
        if m.reasoning:
            msg["reasoning_content"] = m.reasoning
        if m.calls:
            msg["content"] = m.content or None
            msg["tool_calls"] = [c.openai() for c in m.calls]
            if s.finish_reason == "stop":
                out["choices"][0]["finish_reason"] = "tool_calls"
        return out

    def delta(self, d: Delta, c: Chunk | None = None) -> dict[str, Any]:
        """A streamed piece of a read answer (`c`: the token it came with, for its telemetry)."""
        delta: dict[str, Any] = {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.content or not d:
            delta["content"] = d.content
        if d.calls:
            delta["tool_calls"] = [x.openai() for x in d.calls]
        return self.chunk(delta, **self._progress(c))

    def last(self, s: GenerationStats, ahead: int, called: bool = False) -> dict[str, Any]:
        """The last chunk; `called`: the answer made tool calls (finish_reason tool_calls)."""
        finish = "tool_calls" if called and s.finish_reason == "stop" else s.finish_reason
        return self.chunk({} if self.chat else "", finish, usage=usage(s),
                          bmoe={**dataclasses.asdict(s), "queue_position": ahead})


def usage(s: GenerationStats) -> dict[str, int]:
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens}


def sse(obj: dict[str, Any] | str) -> bytes:
    return format_sse_event(data_str=obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False))
