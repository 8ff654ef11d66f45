"""`bmoe-server`: an OpenAI-compatible HTTP server over one loaded model (FastAPI + uvicorn).

Routes: `GET /health` (no key needed), `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (`"stream": true` gives server-sent events ending `data: [DONE]`),
`GET /metrics` (Prometheus text). Every generation goes through bmoe.generation.Generation.

Decisions:

- Up to `--parallel N` generations run at once (one KV sequence each), on one worker thread
  (bmoe.scheduler): each step batches them or lets them take turns (`--batching`, by default
  whichever measured faster per generated token). Up to `--queue` more requests wait, more get
  429. The `X-Queue-Position` header says how many requests were ahead at admission (0: it runs
  at once); a stream also says `: queue position N` (an SSE comment, which clients skip) as it
  moves up.
- A request is checked before it queues (pydantic with strict types; the prompt against the
  context), so a bad one gets its 400 at once and never waits.
- Options a request leaves out take the server's flags: `max_tokens` is `-n`, sampling is
  `--temp/--top-k/--top-p/--seed` (greedy by default, so a request's answer equals `bmoe-cli`'s
  for the same prompt and settings). `top_k` and `think` (chat: False renders the conversation
  with `enable_thinking=False`) are extensions; `n` must be 1; the `model` field is not checked
  (one model is served; responses name it).
- A chat whose messages extend an earlier request's conversation (its messages, the answer as
  it was returned, then more) reuses that KV sequence's prefix while the sequence still holds it
  (a free sequence is taken least recently used first); any other request starts from an empty KV.
- Telemetry: each response's `bmoe` field holds the request's (bmoe.api.GenerationStats: tok/s,
  MiB/token, hit %, stall, prefill ...), a streamed token's chunk that token's (the contract's
  BMOE_PROGRESS fields but the text); `/metrics` has totals and the last request's figures.
  A stream's last chunk carries `usage` and `bmoe`.
- A client that disconnects cancels its generation at once, or leaves the queue.
- Security: binds 127.0.0.1 by default; `--api-key` (or `BMOE_API_KEY`) requires
  `Authorization: Bearer KEY` on every route but /health; a non-loopback `--host` without a key
  is refused unless `--insecure`. Bodies over `--max-body-kb` get 413. Every error is an OpenAI
  error object `{"error": {"message", "type", "param", "code"}}`; in a stream that has begun, an
  `{"error": ...}` event before `[DONE]`.
- SIGTERM / SIGINT: the running generation is cancelled, waiting requests get 503, and the
  process exits 143 / 130 with its I/O lanes stopped and its shared memory freed. A lane that
  keeps failing or a model file changed under the server is fatal: the request gets a 500 and
  the server exits 1, as the session does.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import json
import os
import secrets
import socket
import sys
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Literal

try:
    import uvicorn
    from fastapi import APIRouter, Depends, FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
    from fastapi.sse import format_sse_event
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.datastructures import Headers
    from starlette.exceptions import HTTPException
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as e:  # the server extra is not installed
    raise SystemExit(f"bmoe-server: error: {e.name} is missing; install the server extra: "
                     "pip install 'bmoe[server]'") from None

from bmoe import cli, console, flags, telemetry
from bmoe.api import Chunk, GenerationStats, Model, Request
from bmoe.argtypes import nonneg_int, number, positive_int
from bmoe.scheduler import MODES, Event, GenerationFailed, Job, Position, QueueFull, Scheduler, ShuttingDown
from bmoe.settings import ConfigError

PROG = "bmoe-server"
EXIT_OK, EXIT_ERROR, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 130, 143
CONTEXT_FIX = "shorten the prompt, lower max_tokens, or restart bmoe-server with a larger -c"
RELOAD_FIX = "restart bmoe-server to load it again"
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
CLI_ONLY = ("prompt", "file", "chat", "progress", "csv", "profile", "session", "route_trace")

EXAMPLES = """\
examples:
  bmoe-server                                      # the demo model at http://127.0.0.1:8000/v1
  bmoe-server -m model.gguf --cache-mb 2000 --io-threads 4 --queue 16
  bmoe-server -m model.gguf --parallel 4          # up to 4 requests decode at once, batched when it pays
  bmoe-server -m model.gguf --host 0.0.0.0 --api-key "$KEY"   # reachable from the network, with a key
  BMOE_API_KEY=secret bmoe-server -m model.gguf --port 0      # any free port (printed at start)

  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'
  python -c 'import openai; c = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none");
             print(c.completions.create(model="bmoe", prompt="Once upon a time", max_tokens=32).choices[0].text)'
