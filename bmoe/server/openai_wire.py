"""OpenAI's completions and chat completions API as bmoe-server speaks it: the request bodies
(pydantic, strict types; their shared base is bmoe.server.request_base's) and the answer in OpenAI's
shapes (`OpenAIShape`: a response object, or its stream of chunks ending `[DONE]`); errors are
bmoe.server.http_errors'. The chat body is also what the other APIs' requests are translated into.
No engine and no routes here: bmoe.server.app joins these to the scheduler.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from importlib import metadata
from typing import Any, Literal

from fastapi.sse import format_sse_event
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from bmoe.api import (
    TOP_LOGPROBS_MAX,
    Chunk,
    ContentTokens,
    GenerationStats,
    PrefillProgress,
    Request,
    TokenLogprob,
    content_logprobs,
)
from bmoe.base import FieldError, telemetry
from bmoe.chat import STOP_STRINGS_MAX, Delta, Reply, schema_grammar
from bmoe.server.answer_shape import SSE, AnswerShape, Finished, sse_comment
from bmoe.server.http_errors import ServeError
from bmoe.server.request_base import BmoeOptions, Metadata, SamplingFields, implemented
from bmoe.server.timings import TimingsSoFar, final_timings

# llama-server's request fields bmoe does not implement, refused alike on its native /completion
# (bmoe.server.llama_wire) and on the OpenAI routes, each with the values that ask for nothing
LLAMA_UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "mirostat": (None, 0), "typical_p": (None, 1), "top_n_sigma": (None, -1), "xtc_probability": (None, 0),
    "dry_multiplier": (None, 0), "dynatemp_range": (None, 0),
    "n_indent": (None, 0), "n_cache_reuse": (None, 0), "min_keep": (None, 0),
    "t_max_predict_ms": (None, 0), "samplers": (None,),
    "response_fields": (None, []), "lora": (None, []),
    "sse_ping_interval": (None,), "multimodal_data": (None, []),
}

# Request fields of OpenAI's API (and llama-server's) that bmoe does not implement, each with the values
# that ask for nothing (accepted as sent): any other value is a 400 naming the field, never silently
# ignored. Documented fields that change no text here are request_base.NO_EFFECT's; a field neither
# declared nor listed is ignored (another server's extension). tests/test_server_fields.py walks them.
UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "n_probs": (None, 0),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    "functions": (None, []), "function_call": (None, "none"), "tfs_z": (None, 1),
    "moderation": (None,), "verbosity": (None, "medium"),
    **LLAMA_UNIMPLEMENTED,
    # llama-server's, refused here only (its native route takes return_tokens and post_sampling_probs, and ignores
    # the others)
    "t_max_prompt_ms": (None, 0), "return_tokens": (None, False), "post_sampling_probs": (None, False),
    "adaptive_target": (None, -1), "reasoning_budget_tokens": (None, -1),
    "reasoning_control": (None, False), "reasoning_format": (None, "auto", "deepseek"), "chat_format": (None,),
    "chat_parser": (None,), "generation_prompt": (None,), "grammar_lazy": (None, False), "grammar_triggers": (None, []),
    "preserved_tokens": (None, []), "parse_tool_calls": (None, True), "image_data": (None, []),
}

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's reasoning efforts: none turns thinking off

# ---- request bodies --------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False  # a last chunk of its own, `choices: []`, with the usage


class RequestBody(SamplingFields):
    """What /v1/completions and /v1/chat/completions share; unknown fields are ignored, but those of
    UNIMPLEMENTED are refused unless they ask for nothing."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None, max_length=STOP_STRINGS_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)  # choices, each its own generation (bmoe.server.answer_loop); n_cmpl: llama-server's name
    n_cmpl: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None  # json_object / json_schema (bmoe.chat.grammar)
    grammar: str | None = None  # GBNF, as llama-server takes it
    n_predict: int | None = Field(None, ge=-1)  # llama-server's max_tokens; -1: the server's default
    json_schema: dict[str, Any] | None = None  # llama-server's response_format of a schema
    timings_per_token: bool = False  # llama-server's: every streamed chunk carries the timings so far
    ignore_eos: bool = False  # llama-server's: no end of generation (bmoe.api.Ask's)
    return_progress: bool = False  # llama-server's: a stream reports the prompt's prefill as it goes
    verbose: bool = False  # llama-server's: the answer carries `__verbose`, its native answer object
    id_slot: int | None = Field(None, ge=-1)  # llama-server's: the KV sequence to run on (-1: any)
    bmoe: BmoeOptions = BmoeOptions()

    @model_validator(mode="before")
    @classmethod
    def _implemented(cls, data: Any) -> Any:
        return implemented(data, UNIMPLEMENTED)

    @model_validator(mode="after")
    def _llama_server_names(self) -> RequestBody:
        """llama-server's names for max_tokens, n and a schema's response_format, as those (sent with them, the
        same value or a 400)."""
        self.n = choices_of(self.n, self.n_cmpl)
        if self.n_predict is not None and self.n_predict != -1:
            if self.n_predict == 0 or self.max_tokens not in (None, self.n_predict):
                raise FieldError("n_predict: llama-server's name for max_tokens, 1 or more (-1: the server's "
                                 "default); send one of them", param="n_predict")
            self.max_tokens = self.n_predict
        if self.json_schema is not None:
            if self.response_format is not None:
                raise FieldError("json_schema: llama-server's name for a response_format of a JSON schema; send "
                                 "one of them", param="json_schema")
            schema_grammar(self.json_schema, "json_schema")  # a schema's own error names this field
            self.response_format = {"type": "json_object", "schema": self.json_schema}
        return self

    @property
    def to_context_end(self) -> bool:
        """llama-server's `n_predict` was sent: its cap is cut to the room the prompt leaves, as llama-server cuts it
        (OpenAI's `max_tokens` past the context stays a 400)."""
        return self.n_predict not in (None, -1)


