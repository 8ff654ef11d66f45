"""Ollama's API as bmoe-server speaks it, on the same port: `POST /api/chat` and `/api/generate`
translated into the chat route's request (or, for a raw prompt, the completions route's), so the
engine, scheduler, grammars, tool-call reading, prompt cache, limits and errors are theirs; the
answer as one JSON object or as JSON lines (`OllamaShape`); and what Ollama's clients ask of the
models a server has (`ModelFacts`: `/api/tags`, `/api/ps`, `/api/show`, `/api/version`).

What is taken and what is not (docs/server.md says the same for users):
- `/api/chat`: `messages` (`system`, `user`, `assistant` with `thinking` and `tool_calls`, `tool`
  with `tool_name` or `tool_call_id`), `tools` (OpenAI's function shape), `format` (`"json"` or a
  JSON schema, held by the chat route's grammars), `think` (false: thinking off; true or a level:
  the server's default, the template decides), `stream` (default true: JSON lines), `options`,
  `keep_alive` (accepted; the model stays loaded while the server runs). Images are a 400 (the
  model takes text only). Empty `messages` answer at once, `done_reason: "load"`, as Ollama's.
- `/api/generate`: `prompt` and `system` as a chat of one user message (Ollama renders them with
  the model's template too), or `raw: true` for the prompt as it is (no template, no `system`);
  `format`, `think`, `options`, `stream`, `keep_alive` as above. `suffix`, `template`, `context`,
  `images`, `logprobs` and the image-generation fields are a 400 unless they ask for nothing.
- `options`: the sampling settings by their own names (SAMPLING_FIELDS: `temperature`, `top_k`,
  `top_p`, `min_p`, `seed`, `repeat_penalty`, `repeat_last_n`, `frequency_penalty`,
  `presence_penalty`, `logit_bias`), `num_predict` (max tokens; -1 and -2 take the server's -n)
  and `stop`. Ollama's load-time options (`num_ctx`, `num_gpu`, `num_thread`, `use_mmap`, ...) and
  `num_keep`, `penalize_newline` cannot change a loaded server and are named in the answer's
  `warnings`; `mirostat`, `typical_p` and `tfs_z` are a 400 unless neutral; any other option is a
  400 naming it (a typo would otherwise change nothing, silently).
- The answer: `message` (or `response`) with `thinking` and `tool_calls` (`id`, `function`:
  `index`, `name`, `arguments` as an object), `done`, `done_reason` (`stop`, `length`), and on
  the last object `total_duration`, `load_duration` (0: loaded at start), `prompt_eval_count`,
  `prompt_eval_duration`, `eval_count`, `eval_duration` (nanoseconds), `bmoe` (the request's
  telemetry), `warnings` when any. Errors are `{"error": "..."}` with the HTTP status; in a
  stream, an `{"error": ...}` line.
- `/api/tags` and `/api/ps` list the model by its id (`--alias`) and by its GGUF's name;
  `/api/show` gives its facts from the GGUF (architecture, parameters, context, quantization,
  template, capabilities); `/api/version` bmoe's version. `/api/pull` of the served model answers
  success; pulling another, `/api/delete`, `/api/create`, `/api/copy`, `/api/push`, blobs and
  embeddings are a 400 saying this server serves one model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import gguf
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bmoe.api import Chunk, GenerationStats, Model
from bmoe.base import SAMPLING_FIELDS, read_table, shard_paths
from bmoe.chat import Delta, Reply
from bmoe.server.answer_shape import Finished
from bmoe.server.http_errors import ServeError, invalid
from bmoe.server.openai_wire import ChatBody, CompletionBody
from bmoe.server.request_base import BmoeOptions, implemented

OLLAMA_PREFIX = "/api/"
NDJSON = "application/x-ndjson"
OLLAMA_TOO_LONG_FIX = ("shorten the messages (or prompt), lower options.num_predict, or restart bmoe-server with a "
                       "larger -c")
# Ollama's options that a loaded server cannot change (its load-time ones, and two it no longer reads)
FIXED = ("numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
         "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "penalize_newline")
_UNIMPLEMENTED_OPTIONS: dict[str, tuple[Any, ...]] = {"mirostat": (None, 0), "typical_p": (None, 1), "tfs_z": (None, 1)}
MIROSTAT_ONLY = ("mirostat_tau", "mirostat_eta")  # read only by mirostat: with it off, they change nothing
_UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "template": (None, ""), "context": (None, []), "images": (None, []),
    "logprobs": (None, False), "top_logprobs": (None, 0), "width": (None,), "height": (None,), "steps": (None,)}
# a field of the chat or completions request a 400 names, as Ollama's request names it
OLLAMA_FIELD_NAMES = ((r"response_format\.json_schema\.schema", "format"), (r"response_format", "format"),
                      (r"max_tokens", "options.num_predict"), (r"stop", "options.stop"),
                      *((rf"{name}\b", f"options.{name}") for name in SAMPLING_FIELDS))


def is_ollama_path(path: str) -> bool:
    """Whether a request to `path` gets Ollama's shapes (errors included)."""
    return path.startswith(OLLAMA_PREFIX)


