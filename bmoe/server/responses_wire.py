"""OpenAI's Responses API as bmoe-server speaks it: the body of `POST /v1/responses`, its
translation into the chat request the chat route runs (`chat_body_of_response`: one request inside, so the
engine, scheduler, grammars, tool-call reading, prompt cache, limits and errors are the chat
route's), the answer as a Response object or its stream of events (`ResponsesShape`), and the
responses kept for `previous_response_id` (a bmoe.server.response_store `KeptResponses`: in memory, or shared by
replicas; this module does not care which).

What is taken and what is not (docs/server.md says the same for users):
- `input`: text (one user message), or items: messages (`user`, `system`, `developer`, `assistant`;
  content as text or `input_text` / `output_text` parts), `function_call`, `function_call_output`
  and `reasoning` (its summary and content text become the next assistant turn's reasoning). An
  image, file or audio part is a 400 (the model takes text only); so are `item_reference` and the
  items of built-in tools. `instructions`: a system message before them.
- `tools`: function tools (`name`, `description`, `parameters`; `strict` is how bmoe holds every
  call anyway); OpenAI's built-in tools (`web_search`, `file_search`, `computer_use_preview`,
  `code_interpreter`, `mcp`, ...) are a 400 naming them. `tool_choice` `auto` / `none` / `required`
  / `{"type": "function", "name"}`; `parallel_tool_calls`.
- `text.format`: `text`, `json_object`, `json_schema` (held by the chat route's grammars);
  `text.verbosity` other than `medium` is a 400.
- `reasoning`: the model's thinking comes as a `reasoning` item whose summary is that thinking as
  written (bmoe summarizes nothing); `effort: "none"` renders the conversation with thinking off,
  any other effort as the server's default (the template decides; effort is not graded).
- `max_output_tokens` (a cut answer is `status: "incomplete"`, `incomplete_details.reason`
  `max_output_tokens`), the sampling fields as on the chat route (`temperature`, `top_p`, and the
  extensions `top_k`, `min_p`, `seed`, the penalties, `logit_bias`), and bmoe's extensions `stop`,
  `grammar`, `"bmoe": {"lossless": true}`.
- `store` (default true) and `previous_response_id`: the last `--store-responses` responses, within
  `--store-responses-mb` (bmoe.server.response_store; the least recently used dropped first; in memory none
  across a restart, in a shared `--response-store` any replica's, for `--store-responses-ttl`) are kept, so a
  follow-up that names one is that conversation and its new input, which reuses the KV sequence that answered
  it while the sequence holds it. A response not kept (never stored, dropped, expired, or from before a restart
  in memory) is a 400 saying to send the conversation as `input` instead.
  `GET` and `DELETE /v1/responses/{id}` read and drop a kept response.
- `include`: `reasoning.encrypted_content` is accepted (bmoe encrypts nothing: a reasoning item
  carries its text and is read back as sent); any other is a 400. `background`, `conversation`,
  `prompt`, `max_tool_calls`, `truncation: "auto"`, `top_logprobs` and `context_management` are a
  400 unless they ask for nothing; `metadata` is echoed (within OpenAI's bounds: 16 keys, keys of 64
  characters, string values of 512; else a 400 naming it); `user`, `safety_identifier`,
  `service_tier`, `prompt_cache_key`, `prompt_cache_retention`, `stream_options` and other fields
  bmoe does not know change no text and are ignored, as on the chat route.
- `usage`: `input_tokens` (the conversation as rendered), `input_tokens_details.cached_tokens`
  (those the KV held already), `output_tokens`, `output_tokens_details.reasoning_tokens` (0: not
  counted apart), `total_tokens`. Errors are OpenAI's error objects, as on the chat route.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi.sse import format_sse_event
from pydantic import Field, ValidationError, model_validator

from bmoe.api import Chunk, GenerationStats
from bmoe.chat import STOP_STRINGS_MAX, Delta
from bmoe.server.answer_shape import SSE, Finished, sse_comment
from bmoe.server.http_errors import ServeError, invalid
from bmoe.server.openai_wire import EFFORTS, ChatBody, prompt_progress
from bmoe.server.request_base import BmoeOptions, Metadata, SamplingFields, implemented, sampling_of
from bmoe.server.response_store import KeptResponses
from bmoe.server.timings import TimingsSoFar, final_timings

RESOURCE = "/responses"  # under /v1, and without it as llama-server serves it
# fields of the Responses API bmoe does not implement, each with the values that ask for nothing
_UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "background": (None, False), "conversation": (None,), "prompt": (None,), "max_tool_calls": (None,),
    "truncation": (None, "disabled"), "top_logprobs": (None, 0), "context_management": (None,),
    "background_options": (None,), "image": (None,), "moderation": (None,),
}
INCLUDABLE = ("reasoning.encrypted_content",)
RESPONSES_TOO_LONG_FIX = "shorten the input, lower max_output_tokens, or restart bmoe-server with a larger -c"
# a field of the chat request a 400 names, as this API names it (bmoe.server.http_errors.renamed)
RESPONSES_FIELD_NAMES = ((r"response_format\.json_schema\.schema", "text.format.schema"),
                         (r"response_format", "text.format"),
                         (r"tools\[(\d+)\]\.function\.", r"tools[\1]."), (r"max_tokens", "max_output_tokens"),
                         (r"messages$", "input"))


def _bad(where: str, message: str) -> ServeError:
    return ServeError(400, f"{where}: {message}", param=where)


# ---- the request -----------------------------------------------------------------------------------


class ResponsesBody(SamplingFields):
    """`POST /v1/responses`; unknown fields are ignored, those of _UNIMPLEMENTED refused unless they ask
    for nothing (as on the chat route)."""

    model: str | None = None  # one model is served; not checked
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    metadata: Metadata | None = None  # OpenAI's bounds (bmoe.server.request_base), echoed
    stop: str | list[str] | None = Field(None, max_length=STOP_STRINGS_MAX)  # bmoe's extension
    grammar: str | None = None  # bmoe's extension (GBNF)
    timings_per_token: bool = False  # llama-server's: each streamed delta carries the timings so far
    return_progress: bool = False  # llama-server's: a stream reports the prompt's prefill (response.in_progress)
    bmoe: BmoeOptions = BmoeOptions()

    @model_validator(mode="before")
    @classmethod
    def _implemented(cls, data: Any) -> Any:
        return implemented(data, _UNIMPLEMENTED)


def input_items(body: ResponsesBody) -> list[dict[str, Any]]:
    """The request's input as items (text: one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input or ())


