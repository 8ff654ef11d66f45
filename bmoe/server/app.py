"""bmoe-server's HTTP app: the routes of its five APIs (OpenAI's completions and chat, OpenAI's
Responses, Anthropic's Messages, Ollama's, llama-server's native ones: bmoe.server.llama_routes; the
embeddings routes of OpenAI and llama-server: bmoe.server.embeddings), the
metrics route (bmoe.server.metrics) and the request guard that counts answers by route and bounds
request bodies (FastAPI on uvicorn's event loop). Requests are checked and
tokenized here, then handed to the scheduler (bmoe.server.scheduler) as jobs whose events become
responses; the decisions are in bmoe.server's notes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psutil
from fastapi import Depends, FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Gauge
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bmoe.api import Ask, GenerationStats, Model, Request
from bmoe.base import ConfigError, ContextTooLong, FieldError
from bmoe.server import anthropic_wire, ollama_wire, responses_wire
from bmoe.server.answer_loop import LISTED, AnswerLoop, Choices, choice_requests
from bmoe.server.answer_shape import AnswerShape
from bmoe.server.anthropic_wire import AnthropicShape, CountBody, MessagesBody
from bmoe.server.completion_prompts import check_choices, prompts_of, tokens_of
from bmoe.server.connections import ApiKey, BodiesHeld, BodyLimits, SlowReader
from bmoe.server.embeddings import EmbeddingEndpoints, add_embedding_routes
from bmoe.server.events import EVENTS, Feed
from bmoe.server.grammar_pool import GrammarPool
from bmoe.server.hosts import HostCheck, Trusted, add_cors
from bmoe.server.http_errors import (
    ServeError,
    context_too_long,
    http_error,
    internal,
    renamed,
    validation_error,
)
from bmoe.server.llama_routes import LlamaEndpoints, add_llama_routes, is_native_path, llama_error
from bmoe.server.llama_slots import not_served
from bmoe.server.llama_wire import LlamaCompletionBody, LlamaShape, generation_settings
from bmoe.server.metrics import Metrics
from bmoe.server.ollama_wire import ModelFacts, NamedBody, OllamaChatBody, OllamaGenerateBody, OllamaShape, ShowBody
from bmoe.server.openai_wire import ChatBody, CompletionBody, OpenAIJoin, OpenAIShape, RequestBody
from bmoe.server.replica import DrainGuard, NamedAnswers, Replica
from bmoe.server.request_base import sampling_of, unasked
from bmoe.server.response_store import KeptResponses, ResponseStore
from bmoe.server.responses_wire import ResponsesBody, ResponsesShape
from bmoe.server.scheduler import Scheduler
from bmoe.server.sleep import Sleep
from bmoe.server.vertex import Vertex, add_vertex
from bmoe.server.webui import add_pages

TOO_LONG_FIX = "shorten the prompt, lower max_tokens, or restart bmoe-server with a larger -c"
UNROUTED = "other"  # the metrics label of a request no route matches


class RequestGuard:
    """ASGI middleware at the app's edge: counts every answer by route and status; refuses, before it reads
    any of the body, a request that declares a body over the limit (413) or that a keyed route gets without
    the key (401); reads the body within its time and against every connection's bodies together
    (`limits`: 408 and 503 past them, 413 past its size), so a slow or large body holds neither a connection
    nor memory for long; and drops a client that leaves a piece of its response unread for `write_timeout`
    seconds (its socket's buffer full): the response ends there, and a generation still running for it is
    cancelled like any client's who left. A refusal closes the connection (the rest of the body is dropped
    unread: bmoe.server.connections' lingering close). `routes` are the app's (its router's list, so routes
    added later count): a request is counted under the path of the route it matches."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: list[BaseRoute], key: ApiKey, limits: BodyLimits,
                 bodies: BodiesHeld, write_timeout: float) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes
        self.key = key
        self.limits = limits
        self.bodies = bodies
        self.write_timeout = write_timeout

    def match(self, scope: Scope) -> tuple[str, Route | None]:
        """The metrics label of a request, the path its route was declared with (one label for every
        /v1/responses/{response_id}), as the router picks the route (a method the path does not serve
        counts under the path; UNROUTED where no route has its path); and the route it fully matches."""
        partial = UNROUTED
        for r in (r for r in self.routes if isinstance(r, Route)):
            match = r.matches(scope)[0]
            if match == Match.FULL:
                return r.path, r
            if match == Match.PARTIAL and partial == UNROUTED:
                partial = r.path
        return partial, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        label, route = self.match(scope)

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(label, str(message["status"])).inc()
            try:
                await asyncio.wait_for(send(message), self.write_timeout)
            except asyncio.TimeoutError:
                self.metrics.slow_readers.inc()
                raise SlowReader() from None

        async def refuse(e: ServeError) -> None:
            answer = _error_response(scope["path"], e)
            answer.headers["connection"] = "close"
            await answer(scope, receive, counted)

        limits = self.limits
        too_large = ServeError(413, f"the request body is over {limits.size} bytes (bmoe-server --max-body-kb)",
                               code="request_too_large")
        headers = Headers(scope=scope)
        declared = headers.get("content-length", "")
        loop = asyncio.get_running_loop()
        start, body, held, more = loop.time(), bytearray(), 0, True
        try:
            if declared.isdigit() and int(declared) > limits.size:
                await refuse(too_large)
                return
            if route is not None and self.key.guards(route) and (wrong := self.key.refusal(headers)) is not None:
                await refuse(wrong)
                return
            while more:
                left = start + limits.timeout + held / limits.rate - loop.time()
                try:
                    message = await asyncio.wait_for(receive(), max(left, 0.0))
                except asyncio.TimeoutError:
                    await refuse(ServeError(
                        408, f"the request body came too slowly: {held} bytes in {loop.time() - start:.0f} s "
                        f"(bmoe-server --body-timeout, --min-body-rate)", code="request_timeout"))
                    return
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                more = message.get("more_body", False)
                if held + len(chunk) > limits.size:
                    await refuse(too_large)
                    return
                if not self.bodies.take(len(chunk)):
                    await refuse(ServeError(
                        503, f"the server holds {self.bodies.bound >> 20} MiB of request bodies, its bound "
                        "(bmoe-server --max-bodies-mb); send it again later", "server_error", "bodies_full"))
                    return
                held += len(chunk)
                body += chunk
            pending = [{"type": "http.request", "body": bytes(body), "more_body": False}]
            body.clear()

            async def replay() -> Message:
                return pending.pop() if pending else await receive()

            await self.app(scope, replay, counted)
        except SlowReader:  # the connection closes with the response unfinished: the client sees it cut
            pass
        finally:
            self.bodies.give_back(held)