def ollama_error(e: ServeError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=e.status)


def _bad(where: str, message: str) -> ServeError:
    return ServeError(400, f"{where}: {message}", param=where)


# ---- the requests ----------------------------------------------------------------------------------


class GenerateBody(BaseModel):
    """What `/api/chat` and `/api/generate` share; unknown fields are ignored, those of _UNIMPLEMENTED
    refused unless they ask for nothing."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None  # one model is served; not checked
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: float | int | str | None = None  # accepted: the model stays loaded while the server runs
    think: bool | Literal["low", "medium", "high"] | None = None
    grammar: str | None = None  # bmoe's extension (GBNF)
    bmoe: BmoeOptions = BmoeOptions()

    @model_validator(mode="before")
    @classmethod
    def _implemented(cls, data: Any) -> Any:
        return implemented(data, _UNIMPLEMENTED)


class OllamaChatBody(GenerateBody):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateBody(GenerateBody):
    prompt: str = ""
    system: str | None = None
    raw: bool = False


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str = Field(min_length=1)
    verbose: bool = False


class NamedBody(BaseModel):
    """A pull, push, create or delete: the model it names (`name` in older clients)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    name: str | None = None


@dataclasses.dataclass(frozen=True)
class Translated:
    """An Ollama request as the chat (or completions) request bmoe runs, and what the answer should say."""

    body: ChatBody | CompletionBody
    warnings: tuple[str, ...]


def _options(options: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """Ollama's options as the chat request's fields (sampling, max_tokens, stop), and the warnings of
    those a loaded server cannot follow; a 400 names one it does not implement or know."""
    opts = dict(options or {})
    implemented(opts, _UNIMPLEMENTED_OPTIONS, "options.")
    fields: dict[str, Any] = {}
    warnings: list[str] = []
    for name, value in opts.items():
        if name in SAMPLING_FIELDS or name == "stop":
            fields[name] = value
        elif name == "num_predict":
            if isinstance(value, int) and not isinstance(value, bool) and value in (-1, -2):
                warnings.append(f"options.num_predict {value}: bmoe-server's -n bounds the answer instead")
            else:
                fields["max_tokens"] = value
        elif name in FIXED:
            warnings.append(f"options.{name}: bmoe-server's load sets it (its flags); ignored")
        elif name in MIROSTAT_ONLY:
            warnings.append(f"options.{name}: read only by mirostat, which is off; ignored")
        elif name not in _UNIMPLEMENTED_OPTIONS:
            raise _bad(f"options.{name}", "not an option bmoe-server knows; leave it out (the sampling options are "
                                          f"{', '.join(SAMPLING_FIELDS)}, num_predict and stop)")
    return fields, warnings


def _format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt}}


def _common(body: GenerateBody) -> tuple[dict[str, Any], list[str]]:
    fields, warnings = _options(body.options)
    if body.keep_alive is not None:
        warnings.append("keep_alive: the model stays loaded as long as bmoe-server runs")
    return dict(response_format=_format(body.format), grammar=body.grammar, bmoe=body.bmoe, **fields), warnings


def _validated(cls: type[ChatBody] | type[CompletionBody], fields: dict[str, Any]) -> ChatBody | CompletionBody:
    try:
        return cls.model_validate(fields)
    except ValidationError as e:  # a value the chat request cannot take: the 400 names the field
        raise invalid(e.errors()) from None


def chat_translated(body: OllamaChatBody) -> Translated:
    fields, warnings = _common(body)
    fields.update(messages=_messages(body.messages), tools=body.tools, think=_think(body.think))
    return Translated(_validated(ChatBody, fields), tuple(warnings))


def generate_translated(body: OllamaGenerateBody) -> Translated:
    fields, warnings = _common(body)
    if body.raw:
        if body.system is not None:
            raise _bad("system", "a raw prompt has no template to put it in; write it into the prompt")
        if body.think is not None:
            raise _bad("think", "a raw prompt has no template to turn thinking on or off; leave it out")
        return Translated(_validated(CompletionBody, {**fields, "prompt": body.prompt}), tuple(warnings))
    messages = [{"role": "system", "content": body.system}] if body.system is not None else []
    messages.append({"role": "user", "content": body.prompt})
    fields.update(messages=messages, think=_think(body.think))
    return Translated(_validated(ChatBody, fields), tuple(warnings))