"""


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
    """What a request hears of a scheduler's exception (bmoe.scheduler)."""
    if isinstance(e, ShuttingDown):
        return shutting_down()
    if isinstance(e, QueueFull):
        return ServeError(429, f"the server is busy: {e}; send it again later", "rate_limit_error", "queue_full")
    if isinstance(e, ConfigError):
        return ServeError(400, str(e))
    assert isinstance(e, GenerationFailed), e
    return ServeError(500, f"generation failed: {e}", "server_error", "internal_error")


def _http_error(exc: HTTPException) -> ServeError:
    code = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed"}
    return ServeError(exc.status_code, str(exc.detail), "server_error" if exc.status_code >= 500
                      else "invalid_request_error", code.get(exc.status_code))


def _validation_error(exc: RequestValidationError) -> ServeError:
    first = exc.errors()[0]
    where = ".".join(str(x) for x in first.get("loc", ())[1:])
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return ServeError(400, f"the body is not valid JSON ({detail}); send a JSON object", code="invalid_json")
    msg = f"{where}: {first.get('msg')}" if where else f"the body: {first.get('msg')}"
    more = len(exc.errors()) - 1
    return ServeError(400, msg + (f" (and {more} more)" if more else ""), param=where or None)


# ---- request bodies --------------------------------------------------------------------------------


class _Body(BaseModel):
    """What /v1/completions and /v1/chat/completions share; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, max_length=4)
    stream: bool = False
    n: Literal[1] = 1


class CompletionBody(_Body):
    prompt: str | list[str] = Field(min_length=1)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    think: bool = True


# ---- metrics ---------------------------------------------------------------------------------------


class Metrics:
    """The Prometheus registry of one server: totals, the last request's telemetry, queue and cache gauges."""

    def __init__(self, model: Model, sched: Scheduler) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("bmoe_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.generations = Counter("bmoe_generations", "generations run, by finish reason", ["finish_reason"],
                                   registry=r)
        self.generated = Counter("bmoe_generated_tokens", "tokens generated", registry=r)
        self.prefilled = Counter("bmoe_prefill_tokens", "prompt tokens decoded (a reused KV prefix is not)",
                                 registry=r)
        self.read = Counter("bmoe_read_bytes", "expert bytes read from flash while decoding", registry=r)
        self.decode_s = Counter("bmoe_decode_seconds", "wall time of the decode tokens", registry=r)
        self.stall_s = Counter("bmoe_stall_seconds", "decode time lost waiting for expert reads", registry=r)
        self.last = Gauge("bmoe_last_request", "the last generation's telemetry (tok_s, mib_per_token, "
                          "cache_hit_pct, stall_s_per_token, prefill_s)", ["measure"], registry=r)
        Gauge("bmoe_queue_waiting", "requests waiting for a KV sequence", registry=r).set_function(
            lambda: len(sched.waiting))
        Gauge("bmoe_generating", "generations running", registry=r).set_function(lambda: len(sched.active))
        steps = Gauge("bmoe_decode_steps", "decode steps with two or more generations running, by how they ran "
                      "(batch: together; turns: the oldest alone)", ["mode"], registry=r)
        for mode in sched.batching.steps:
            steps.labels(mode).set_function(lambda m=mode: sched.batching.steps[m])
        e = model.engine
        Gauge("bmoe_cache_resident_bytes", "expert bytes resident in the cache", registry=r).set_function(
            e.resident_bytes)
        Gauge("bmoe_cache_budget_bytes", "the expert cache budget", registry=r).set_function(lambda: e.budget)
        Gauge("bmoe_kv_tokens", "tokens in the KV, every sequence's", registry=r).set_function(
            lambda: sum(len(s.kv_tokens) for s in model.slots))

    def generation(self, s: GenerationStats) -> None:
        self.generations.labels(s.finish_reason).inc()
        self.generated.inc(s.completion_tokens)
        self.prefilled.inc(s.prefill_tokens)
        self.read.inc(s.read_mib * 2**20)
        wall = s.completion_tokens / s.tok_s if s.tok_s > 0 else 0.0
        self.decode_s.inc(wall)
        self.stall_s.inc(s.stall_s_per_token * s.completion_tokens)
        for k in ("tok_s", "mib_per_token", "cache_hit_pct", "stall_s_per_token", "prefill_s"):
            self.last.labels(k).set(getattr(s, k))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class Gate:
    """ASGI middleware at the app's edge: counts every answer by route and status, and answers a
    body over `limit` bytes with a 413 error object before the app reads any of it."""

    def __init__(self, app: ASGIApp, metrics: Metrics, limit: int) -> None:
        self.app = app
        self.metrics = metrics
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        too_large = ServeError(413, f"the request body is over {self.limit} bytes (bmoe-server --max-body-kb)",
                               code="request_too_large").response()
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await too_large(scope, receive, counted)
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await too_large(scope, receive, counted)
                return
        pending = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, counted)


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
        return self.chunk({"content": c.text} if self.chat else c.text, bmoe=telemetry.progress_fields(c.token))

    def last(self, s: GenerationStats, ahead: int) -> dict[str, Any]:
        return self.chunk({} if self.chat else "", s.finish_reason, usage=usage(s),
                          bmoe={**dataclasses.asdict(s), "queue_position": ahead})


