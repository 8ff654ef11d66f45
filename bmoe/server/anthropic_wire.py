"""Anthropic's Messages API as bmoe-server speaks it: the request bodies of `POST /v1/messages` and
`/v1/messages/count_tokens`, their translation into the OpenAI chat request the chat route runs
(`chat_body_of_messages`: one request model inside, so the engine, scheduler, grammar, tool-call reading and
prompt cache are the same), and the answer in Anthropic's shapes (`AnthropicShape`: a message, or a
stream of `message_start … message_stop` events) and errors (`anthropic_error`).

What is taken and what is not (docs/server.md says the same for users):
- `system` (text or text blocks), `user`/`assistant` turns of text, `tool_use` and `tool_result`
  blocks (a result's `is_error` reaches the model as "Error: " before its text), `thinking` blocks
  of earlier turns (their text becomes the turn's reasoning; `redacted_thinking` is dropped).
  Image and document blocks are a 400: the model takes text only. A last `assistant` turn (a
  prefill to continue) is a 400: the chat template starts a new turn after it.
- `tools` (custom tools: `name`, `description`, `input_schema`), `tool_choice` (`auto`, `any` →
  required, `tool` → that function, `none`; `disable_parallel_tool_use` → parallel_tool_calls
  false). Anthropic's server tools (a `type` such as `web_search_…`) are a 400.
- `thinking`: `disabled` renders the conversation with enable_thinking false; `enabled` and
  `adaptive` as the server's default (the template decides); `budget_tokens` is not enforced.
  A thinking block's `signature` is empty: bmoe signs nothing and checks nothing sent back.
- `output_config.format` (`json_schema`) holds the answer to the schema, as OpenAI's
  `response_format`; `output_config.effort`, `metadata`, `service_tier`, `cache_control`, `speed`
  and other fields that change no text are ignored; `container` and `mcp_servers` are a 400.
- Sampling as the OpenAI routes take it: `temperature` (Anthropic's 0–1), `top_p`, `top_k`,
  `stop_sequences` (up to 4), left out → the server's flags (greedy by default, not Anthropic's
  temperature 1); `seed`, `grammar` and `bmoe` are bmoe's extensions, as on the chat route.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Literal

from fastapi.responses import JSONResponse
from fastapi.sse import format_sse_event
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from bmoe.api import Chunk, GenerationStats
from bmoe.chat import STOP_STRINGS_MAX, Delta, Reply
from bmoe.server.answer_shape import SSE, Finished, sse_comment
from bmoe.server.http_errors import ServeError
from bmoe.server.openai_wire import ChatBody
from bmoe.server.request_base import BmoeOptions, in_bounds, sampling_of

_PREFIX = "/v1/messages"
REFUSED = {"container": "bmoe-server runs no code containers", "mcp_servers": "bmoe-server connects to no MCP servers"}
# Anthropic's fields taken that change no text here, with why (docs/server.md; tests/test_server_fields.py)
ANTHROPIC_NO_EFFECT = {
    "metadata": "an end user's id for Anthropic's abuse monitoring; bmoe monitors no one",
    "service_tier": "one tier: this server's", "speed": "one speed: this server's",
    "cache_control": "bmoe's KV reuse and prompt cache key on the tokens themselves (cache_read_input_tokens)",
    "inference_geo": "it runs here", "diagnostics": "Anthropic's own request tracing",
    "user_profile_id": "Anthropic's accounts", "workspace_id": "Anthropic's accounts"}
SIGNATURE = ""  # a thinking block's: bmoe signs nothing (and checks nothing sent back)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
OVERLOADED = 529  # the status Anthropic's clients read as "overloaded, try again" (a full queue here)


def is_messages_path(path: str) -> bool:
    """Whether a request to `path` gets Anthropic's shapes (errors included)."""
    return path == _PREFIX or path.startswith(_PREFIX + "/")


# ---- request bodies --------------------------------------------------------------------------------