def chat_body_of_response(body: ResponsesBody, earlier: Sequence[dict[str, Any]]) -> ChatBody:
    """The request as the chat request the chat route runs, its conversation `earlier` (a kept
    response's, for previous_response_id) and then its own input; a 400 naming the field that
    cannot be taken (see the module notes)."""
    items = [*earlier, *input_items(body)]
    if not items:
        raise _bad("input", "text, or a list of items (messages, function calls, their outputs)")
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions is not None else [])
    messages += _messages(items, len(earlier))
    for i, name in enumerate(body.include or ()):
        if name not in INCLUDABLE:
            raise _bad(f"include[{i}]", f"bmoe-server cannot add {name!r} to a response (it can: "
                                        f"{', '.join(INCLUDABLE)}); leave it out")
    chat: dict[str, Any] = dict(
        messages=messages, tools=_tools(body.tools), tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls, response_format=_response_format(body.text),
        think=_think(body.reasoning), grammar=body.grammar, max_tokens=body.max_output_tokens, stop=body.stop,
        stream=body.stream, return_progress=body.return_progress, bmoe=body.bmoe, **sampling_of(body))
    try:
        return ChatBody.model_validate(chat)
    except ValidationError as e:  # a shape the checks above let through: still the client's 400
        raise invalid(e.errors()) from None