def usage(s: GenerationStats) -> dict[str, int]:
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens}


def sse(obj: dict[str, Any] | str) -> bytes:
    return format_sse_event(data_str=obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False))


async def _disconnected(request: HttpRequest) -> None:
    """Returns when the client has gone (the body is read: nothing else comes before that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- the app ---------------------------------------------------------------------------------------


def create_app(model: Model, sched: Scheduler, *, api_key: str | None, max_body: int, n_predict: int) -> FastAPI:
    """The FastAPI app serving `model` through `sched`."""
    metrics = Metrics(model, sched)
    sched.on_generation = metrics.generation
    bearer = HTTPBearer(auto_error=False)

    async def authorized(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if api_key is None:
            return
        if creds is None or not secrets.compare_digest(creds.credentials.encode(), api_key.encode()):
            raise ServeError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'",
                             code="invalid_api_key")

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        sched.close()
        await asyncio.to_thread(sched.join)

    app = FastAPI(title="bmoe", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(Gate, metrics=metrics, limit=max_body)
    api = APIRouter(dependencies=[Depends(authorized)])

    @app.exception_handler(ServeError)
    async def on_serve_error(_r: HttpRequest, exc: ServeError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_r: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def on_http(_r: HttpRequest, exc: HTTPException) -> JSONResponse:
        return _http_error(exc).response()

    @app.exception_handler(Exception)
    async def on_bug(_r: HttpRequest, exc: Exception) -> JSONResponse:
        return ServeError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error",
                          "internal_error").response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model.name, "generating": len(sched.active), "parallel": sched.capacity,
                "waiting": len(sched.waiting)}

    @api.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model.name, "object": "model",
                                            "created": int(time.time() - model.engine.load_s),
                                            "owned_by": "bmoe"}]}

    async def prepare(body: _Body, max_tokens: int | None, **what: Any) -> Request:
        """The request as tokens, checked against the context (off the event loop: tokenizing takes a while)."""
        sampling = dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed)
        try:
            return await asyncio.to_thread(model.prepare, **what, **sampling, max_tokens=max_tokens or n_predict,
                                           stop=body.stop, fix=CONTEXT_FIX)
        except ConfigError as e:
            too_long = "exceeds the context" in str(e)  # Engine.check_fits's words
            raise ServeError(400, str(e), code="context_length_exceeded" if too_long else None,
                             param="messages" if "messages" in what else "prompt") from None

    @api.post("/v1/completions")
    async def completions(body: CompletionBody, request: HttpRequest) -> Response:
        if isinstance(body.prompt, list) and len(body.prompt) != 1:
            raise ServeError(400, "prompt: one prompt per request (a string, or a list of one)", param="prompt")
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        req = await prepare(body, body.max_tokens, prompt=prompt)
        return await answer(request, body, req, Shape(False, model.name))

    @api.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: HttpRequest) -> Response:
        req = await prepare(body, body.max_tokens or body.max_completion_tokens,
                            messages=[m.as_dict() for m in body.messages], think=body.think)
        return await answer(request, body, req, Shape(True, model.name))

    async def answer(request: HttpRequest, body: _Body, req: Request, shape: Shape) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        job = Job(req, lambda item: loop.call_soon_threadsafe(events.put_nowait, item))
        try:
            ahead = sched.submit(job)
        except (QueueFull, ShuttingDown) as e:
            raise serve_error(e) from None
        headers = {"X-Queue-Position": str(ahead)}
        if body.stream:
            return StreamingResponse(stream(job, events, shape, ahead), media_type="text/event-stream",
                                     headers=headers)
        text, stats = await whole(request, job, events)
        return JSONResponse(shape.whole(text, stats, ahead), headers=headers)

    async def whole(request: HttpRequest, job: Job, events: asyncio.Queue[Event]) -> tuple[str, GenerationStats]:
        gone = asyncio.ensure_future(_disconnected(request))
        parts: list[str] = []
        try:
            while True:
                get = asyncio.ensure_future(events.get())
                await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    sched.cancel(job)
                    raise ServeError(499, "the client closed the connection", code="client_gone")
                item = get.result()
                if isinstance(item, Exception):
                    raise serve_error(item)
                if isinstance(item, Chunk):
                    parts.append(item.text)
                    if item.stats is not None:
                        return "".join(parts), ended(item.stats)
        finally:
            gone.cancel()

    def ended(s: GenerationStats) -> GenerationStats:
        if s.finish_reason == "cancelled":  # only a shutdown cancels a request whose client is there
            raise shutting_down()
        return s

    async def stream(job: Job, events: asyncio.Queue[Event], shape: Shape, ahead: int) -> AsyncIterator[bytes]:
        try:
            if ahead:
                yield format_sse_event(comment=f"queue position {ahead}")
            if shape.chat:
                yield sse(shape.chunk({"role": "assistant", "content": ""}))
            while True:
                item = await events.get()
                if isinstance(item, Position):
                    yield format_sse_event(comment=f"queue position {item.ahead}" if item.ahead else "running")
                    continue
                if isinstance(item, Exception):
                    yield sse(serve_error(item).body())
                    break
                if item.stats is None:
                    yield sse(shape.token(item))
                    continue
                try:
                    yield sse(shape.last(ended(item.stats), ahead))
                except ServeError as e:
                    yield sse(e.body())
                break
            yield sse("[DONE]")
        finally:
            sched.cancel(job)  # the client left mid-stream (nothing happens when the job ended)

    app.include_router(api)
    return app


# ---- flags and the process -------------------------------------------------------------------------


def _port(text: str) -> int:
    return number(text, int, "a port number", lambda v: 0 <= v <= 65535, "must be 0 (any free port) to 65535")


def build_parser() -> argparse.ArgumentParser:
    """bmoe-cli's parser (model, cache, streaming and sampling flags) with the server's flags added."""
    ap = flags.build_parser()
    ap.prog = PROG
    ap.usage = "%(prog)s [-m MODEL] [options]"
    ap.epilog = EXAMPLES
    ap.description = ("Serve a Mixture-of-Experts GGUF larger than RAM over the OpenAI HTTP API (completions, "
                      "chat completions, streaming), streaming its experts from flash; one model, up to "
                      "--parallel generations at a time, more requests queue.")
    for action in ap._actions:
        if action.dest in CLI_ONLY:
            action.help = argparse.SUPPRESS
        elif action.dest == "n_predict":
            action.help = f"max_tokens of a request that does not say (default {flags.N_PREDICT})"
    g = ap.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only); any other address "
                        "needs --api-key, or --insecure")
    g.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0: any free port, printed)")
    g.add_argument("--api-key", metavar="KEY", default=os.environ.get("BMOE_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "$BMOE_API_KEY; none)")
    g.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without an API key (anyone who reaches it can use it)")
    g.add_argument("--queue", type=nonneg_int, default=8, metavar="N",
                   help="requests that may wait for a KV sequence (see --parallel); more get 429 (default 8)")
    g.add_argument("--batching", choices=MODES, default="auto",
                   help="with --parallel N above 1, how running requests share a decode step: batch (one "
                        "llama.cpp batch, each layer reads their experts' union once), turns (the oldest "
                        "alone), or auto (default: whichever it measured faster per generated token; it "
                        "starts with batch when every expert is cached, turns otherwise)")
    g.add_argument("--max-body-kb", type=positive_int, default=1024, metavar="KB",
                   help="largest request body; larger gets 413 (default 1024)")
    return ap


def check_server_flags(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Usage errors (exit 2): bmoe-cli's own flags, and a network address without a key."""
    given = [f"--{d.replace('_', '-')}" for d in CLI_ONLY if getattr(a, d, None) not in (None, False)]
    if given:
        ap.error(f"{', '.join(given)}: bmoe-cli's, not the server's (prompts come over HTTP)")
    if not _loopback(a.host) and not a.api_key and not a.insecure:
        ap.error(f"--host {a.host} lets other machines reach the model; give --api-key KEY (or set BMOE_API_KEY), "
                 "or say --insecure to serve it without a key")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, made before the model loads so a busy port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port or --host") from None