class AnthropicMessage(BaseModel):
    """A message as Anthropic writes it; its blocks are read by `chat_body_of_messages`, which names a bad one."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountBody(BaseModel):
    """What `/v1/messages/count_tokens` takes: the conversation and what it shows the model."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None  # one model is served; the field is not checked (as on the OpenAI routes)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    grammar: str | None = None  # bmoe's extension, as on the chat route

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, v: Any) -> Any:
        for key in REFUSED:
            if isinstance(v, dict) and v.get(key) is not None:
                raise PydanticCustomError("refused", "{key}: {why}; send the request without it",
                                          {"key": key, "why": REFUSED[key]})
        return v


class MessagesBody(CountBody):
    """`POST /v1/messages`: the conversation, how long and how to sample the answer."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=STOP_STRINGS_MAX)
    stream: bool = False
    temperature: float | None = Field(None, le=1)  # Anthropic's own cap; the bounds below are the settings'
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # bmoe's extension
    bmoe: BmoeOptions = BmoeOptions()

    @field_validator("*")
    @classmethod
    def _in_bounds(cls, v: Any, info: ValidationInfo) -> Any:
        return in_bounds(v, info)


# ---- the translation -------------------------------------------------------------------------------


def _bad(where: str, message: str) -> ServeError:
    return ServeError(400, f"{where}: {message}", param=where)


def _text_of(blocks: str | list[dict[str, Any]], where: str) -> str | list[dict[str, Any]]:
    """Text, or text blocks as the chat route's text parts; anything else is a 400."""
    if isinstance(blocks, str):
        return blocks
    for k, b in enumerate(blocks):
        _text_block(b, f"{where}.{k}")
    return [{"type": "text", "text": b["text"]} for b in blocks]


def _text_block(b: dict[str, Any], where: str) -> str:
    kind = b.get("type")
    if kind in ("image", "document"):
        raise _bad(where, f"this model takes text only; the {kind!r} block cannot be read (send it as text)")
    if kind != "text" or not isinstance(b.get("text"), str):
        raise _bad(where, f"a text block {{\"type\": \"text\", \"text\": ...}} here, not {kind!r}")
    return b["text"]


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks as chat messages: each tool result a `tool` message, the text a `user` one."""
    out: list[dict[str, Any]] = []
    text: list[dict[str, Any]] = []
    for k, b in enumerate(blocks):
        at = f"{where}.{k}"
        if b.get("type") != "tool_result":
            text.append({"type": "text", "text": _text_block(b, at)})
            continue
        if text:
            out.append({"role": "user", "content": text})
            text = []
        if not isinstance(b.get("tool_use_id"), str):
            raise _bad(f"{at}.tool_use_id", "the id of the tool_use block this answers")
        content = b.get("content", "")
        if not isinstance(content, str):
            if not isinstance(content, list):
                raise _bad(f"{at}.content", "text, or a list of text blocks")
            content = "".join(_text_block(c, f"{at}.content.{j}") for j, c in enumerate(content))
        if b.get("is_error") is True:
            content = "Error: " + content
        out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": content})
    if text:
        out.append({"role": "user", "content": text})
    return out


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    """An assistant turn's blocks as one chat message: text, tool calls, and reasoning."""
    text: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for k, b in enumerate(blocks):
        at, kind = f"{where}.{k}", b.get("type")
        if kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or \
                    not isinstance(b.get("input"), dict):
                raise _bad(at, "a tool_use block has an id, a name and an input object")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        elif kind == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise _bad(f"{at}.thinking", "the block's text")
            reasoning.append(b["thinking"])
        elif kind != "redacted_thinking":
            text.append({"type": "text", "text": _text_block(b, at)})
    msg: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    return msg