def _messages(items: Sequence[dict[str, Any]], earlier: int) -> list[dict[str, Any]]:
    """Items as chat messages: an assistant's reasoning, text and calls gathered into one turn, each
    call's output a `tool` message. `earlier` items come first (a kept response's; a 400 names an
    item by its place in this request's input)."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            text, calls, reasoning = turn["text"], turn["calls"], turn["reasoning"]
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            out.append(msg)
            turn = None

    for i, item in enumerate(items):
        at = f"input[{i - earlier}]" if i >= earlier else f"previous_response_id (its item {i})"
        if not isinstance(item, dict):
            raise _bad(at, "an item is an object with a type (message, function_call, function_call_output)")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            if turn is not None and (turn["text"] or turn["calls"]):
                flush()
            turn = turn or {"text": [], "calls": [], "reasoning": []}
            turn["reasoning"] += [_part_text(p, f"{at}.summary[{j}]") for j, p in enumerate(item.get("summary") or ())]
            turn["reasoning"] += [_part_text(p, f"{at}.content[{j}]") for j, p in enumerate(item.get("content") or ())]
        elif kind == "message" and item.get("role") == "assistant":
            turn = turn or {"text": [], "calls": [], "reasoning": []}
            turn["text"].append(_text(item.get("content"), f"{at}.content"))
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise _bad(f"{at}.{key}", "a function_call item has a call_id, a name and its arguments as JSON "
                                              "text")
            turn = turn or {"text": [], "calls": [], "reasoning": []}
            turn["calls"].append({"id": item["call_id"], "type": "function",
                                  "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            flush()
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{at}.call_id", "the call_id of the function_call this answers")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"),
                                                                                           f"{at}.output")})
        elif kind == "message":
            flush()
            role = item.get("role")
            if role not in ("user", "system", "developer"):
                raise _bad(f"{at}.role", "user, system, developer or assistant")
            out.append({"role": role, "content": _text(item.get("content"), f"{at}.content")})
        elif kind == "item_reference":
            raise _bad(at, "bmoe-server keeps no items to refer to; send the item itself (or previous_response_id)")
        else:
            raise _bad(f"{at}.type", f"{kind!r} items are not taken (bmoe-server runs none of OpenAI's built-in "
                                     "tools); send messages, function_call and function_call_output items")
    flush()
    return out


def _text(content: Any, where: str) -> str:
    """A message's content or a call's output: text, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "text, or a list of text parts")
    return "".join(_part_text(p, f"{where}[{j}]") for j, p in enumerate(content))


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_image", "input_file", "input_audio"):
        raise _bad(where, f"this model takes text only; the {kind!r} part cannot be read (send it as text)")
    if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text") and \
            isinstance(part.get("text"), str):
        return str(part["text"])
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return str(part["refusal"])
    raise _bad(where, f"a text part {{\"type\": \"input_text\", \"text\": ...}} here, not {kind!r}")


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type")
        if kind != "function":
            raise _bad(f"tools[{i}].type", f"{kind!r} is not a function tool: bmoe-server runs none of OpenAI's "
                                           "built-in tools (define a function tool: type function, name, "
                                           "description, parameters)")
        if not isinstance(t.get("name"), str):
            raise _bad(f"tools[{i}].name", "the function's name")
        fn: dict[str, Any] = {"name": t["name"]}
        for key in ("description", "parameters"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(c: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if c is None or isinstance(c, str):
        return c
    if c.get("type") == "function" and isinstance(c.get("name"), str):
        return {"type": "function", "function": {"name": c["name"]}}
    raise _bad("tool_choice", "auto, none, required or {\"type\": \"function\", \"name\": ...} (bmoe-server runs "
                              f"no built-in tools), not {c.get('type')!r}")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    implemented(text, {"verbosity": (None, "medium")}, "text.")
    fmt = (text or {}).get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        schema: dict[str, Any] = {"name": fmt.get("name") or "output", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise _bad("text.format", "{\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                              "\"name\": ..., \"schema\": {...}}")


def _think(reasoning: dict[str, Any] | None) -> bool | None:
    """effort none: thinking off; another (or none said): the server's --reasoning."""
    effort = (reasoning or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise _bad("reasoning.effort", f"one of {', '.join(EFFORTS)}")
    return False if effort == "none" else None


# ---- the answer ------------------------------------------------------------------------------------


class ResponsesShape:
    """One answer as a Response object, or as the Responses API's stream of events, in order:
    response.created, response.in_progress, then per output item (reasoning, message, function_call)
    response.output_item.added, its parts and deltas and their .done events, response.output_item.done,
    and last response.completed (response.incomplete when max_output_tokens cut it); an error mid-way
    is an `error` event and response.failed. A whole answer is made by the same steps, so both carry
    the same items. A message opens only once its text is more than whitespace (whitespace before a
    call is no item), or at the end when there is nothing else. As llama-server's, a streamed answer's last
    event carries its `timings`; with timings_per_token each delta event the timings so far (`prompt_tokens`: the
    prompt's), and with return_progress each report on the prefill is a response.in_progress event with its
    `prompt_progress`."""

    media_type = SSE

    def __init__(self, model: str, body: ResponsesBody, items: Sequence[dict[str, Any]],
                 store: KeptResponses | None, prompt_tokens: int = 0, replica: str = "") -> None:
        self.id = response_id(replica)
        self.created = int(time.time())
        self.model, self.body, self.items, self.store = model, body, items, store
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.blank = ""  # whitespace of the answer's text not yet in an item
        self.so_far = TimingsSoFar(prompt_tokens) if body.timings_per_token else None
        self.timings: dict[str, Any] | None = None  # on the delta events of the token under way (timings_per_token)

    def response(self, status: str, s: GenerationStats | None = None, ahead: int = 0,
                 error: ServeError | None = None) -> dict[str, Any]:
        b = self.body
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": {"code": error.code or "server_error", "message": error.message} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": copy.deepcopy(self.output), "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": None, "summary": None, **(b.reasoning or {})}, "store": b.store,
            "temperature": b.temperature, "text": {"format": {"type": "text"}, **(b.text or {})},
            "tool_choice": b.tool_choice or "auto", "tools": b.tools or [], "top_p": b.top_p, "truncation": "disabled",
            "metadata": b.metadata or {}, "usage": responses_usage(s) if s is not None else None}
        if s is not None:
            out["bmoe"] = {**dataclasses.asdict(s), "queue_position": ahead}
        return out

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        if self.timings is not None and kind.endswith(".delta"):
            data["timings"] = self.timings
        self.seq += 1
        return format_sse_event(event=kind, data_str=json.dumps(data, ensure_ascii=False))

    # -- the items, as the answer comes --

    def _add(self, item: dict[str, Any]) -> bytes:
        out = self._close()
        self.output.append(item)
        self.open = item
        out += self._event("response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item))
        if item["type"] == "message":
            out += self._event("response.content_part.added", item_id=item["id"], output_index=len(self.output) - 1,
                               content_index=0, part=_output_text(""))
        elif item["type"] == "reasoning":
            out += self._event("response.reasoning_summary_part.added", item_id=item["id"],
                               output_index=len(self.output) - 1, summary_index=0, part=_summary(""))
        return out

    def _close(self, status: str = "completed") -> bytes:
        item, self.open = self.open, None
        if item is None:
            return b""
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        out = b""
        if item["type"] == "message":
            part = item["content"][0]
            out += self._event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            out += self._event("response.content_part.done", **where, content_index=0, part=part)
        elif item["type"] == "reasoning":
            text = item["summary"][0]["text"]
            out += self._event("response.reasoning_summary_text.done", **where, summary_index=0, text=text)
            out += self._event("response.reasoning_summary_part.done", **where, summary_index=0, part=_summary(text))
        if "status" in item:
            item["status"] = status
        return out + self._event("response.output_item.done", output_index=where["output_index"], item=item)

    def _pieces(self, d: Delta) -> bytes:
        """The events of a piece of the read answer (bmoe.chat.output's Delta)."""
        out = b""
        if d.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                out += self._add({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": []})
                assert self.open is not None
                self.open["summary"].append(_summary(""))
            self.open["summary"][0]["text"] += d.reasoning
            out += self._event("response.reasoning_summary_text.delta", item_id=self.open["id"],
                               output_index=len(self.output) - 1, summary_index=0, delta=d.reasoning)
        if d.content:
            if self.open is None or self.open["type"] != "message":
                self.blank += d.content
                if self.blank.strip():
                    out += self._message(self.blank)
                    self.blank = ""
            else:
                out += self._text(d.content)
        for c in d.calls:
            self.blank = ""
            out += self._call(c.id, c.name, c.arguments)
        return out

    def _message(self, text: str) -> bytes:
        out = self._add({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                         "role": "assistant", "content": []})
        assert self.open is not None
        self.open["content"].append(_output_text(""))
        return out + (self._text(text) if text else b"")

    def _text(self, text: str) -> bytes:
        assert self.open is not None
        self.open["content"][0]["text"] += text
        return self._event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.output) - 1,
                           content_index=0, delta=text, logprobs=[])

    def _call(self, call_id: str, name: str, arguments: str) -> bytes:
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress", "call_id": call_id,
                "name": name, "arguments": ""}
        out = self._add(item)
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        item["arguments"] = arguments
        out += self._event("response.function_call_arguments.delta", **where, delta=arguments)
        return out + self._event("response.function_call_arguments.done", **where, arguments=arguments, name=name)

    def _last(self, s: GenerationStats, ahead: int) -> tuple[bytes, dict[str, Any]]:
        """The events that end the answer, and the Response; kept when the request said store."""
        cut = s.finish_reason == "length"
        out = b""
        if not any(i["type"] in ("message", "function_call") for i in self.output):
            out += self._message(self.blank)  # an answer of no text and no calls is an empty message
        out += self._close("incomplete" if cut else "completed")
        response = self.response("incomplete" if cut else "completed", s, ahead)
        if self.store is not None and self.body.store:
            self.store.keep(response, [*self.items, *(_as_input(i) for i in self.output)])
        return out, response

    # -- AnswerShape --

    def whole(self, done: Finished) -> dict[str, Any]:
        m = done.reply
        self._pieces(Delta(m.reasoning, m.content))
        for c in m.calls:
            self._call(c.id, c.name, c.arguments)
        return self._last(done.stats, done.ahead)[1]

    def comment(self, text: str) -> bytes:
        return sse_comment(text)

    def start(self) -> bytes:
        return (self._event("response.created", response=self.response("in_progress"))
                + self._event("response.in_progress", response=self.response("in_progress")))

    def token(self, c: Chunk, d: Delta | None) -> bytes:
        if self.so_far is not None:
            self.so_far.add(c)
            self.timings = self.so_far.now()
        try:
            return self._pieces(d if d is not None else Delta(content=c.text))
        finally:
            self.timings = None

    def progress(self, c: Chunk) -> bytes:
        assert c.progress is not None
        extra: dict[str, Any] = {"prompt_progress": prompt_progress(c.progress)}
        if self.so_far is not None:
            self.so_far.add(c)
            extra["timings"] = self.so_far.now()
        return self._event("response.in_progress", response=self.response("in_progress"), **extra)

    def finish(self, d: Delta) -> bytes:
        return self._pieces(d)

    def end(self, s: GenerationStats, stop: str | None, ahead: int) -> bytes:
        out, response = self._last(s, ahead)
        return out + self._event("response.incomplete" if response["status"] == "incomplete"
                                 else "response.completed", response=response, timings=final_timings(s))

    def error(self, e: ServeError) -> bytes:
        return (self._event("error", code=e.code, message=e.message, param=e.param)
                + self._event("response.failed", response=self.response("failed", error=e)))

    def close(self) -> bytes:
        return b""


def response_id(replica: str) -> str:
    """A new response's id: `resp_`, 32 random hex digits, and `_` and the replica's name when there is one (a
    router sends a previous_response_id to the replica it names: bmoe.server.replica)."""
    return f"resp_{uuid.uuid4().hex}" + (f"_{replica}" if replica else "")


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _summary(text: str) -> dict[str, Any]:
    return {"type": "summary_text", "text": text}


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the next request's input has it (what a client sends back)."""
    return {k: v for k, v in item.items() if k != "status"}


def responses_usage(s: GenerationStats) -> dict[str, Any]:
    return {"input_tokens": s.prompt_tokens,
            "input_tokens_details": {"cached_tokens": s.prompt_tokens - s.prefill_tokens},
            "output_tokens": s.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": s.prompt_tokens + s.completion_tokens}
