"""Embeddings on bmoe-server, as llama-server --embedding serves them: `POST /v1/embeddings` (OpenAI's
request and answer) and `POST /embeddings` (and `/embedding`, its legacy name: llama-server's native
answer, a list of `{"index", "embedding": [vectors]}`, per-token vectors with pooling none). The
inputs queue with the generations (bmoe.server.scheduler's EmbedAsk) and are decoded through the
streamed experts (bmoe.generation.embedding).

What is taken, as llama-server's handle_embeddings takes it (docs/server.md says the same for users):
- `input` (or `content`, which makes the answer native): a string, token ids, a list of strings and
  token ids mixed (one input: the first string with its special tokens, the rest without, ids as they
  are), `{"prompt_string": ...}`, `{"content": [{"type": "text", "text"}, ...]}` (the parts' text
  joined), or a list of those (several inputs; a list that holds a number at its top is one input).
  Media parts, multimodal data, an empty list or an input of no tokens are a 400.
- `encoding_format` `float` or `base64` (little-endian float32, as OpenAI's), `embd_normalize`
  (llama-server's: -1 none, 0 max absolute, 2 L2 (default), p: p-norm; pooled vectors only),
  `dimensions` only as the model's own size, `user` taken, `model` not checked (the answer names the
  served model, as every route's does).
- Bounds, answered before the request queues: EMBED_INPUTS_MAX inputs (OpenAI's own bound), each
  within one decode (its message says "too large", as llama-server's), EMBED_TOKENS_MAX tokens and
  EMBED_VALUES_MAX floats in the answer, all of one request.
- Without --embedding every route is a 501 naming the flag; `/v1/embeddings` with pooling none a 400
  (OpenAI's answer has one vector per input).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.params import Depends
from pydantic import BaseModel, ConfigDict, Field

from bmoe.api import Model
from bmoe.base import ConfigError
from bmoe.server.http_errors import ServeError
from bmoe.server.job_events import answered, enqueue
from bmoe.server.scheduler import EmbedAsk, Embedded, Scheduler

EMBED_INPUTS_MAX = 2048  # inputs in one request: OpenAI's bound
EMBED_TOKENS_MAX = 65536  # tokens of one request's inputs together: each is a prefill through the experts
EMBED_VALUES_MAX = 1 << 22  # floats in one answer (16 MiB as float32; several times that as JSON)
OAI_PATH = "/v1/embeddings"
EMBEDDING_PATHS = ("/embeddings", "/embedding")  # llama-server's native route and its legacy name
NO_EMBEDDINGS = "this server computes no embeddings; restart bmoe-server with --embedding"


class EmbeddingsBody(BaseModel):
    """Both routes' body (see the module notes); unknown fields are ignored, as on the other routes."""

    model_config = ConfigDict(extra="ignore", strict=True)

    input: Any = None
    content: Any = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    embd_normalize: int = 2  # L2, llama-server's default
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # an end user's id for the provider's abuse monitoring; bmoe monitors no one


def _input_error(where: str, what: str) -> ServeError:
    return ServeError(400, f"{where}: {what}", param=where.split("[")[0].split(".")[0])