def _tool(t: dict[str, Any], where: str) -> dict[str, Any]:
    if t.get("type") not in (None, "custom"):
        raise _bad(f"{where}.type", f"{t['type']!r} is one of Anthropic's own tools; bmoe-server runs none (define "
                                    "a custom tool: name, description, input_schema)")
    if "input_schema" not in t:
        raise _bad(f"{where}.input_schema", "a tool's arguments as a JSON schema")
    described = {"description": t["description"]} if "description" in t else {}
    return {"type": "function", "function": {"name": t.get("name"), **described, "parameters": t["input_schema"]}}


def _tool_choice(c: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice as OpenAI's, and parallel_tool_calls."""
    if c is None:
        return None, None
    parallel = False if c.get("disable_parallel_tool_use") is True else None
    kind = c.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(c.get("name"), str):
        return {"type": "function", "function": {"name": c["name"]}}, parallel
    raise _bad("tool_choice", "{\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                              "{\"type\": \"tool\", \"name\": ...}")


def _think(thinking: dict[str, Any] | None) -> bool | None:
    """disabled: thinking off; enabled or adaptive (or left out): the server's --reasoning."""
    kind = (thinking or {}).get("type", "enabled")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise _bad("thinking.type", "enabled, adaptive or disabled")
    return False if kind == "disabled" else None


def _response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("output_config.format", "{\"type\": \"json_schema\", \"schema\": {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_body_of_messages(body: CountBody) -> ChatBody:
    """The Anthropic request as the OpenAI chat request the chat route runs (see the module notes);
    a 400 naming the Anthropic field that cannot be taken."""
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        messages.append({"role": "system", "content": _text_of(body.system, "system")})
    for i, m in enumerate(body.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            messages += _user(m.content, where)
        else:
            messages.append(_assistant(m.content, where))
    if body.messages[-1].role == "assistant":
        raise _bad(f"messages.{len(body.messages) - 1}", "bmoe-server does not continue a last assistant turn (a "
                                                         "prefill); end the conversation with a user turn")
    choice, parallel = _tool_choice(body.tool_choice)
    chat: dict[str, Any] = dict(
        messages=messages, think=_think(body.thinking), grammar=body.grammar, tool_choice=choice,
        parallel_tool_calls=parallel, response_format=_response_format(body.output_config),
        tools=[_tool(t, f"tools.{i}") for i, t in enumerate(body.tools)] if body.tools else None)
    if isinstance(body, MessagesBody):
        chat.update(max_tokens=body.max_tokens, stop=body.stop_sequences, bmoe=body.bmoe, **sampling_of(body))
    try:
        return ChatBody.model_validate(chat)
    except ValidationError as e:  # a shape the checks above let through: still the client's 400
        raise ServeError(400, f"the request cannot be read as a chat: {e.errors()[0]['msg']}") from None


# ---- responses -------------------------------------------------------------------------------------


def anthropic_usage(s: GenerationStats) -> dict[str, int]:
    """Anthropic's usage: its input tokens are those decoded, the KV's reused prefix (bmoe's prompt cache) is
    `cache_read_input_tokens`, so the three input counts add up to the prompt as Anthropic's do; bmoe writes
    no cache entry a client pays for (`cache_creation_input_tokens` 0)."""
    cached = s.prompt_tokens - s.prefill_tokens
    return {"input_tokens": s.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": s.completion_tokens}


def stop_reason(s: GenerationStats, called: bool, stop: str | None) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence of an answer that ended `s.finish_reason`."""
    if s.finish_reason == "length":
        return "max_tokens", None
    if stop is not None:
        return "stop_sequence", stop
    return ("tool_use" if called else "end_turn"), None


def _event(kind: str, obj: dict[str, Any]) -> bytes:
    return format_sse_event(event=kind, data_str=json.dumps({"type": kind, **obj}, ensure_ascii=False))


class AnthropicShape:
    """One answer in Anthropic's shapes for the answer loop (bmoe.server.answer_shape): a whole message,
    or the events of a stream (start, deltas as content blocks open and close, end). A text block
    opens only once its text is more than whitespace (whitespace before a tool call is no block), as
    a whole message's is."""

    media_type = SSE

    def __init__(self, model: str, input_tokens: int) -> None:
        self.model = model
        self.input_tokens = input_tokens
        self.id = f"msg_{uuid.uuid4().hex}"
        self.index = -1  # the open block's
        self.kind: str | None = None  # its type
        self.blank = ""  # whitespace of the answer's text not yet in a block
        self.called = False

    def _head(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
              used: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": used}

    def whole(self, done: Finished) -> dict[str, Any]:
        return self.message(done.reply, done.stats, done.stop, done.ahead)

    def message(self, m: Reply, s: GenerationStats, stop: str | None, ahead: int) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if m.reasoning:
            content.append({"type": "thinking", "thinking": m.reasoning, "signature": SIGNATURE})
        if m.content.strip():
            content.append({"type": "text", "text": m.content})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
                    for c in m.calls]
        reason, sequence = stop_reason(s, bool(m.calls), stop)
        return {**self._head(content, reason, sequence, anthropic_usage(s)), "bmoe": _telemetry(s, ahead)}

    # -- a stream --

    def comment(self, text: str) -> bytes:
        return sse_comment(text)

    def start(self) -> bytes:
        used = {"input_tokens": self.input_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                "output_tokens": 0}  # what the cache holds is known at the end (message_delta's usage)
        return _event("message_start", {"message": self._head([], None, None, used)})

    def _open(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.index += 1
        self.kind = block["type"]
        out += _event("content_block_start", {"index": self.index, "content_block": block})
        if self.index == 0:
            out += _event("ping", {})
        return out

    def _close(self) -> bytes:
        if self.kind is None:
            return b""
        self.kind = None
        return _event("content_block_stop", {"index": self.index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def token(self, c: Chunk, d: Delta | None) -> bytes:
        return self._blocks(d if d is not None else Delta(content=c.text))

    def progress(self, c: Chunk) -> bytes:
        return b""  # its requests ask for no progress reports

    def finish(self, d: Delta) -> bytes:
        return self._blocks(d)

    def _blocks(self, d: Delta) -> bytes:
        """The events of a piece of the read answer (bmoe.chat.output's Delta): none, or some."""
        out = b""
        if d.reasoning:
            if self.kind != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": SIGNATURE})
            out += self._delta({"type": "thinking_delta", "thinking": d.reasoning})
        if d.content:
            if self.kind == "text":
                out += self._delta({"type": "text_delta", "text": d.content})
            else:
                self.blank += d.content
                if self.blank.strip():
                    out += self._open({"type": "text", "text": ""})
                    out += self._delta({"type": "text_delta", "text": self.blank})
                    self.blank = ""
        for c in d.calls:
            if c.id is not None:
                self.called, self.blank = True, ""
                out += self._open({"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
            if c.arguments:
                out += self._delta({"type": "input_json_delta", "partial_json": c.arguments})
        return out

    def end(self, s: GenerationStats, stop: str | None, ahead: int) -> bytes:
        reason, sequence = stop_reason(s, self.called, stop)
        return self._close() + _event("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": anthropic_usage(s),
            "bmoe": _telemetry(s, ahead)}) + _event("message_stop", {})

    @staticmethod
    def error(e: ServeError) -> bytes:
        return format_sse_event(event="error", data_str=json.dumps(error_body(e), ensure_ascii=False))

    @staticmethod
    def close() -> bytes:
        return b""  # message_stop (or an error event) was the last


def _telemetry(s: GenerationStats, ahead: int) -> dict[str, Any]:
    return {**dataclasses.asdict(s), "queue_position": ahead}


# ---- errors ----------------------------------------------------------------------------------------


def _status(e: ServeError) -> int:
    return OVERLOADED if e.code == "queue_full" else e.status


def error_body(e: ServeError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(_status(e), "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def anthropic_error(e: ServeError) -> JSONResponse:
    """The error as Anthropic's error object, with the status its clients expect (a full queue: 529)."""
    return JSONResponse(error_body(e), status_code=_status(e))
