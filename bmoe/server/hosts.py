"""Which `Host` and `Origin` a server without an API key answers: the defence against DNS rebinding.

A server on 127.0.0.1 without a key trusts whoever can connect. A web page can make the user's
browser connect: it rebinds its own name to 127.0.0.1, and its scripts' requests are then
same-origin for the browser and reach this server carrying `Host: evil.example:8000`. A page of another
origin can also send requests to 127.0.0.1 outright (a form's POST or a `no-cors` fetch: it cannot read the
answer but it can start a generation); the browser sends `Origin: http://evil.example` with them.
A browser never lets a page set either header, so the two checks (HostCheck) stop both:

- Host: an IP address (a name can be rebound to an address, an address cannot be rebound: a
  browser that sends `Host: 127.0.0.1:8000` connected to 127.0.0.1), `localhost` and names under
  `.localhost` (browsers resolve them to loopback themselves), the `--host` given, and the names
  given with `--allowed-host` (`*`: any); the port is not looked at. An empty name is refused, a
  missing header (HTTP/1.0, never a browser) is not.
- Origin: none (clients that are not browsers, and a page's own GETs), the request's own origin (the chat
  page at `/`, whose fetches send `Origin: http://<its Host>`), and those given with
  `--allowed-origin` (`*`: any; the bare word `localhost`, as llama-server's `--cors-origins localhost`
  has it: every page this machine serves itself, any scheme and port on `localhost`, a `.localhost`
  name or a loopback address, and no other host). `null` (a sandboxed frame, a file:// page) is
  foreign unless given.

With an API key the checks are off (create_app does not install HostCheck): the key is the check.
A rebinding page does not have it (the browser adds no `Authorization` of its own, and the key the chat page
keeps is in the real origin's storage, not the rebound name's), and a keyed server is meant to be reached by
names the server cannot list (a LAN name, a container's, a reverse proxy's); Ollama, the reference here, checks
the Host only on a loopback listener, and llama-server's defence is its key too. What stays open
to any Host with a key is what is open without one: /health and the page's static files.

Refused requests get 403 in the error shape of the route's API, naming the flag that would admit them.

CORS agrees with that list, with or without a key: the origins of `--allowed-origin` (`*`: any) are the
web pages that may use the server from a browser, and exactly they get CORS headers (add_cors): their
preflight (OPTIONS) is answered, their answers (errors included) may be read, `X-Queue-Position` too.
Any other origin's preflight gets a 200 with no CORS header (as llama-server answers it), so its browser
refuses the page's request, and without a key its requests get 403 as above; with
a key a listed page must still send it (`Authorization: Bearer KEY` is a header the preflight allows,
not a cookie: no credentials mode). With no `--allowed-origin` no CORS header is sent at all, and
an OPTIONS is a 405 as on any route that does not serve it.
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bmoe.server.http_errors import ServeError

ANY = "*"
LOOPBACK = "localhost"  # --allowed-origin's bare word: the pages served from this machine's loopback names
KEY_FIX = "or give the server a key (--api-key KEY or BMOE_API_KEY), which turns these checks off"


def host_names(text: str) -> tuple[str, ...]:
    """--allowed-host: host names, comma-separated, as a Host header has them but without the port."""
    names = tuple(n.strip().lower() for n in text.split(",") if n.strip())
    for n in names:
        if n != ANY and (not n or any(c in n for c in ":/[]@ ")):
            raise argparse.ArgumentTypeError(f"{n!r} is not a host name: give the name alone, without a scheme or "
                                             "port (e.g. my-box.lan); IP addresses are always served")
    return names


def origins(text: str) -> tuple[str, ...]:
    """--allowed-origin: origins, comma-separated, as a browser sends them: SCHEME://HOST[:PORT], null, or the
    bare word localhost (every loopback page)."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        origin = part.lower().rstrip("/")
        if origin not in (ANY, "null", LOOPBACK):
            u = urlsplit(origin)
            if not u.scheme or not u.netloc or u.path or u.query or u.fragment:
                raise argparse.ArgumentTypeError(f"{part!r} is not an origin: SCHEME://HOST[:PORT] with no path "
                                                 "(e.g. http://localhost:3000), null, or localhost (every page on "
                                                 "this machine's loopback names)")
        out.append(origin)
    return tuple(out)