def choices_of(n: int, n_cmpl: int | None) -> int:
    """A request's choices: `n`, or llama-server's `n_cmpl` (sent with n, the same value or a 400)."""
    if n_cmpl is None:
        return n
    if n not in (1, n_cmpl):
        raise FieldError("n_cmpl: llama-server's name for n; send one of them", param="n_cmpl")
    return n_cmpl


class CompletionBody(RequestBody):
    # a text, token ids, or several prompts (bmoe.server.completion_prompts), each answered as its choices
    prompt: str | list[Any] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS_MAX)  # the legacy shape: alternatives per token


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
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS_MAX)
    max_completion_tokens: int | None = Field(None, ge=1)
    think: bool | None = None  # None: the server's --reasoning
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: Metadata | None = None  # OpenAI's bounds (bmoe.server.request_base); nothing is stored
    add_generation_prompt: bool | None = None  # llama-server's and transformers': false renders no assistant turn
    continue_final_message: bool | str | None = None  # theirs too: true ("content") continues the last message
    chat_template_kwargs: dict[str, Any] | None = None  # llama-server's: only enable_thinking (as `think`)
    reasoning_effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]  # none: `think: false`

    @field_validator("chat_template_kwargs")
    @classmethod
    def _only_thinking(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, value in (v or {}).items():
            if key != "enable_thinking" or not isinstance(value, bool):
                raise FieldError(f"chat_template_kwargs.{key}: bmoe-server passes the chat template only "
                                 "enable_thinking (true or false)", param=f"chat_template_kwargs.{key}")
        return v

    @property
    def thinks(self) -> bool | None:
        """Thinking off when `think`, chat_template_kwargs' enable_thinking or reasoning_effort none say so, on
        when think or enable_thinking say so, else None: the server's --reasoning (another effort is the
        server's default, as on the Responses route: efforts are not graded)."""
        said = (self.chat_template_kwargs or {}).get("enable_thinking")
        if self.think is False or said is False or self.reasoning_effort == "none":
            return False
        return True if self.think or said else None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatBody:
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs: it lists alternatives to the logprobs; send logprobs: true with it",
                             param="top_logprobs")
        return self

    @model_validator(mode="after")
    def _continuation(self) -> ChatBody:
        """Continuing the last message opens no turn: asking for both, or for the reasoning to be continued,
        is a 400."""
        cont = self.continue_final_message
        if cont not in (None, False, True, "content"):
            raise FieldError(f"continue_final_message: {cont!r}: bmoe-server continues a message's text (true or "
                             "\"content\"), not its reasoning", param="continue_final_message")
        if cont not in (None, False) and self.add_generation_prompt:
            raise FieldError("continue_final_message: it continues the last message, so no new turn can be "
                             "opened; leave add_generation_prompt out (or false)", param="continue_final_message")
        return self

    def template_options(self) -> dict[str, bool]:
        """How the conversation ends in the prompt (bmoe.api.Ask's fields of these names)."""
        cont = self.continue_final_message
        return {"add_generation_prompt": self.add_generation_prompt is not False and cont in (None, False),
                "continue_final_message": cont not in (None, False)}

    @property
    def n_logprobs(self) -> int | None:
        """The alternatives per token the request asks for; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses -------------------------------------------------------------------------------------


# what OpenAI's answers carry as the backend configuration they ran with (clients log it; llama-server's
# and llama.cpp's server tests read it): the serving program and its version
FINGERPRINT = f"bmoe-{metadata.version('bmoe')}"


class OpenAIShape:
    """One completion or chat answer in OpenAI's shapes for the answer loop (bmoe.server.answer_shape):
    a whole response object, or chunks (a chat's first with the role and content null, as llama-server's; with
    logprobs asked for, each chunk those of the tokens it completes; the last with the finish reason and the
    telemetry, then the usage with stream_options.include_usage; `[DONE]` last). llama-server's `timings` come
    with the whole response and the stream's last chunk, and on every chunk with `timings_per_token` (`per_token`).
    `req`: the request it answers (whether it asked for logprobs and reads its answer; None for neither).
    One of several choices (`n`, several prompts): `index`, the first choice's shape `head` (their one id), and
    not `alone` (OpenAIJoin ends the stream). `verbose`: llama-server's native shape of the answer, whose object
    is its `__verbose`."""

    media_type = SSE

    def __init__(self, chat: bool, model: str, req: Request | None = None, include_usage: bool = False,
                 per_token: bool = False, index: int = 0, head: OpenAIShape | None = None, alone: bool = True,
                 verbose: AnswerShape | None = None) -> None:
        self.chat = chat
        self.model = model
        self.include_usage = include_usage  # stream_options.include_usage: usage null on each chunk, then its own
        self.index = index  # the choice's, of several (`n`, several prompts: OpenAIJoin)
        # one answer's id and time, every choice's alike (`head`: the first choice's shape)
        self.id: str = head.id if head is not None else f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created: int = head.created if head is not None else int(time.time())
        self.alone = alone  # one answer: its usage chunk ends the stream (else OpenAIJoin's does)
        self.asked = req is not None and req.logprobs is not None  # logprobs
        self.content = ContentTokens() if self.asked and req is not None and req.reading is not None else None
        self.called = False  # the answer made tool calls: finish_reason tool_calls
        self.so_far = TimingsSoFar(len(req.tokens)) if per_token and req is not None else None
        # llama-server's `verbose`: the answer's native object (llama_wire's LlamaShape), on the whole answer and on
        # a stream's last chunk (`seen`: the stream's chunks so far)
        self.req, self.verbose = req, verbose
        self.seen: list[Chunk] = []

    # -- the objects --

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT}

    def response(self, text: str, s: GenerationStats, ahead: int,
                 logprobs: Sequence[TokenLogprob] | None = None) -> dict[str, Any]:
        """The whole response: a completion's text, or a chat's message of it."""
        choice: dict[str, Any] = {"index": self.index, "logprobs": self.logprobs(logprobs),
                                  "finish_reason": s.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": openai_usage(s), "timings": final_timings(s),
                "bmoe": {**dataclasses.asdict(s), "queue_position": ahead}}

    def chunk(self, delta: dict[str, Any] | str, finish: str | None = None,
              logprobs: Sequence[TokenLogprob] | None = None, **extra: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index, "logprobs": self.logprobs(logprobs), "finish_reason": finish}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        if self.include_usage:
            extra = {"usage": None, **extra}
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice],
                **extra}

    def token_chunk(self, c: Chunk, logprobs: bool = False) -> dict[str, Any]:
        """A streamed token's chunk; `logprobs`: the request asked for them (those of the tokens it completes)."""
        return self.chunk({"content": c.text} if self.chat else c.text, logprobs=c.logprobs if logprobs else None,
                          **self._progress(c))

    def logprobs(self, tokens: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens (None: not asked for): chat's `content` list, or the
        legacy completions' parallel lists (`text_offset` counts characters of this response's text)."""
        if tokens is None:
            return None
        if self.chat:
            return {"content": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.bytes),
                                 "top_logprobs": [{"token": a.text, "logprob": a.logprob, "bytes": list(a.bytes)}
                                                  for a in t.top]} for t in tokens], "refusal": None}
        return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{a.text: a.logprob for a in t.top} for t in tokens],
                "text_offset": [t.offset for t in tokens]}

    def _progress(self, c: Chunk | None) -> dict[str, Any]:
        """The `bmoe` field of a chunk that came with a token (and with timings_per_token, the `timings` so far);
        none for the text held back to the end (a possible stop string, a partial UTF-8 sequence), which comes
        without one."""
        if c is None or c.token is None:
            return {}
        return {"bmoe": {**telemetry.progress_fields(c.token), **telemetry.draft_fields(c.token)},
                **({"timings": self.so_far.now()} if self.so_far else {})}

    def message(self, m: Reply, s: GenerationStats, ahead: int,
                logprobs: Sequence[TokenLogprob] | None = None) -> dict[str, Any]:
        """A whole chat answer read into reasoning, content and tool calls (bmoe.chat.output); `logprobs`:
        its content's tokens."""
        out = self.response(m.content, s, ahead, logprobs)
        msg = out["choices"][0]["message"]
        if m.reasoning:
            msg["reasoning_content"] = m.reasoning
        if m.calls:
            msg["content"] = m.content or None
            msg["tool_calls"] = [c.openai() for c in m.calls]
            if s.finish_reason == "stop":
                out["choices"][0]["finish_reason"] = "tool_calls"
        return out

    def delta(self, d: Delta, c: Chunk | None = None, logprobs: Sequence[TokenLogprob] | None = None
              ) -> dict[str, Any]:
        """A streamed piece of a read answer (`c`: the token it came with, for its telemetry; `logprobs`:
        its content's tokens, when asked for)."""
        delta: dict[str, Any] = {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        if d.calls:
            delta["tool_calls"] = [x.openai() for x in d.calls]
        return self.chunk(delta, logprobs=logprobs, **self._progress(c))

    def last(self, s: GenerationStats, ahead: int, stop: str | None = None) -> dict[str, Any]:
        """The chunk with the finish reason and the request's telemetry (finish_reason tool_calls where
        the answer made tool calls)."""
        finish = "tool_calls" if self.called and s.finish_reason == "stop" else s.finish_reason
        extra: dict[str, Any] = {} if self.include_usage else {"timings": final_timings(s)}  # else the usage chunk's
        if self.verbose is not None and self.req is not None:
            text = "".join(c.text for c in self.seen)
            extra["__verbose"] = self.verbose.whole(Finished(self.req, text, s, stop, self.seen, ahead))
        return self.chunk({} if self.chat else "", finish, None,
                          bmoe={**dataclasses.asdict(s), "queue_position": ahead}, **extra)

    def usage_chunk(self, s: GenerationStats, usage: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """With stream_options.include_usage, the stream's last chunk: no choices, the usage (`usage`: every
        choice's, else `s`'s)."""
        if not self.include_usage:
            return None
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage or openai_usage(s), "timings": final_timings(s)}

    # -- AnswerShape --

    def whole(self, done: Finished) -> dict[str, Any]:
        req = done.req
        if req.reading is not None:
            lp = content_logprobs(req.reading, [(c.text, c.logprobs) for c in done.chunks]) if self.asked else None
            out = self.message(done.reply, done.stats, done.ahead, lp)
        else:
            out = self.response(done.text, done.stats, done.ahead,
                                [t for c in done.chunks for t in c.logprobs] if self.asked else None)
        return {**out, "__verbose": self.verbose.whole(done)} if self.verbose is not None else out

    def comment(self, text: str) -> bytes:
        return sse_comment(text)

    def start(self) -> bytes:
        return sse(self.chunk({"role": "assistant", "content": None})) if self.chat else b""

    def token(self, c: Chunk, d: Delta | None) -> bytes:
        if self.verbose is not None:
            self.seen.append(c)
        if self.so_far is not None:
            self.so_far.add(c)
        if d is None:
            return sse(self.token_chunk(c, self.asked))
        return self._delta(d, c, self.content.push(c.text, c.logprobs, d) if self.content is not None else None)

    def progress(self, c: Chunk) -> bytes:
        """llama-server's progress chunk: a chat's opening delta or an empty text, with `prompt_progress` (and the
        timings so far with timings_per_token)."""
        assert c.progress is not None
        p = c.progress
        extra: dict[str, Any] = {"prompt_progress": prompt_progress(p)}
        if self.so_far is not None:
            self.so_far.add(c)
            extra["timings"] = self.so_far.now()
        return sse(self.chunk({"role": "assistant", "content": None} if self.chat else "", **extra))

    def finish(self, d: Delta) -> bytes:
        return self._delta(d, None, self.content.push("", (), d, final=True) if self.content is not None else None)

    def _delta(self, d: Delta, c: Chunk | None, lp: Sequence[TokenLogprob] | None) -> bytes:
        """A read answer's chunk, only when it hands something out."""
        if not (d or lp):
            return b""
        self.called = self.called or bool(d.calls)
        return sse(self.delta(d, c, lp))

    def end(self, s: GenerationStats, stop: str | None, ahead: int) -> bytes:
        used = self.usage_chunk(s) if self.alone else None
        return sse(self.last(s, ahead, stop)) + (sse(used) if used is not None else b"")

    def error(self, e: ServeError) -> bytes:
        return sse(e.body())

    def close(self) -> bytes:
        return sse("[DONE]")


class OpenAIJoin:
    """Several choices as one OpenAI answer (bmoe.server.answer_loop's Join): every choice in the first's object, in
    index order; the usage of all of them, each prompt counted once (`n`: the choices of each prompt, which come
    together); a stream ends with one usage chunk (include_usage) and one `[DONE]`."""

    def __init__(self, n: int) -> None:
        self.n = n

    def whole(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        return {**parts[0], "choices": [p["choices"][0] for p in parts],
                "usage": self.usage([p["usage"] for p in parts])}

    def close(self, first: AnswerShape, stats: Sequence[GenerationStats]) -> bytes:
        assert isinstance(first, OpenAIShape)
        used = first.usage_chunk(stats[0], self.usage([openai_usage(s) for s in stats]))
        return (sse(used) if used is not None else b"") + first.close()

    def usage(self, each: list[dict[str, Any]]) -> dict[str, Any]:
        prompts = each[::self.n]
        prompt = sum(u["prompt_tokens"] for u in prompts)
        completion = sum(u["completion_tokens"] for u in each)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {
                    "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in prompts)}}


def prompt_progress(p: PrefillProgress) -> dict[str, Any]:
    """llama-server's `prompt_progress` object of a prefill's report."""
    return {"total": p.total, "cache": p.cache, "processed": p.processed, "time_ms": int(p.seconds * 1000)}


def openai_usage(s: GenerationStats) -> dict[str, Any]:
    """OpenAI's usage, with `prompt_tokens_details.cached_tokens`: the prompt's tokens the KV held already
    (the Responses route's `input_tokens_details` count the same)."""
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": s.prompt_tokens - s.prefill_tokens}}


def sse(obj: dict[str, Any] | str) -> bytes:
    return format_sse_event(data_str=obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False))