class Server(uvicorn.Server):
    """uvicorn's server with bmoe's start line and a shutdown that cancels the generation at once."""

    def __init__(self, config: uvicorn.Config, sched: Scheduler, url: str) -> None:
        super().__init__(config)
        self.sched = sched
        self.url = url
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.loop = asyncio.get_running_loop()
        if self.started:
            console.notice(f"serving {self.sched.model.name} at {self.url}/v1 (parallel {self.sched.capacity}, "
                           f"batching {self.sched.batching.mode}, queue {self.sched.size})")

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.sched.close)

    def end(self) -> None:
        """From any thread: stop serving (a fatal error)."""
        self.should_exit = True


def serve(model: Model, a: argparse.Namespace, sock: socket.socket) -> int:
    """Serve until a signal (which re-raises here: exit 143/130) or a fatal error (exit 1)."""
    fatal: list[BaseException] = []
    server: Server | None = None

    def on_fatal(e: BaseException) -> None:
        fatal.append(e)
        server.end()

    sched = Scheduler(model, a.queue, on_fatal, reload_fix=RELOAD_FIX, batching=a.batching)
    app = create_app(model, sched, api_key=a.api_key, max_body=a.max_body_kb * 1024, n_predict=a.n_predict)
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10)
    server = Server(config, sched, url)
    sched.start()
    try:
        server.run(sockets=[sock])
    finally:
        sched.close()
        sched.join()
    if fatal:
        e = fatal[0]
        console.error(f"{type(e).__name__}: {e}", PROG)
        return EXIT_ERROR
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    from bmoe.coordinator import Engine
    from bmoe.lanes import LaneError
    from bmoe.model_files import ModelError

    ap = build_parser()
    a = ap.parse_args(argv)
    settings = flags.check(ap, a)
    check_server_flags(ap, a)
    cli.install_signal_handlers()
    model: Model | None = None
    try:
        sock = listen(a.host, a.port)
        try:
            model = Model(Engine(flags.resolve_model(a, settings), notice=console.notice))
            return serve(model, a, sock)
        finally:
            sock.close()
            if model is not None:
                model.close()
    except (ModelError, ConfigError, LaneError, OSError) as e:
        console.error(str(e), PROG)
        return EXIT_ERROR
    except KeyboardInterrupt:
        console.error("interrupted", PROG)
        return EXIT_SIGINT


if __name__ == "__main__":
    sys.exit(main())