def _loopback_page(origin: str) -> bool:
    """Whether a browser's Origin is a page this machine serves on a loopback name: localhost, a name under
    .localhost (browsers resolve both to loopback themselves) or a loopback address, any scheme and port."""
    u = urlsplit(origin)
    name = u.hostname or ""
    if not u.scheme or u.path or u.query or u.fragment or u.username is not None:
        return False
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def name_of(host: str) -> str:
    """The name in a Host header: without its port, an IPv6 address without its brackets."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host if host.count(":") > 1 else host.partition(":")[0]


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Trusted:
    """The Hosts and Origins a server without a key answers (see the module notes); `listen_host` is --host
    (a comma list of addresses)."""

    def __init__(self, listen_host: str = "localhost", hosts: Iterable[str] = (), origins: Iterable[str] = ()) -> None:
        self.hosts = frozenset({"localhost", *listen_host.lower().split(","), *hosts})
        self.origins = frozenset(origins)

    def origin_listed(self, origin: str) -> bool:
        """Whether a browser's Origin is one --allowed-origin names (CORS's list, and HostCheck's but for the
        page's own origin)."""
        origin = origin.lower()
        return (ANY in self.origins or origin in self.origins
                or (LOOPBACK in self.origins and _loopback_page(origin)))

    def host_ok(self, host: str) -> bool:
        """Whether a Host header names this server (see the module notes)."""
        name = name_of(host.lower())
        return bool(name) and (ANY in self.hosts or name in self.hosts or name.endswith(".localhost")
                               or _is_address(name))

    def refusal(self, scope: Scope) -> ServeError | None:
        """Why this request is refused, or None when it is served."""
        headers = Headers(scope=scope)
        host = headers.get("host")
        if host is not None and not self.host_ok(host):
            name = name_of(host.lower())
            return ServeError(403, f"this server does not answer to the name {name!r} (a web page may have pointed "
                              f"that name at it): to serve it, restart bmoe-server with --allowed-host "
                              f"{name or 'NAME'}, {KEY_FIX}", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is None or self.origin_listed(origin):
            return None
        origin = origin.lower()
        if host is not None and origin == f"{scope['scheme']}://{host.lower()}":
            return None
        return ServeError(403, f"requests from the web page at {origin} are refused: it is not this server's own "
                          f"page; to serve it, restart bmoe-server with --allowed-origin {origin}, {KEY_FIX}",
                          code="origin_not_allowed")


class HostCheck:
    """ASGI middleware: every HTTP request's Host and Origin checked against `trusted` before any route
    runs; a refused one is answered by `answer` (the route's API's error shape)."""

    def __init__(self, app: ASGIApp, trusted: Trusted, answer: Callable[[str, ServeError], JSONResponse]) -> None:
        self.app = app
        self.trusted = trusted
        self.answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = self.trusted.refusal(scope) if scope["type"] == "http" else None
        if refused is not None:
            await self.answer(scope["path"], refused)(scope, receive, send)
            return
        await self.app(scope, receive, send)


CORS_METHODS = ("GET", "POST", "DELETE", "HEAD")
CORS_MAX_AGE_S = 600  # how long a browser may keep a preflight's answer


class Cors(CORSMiddleware):
    """Starlette's CORS over exactly the origins `trusted` lists (Trusted.origin_listed, the list HostCheck
    admits), whose preflight of another origin is a 200 without CORS headers, as llama-server's: the
    browser then refuses the page's request, and nothing ran."""

    def __init__(self, app: ASGIApp, trusted: Trusted) -> None:
        super().__init__(app, allow_origins=[ANY] if ANY in trusted.origins else sorted(trusted.origins),
                         allow_methods=CORS_METHODS, allow_headers=["*"],
                         expose_headers=["X-Queue-Position", "X-Bmoe-Replica"], max_age=CORS_MAX_AGE_S)
        self.trusted = trusted

    def is_allowed_origin(self, origin: str) -> bool:
        return self.trusted.origin_listed(origin)

    def preflight_response(self, request_headers: Headers) -> Response:
        if not self.is_allowed_origin(request_headers["origin"]):
            return Response(status_code=200, headers={"Vary": "Origin"})
        answer = super().preflight_response(request_headers)
        answer.raw_headers = _spelt(answer.raw_headers)
        return answer

    async def send(self, message: Message, send: Send, request_headers: Headers) -> None:
        async def spelling(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = _spelt(message.get("headers", []))
            await send(message)

        await super().send(message, spelling, request_headers)


def _spelt(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The CORS headers' names spelt as llama-server (and most servers) send them, `Access-Control-Allow-Origin`
    (h11 keeps a name's case): a client that looks one up as llama-server spells it finds it."""
    return [(b"-".join(w.capitalize() for w in k.split(b"-")) if k.startswith(b"access-control-") else k, v)
            for k, v in headers]


def add_cors(app: FastAPI, trusted: Trusted) -> None:
    """CORS headers for `trusted`'s origins (see the module notes); none without --allowed-origin. Added
    last, so it wraps every other middleware: a refusal (401, 403, 413) reaches an allowed page readable."""
    if trusted.origins:
        app.add_middleware(Cors, trusted=trusted)
