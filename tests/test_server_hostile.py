"""Clients built to hold bmoe-server: connections that never send a request or send it a byte at a
time, a reader that stops reading a stream, a body of tens of megabytes and `model` names that look like
paths. Each ends in a clear refusal or a closed connection, and another client is served as before.
(Requests whose fields ask too much are tests/test_server.py's HOSTILE, sent to every route that takes
them beside a running stream.)"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.test_server import FLAGS, KEY, PROMPT, Server, auth, error_of

IDLE_S = 2  # --idle-timeout
WRITE_S = 2  # --write-timeout
CONNECTIONS = 8  # --max-connections


@pytest.fixture(scope="module")
def server(small_moe) -> Iterator[Server]:
    s = Server("-m", str(small_moe), *FLAGS, "--parallel", "1", "--queue", "2", "--idle-timeout", str(IDLE_S),
               "--write-timeout", str(WRITE_S), "--max-connections", str(CONNECTIONS), env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def address(server: Server) -> tuple[str, int]:
    m = re.match(r"http://([\d.]+):(\d+)", server.url)
    assert m
    return m.group(1), int(m.group(2))


def closed_by_server(sock: socket.socket) -> bool:
    """Blocks until the server closes `sock` (True), or 120 s pass with it open (False)."""
    sock.settimeout(120)
    try:
        return sock.recv(1 << 16) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=auth(), timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def answered(server: Server) -> httpx.Response:
    r = httpx.post(server.url + "/v1/completions", headers=auth(), timeout=120,
                   json={"prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r


def test_connections_that_send_no_request_are_closed_and_do_not_shut_others_out(server: Server) -> None:
    """As many idle connections as --max-connections allows, and one sending its head a byte at a time:
    each is closed after --idle-timeout, and then a request is answered (not 503)."""
    idle = [socket.create_connection(address(server)) for _ in range(CONNECTIONS)]
    dribble = socket.create_connection(address(server))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n".encode()
    start = time.monotonic()
    dribble.settimeout(120)
    cut = False
    for i in range(len(head)):  # a byte every 0.2 s: every byte would restart uvicorn's own clock
        try:
            dribble.send(head[i:i + 1])
        except (BrokenPipeError, ConnectionResetError):
            cut = True
            break
        dribble.settimeout(0.2)
        try:
            if dribble.recv(1 << 16) == b"":
                cut = True
                break
        except TimeoutError:
            pass
        except ConnectionResetError:  # the byte sent just as the server closed: the kernel answers it with a reset
            cut = True
            break
    assert cut, "a head sent a byte at a time was never cut off"
    assert time.monotonic() - start >= IDLE_S * 0.9
    assert all(closed_by_server(s) for s in idle), "idle connections are closed"
    for s in [*idle, dribble]:
        s.close()
    answered(server)


def test_a_reader_that_stops_reading_is_cut_and_its_slot_freed(server: Server) -> None:
    """A stream whose client reads nothing (its socket's buffers fill) is cut after --write-timeout
    and its generation cancelled if it is still running (a fast machine may decode all 3000 tokens
    before the buffers fill): the one KV sequence (--parallel 1) is free for the next client. A chat
    stream with 20 alternatives per token: the largest chunks the server writes (about 2.3 KB a token,
    twice a completion's), so the server's socket buffers (megabytes on loopback) fill soonest."""
    ended = {why: metric(server, f'bmoe_generations_total{{finish_reason="{why}"}}') for why in ("cancelled", "length")}
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(address(server))
    body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3000, "logprobs": True,
                       "top_logprobs": 20, "stream": True})
    slow.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
    deadline = time.monotonic() + 600
    while metric(server, "bmoe_slow_readers_total") < 1:  # the server notices by itself
        assert time.monotonic() < deadline, "the slow reader was never cut"
        time.sleep(0.5)
    r = answered(server)
    assert r.headers["X-Queue-Position"] == "0", "the slow reader's sequence was free"
    now = {why: metric(server, f'bmoe_generations_total{{finish_reason="{why}"}}') - n for why, n in ended.items()}
    assert now in ({"cancelled": 1, "length": 1}, {"cancelled": 0, "length": 2}), now  # (the answer: length)
    assert json.loads(r.text)["bmoe"]["completion_tokens"] == 4
    slow.close()


def test_a_body_of_tens_of_megabytes_is_refused_before_it_is_read(server: Server) -> None:
    """On every route that takes a body, in its API's error shape (Ollama's: the message alone)."""
    big = b'{"prompt": "' + b"x" * (20 << 20) + b'"}'
    for path in ("/v1/completions", "/v1/responses", "/api/chat", "/api/generate"):
        r = httpx.post(server.url + path, headers={**auth(), "Content-Type": "application/json"}, content=big,
                       timeout=60)
        if path.startswith("/api/"):
            assert r.status_code == 413 and "--max-body-kb" in r.json()["error"], (path, r.text)
        else:
            assert "--max-body-kb" in error_of(r, 413)["message"]


def test_a_model_name_is_never_a_path(server: Server, tmp_path) -> None:
    """The request's `model` names nothing on disk: any name gets the one model, by its own name."""
    for name in ("../../../../etc/passwd", str(tmp_path / "x.gguf"), "/dev/zero"):
        r = httpx.post(server.url + "/v1/completions", headers=auth(), timeout=120,
                       json={"model": name, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] != name, r.text
        assert httpx.get(f"{server.url}/v1/models/{name}", headers=auth(), timeout=60).status_code == 404
    assert not (tmp_path / "x.gguf").exists()
