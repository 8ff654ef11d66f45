"""bmoe-server as one of several replicas behind a router (docs/deploy.md): its name on every answer, and
its drain when it is told to stop.

- The name (`--replica-id`; none by default, so a lone server does not tell every client its machine's
  name) is on every answer as the `X-Bmoe-Replica` header, refusals
  and errors too, so a client, a log or a test can tell which replica answered; the Responses API's ids end
  with it (`resp_<hex>_<name>`: bmoe.server.responses_wire), so a router can send a `previous_response_id`
  back to the replica whose KV holds that conversation (deploy/haproxy.cfg reads it with `field(-1,_)`). A
  name is letters, digits, `.`, `:` and `-` (no `_`, which ends the id's random part), 64 at most.
- SIGTERM drains first (`--drain-seconds`, bmoe.server.main): from the signal on, a new request gets 503 with
  `Retry-After` (a router retries it on another replica: nothing has run), `/health` answers 503 with status
  "draining" (a router's health check takes the replica out), and the requests already in flight run to their
  end; once none is left, or the drain's seconds have passed, the ordinary bounded shutdown follows
  (bmoe.edges.exits.Shutdown: what still runs is cancelled, a stream ends with a `shutting_down` error event).
  A second signal during the drain starts that shutdown at once. The health, metrics and events routes are
  neither refused nor waited for: a router and a scraper keep watching a draining replica, and the events feed
  is a stream that never ends on its own.

A request counts as in flight from the moment its body has arrived (bmoe.server.app's RequestGuard reads it
first) until its answer's last byte is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bmoe.edges import console
from bmoe.server.http_errors import ServeError

HEADER = "X-Bmoe-Replica"
NAME = re.compile(r"[A-Za-z0-9.:-]{1,64}")
RETRY_AFTER_S = 1  # what a client without a router waits before it asks again (a router retries at once)
DRAIN_S = 30.0  # --drain-seconds' default: Kubernetes' default grace period before it kills a pod


def replica_name(text: str) -> str:
    """--replica-id: a name that can end a response id and name a router's server."""
    if not NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: give 1 to 64 letters, digits, '.', ':' or '-' (e.g. r1, "
                                         "box2:8000)")
    return text


class Replica:
    """This server's name and drain state."""

    def __init__(self, name: str, drain_s: float = DRAIN_S) -> None:
        self.name, self.drain_s = name, drain_s
        self.exempt: frozenset[str] = frozenset()  # paths neither refused nor waited for (bmoe.server.app sets them)
        self.draining = False
        self.in_flight = 0  # requests (not exempt) being answered
        self._idle: asyncio.Event | None = None  # set whenever in_flight falls to 0 (made on the event loop)
        self._waiting: asyncio.Task[None] | None = None  # the drain's wait (held: the loop keeps only a weak one)

    def drain(self, then: Callable[[], None]) -> None:
        """On the event loop: start draining; `then` (the shutdown) runs once nothing is in flight or the drain's
        seconds have passed."""
        self.draining = True
        console.notice(f"draining (replica {self.name}): new requests get 503 and /health says draining; the "
                       f"{self.in_flight} in flight have {self.drain_s:g} s (--drain-seconds), then the server "
                       "shuts down; a second signal shuts it down now")
        self._waiting = asyncio.get_running_loop().create_task(self._wait(then))

    async def _wait(self, then: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_s
        idle = self._idle_event()
        while self.in_flight and (left := deadline - loop.time()) > 0:
            idle.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(idle.wait(), left)
        console.notice("drained: every request in flight has ended" if not self.in_flight else
                       f"the drain's {self.drain_s:g} s have passed: the {self.in_flight} still in flight end now, "
                       "with an error")
        then()

    def _idle_event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
        return self._idle

    def refusal(self) -> ServeError:
        return ServeError(503, f"this replica ({self.name}) is draining to shut down; send the request again (another "
                          "replica, or this one once it is back, answers it)", "server_error", "draining")

    def started(self) -> None:
        self.in_flight += 1

    def ended(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self._idle_event().set()


class NamedAnswers:
    """ASGI middleware: the replica's name on every answer (HEADER)."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app = app
        self.header = (HEADER.encode(), name.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, named if scope["type"] == "http" else send)


class DrainGuard:
    """ASGI middleware: counts the requests in flight, and while the replica drains refuses new ones (503 with
    Retry-After, the connection closed; answered by `answer`, the route's API's error shape)."""

    def __init__(self, app: ASGIApp, replica: Replica, answer: Callable[[str, ServeError], JSONResponse]) -> None:
        self.app = app
        self.replica = replica
        self.answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        r = self.replica
        if scope["type"] != "http" or scope["path"] in r.exempt:
            await self.app(scope, receive, send)
            return
        if r.draining:
            answer = self.answer(scope["path"], r.refusal())
            answer.headers["Retry-After"] = str(RETRY_AFTER_S)
            answer.headers["Connection"] = "close"
            await answer(scope, receive, send)
            return
        r.started()
        try:
            await self.app(scope, receive, send)
        finally:
            r.ended()