# ---- the app ---------------------------------------------------------------------------------------


def _error_response(path: str, e: ServeError) -> JSONResponse:
    """The error as the object the route's clients read: Anthropic's under /v1/messages, Ollama's under
    /api/, else OpenAI's (with llama-server's types on its native routes)."""
    if anthropic_wire.is_messages_path(path):
        return anthropic_wire.anthropic_error(e)
    if is_native_path(path):
        return llama_error(e)
    return ollama_wire.ollama_error(e) if ollama_wire.is_ollama_path(path) else e.response()


async def _on_serve_error(r: HttpRequest, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServeError)
    return _error_response(r.url.path, exc)


async def _on_invalid(r: HttpRequest, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return _error_response(r.url.path, validation_error(exc))


async def _on_http(r: HttpRequest, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return _error_response(r.url.path, http_error(exc))


async def _on_bug(r: HttpRequest, exc: Exception) -> JSONResponse:
    return _error_response(r.url.path, internal("internal error", f"{type(exc).__name__}: {exc}"))


# every error a route can meet, as the error object a client receives (bmoe.server.http_errors; Anthropic's
# and Ollama's shapes on their routes)
HANDLERS = ((ServeError, _on_serve_error), (RequestValidationError, _on_invalid), (HTTPException, _on_http),
            (Exception, _on_bug))


class Endpoints:
    """One server's routes, each a handler over the model, the scheduler and the metrics."""

    def __init__(self, model: Model, sched: Scheduler, metrics: Metrics, grammars: GrammarPool, n_predict: int,
                 alias: str | None = None, kept: KeptResponses | None = None, tags: tuple[str, ...] = (),
                 replica: Replica | None = None) -> None:
        self.model, self.sched, self.metrics, self.grammars = model, sched, metrics, grammars
        self.loop = AnswerLoop(sched)
        self.n_predict = n_predict
        # --alias's names (a comma list), sorted as llama-server's: the first is the id /v1/models lists and
        # responses name; every one, and the GGUF's name, finds the model
        self.aliases = sorted({a.strip() for a in (alias or "").split(",") if a.strip()})
        self.model_id = self.aliases[0] if self.aliases else model.name
        self.tags = sorted(set(tags))  # --tags: told in /v1/models, as llama-server's (they route nothing)
        # /v1/responses' stored responses (previous_response_id, GET and DELETE)
        self.kept: KeptResponses = kept if kept is not None else ResponseStore()
        self.replica = replica or Replica("")  # its name ends the Responses ids; its drain turns /health to 503
        self.facts: ModelFacts | None = None  # the model as Ollama's clients see it (read on first use)

    @asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        yield
        self.sched.close()
        await asyncio.to_thread(self.sched.join)
        await asyncio.to_thread(self.grammars.close)

    async def health(self) -> JSONResponse:
        """200 while the server takes requests; 503 "draining" once a SIGTERM has it drain (bmoe.server.replica)."""
        sched, draining = self.sched, self.replica.draining
        named = {"replica": self.replica.name} if self.replica.name else {}
        return JSONResponse({"status": "draining" if draining else "ok", "model": self.model_id, **named,
                             "generating": len(sched.active), "parallel": sched.capacity,
                             "waiting": len(sched.waiting)},
                            status_code=503 if draining else 200)

    async def prometheus(self) -> Response:
        # off the loop: a shared response store's gauges are queries, which can wait on another replica's write
        answer = Response(await asyncio.to_thread(self.metrics.text), media_type=CONTENT_TYPE_LATEST)
        # llama-server's header, spelt as it spells it (h11 keeps a name's case): clients look it up so
        answer.raw_headers.append((b"Process-Start-Time-Unix", str(self.metrics.started).encode()))
        return answer

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_object()]}

    async def model_by_id(self, model_id: str) -> dict[str, Any]:
        """The served model by its id, another of its --alias names, or its GGUF's name."""
        if model_id not in (*self.aliases, self.model.name):
            raise ServeError(404, f"the model {model_id!r} does not exist; this server serves {self.model_id!r}",
                             code="model_not_found", param="model")
        return self.model_object()

    def model_object(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": int(time.time() - self.model.stats.load_s),
                "owned_by": "bmoe", "aliases": self.aliases, "tags": self.tags}

    async def completions(self, body: CompletionBody, request: HttpRequest) -> Response:
        """OpenAI's completions: each prompt (bmoe.server.completion_prompts) answered as `n` choices."""
        prompts = prompts_of(body.prompt)
        check_choices(len(prompts), body.n)
        reqs: list[Request] = []
        for p in prompts:
            prompt = await asyncio.to_thread(tokens_of, p, self.model.vocab_tokens)
            reqs += choice_requests(await self.completion_request(body, prompt=prompt), body.n)
        return await self.loop.answer(request, self.openai_choices(False, body, reqs), body.stream)

    async def completion_request(self, body: CompletionBody, fix: str = TOO_LONG_FIX,
                                 prompt: str | list[int] | None = None) -> Request:
        """A plain prompt (`prompt`, else the body's one text) as the engine's request: the completions route's,
        and a raw Ollama generate's (`fix`: what to do about a prompt too long, in the words of the route's API)."""
        if prompt is None:
            assert isinstance(body.prompt, str), "Ollama's generate: one text"
            prompt = body.prompt
        return await self.prepare(body, body.max_tokens, fix, prompt=prompt, response_format=body.response_format,
                                  grammar=body.grammar, logprobs=body.logprobs, ignore_eos=body.ignore_eos)

    async def chat(self, body: ChatBody, request: HttpRequest) -> Response:
        check_choices(1, body.n)
        reqs = choice_requests(await self.chat_request(body), body.n)
        return await self.loop.answer(request, self.openai_choices(True, body, reqs), body.stream)

    def openai_choices(self, chat: bool, body: RequestBody, reqs: list[Request]) -> Choices:
        """Each choice's request in OpenAI's shapes (with llama-server's `verbose`, each its native object too),
        one answer (OpenAIJoin) when there are several."""
        usage = body.stream_options is not None and body.stream_options.include_usage
        shapes: list[OpenAIShape] = []
        for i, r in enumerate(reqs):
            native = None
            if body.verbose:  # the prompt as text, and what it ran with, as llama-server's answer tells them
                settings = generation_settings(self.model.stats.n_ctx, r.max_tokens, r.sampler, r.stop)
                native = LlamaShape(self.model_id, self.model.detokenize(r.tokens), settings, index=i,
                                    prompt_tokens=len(r.tokens))
            shapes.append(OpenAIShape(chat, self.model_id, r, usage, body.timings_per_token, i,
                                      shapes[0] if shapes else None, len(reqs) == 1, native))
        return Choices(reqs, shapes, OpenAIJoin(body.n) if len(reqs) > 1 else LISTED)

    async def one(self, request: HttpRequest, req: Request, shape: AnswerShape, stream: bool) -> Response:
        """One request answered in one shape."""
        return await self.loop.answer(request, Choices([req], [shape]), stream)

    async def chat_request(self, body: ChatBody, fix: str = TOO_LONG_FIX) -> Request:
        """A chat as the engine's request: OpenAI's chat route's, and the other APIs' translated to it
        (`fix`: what to do about a conversation too long, in the words of the route's API)."""
        return await self.prepare(body, body.max_tokens or body.max_completion_tokens, fix,
                                  messages=[m.as_dict() for m in body.messages], think=body.thinks, tools=body.tools,
                                  tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls,
                                  response_format=body.response_format, grammar=body.grammar,
                                  logprobs=body.n_logprobs, ignore_eos=body.ignore_eos, **body.template_options())

    async def messages(self, body: MessagesBody, request: HttpRequest) -> Response:
        """Anthropic's Messages API: the same chat request, answered in Anthropic's shapes."""
        req = await self.chat_request(anthropic_wire.chat_body_of_messages(body))
        return await self.one(request, req, AnthropicShape(self.model_id, len(req.tokens)), body.stream)

    async def responses(self, body: ResponsesBody, request: HttpRequest) -> Response:
        """OpenAI's Responses API: the chat request, after the conversation of the response it goes on
        from (previous_response_id), answered as a Response or its events."""
        req, earlier = await self.responses_request(body)
        shape = ResponsesShape(self.model_id, body, [*earlier, *responses_wire.input_items(body)], self.kept,
                               len(req.tokens), self.replica.name)
        return await self.one(request, req, shape, body.stream)

    async def responses_request(self, body: ResponsesBody) -> tuple[Request, tuple[dict[str, Any], ...]]:
        """A Responses request as the chat request, and the earlier items it goes on from."""
        earlier = (await asyncio.to_thread(self.kept.items, body.previous_response_id)
                   if body.previous_response_id is not None else ())
        try:
            return await self.chat_request(responses_wire.chat_body_of_response(body, earlier),
                                           responses_wire.RESPONSES_TOO_LONG_FIX), tuple(earlier)
        except (ServeError, FieldError) as e:
            raise renamed(e, responses_wire.RESPONSES_FIELD_NAMES) from None

    async def input_tokens(self, body: ChatBody) -> dict[str, int]:
        """llama-server's count of a chat request's prompt tokens: what its usage.prompt_tokens would be."""
        return {"input_tokens": len((await self.chat_request(body)).tokens)}

    async def responses_input_tokens(self, body: ResponsesBody) -> dict[str, Any]:
        """OpenAI's and llama-server's count of a Responses request's input tokens."""
        return {"object": "response.input_tokens", "input_tokens": len((await self.responses_request(body))[0].tokens)}

    async def response_by_id(self, response_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.kept.get, response_id)

    async def drop_response(self, response_id: str) -> dict[str, Any]:
        await asyncio.to_thread(self.kept.drop, response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def ollama_chat(self, body: OllamaChatBody, request: HttpRequest) -> Response:
        """Ollama's chat: the chat request, answered in Ollama's shapes (JSON lines when streamed)."""
        try:
            t = ollama_wire.chat_translated(body) if body.messages else None
            shape = OllamaShape(self.model_id, True, t.warnings if t is not None else ())
            if t is None:  # Ollama's way to load a model
                return JSONResponse(shape.loaded())
            assert isinstance(t.body, ChatBody)
            req = await self.chat_request(t.body, ollama_wire.OLLAMA_TOO_LONG_FIX)
        except (ServeError, FieldError) as e:
            raise renamed(e, ollama_wire.OLLAMA_FIELD_NAMES) from None
        return await self.one(request, req, shape, body.stream)

    async def ollama_generate(self, body: OllamaGenerateBody, request: HttpRequest) -> Response:
        """Ollama's generate: a chat of one user message (or, raw, the prompt as it is)."""
        try:
            t = ollama_wire.generate_translated(body)
            shape = OllamaShape(self.model_id, False, t.warnings)
            if not body.prompt and not body.system:  # Ollama's way to load a model
                return JSONResponse(shape.loaded())
            fix = ollama_wire.OLLAMA_TOO_LONG_FIX
            req = await (self.chat_request(t.body, fix) if isinstance(t.body, ChatBody) else
                         self.completion_request(t.body, fix))
        except (ServeError, FieldError) as e:
            raise renamed(e, ollama_wire.OLLAMA_FIELD_NAMES) from None
        return await self.one(request, req, shape, body.stream)

    async def model_facts(self) -> ModelFacts:
        if self.facts is None:
            self.facts = await asyncio.to_thread(ModelFacts.of, self.model, self.model_id)
        return self.facts

    async def ollama_tags(self) -> dict[str, Any]:
        return (await self.model_facts()).tags()

    async def ollama_ps(self) -> dict[str, Any]:
        return (await self.model_facts()).ps(psutil.Process().memory_info().rss)

    async def ollama_show(self, body: ShowBody) -> dict[str, Any]:
        facts = await self.model_facts()
        if not facts.serves(body.model):
            raise ServeError(404, f"model {body.model!r} not found; this server serves {self.model_id!r}",
                             code="model_not_found", param="model")
        return facts.show()

    async def ollama_version(self) -> dict[str, str]:
        return ollama_wire.version()

    async def ollama_pull(self, body: NamedBody) -> dict[str, str]:
        name = body.model or body.name or ""
        if (await self.model_facts()).serves(name):
            return {"status": "success"}  # it is here already
        raise ollama_wire.one_model("pulls none", self.model_id)

    async def ollama_refused(self, request: HttpRequest) -> None:
        """What would change the models the server has, or is not generation: a 400 saying so."""
        verb = request.url.path.removeprefix(ollama_wire.OLLAMA_PREFIX).split("/")[0]
        if verb in ("embed", "embeddings"):
            raise ServeError(400, "Ollama's embeddings API is not served here; use /v1/embeddings (bmoe-server "
                             "--embedding)", code="one_model")
        what = {"delete": "deletes none", "create": "creates none", "copy": "copies none", "push": "pushes none",
                "blobs": "takes no model files"}[verb]
        raise ollama_wire.one_model(what, self.model_id)

    async def count_tokens(self, body: CountBody) -> dict[str, int]:
        """The prompt tokens a Messages request with this conversation would decode."""
        req = await self.chat_request(anthropic_wire.chat_body_of_messages(body))
        return {"input_tokens": len(req.tokens)}

    async def prepare(self, body: RequestBody | LlamaCompletionBody, max_tokens: int | None, fix: str,
                      **what: Any) -> Request:
        """The request as tokens, checked against the context (off the event loop: tokenizing takes a while; without
        `max_tokens`, the server's -n cut to the room the prompt leaves, as OpenAI and llama-server do, and so is
        llama-server's n_predict: `to_context_end`), its new grammar parsed by llama.cpp on the grammar checks' own
        threads (bmoe.server.grammar_pool); a stream with llama-server's return_progress reports its prefill."""
        model = self.model
        slot = None if body.id_slot in (None, -1) else body.id_slot
        if slot is not None and slot >= len(model.slots):
            raise ServeError(400, f"id_slot: {slot}: this server's slots (KV sequences, --parallel) are 0 to "
                             f"{len(model.slots) - 1} (-1: any)", param="id_slot")
        if body.bmoe.lossless:
            try:
                model.check_lossless("restart bmoe-server without one of them for lossless requests")
            except ConfigError as e:
                raise ServeError(400, str(e), param="bmoe.lossless") from None
        try:
            clip = max_tokens is None or body.to_context_end
            ask = Ask(**what, **sampling_of(body), max_tokens=max_tokens or self.n_predict, clip=clip, stop=body.stop,
                      fix=unasked(fix) if clip else fix, lossless=body.bmoe.lossless, slot=slot,
                      progress=body.return_progress and body.stream)
            req = await asyncio.to_thread(model.prepare, ask, False)
            if req.grammar is not None:
                await self.grammars.check(req.grammar)
            return req
        except FieldError as e:  # a stop, schema, tools or grammar that cannot be held to: the field is named
            raise ServeError(400, str(e), param=e.param) from None
        except ConfigError as e:
            param = "messages" if "messages" in what else "prompt"
            raise (context_too_long(e, param) if isinstance(e, ContextTooLong) else
                   ServeError(400, str(e), param=param)) from None


def create_app(model: Model, sched: Scheduler, *, api_key: str | None, limits: BodyLimits, grammars: GrammarPool,
               n_predict: int, alias: str | None = None, webui: bool = True, write_timeout: float = 30.0,
               trusted: Trusted | None = None, kept: KeptResponses | None = None, slots: bool = True,
               metrics_route: bool = True, tags: tuple[str, ...] = (), vertex: Vertex | None = None,
               sleep_idle: float | None = None, replica: Replica | None = None) -> FastAPI:
    """The FastAPI app serving `model` (named `alias` if given, tagged `tags`) through `sched`: the routes (Endpoints),
    every route but /health and the chat page's files behind the API key (ApiKey), errors as each API's
    error objects (HANDLERS), the body's limits, the key checked before the body and metrics by route
    (RequestGuard), the events feed (bmoe.server.events) and the page (bmoe.server.webui). Without a key,
    every request's Host and Origin are checked before any route runs (HostCheck: `trusted`, by default
    loopback's; bmoe.server.hosts). New grammars are parsed on `grammars`' own threads; `kept` stores responses.
    `slots` and `metrics_route` false: /slots and /metrics answer 501 (--no-slots, --no-metrics); `vertex`: Vertex
    AI's prediction route (bmoe.server.vertex); `sleep_idle`: seconds idle before the model sleeps (bmoe.server.sleep:
    the routes that need the model wake it; None: it never sleeps); `replica`: its name on every answer and its drain
    (bmoe.server.replica: DrainGuard refuses new requests while it drains, counted under their route)."""
    trusted = trusted or Trusted()
    metrics = Metrics(model, sched)
    feed = Feed(model, sched)
    bodies = BodiesHeld(limits.total)
    Gauge("bmoe_event_watchers", f"clients following {EVENTS}", registry=metrics.registry).set_function(
        lambda: len(feed.watchers))
    Gauge("bmoe_request_body_bytes", "request body bytes held, every connection's together (bound: "
          "--max-bodies-mb)", registry=metrics.registry).set_function(lambda: bodies.held)
    Gauge("bmoe_grammar_checks", "new grammars being checked or waiting for a check (bound: --grammar-checks plus "
          "--grammar-queue)", registry=metrics.registry).set_function(lambda: grammars.held)

    def generated(s: GenerationStats) -> None:
        metrics.generation(s)
        feed.generation(s)

    sched.on_generation = generated
    sched.on_close = feed.close
    routes = Endpoints(model, sched, metrics, grammars, n_predict, alias, kept, tags, replica)
    replica = routes.replica
    # what a router and a scraper keep reading while the replica drains, and the feed that never ends on its own
    replica.exempt = frozenset({"/health", "/metrics", EVENTS, *([vertex.health] if vertex and vertex.health else [])})
    Gauge("bmoe_stored_responses", "responses kept for previous_response_id (bound: --store-responses)",
          registry=metrics.registry).set_function(lambda: len(routes.kept))
    Gauge("bmoe_stored_response_bytes", "bytes the kept responses take (bound: --store-responses-mb)",
          registry=metrics.registry).set_function(lambda: routes.kept.held)
    Gauge("bmoe_draining", "1 while the replica drains to shut down (SIGTERM, --drain-seconds)",
          registry=metrics.registry).set_function(lambda: int(replica.draining))
    Gauge("bmoe_requests_in_flight", "requests being answered (not /health, /metrics nor the events feed)",
          registry=metrics.registry).set_function(lambda: replica.in_flight)
    keyed = ApiKey(api_key)
    app = FastAPI(title="bmoe", docs_url=None, redoc_url=None, openapi_url=None, lifespan=routes.lifespan)
    # added before RequestGuard, so they run inside it: a refusal is counted under its route
    app.add_middleware(DrainGuard, replica=replica, answer=_error_response)
    if api_key is None:
        app.add_middleware(HostCheck, trusted=trusted, answer=_error_response)
    app.add_middleware(RequestGuard, metrics=metrics, routes=app.router.routes, key=keyed, limits=limits,
                       bodies=bodies, write_timeout=write_timeout)
    add_cors(app, trusted)  # every answer, refusals too, has the CORS headers
    if replica.name:  # outermost: and the replica's name
        app.add_middleware(NamedAnswers, name=replica.name)
    for exc, handler in HANDLERS:
        app.add_exception_handler(exc, handler)
    app.get("/health")(routes.health)
    add_pages(app, webui)
    key = [Depends(keyed.authorized)]  # the routes of the APIs, the metrics and the events
    native = LlamaEndpoints(model, routes.model_id, n_predict, sched.capacity, routes.prepare, routes.loop.answer,
                            slots, metrics_route)
    sleep = Sleep(model, sleep_idle, native.facts, lambda: sched.closed)
    sched.on_idle = sleep.idle
    awake = [*key, Depends(sleep.awake)]  # the routes that need the model loaded
    app.get("/metrics", dependencies=key)(routes.prometheus if metrics_route else not_served("/metrics",
                                                                                             "--no-metrics"))
    for v1 in ("/v1", ""):  # "": the paths llama-server also serves them at (a base URL without /v1)
        app.get(v1 + "/models", dependencies=key)(routes.models)
        app.get(v1 + "/models/{model_id:path}", dependencies=key)(routes.model_by_id)
        app.post(v1 + "/chat/completions", dependencies=awake)(routes.chat)
        app.post(v1 + "/chat/completions/input_tokens", dependencies=awake)(routes.input_tokens)
        app.post(v1 + responses_wire.RESOURCE + "/input_tokens", dependencies=awake)(routes.responses_input_tokens)
        app.post(v1 + responses_wire.RESOURCE, dependencies=awake)(routes.responses)
        app.get(v1 + responses_wire.RESOURCE + "/{response_id}", dependencies=key)(routes.response_by_id)
        app.delete(v1 + responses_wire.RESOURCE + "/{response_id}", dependencies=key)(routes.drop_response)
    app.post("/v1/completions", dependencies=awake)(routes.completions)  # /completions is llama-server's own
    app.post("/v1/messages", dependencies=awake)(routes.messages)
    app.post("/v1/messages/count_tokens", dependencies=awake)(routes.count_tokens)
    app.post("/api/chat", dependencies=awake)(routes.ollama_chat)
    app.post("/api/generate", dependencies=awake)(routes.ollama_generate)
    app.get("/api/tags", dependencies=awake)(routes.ollama_tags)
    app.get("/api/ps", dependencies=awake)(routes.ollama_ps)
    app.post("/api/show", dependencies=awake)(routes.ollama_show)
    app.get("/api/version", dependencies=key)(routes.ollama_version)
    app.post("/api/pull", dependencies=awake)(routes.ollama_pull)
    app.delete("/api/delete", dependencies=key)(routes.ollama_refused)
    for refused in ("/api/create", "/api/copy", "/api/push", "/api/embed", "/api/embeddings"):
        app.post(refused, dependencies=key)(routes.ollama_refused)
    app.api_route("/api/blobs/{digest}", methods=["HEAD", "POST"], dependencies=key)(routes.ollama_refused)
    add_embedding_routes(app, EmbeddingEndpoints(model, routes.model_id, sched), awake)
    add_llama_routes(app, native, key, awake)
    app.get(EVENTS, dependencies=key)(feed.route)
    if vertex is not None:
        add_vertex(app, vertex, key, routes.health)
    return app
