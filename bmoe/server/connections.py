"""What a connection may hold: uvicorn's HTTP protocol (h11) with a deadline for a request's head and a
lingering close, and streamed responses that let go at once of a client cut for reading too slowly.

uvicorn times out an idle keep-alive connection only after a response, and any byte that arrives
restarts its clock: a client that connects and sends nothing, or sends its headers a byte at a time,
holds a connection for ever, and `--max-connections` of them shut every other client out (503). Here
the clock starts when the connection opens (and again after each response) and stops only when a
request's whole head has arrived; past `--idle-timeout` the connection is closed.

A refusal sent while the client is still sending its body (413 on the declared length, 401 before the
body) must not close the socket at once: the kernel answers a close with unread bytes, or bytes that
arrive after it, with a reset, and a reset makes the client's system throw away the answer it has not
read yet, so the client sees "connection reset" instead of the 413. Such a close lingers, as web
servers' do: the answer is sent and the write side shut (the client reads it and its end), what the
client still sends is read and dropped, and the socket closes at the client's end or after LINGER_S.

Once the head is in, bmoe.server.app's RequestGuard refuses a keyed route's request without the key
(ApiKey: 401) before it reads any body, then reads the body against BodyLimits: a request's
body must arrive within `--body-timeout` of its head, plus a second for each `--min-body-rate` KB it has
brought (408 past it: one byte every few seconds holds a connection no longer), and the bodies of every
connection together are bounded by `--max-bodies-mb` (BodiesHeld: 503 past it), so many large bodies at
once cannot exhaust memory.

A client that leaves a response unread past `--write-timeout` is cut by RequestGuard (SlowReader); a
stream's generator (its cleanup cancels the generation, or drops an events watcher) is then closed by
ClosingStream at once, not whenever the suspended generator is collected.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

import h11
from fastapi import Request
from fastapi.routing import APIRoute
from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.types import Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from bmoe.server.http_errors import ServeError

LINGER_S = 2.0  # how long a refused body is read and dropped before the socket closes anyway

class SlowReader(Exception):
    """A client left a piece of its response unread past the write timeout."""


@dataclass(frozen=True)
class BodyLimits:
    """What a request body may take: `size` bytes at most, `timeout` seconds after its head plus a second
    for each `rate` bytes it has brought, and `total` bytes for every connection's bodies together."""

    size: int
    timeout: float
    rate: float
    total: int


class BodiesHeld:
    """The bytes of request bodies the server holds, every connection's together (on the event loop's
    thread), against `bound`: a body that would pass it is refused rather than buffered."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.held = 0

    def take(self, n: int) -> bool:
        """Counts `n` more bytes held; False (nothing counted) when they would pass the bound."""
        if self.held + n > self.bound:
            return False
        self.held += n
        return True

    def give_back(self, n: int) -> None:
        self.held -= n


class ApiKey:
    """`--api-key` as each API's clients send it: `Authorization: Bearer` (OpenAI's, the Responses API's,
    Ollama's) or `x-api-key` (Anthropic's). A keyed route declares `authorized` as its dependency;
    RequestGuard checks the same headers before it reads a body, so a client without the key holds nothing."""

    def __init__(self, key: str | None) -> None:
        self.key = key

    def refusal(self, headers: Headers) -> ServeError | None:
        """The 401 of a request whose headers lack the key; None when they have it, or no key is set."""
        if self.key is None:
            return None
        scheme, bearer = get_authorization_scheme_param(headers.get("authorization"))
        sent = bearer if scheme.lower() == "bearer" and bearer else headers.get("x-api-key")
        if sent is None or not secrets.compare_digest(sent.encode(), self.key.encode()):
            return ServeError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY' "
                              "(or 'x-api-key: KEY')", code="invalid_api_key")
        return None

    async def authorized(self, request: Request) -> None:
        if (wrong := self.refusal(request.headers)) is not None:
            raise wrong

    def guards(self, route: Route) -> bool:
        """Whether `route` needs the key (it depends on `authorized`)."""
        return isinstance(route, APIRoute) and any(d.dependency == self.authorized for d in route.dependencies)


class ClosingStream(StreamingResponse):
    """A streamed response whose generator is closed as soon as sending ends, failed or not."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


class _Lingering:
    """The transport uvicorn's protocol writes to: the real one, whose close lingers (HeadDeadline.linger)
    while the client is in the middle of a body."""

    def __init__(self, real: asyncio.Transport, protocol: HeadDeadline) -> None:
        self.real = real
        self.protocol = protocol

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def close(self) -> None:
        if self.protocol.conn.their_state is h11.SEND_BODY and not self.is_closing() and self.real.can_write_eof():
            self.protocol.linger()
        else:
            self.real.close()

    def is_closing(self) -> bool:
        return self.protocol.lingering is not None or self.real.is_closing()


class HeadDeadline(H11Protocol):
    """h11 with a deadline from connecting (or the last response) to a complete request head, and a close
    that lingers while the client still sends a body."""

    deadline: asyncio.TimerHandle | None = None
    lingering: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.socket = transport
        super().connection_made(_Lingering(transport, self))  # type: ignore[arg-type]
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.lingering is not None:  # the rest of a refused body: dropped
            return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in: the request has its answer's time
            self._disarm()

    def linger(self) -> None:
        """Shut the write side once the answer is out, read and drop what comes, close at the client's end
        (asyncio closes a half-closed socket at EOF) or after LINGER_S."""
        self._disarm()
        self.lingering = self.loop.call_later(LINGER_S, self.socket.close)
        self.socket.write_eof()
        self.socket.resume_reading()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.lingering is not None:
            self.lingering.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(self.timeout_keep_alive, self._expired)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self) -> None:
        self.deadline = None
        if self.conn.their_state is h11.IDLE:
            self.timeout_keep_alive_handler()
