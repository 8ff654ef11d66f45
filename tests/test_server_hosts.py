"""DNS rebinding and foreign pages against a real bmoe-server without a key (bmoe.server.hosts): a
request sent to a name the server does not answer to, as a page that rebound its name to 127.0.0.1
sends it, or from a web page of another origin, gets 403 on every route before the route runs;
loopback names, IP addresses and the chat page's own origin are served, and `--allowed-host` /
`--allowed-origin` admit what they name. With a key the names are not checked (the key is).
(The page itself, from its own origin and from a rebound name, in a browser: tests/test_webui.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import REPO
from tests.test_server import FLAGS, KEY, PROMPT, Server, auth, error_of, metric

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
# every kind of route: the four APIs, the metrics, the health, the events, the page, and no route at all
ROUTES = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
          ("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/responses", {"input": "hello", "max_output_tokens": 2}),
          ("POST", "/v1/messages", {**CHAT, "model": "x"}), ("POST", "/api/chat", {**CHAT, "model": "x"}),
          ("POST", "/api/show", {"model": "x"}), ("GET", "/api/tags", None), ("GET", "/metrics", None),
          ("GET", "/health", None), ("GET", "/v1/bmoe/events", None), ("GET", "/", None),
          ("GET", "/webui/chat.js", None), ("GET", "/nowhere", None)]


def without_key() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "BMOE_API_KEY"}


@pytest.fixture(scope="module")
def open_server(small_moe) -> Iterator[Server]:
    """The default: loopback, no key."""
    s = Server("-m", str(small_moe), *FLAGS, env=without_key())
    yield s
    s.stop()


def port(server: Server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def send(server: Server, method: str, path: str, body: object = None, **headers: str) -> httpx.Response:
    """A request to the server's loopback address carrying these headers (Host included) as a browser's would."""
    return httpx.request(method, server.url + path, json=body, headers=headers, timeout=120)


def refused(r: httpx.Response, path: str) -> str:
    """A 403 in the error shape of the path's API; its message."""
    assert r.status_code == 403, (path, r.status_code, r.text)
    if path == "/v1/messages":
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "permission_error"
        return r.json()["error"]["message"]
    if path.startswith("/api/"):
        return r.json()["error"]
    err = error_of(r, 403)
    assert err["code"] in ("host_not_allowed", "origin_not_allowed")
    return err["message"]


def generations(server: Server) -> float:
    return metric(server, "bmoe_generations_total")


def test_a_rebound_name_gets_403_on_every_route_and_nothing_runs(open_server: Server) -> None:
    s, rebound = open_server, f"rebind.example:{port(open_server)}"
    before = generations(s)
    counted = {r: metric(s, f'bmoe_requests_total{{route="{r}",status="403"}}')
               for r in ("/v1/chat/completions", "/health")}
    for method, path, body in ROUTES:
        message = refused(send(s, method, path, body, host=rebound), path)
        assert "--allowed-host rebind.example" in message and "--api-key" in message, message
    assert refused(send(s, "GET", "/v1/models", host=f":{port(s)}"), "/v1/models")  # an empty name
    assert refused(send(s, "GET", "/v1/models", host="REBIND.example"), "/v1/models")
    assert generations(s) == before  # no request reached the model
    # counted under their routes, as every answer is
    for route, n in counted.items():
        assert metric(s, f'bmoe_requests_total{{route="{route}",status="403"}}') == n + 1, route


def test_loopback_names_addresses_and_the_pages_own_origin_are_served(open_server: Server) -> None:
    s, p = open_server, port(open_server)
    for host in (f"127.0.0.1:{p}", f"localhost:{p}", "localhost", f"[::1]:{p}", f"LocalHost:{p}",
                 f"bmoe.localhost:{p}", f"127.0.0.2:{p}", f"192.168.1.5:{p}", f"[fe80::1]:{p}"):
        assert send(s, "GET", "/v1/models", host=host).status_code == 200, host
    # the chat page's own requests: its fetches send the page's origin, which is its Host's
    for own in (f"127.0.0.1:{p}", f"localhost:{p}"):
        assert send(s, "GET", "/", host=own).headers["content-type"].startswith("text/html")
        r = send(s, "POST", "/v1/chat/completions", CHAT, host=own, origin=f"http://{own}")
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert send(s, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200  # no Origin


def preflight(server: Server, origin: str) -> httpx.Response:
    """A browser's CORS preflight for a page at `origin` that posts JSON with a key."""
    return send(server, "OPTIONS", "/v1/chat/completions", **{"origin": origin, "access-control-request-method": "POST",
                                                                 "access-control-request-headers": "content-type"})


def test_no_cors_by_default(open_server: Server) -> None:
    """Without --allowed-origin no page of another origin gets CORS headers: not on the preflight (405, as any
    method a route does not serve), not on the chat page's own requests."""
    s, p = open_server, port(open_server)
    for origin, status in ((f"http://127.0.0.1:{p}", 405), ("http://localhost:3000", 403)):  # its own page, another
        r = preflight(s, origin)
        assert r.status_code == status and not any(h.startswith("access-control-") for h in r.headers), origin
    r = send(s, "POST", "/v1/chat/completions", CHAT, origin=f"http://127.0.0.1:{p}")
    assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)