class Tokenizer:
    """An input as llama-server's tokenize_input_subprompt and tokenize_oai_content_array read it."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def inputs(self, prompt: Any, field: str) -> list[list[int]]:
        """Every input of `prompt` (the body's `field`) as token ids."""
        if isinstance(prompt, list) and not any(_is_id(x) for x in prompt):
            if not prompt:
                raise _input_error(field, "an empty list; give at least one input")
            if len(prompt) > EMBED_INPUTS_MAX:
                raise _input_error(field, f"{len(prompt)} inputs; at most {EMBED_INPUTS_MAX} in one request")
            return [self.one(p, f"{field}[{i}]") for i, p in enumerate(prompt)]
        return [self.one(prompt, field)]

    def one(self, p: Any, where: str) -> list[int]:
        if isinstance(p, dict) and "content" in p:
            return self.parts(p["content"], f"{where}.content")
        if isinstance(p, dict) and "prompt_string" in p:
            if p.get("multimodal_data"):
                raise _input_error(f"{where}.multimodal_data", "this model takes text only")
            return self.mixed(p["prompt_string"], f"{where}.prompt_string")
        return self.mixed(p, where)

    def mixed(self, p: Any, where: str) -> list[int]:
        """A string (its special tokens added), or a list of strings and token ids (only a first string's)."""
        if isinstance(p, str):
            return self.model.vocab_tokens(p, True)
        if not isinstance(p, list) or not all(isinstance(x, str) or _is_id(x) for x in p):
            raise _input_error(where, "a string, token ids, strings and token ids mixed, {\"prompt_string\"} or "
                                      "{\"content\": [text parts]}")
        out: list[int] = []
        for i, x in enumerate(p):
            if isinstance(x, str):
                out += self.model.vocab_tokens(x, i == 0)
            else:
                try:
                    out += self.model.token_ids([x])
                except ConfigError:
                    raise _input_error(f"{where}[{i}]", f"{x} is not a token id of this model") from None
        return out

    def parts(self, content: Any, where: str) -> list[int]:
        """OpenAI's content parts: text only, joined."""
        if not isinstance(content, list):
            raise _input_error(where, "a list of content parts ({\"type\": \"text\", \"text\"})")
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise _input_error(f"{where}[{i}]", f"this model takes text only; the {kind!r} part cannot be read")
            texts.append(part["text"])
        return self.model.vocab_tokens("".join(texts), True)


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _vector(v: np.ndarray, b64: bool) -> Any:
    return base64.b64encode(v.astype("<f4").tobytes()).decode() if b64 else v.tolist()


class EmbeddingEndpoints:
    """The embeddings routes over one server's model (named `model_id`) and scheduler."""

    def __init__(self, model: Model, model_id: str, sched: Scheduler) -> None:
        self.model, self.model_id, self.sched = model, model_id, sched
        self.tokenizer = Tokenizer(model)

    async def oai(self, body: EmbeddingsBody, request: HttpRequest) -> Any:
        return await self.answer(body, request, native=body.input is None and body.content is not None)

    async def native(self, body: EmbeddingsBody, request: HttpRequest) -> Any:
        return await self.answer(body, request, native=True)

    async def answer(self, body: EmbeddingsBody, request: HttpRequest, native: bool) -> Any:
        facts = self.model.embedding_facts
        if facts is None:
            raise ServeError(501, NO_EMBEDDINGS, "not_supported_error", "not_supported")
        if not native and facts.pooling == "none":
            raise ServeError(400, "pooling none gives a vector per token, which OpenAI's embeddings answer has no "
                             "place for; use /embeddings, or restart bmoe-server with --pooling mean, cls or last")
        if body.dimensions not in (None, facts.size):
            raise ServeError(400, f"dimensions: this model's embeddings have {facts.size}; leave it out",
                             param="dimensions")
        field = "input" if body.input is not None else "content"
        prompt = body.input if body.input is not None else body.content
        if prompt is None:
            raise ServeError(400, "input: required (or llama-server's content)", param="input")
        inputs = await asyncio.to_thread(self.tokenizer.inputs, prompt, field)
        try:
            self.model.check_embedding(inputs, body.embd_normalize, field)
        except ConfigError as e:  # an input (input[i]: ...), embd_normalize, or the load's lossy routing
            named = next((f for f in (field, "embd_normalize") if str(e).startswith(f)), None)
            raise ServeError(400, str(e), param=named) from None
        _check_bounds(inputs, facts.size if facts.pooling != "none" else 0, facts.size, field)
        vectors = await self.run(EmbedAsk(inputs, body.embd_normalize), request)
        if native:
            return [{"index": i, "embedding": [_vector(r, False) for r in (v if v.ndim == 2 else [v])]}
                    for i, v in enumerate(vectors)]
        b64 = body.encoding_format == "base64"
        extra = {"encoding_format": "base64"} if b64 else {}
        n = sum(len(t) for t in inputs)
        return {"object": "list", "model": self.model_id, "usage": {"prompt_tokens": n, "total_tokens": n},
                "data": [{"object": "embedding", "index": i, "embedding": _vector(v, b64), **extra}
                         for i, v in enumerate(vectors)]}

    async def run(self, ask: EmbedAsk, request: HttpRequest) -> list[np.ndarray]:
        """`ask` through the scheduler's queue: its vectors; a client that leaves cancels it."""
        jobs, events, _ = enqueue(self.sched, [ask])
        try:
            return await answered(request, self.sched, jobs, events,
                                  lambda _, item: item.vectors if isinstance(item, Embedded) else None)
        finally:
            self.sched.cancel(jobs[0])


def _check_bounds(inputs: list[list[int]], pooled: int, size: int, field: str) -> None:
    """The request within EMBED_TOKENS_MAX tokens and EMBED_VALUES_MAX floats (`pooled`: a vector's size; 0
    with pooling none: a row of `size` per token)."""
    n = sum(len(t) for t in inputs)
    if n > EMBED_TOKENS_MAX:
        raise _input_error(field, f"{n} tokens; at most {EMBED_TOKENS_MAX} in one request")
    values = pooled * len(inputs) if pooled else n * size
    if values > EMBED_VALUES_MAX:
        raise _input_error(field, f"the answer would hold {values} floats; at most {EMBED_VALUES_MAX} in one request")


def add_embedding_routes(app: FastAPI, routes: EmbeddingEndpoints, key: list[Depends]) -> None:
    """The embeddings routes, behind `key` as the others are."""
    app.post(OAI_PATH, dependencies=key)(routes.oai)
    for path in EMBEDDING_PATHS:
        app.post(path, dependencies=key)(routes.native)
