"""Request bodies that would hold bmoe-server (issue 50): hundreds of connections whose body trickles in
after a complete head, a request without the key that announces a large body, and bodies that together
would fill memory. Each ends in a refusal in the route's error shape and a closed connection, while
/health and a chat request are answered as before. The server's deadlines are made small with its
flags; the clients wait on what the server does (a closed socket, a gauge), never on a fixed sleep."""

from __future__ import annotations

import json
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import REPO
from tests.test_server import CHAT_PROMPT, FLAGS, KEY, PROMPT, Server, auth, error_of
from tests.test_server_hostile import address, metric

SLOW = 256  # slow bodies open at once: --max-connections' default
BODY_S = 2  # --body-timeout
RATE_KB = 1  # --min-body-rate
HANG_S = 120  # a bound only against a hang: nothing here should take a tenth of it


@pytest.fixture(scope="module")
def server(small_moe) -> Iterator[Server]:
    """Room for the slow bodies and the test's own clients (--max-connections bounds connections, not
    bodies: 256 open ones would fill the default)."""
    s = Server("-m", str(small_moe), *FLAGS, "--body-timeout", str(BODY_S), "--min-body-rate", str(RATE_KB),
               "--max-connections", str(SLOW + 8), env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def head(path: str, length: int, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json", f"Content-Length: {length}",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer_of(sock: socket.socket) -> bytes:
    """What the server sends until it closes `sock` (a reset after an answer ends it too)."""
    sock.settimeout(HANG_S)
    got = b""
    try:
        while chunk := sock.recv(1 << 16):
            got += chunk
    except ConnectionResetError:
        pass
    return got


class SlowBodies:
    """`n` connections that each send a complete head announcing a large body, then its bytes: while
    `keep_up` is set at twice --min-body-rate (the server must wait for them), then a byte a quarter
    second (far below it) until the server closes them, or HANG_S pass. One thread sends, and records
    when each was closed and what it was answered."""

    def __init__(self, at: tuple[str, int], n: int) -> None:
        self.keep_up = threading.Event()
        self.keep_up.set()
        self.opened = time.monotonic()
        self.open: dict[socket.socket, bytes] = {}
        self.closed: list[tuple[float, bytes]] = []
        self.done = threading.Event()
        self.selector = selectors.DefaultSelector()
        for _ in range(n):
            s = socket.create_connection(at)
            s.sendall(head("/v1/completions", 1_000_000, auth()))  # under --max-body-kb's 1024 KiB
            s.setblocking(False)
            self.open[s] = b""
            self.selector.register(s, selectors.EVENT_READ)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = None
        while self.open and (deadline is None or time.monotonic() < deadline):
            piece = b" " * (RATE_KB * 1024 // 2) if self.keep_up.is_set() else b" "
            if piece == b" " and deadline is None:
                deadline = time.monotonic() + HANG_S
            for s in list(self.open):
                try:
                    s.send(piece)
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    pass  # a full buffer sends it next time; a closed socket is seen below
            for key, _ in self.selector.select(0.25):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    got = s.recv(1 << 16)
                except ConnectionResetError:
                    got = b""
                if got:
                    self.open[s] += got
                    continue
                self.closed.append((time.monotonic(), self.open.pop(s)))
                self.selector.unregister(s)
                s.close()
        self.done.set()

    def close(self) -> None:
        self.keep_up.clear()
        self.done.wait(HANG_S)
        for s in self.open:
            s.close()
        self.selector.close()


def chat(server: Server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth(), timeout=HANG_S,
                   json={"messages": [{"role": "user", "content": CHAT_PROMPT}], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text


def test_slow_bodies_are_cut_after_their_deadline_and_shut_nobody_out(server: Server) -> None:
    """256 connections with a complete head and a body trickling in: while they are open, /health and a chat
    request are answered; once their bytes come slower than --min-body-rate, each is answered 408 past
    --body-timeout and closed (before the fix they were held for ever, and filled --max-connections)."""
    slow = SlowBodies(address(server), SLOW)
    try:
        assert httpx.get(server.url + "/health", timeout=HANG_S).json()["status"] == "ok"
        chat(server)
        kept = metric(server, "bmoe_request_body_bytes")
        assert not slow.closed, "a body sent at twice the minimum rate was cut"
        assert kept > 0, "the slow bodies' bytes are counted against --max-bodies-mb"
        slow.keep_up.clear()
        fell_behind = time.monotonic()
        slow.done.wait(HANG_S * 2)  # (the thread gives up HANG_S after the fall)
        assert not slow.open and len(slow.closed) == SLOW, f"{len(slow.open)} slow bodies were never cut"
        assert all(t > fell_behind for t, _ in slow.closed)
        assert min(t for t, _ in slow.closed) - slow.opened >= BODY_S * 0.9
        answers = [a for _, a in slow.closed if a]  # (a reset may beat the answer to the client)
        assert answers, "no slow body was told why"
        for a in answers:
            assert a.startswith(b"HTTP/1.1 408 "), a[:200]
            body = json.loads(a.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "request_timeout" and "--body-timeout" in body["error"]["message"]
    finally:
        slow.close()
    assert httpx.get(server.url + "/health", timeout=HANG_S).json()["status"] == "ok"
    chat(server)
    assert metric(server, "bmoe_request_body_bytes") == 0


def test_a_request_without_the_key_is_refused_before_its_body_is_read(server: Server) -> None:
    """A head announcing 100 kB without the key, or with a wrong one, and no body at all: 401 at once in the
    route's error shape, and the connection closed (the body is never waited for)."""
    cases = [("/v1/chat/completions", {}), ("/v1/completions", auth("wrong")),
             ("/v1/messages", {"x-api-key": "wrong"}), ("/api/chat", {"Authorization": "Basic " + KEY})]
    for path, headers in cases:
        with socket.create_connection(address(server)) as s:
            s.sendall(head(path, 100_000, headers))
            got = answer_of(s)
        assert got.startswith(b"HTTP/1.1 401 "), (path, got[:200])
        body = json.loads(got.split(b"\r\n\r\n", 1)[1])
        if path == "/v1/messages":
            assert body["type"] == "error" and body["error"]["type"] == "authentication_error", body
        elif path.startswith("/api/"):
            assert "API key" in body["error"], body
        else:
            assert body["error"]["code"] == "invalid_api_key", body


def test_a_refused_body_sent_in_full_still_gets_its_answer(server: Server) -> None:
    """A client that sends its whole body before it reads (as most clients do) and is refused mid-body, 413
    for a body over --max-body-kb, 401 without the key: the answer reaches it and the connection ends
    cleanly, ten times in a row. Closed at once, the server's socket would answer the bytes still coming
    with a reset, which makes the client's system drop the unread answer ("connection reset by peer")."""
    cases = [("/v1/completions", 2_000_000, auth(), b"HTTP/1.1 413 "),  # over the default 1024 KiB
             ("/v1/chat/completions", 500_000, {}, b"HTTP/1.1 401 ")]
    for path, length, headers, status in cases:
        for _ in range(10):
            with socket.create_connection(address(server)) as s:
                s.settimeout(HANG_S)
                s.sendall(head(path, length, headers) + b" " * length)
                got = b""
                while chunk := s.recv(1 << 16):
                    got += chunk
            assert got.startswith(status), (path, got[:200])
            assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"], got


BODY_KB = 64  # --max-body-kb of the bounded server
HOLDERS = 16  # bodies of BODY_KB less a byte that fill its --max-bodies-mb 1


@pytest.fixture(scope="module")
def bounded(small_moe) -> Iterator[Server]:
    """A server that holds 1 MiB of bodies at most, and waits long for them (the holders are never cut)."""
    s = Server("-m", str(small_moe), *FLAGS, "--max-body-kb", str(BODY_KB), "--max-bodies-mb", "1",
               "--body-timeout", "600", env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def test_bodies_together_are_bounded(bounded: Server) -> None:
    """16 bodies a byte short of 64 KiB fill the 1 MiB every body shares: the next request with a body gets
    503 in its route's shape (and a bodiless GET is served); once the holders leave, the bytes are given back
    and a request is answered."""
    holders = []
    for _ in range(HOLDERS):
        s = socket.create_connection(address(bounded))
        s.sendall(head("/v1/completions", BODY_KB * 1024, auth()) + b" " * (BODY_KB * 1024 - 1))
        holders.append(s)
    full = HOLDERS * (BODY_KB * 1024 - 1)
    deadline = time.monotonic() + HANG_S
    while metric(bounded, "bmoe_request_body_bytes") < full:
        assert time.monotonic() < deadline, "the holders' bodies were never read"
        time.sleep(0.05)
    r = httpx.post(bounded.url + "/v1/completions", headers=auth(), timeout=HANG_S,
                   json={"prompt": PROMPT, "max_tokens": 2})
    err = error_of(r, 503)
    assert err["code"] == "bodies_full" and "--max-bodies-mb" in err["message"], err
    r = httpx.post(bounded.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=HANG_S,
                   json={"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": PROMPT}]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error", r.text
    assert httpx.get(bounded.url + "/health", timeout=HANG_S).status_code == 200
    for s in holders:
        s.close()
    while metric(bounded, "bmoe_request_body_bytes") > 0:
        assert time.monotonic() < deadline, "the holders' bytes were never given back"
        time.sleep(0.05)
    r = httpx.post(bounded.url + "/v1/completions", headers=auth(), timeout=HANG_S,
                   json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_bound_on_every_body_below_one_body_is_a_usage_error(small_moe) -> None:
    r = subprocess.run([sys.executable, "-m", "bmoe.server", "-m", str(small_moe), "--max-body-kb", "2048",
                        "--max-bodies-mb", "1"], capture_output=True, text=True, cwd=REPO, timeout=HANG_S)
    assert r.returncode == 2 and "--max-bodies-mb 1 holds less than one body" in r.stderr, r.stderr