def test_a_foreign_origin_gets_403_and_its_chat_does_not_run(open_server: Server) -> None:
    s, p = open_server, port(open_server)
    before = generations(s)
    for origin in ("http://evil.example", f"http://localhost:{p + 1}", f"https://127.0.0.1:{p}", "null"):
        message = refused(send(s, "POST", "/v1/chat/completions", CHAT, origin=origin), "/v1/chat/completions")
        assert f"--allowed-origin {origin}" in message and "--api-key" in message, message
    assert refused(send(s, "POST", "/api/chat", {**CHAT, "model": "x"}, origin="http://evil.example"), "/api/chat")
    assert generations(s) == before


def test_allowed_host_and_allowed_origin_admit_what_they_name(small_moe) -> None:
    s = Server("-m", str(small_moe), *FLAGS, "--allowed-host", "my-alias,Bmoe.Home", "--allowed-host", "other.lan",
               "--allowed-origin", "http://localhost:3000", "--allowed-origin", "chrome-extension://abcdef/",
               env=without_key())
    try:
        p = port(s)
        for host in ("my-alias", "bmoe.home", "other.lan"):
            r = send(s, "POST", "/v1/chat/completions", CHAT, host=f"{host}:{p}", origin=f"http://{host}:{p}")
            assert r.status_code == 200, (host, r.text)
        refused(send(s, "GET", "/v1/models", host=f"rebind.example:{p}"), "/v1/models")
        for origin in ("http://localhost:3000", "chrome-extension://abcdef"):
            r = send(s, "POST", "/v1/chat/completions", CHAT, origin=origin)
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, origin
            assert preflight(s, origin).headers["access-control-allow-origin"] == origin
        # CORS is the same list: another page's preflight gets no CORS header (200, as llama-server's), and its
        # request is refused
        r = preflight(s, "http://localhost:3001")
        assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)
        r = send(s, "POST", "/v1/chat/completions", CHAT, origin="http://localhost:3001")
        refused(r, "/v1/chat/completions")
        assert "access-control-allow-origin" not in r.headers
    finally:
        s.stop()
    s = Server("-m", str(small_moe), *FLAGS, "--allowed-host", "*", "--allowed-origin", "*", env=without_key())
    try:
        r = send(s, "POST", "/v1/chat/completions", CHAT, host="rebind.example", origin="http://evil.example")
        assert r.status_code == 200, r.text
    finally:
        s.stop()


def test_with_a_key_the_key_decides_not_the_name(small_moe) -> None:
    s = Server("-m", str(small_moe), *FLAGS, env={"BMOE_API_KEY": KEY})
    try:
        rebound = {"host": f"rebind.example:{port(s)}", "origin": "http://evil.example"}
        error_of(send(s, "POST", "/v1/chat/completions", CHAT, **rebound), 401)
        assert send(s, "POST", "/v1/chat/completions", CHAT, **rebound, **auth()).status_code == 200
    finally:
        s.stop()


@pytest.mark.parametrize("flag, value, says", [
    ("--allowed-host", "http://my-alias", "is not a host name"),
    ("--allowed-host", "my-alias:8000", "without a scheme or port"),
    ("--allowed-origin", "evil.example", "is not an origin"),
    ("--allowed-origin", "http://evil.example/page", "is not an origin"),
])
def test_a_malformed_name_or_origin_is_a_usage_error(flag: str, value: str, says: str) -> None:
    r = subprocess.run([sys.executable, "-m", "bmoe.server", flag, value], capture_output=True, text=True, cwd=REPO,
                       timeout=60)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