def _think(think: bool | str | None) -> bool | None:
    """false: thinking off; true: on; a level (not graded) or left out: the server's --reasoning."""
    return think if isinstance(think, bool) else None


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama's messages as the chat request's: a call's arguments as JSON text, a tool result's call
    found by its tool_call_id, else by its tool_name (the last call of that name not yet answered)."""
    out: list[dict[str, Any]] = []
    unanswered: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(at, "a message is {\"role\", \"content\"}")
        if m.get("images"):
            raise _bad(f"{at}.images", "this model takes text only; the images cannot be read (send the content as "
                                       "text)")
        msg: dict[str, Any] = {"role": m.get("role"), "content": m.get("content", "")}
        if m.get("thinking"):
            msg["reasoning_content"] = m["thinking"]
        if m.get("tool_calls"):
            msg["tool_calls"] = [_call(c, f"{at}.tool_calls[{j}]", j) for j, c in enumerate(m["tool_calls"])]
            msg["content"] = msg["content"] or None
            unanswered = list(msg["tool_calls"])
        if m.get("role") == "tool":
            msg["tool_call_id"] = _answered(m, unanswered, at)
        out.append(msg)
    return out


def _call(c: Any, where: str, index: int) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(where, "{\"function\": {\"name\", \"arguments\"}}")
    args = fn.get("arguments", {})
    return {"id": c.get("id") or f"call_{index}", "type": "function",
            "function": {"name": fn["name"], "arguments": args if isinstance(args, str)
                         else json.dumps(args, ensure_ascii=False)}}


def _answered(m: dict[str, Any], unanswered: list[dict[str, Any]], at: str) -> str:
    """The id of the call a tool message answers (taken from `unanswered`)."""
    named = m.get("tool_call_id")
    if isinstance(named, str):
        return named
    name = m.get("tool_name")
    for c in reversed(unanswered):
        if name is None or c["function"]["name"] == name:
            unanswered.remove(c)
            return str(c["id"])
    raise _bad(f"{at}.tool_name", "the name of a call the assistant made before this message, which it answers")


# ---- the answer ------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class OllamaShape:
    """One answer of `/api/chat` (`chat`: a message) or `/api/generate` (a response) in Ollama's
    shapes: a JSON object, or JSON lines, one per piece of the answer, the last `done: true` with the
    counts and durations."""

    media_type = NDJSON

    def __init__(self, model: str, chat: bool, warnings: tuple[str, ...]) -> None:
        self.model, self.chat, self.warnings = model, chat, warnings
        self.t0 = time.monotonic()
        self.index = 0  # the next tool call's

    def _object(self, done: bool, reasoning: str = "", content: str = "",
                calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.chat:
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning:
                msg["thinking"] = reasoning
            if calls:
                msg["tool_calls"] = calls
            out["message"] = msg
        else:
            out["response"] = content
            if reasoning:
                out["thinking"] = reasoning
        out["done"] = done
        return out

    def _calls(self, calls: Any) -> list[dict[str, Any]]:
        out = []
        for c in calls:
            out.append({"id": c.id, "function": {"index": self.index, "name": c.name,
                                                 "arguments": json.loads(c.arguments)}})
            self.index += 1
        return out

    def _last(self, obj: dict[str, Any], s: GenerationStats, ahead: int) -> dict[str, Any]:
        decode_s = s.completion_tokens / s.tok_s if s.tok_s > 0 else 0.0
        obj.update(done_reason=s.finish_reason, total_duration=int((time.monotonic() - self.t0) * 1e9),
                   load_duration=0, prompt_eval_count=s.prompt_tokens, prompt_eval_duration=int(s.prefill_s * 1e9),
                   eval_count=s.completion_tokens, eval_duration=int(decode_s * 1e9),
                   bmoe={**dataclasses.asdict(s), "queue_position": ahead})
        if self.warnings:
            obj["warnings"] = list(self.warnings)
        return obj

    def loaded(self) -> dict[str, Any]:
        """The answer to a request with nothing to generate (Ollama's way to load a model)."""
        obj = {**self._object(True), "done_reason": "load"}
        if self.warnings:
            obj["warnings"] = list(self.warnings)
        return obj

    @staticmethod
    def _line(obj: dict[str, Any]) -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode() + b"\n"

    # -- AnswerShape --

    def whole(self, done: Finished) -> dict[str, Any]:
        m: Reply = done.reply
        return self._last(self._object(True, m.reasoning, m.content, self._calls(m.calls)), done.stats, done.ahead)

    def comment(self, text: str) -> bytes:
        return b""  # JSON lines have no comments

    def start(self) -> bytes:
        return b""

    def token(self, c: Chunk, d: Delta | None) -> bytes:
        return self.finish(d if d is not None else Delta(content=c.text))

    def progress(self, c: Chunk) -> bytes:
        return b""  # its requests ask for no progress reports

    def finish(self, d: Delta) -> bytes:
        if not d:
            return b""
        return self._line(self._object(False, d.reasoning, d.content, self._calls(d.calls)))

    def end(self, s: GenerationStats, stop: str | None, ahead: int) -> bytes:
        return self._line(self._last(self._object(True), s, ahead))

    def error(self, e: ServeError) -> bytes:
        return self._line({"error": e.message})

    def close(self) -> bytes:
        return b""


# ---- the model -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """The served model as Ollama's clients read a model: its names, file, details and GGUF facts."""

    names: tuple[str, ...]  # its id (--alias), then its GGUF's name when that differs
    size: int  # bytes of its files
    modified_at: str
    digest: str
    details: dict[str, Any]
    model_info: dict[str, Any]
    template: str
    parameters: str
    capabilities: tuple[str, ...]
    n_ctx: int

    @classmethod
    def of(cls, model: Model, model_id: str) -> ModelFacts:
        """Read from the model's GGUF header(s) and its loaded settings (takes a moment: call it off the
        event loop)."""
        paths = shard_paths(Path(model.settings.model))
        tables = [read_table(p) for p in paths]
        info = {k: v for k, v in tables[0].fields.items() if k != "tokenizer.chat_template"}
        params = sum(math.prod(t.shape) for table in tables for t in table.tensors)
        info.setdefault("general.parameter_count", params)
        arch = str(info.get("general.architecture", model.stats.arch))
        stat = [p.stat() for p in paths]
        ftype = info.get("general.file_type")
        details = {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
                   "parameter_size": _human(int(info["general.parameter_count"])),
                   "quantization_level": _quantization(ftype)}
        fmt = model.chat_format
        # the server's sampling settings by the names `options` takes (SAMPLING_FIELDS), a logit bias only
        # when --logit-bias set one, then the context
        sampling = [(name, getattr(model.settings.sampler, field)) for name, field in SAMPLING_FIELDS.items()]
        parameters = "\n".join(f"{k:<30} {v}" for k, v in (*sampling, ("num_ctx", model.stats.n_ctx)) if v != ())
        capabilities = ("completion", *(("tools",) if fmt.renderer.supports_tools else ()),
                        *(("thinking",) if fmt.syntax.think else ()))
        # the digest names the files, not their bytes: hashing a model larger than RAM costs minutes
        ident = "\n".join(f"{p.resolve()} {st.st_size} {st.st_mtime_ns}" for p, st in zip(paths, stat))
        names = (model_id,) if model_id == model.name else (model_id, model.name)
        return cls(names, sum(st.st_size for st in stat),
                   datetime.fromtimestamp(max(st.st_mtime for st in stat), timezone.utc).isoformat(),
                   hashlib.sha256(ident.encode()).hexdigest(), details, info,
                   (fmt.renderer.template or b"").decode(errors="replace"), parameters, capabilities,
                   model.stats.n_ctx)

    def serves(self, name: str) -> bool:
        """Whether `name` (with or without a `:tag`) is the served model."""
        return name in self.names or name.rsplit(":", 1)[0] in self.names

    def tags(self) -> dict[str, Any]:
        return {"models": [{"name": n, "model": n, "modified_at": self.modified_at, "size": self.size,
                            "digest": self.digest, "details": self.details} for n in self.names]}

    def ps(self, resident: int) -> dict[str, Any]:
        return {"models": [{"name": n, "model": n, "size": resident, "digest": self.digest, "details": self.details,
                            "expires_at": None, "size_vram": 0, "context_length": self.n_ctx} for n in self.names]}

    def show(self) -> dict[str, Any]:
        modelfile = (f"# bmoe-server serves this model as it was started; it creates no model from a Modelfile\n"
                     f"FROM {self.names[-1]}\n")
        return {"license": str(self.model_info.get("general.license", "")), "modelfile": modelfile,
                "parameters": self.parameters, "template": self.template, "details": self.details,
                "model_info": self.model_info, "capabilities": list(self.capabilities),
                "modified_at": self.modified_at}


def _human(n: int) -> str:
    """A parameter count as Ollama writes it (8.0B, 135M)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}" if n < 100 * size else f"{n / size:.0f}{unit}"
    return str(n)


def _quantization(ftype: Any) -> str:
    try:
        return gguf.LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        return "unknown"


def version() -> dict[str, str]:
    return {"version": metadata.version("bmoe")}


def one_model(what: str, served: str) -> ServeError:
    """The 400 of a request that would change which models the server has."""
    return ServeError(400, f"bmoe-server serves one model ({served}) and {what}; start it with -m FILE (or -hf "
                      "ORG/REPO) to serve another", code="one_model")
