"""Google Cloud Vertex AI's prediction protocol on bmoe-server, as llama-server serves it: a container
Vertex AI runs is told by its environment (`AIP_MODE=PREDICTION`) to listen on `AIP_HTTP_PORT` and to
answer `POST AIP_PREDICT_ROUTE` (default `/predict`) with `{"instances": [...]}`: each instance is the body
of one of the server's POST routes, named by `@requestFormat` (the route's path, or its camelCase name:
`chatCompletions` for `/v1/chat/completions`, `completion` for `/completion`), and the answer is
`{"predictions": [...]}`, each the JSON that route answered, in order. `AIP_HEALTH_ROUTE`, when set, is
`/health` under a second path.

Each instance is a request of its own through the whole app (bmoe.server.app: key, Host/Origin, body
limits, metrics, queue), carrying the predict request's headers; they run at once, as many as the queue
takes (a busy server answers an instance 429 as any request). A failed instance is an `{"error": ...}`
among the predictions, as llama-server's. An instance may not stream (`stream: true` is an error naming
it: the predictions are whole answers); at most MAX_INSTANCES, else a 400 naming `instances`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from pydantic import BaseModel, ConfigDict, Field
from starlette.routing import Route
from starlette.types import Message

from bmoe.base import ConfigError
from bmoe.server.http_errors import ServeError

MAX_INSTANCES = 128  # llama-server's bound


@dataclass(frozen=True)
class Vertex:
    """What Vertex AI's environment asks: the port, the predict route, a second health route (or None)."""

    port: int
    predict: str
    health: str | None

    @staticmethod
    def of(env: Mapping[str, str]) -> Vertex | None:
        """From Vertex AI's variables; None unless AIP_MODE is PREDICTION."""
        if env.get("AIP_MODE") != "PREDICTION":
            return None
        port = env.get("AIP_HTTP_PORT") or "8080"
        if not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"AIP_HTTP_PORT={port!r} is not a port number (0, any free one, to 65535)")
        return Vertex(int(port), _route(env.get("AIP_PREDICT_ROUTE") or "/predict"),
                      _route(env["AIP_HEALTH_ROUTE"]) if env.get("AIP_HEALTH_ROUTE") else None)


def _route(path: str) -> str:
    return path if path.startswith("/") else "/" + path


def request_format(path: str) -> str:
    """A route's camelCase name, as llama-server derives it: /v1 dropped, each '/', '-', '_' starts a capital
    ("/v1/chat/completions" -> "chatCompletions", "/apply-template" -> "applyTemplate")."""
    words = re.split(r"[/_-]", path.removeprefix("/v1").split("{")[0].strip("/"))
    return words[0] + "".join(w[:1].upper() + w[1:] for w in words[1:])


class PredictBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # Vertex's `parameters`: llama-server reads none either

    instances: list[Any] = Field(max_length=MAX_INSTANCES)


def _error(message: str, param: str | None = None) -> dict[str, Any]:
    return ServeError(400, message, param=param).body()


class Predict:
    """The predict route over `app`'s POST routes (read when first asked: every route is declared by then)."""

    def __init__(self, app: FastAPI, route: str) -> None:
        self.app, self.route = app, route
        self.formats: dict[str, str] | None = None

    def paths(self) -> dict[str, str]:
        """@requestFormat -> path: each POST route's camelCase name (the first route of a name wins) and path."""
        if self.formats is None:
            posts = [r.path for r in self.app.router.routes if isinstance(r, Route) and "POST" in (r.methods or ())
                     and r.path != self.route and "{" not in r.path]
            named: dict[str, str] = {}
            for path in posts:
                named.setdefault(request_format(path), path)
            self.formats = {**named, **{p: p for p in posts}}
        return self.formats

    async def answer(self, body: PredictBody, request: HttpRequest) -> dict[str, Any]:
        predictions = await asyncio.gather(*(self.one(request, i) for i in body.instances))
        return {"predictions": list(predictions)}

    async def one(self, request: HttpRequest, instance: Any) -> Any:
        """One instance, answered by its route as a request of its own; its JSON, or an error object."""
        if not isinstance(instance, dict):
            return _error("each instance must be a JSON object", "instances")
        fmt = instance.get("@requestFormat")
        path = self.paths().get(fmt) if isinstance(fmt, str) else None
        if path is None:
            return _error(f"@requestFormat {fmt!r} names no route: give a POST route's path or camelCase name "
                          f"(chatCompletions, completions, completion, messages, ...)", "@requestFormat")
        payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
        if payload.get("stream"):
            return _error("stream: a prediction is the whole answer; leave stream out", "stream")
        data = json.dumps(payload).encode()
        headers = [(k, v) for k, v in request.scope["headers"] if k not in (b"content-length", b"content-type")]
        scope = {k: request.scope[k] for k in ("type", "asgi", "http_version", "scheme", "server", "client",
                                               "root_path", "state") if k in request.scope}
        scope.update(method="POST", path=path, raw_path=path.encode(), query_string=b"", headers=[
            *headers, (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())])
        pending = [{"type": "http.request", "body": data, "more_body": False}]
        parts: list[bytes] = []

        async def receive() -> Message:  # the body, then the predict request's client leaving
            return pending.pop() if pending else await request.receive()

        async def send(message: Message) -> None:
            if message["type"] == "http.response.body":
                parts.append(message.get("body", b""))

        await self.app(scope, receive, send)
        try:
            return json.loads(b"".join(parts))
        except ValueError:
            return b"".join(parts).decode(errors="replace")


def add_vertex(app: FastAPI, vertex: Vertex, key: list[Any], health: Any) -> None:
    """The predict route (behind `key`) and the second health route, when Vertex AI's environment asks."""
    taken = {r.path for r in app.router.routes if isinstance(r, Route)}
    for path in (vertex.predict, vertex.health):
        if path is not None and path in taken:
            raise ConfigError(f"AIP_PREDICT_ROUTE or AIP_HEALTH_ROUTE {path} is one of bmoe-server's routes; "
                              "choose another path")
    app.post(vertex.predict, dependencies=key)(Predict(app, vertex.predict).answer)
    if vertex.health is not None:
        app.get(vertex.health)(health)
