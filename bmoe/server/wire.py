"""The OpenAI HTTP API's shapes, as bmoe-server speaks them: request bodies (pydantic, strict
types) and response objects and stream chunks (`ReplyShape`); errors are bmoe.server.errors'. No engine
and no routes here: bmoe.server.app joins these to the scheduler.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, Literal

from fastapi.sse import format_sse_event
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from bmoe.api import Chunk, GenerationStats
from bmoe.base import check_sampling, telemetry
from bmoe.chat import STOPS_MAX, Delta, Reply

# ---- request bodies --------------------------------------------------------------------------------


class BmoeOptions(BaseModel):
    """bmoe's extension of a request body, `"bmoe": {...}` (the openai client's `extra_body`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lossless: bool = False  # plain llama.cpp's output whatever lossy routing the server loaded with


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False  # a last chunk of its own, `choices: []`, with the usage


class RequestBody(BaseModel):
    """What /v1/completions and /v1/chat/completions share; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, le=2)  # OpenAI's own cap; the bounds below are the settings'
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(None, max_length=STOPS_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    bmoe: BmoeOptions = BmoeOptions()

    @field_validator("temperature", "top_p", "top_k")
    @classmethod
    def _in_bounds(cls, v: float | None, info: ValidationInfo) -> float | None:
        """The sampler settings' own bounds (bmoe.base.settings.check_sampling), not a copy of them."""
        if v is not None:
            assert info.field_name is not None
            check_sampling(info.field_name, v)
        return v


class CompletionBody(RequestBody):
    prompt: str | list[str] = Field(min_length=1)
    response_format: dict[str, Any] | None = None  # json_object / json_schema (bmoe.chat.grammar)
    grammar: str | None = None  # GBNF, as llama-server takes it


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


def text_only(kind: object) -> PydanticCustomError:
    """The 400 of a content part that is not text (an image, audio, a file, a document)."""
    return PydanticCustomError("text_only", "this model takes text only; the {kind} part cannot be read (send the "
                               "content as text)", {"kind": repr(kind)})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # null: an assistant's turn that only called tools

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        """A part that is not text (`image_url`, `input_audio`, `file`) is named, not a type mismatch."""
        for part in v if isinstance(v, list) else ():
            if isinstance(part, dict) and part.get("type") not in ("text", None):
                raise text_only(part["type"])
        return v
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message for bmoe.chat.request, which checks what the roles need (and reads `developer`
        as `system`)."""
        text = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": self.role, "content": text}
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


class ReplyShape:
    """The OpenAI object of one endpoint: a whole response, a streamed chunk, the last chunk."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False) -> None:
        self.chat = chat
        self.model = model
        self.include_usage = include_usage  # stream_options.include_usage: usage null on each chunk, then its own
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
        if self.include_usage:
            extra = {"usage": None, **extra}
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
        if d.content:
            delta["content"] = d.content
        if d.calls:
            delta["tool_calls"] = [x.openai() for x in d.calls]
        return self.chunk(delta, **self._progress(c))

    def last(self, s: GenerationStats, ahead: int, called: bool = False) -> dict[str, Any]:
        """The chunk with the finish reason and the request's telemetry; `called`: the answer made
        tool calls (finish_reason tool_calls)."""
        finish = "tool_calls" if called and s.finish_reason == "stop" else s.finish_reason
        return self.chunk({} if self.chat else "", finish, bmoe={**dataclasses.asdict(s), "queue_position": ahead})

    def usage_chunk(self, s: GenerationStats) -> dict[str, Any] | None:
        """With stream_options.include_usage, the stream's last chunk: no choices, the usage."""
        if not self.include_usage:
            return None
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(s)}


def usage(s: GenerationStats) -> dict[str, int]:
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens}


def sse(obj: dict[str, Any] | str) -> bytes:
    return format_sse_event(data_str=obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False))
