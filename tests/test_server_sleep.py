"""`--sleep-idle-seconds` on a real bmoe-server (raw HTTP and the openai client): idle, the model is released
(no workers, nothing in /dev/shm, less memory) while /health, /props, /models and /metrics answer without
waking it; every route that needs the model wakes it, the answer after a wake equal to the one before;
concurrent requests wait for one load; a load that fails is a clear 503 and the next request tries again."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import bmoe_segments
from tests.test_server import FLAGS, KEY, PROMPT, Server, auth, completion

IDLE_S = "1"
BOUND_S = 60.0  # a sleep or a wake that takes longer has failed


@pytest.fixture(scope="module")
def sleepy(small_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """A server that sleeps after a second idle, on its own copy of the model (a test moves it away), with
    embeddings on (their route wakes it too)."""
    model = tmp_path_factory.mktemp("sleep") / small_moe.name
    shutil.copy(small_moe, model)
    s = Server("-m", str(model), *FLAGS, "--embedding", "--pooling", "mean", "--sleep-idle-seconds", IDLE_S,
               env={"BMOE_API_KEY": KEY})
    yield s, model
    s.stop()


@pytest.fixture(autouse=True)
def asleep_after(sleepy: tuple[Server, Path]) -> Iterator[None]:
    """Each test leaves the server asleep, as it found it or cleaner: its shared memory gone (no_leaked_segments)."""
    yield
    wait_asleep(sleepy[0])


def props(server: Server) -> dict:
    r = httpx.get(server.url + "/props", headers=auth())
    assert r.status_code == 200
    return r.json()


def wait_asleep(server: Server) -> None:
    """Until /props says it sleeps (polled: /props does not wake it), within BOUND_S."""
    end = time.monotonic() + BOUND_S
    while not props(server)["is_sleeping"]:
        assert time.monotonic() < end, "the idle server did not sleep"
        time.sleep(0.1)


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=auth(), timeout=BOUND_S)


def test_idle_server_releases_the_model_and_a_request_loads_it_again(sleepy: tuple[Server, Path]) -> None:
    server, _ = sleepy
    before = completion(server)
    assert before.strip()
    rss_awake = psutil.Process(server.proc.pid).memory_info().rss
    assert server.workers() and props(server)["is_sleeping"] is False
    wait_asleep(server)
    assert server.workers() == []  # the I/O lanes and workers ended
    assert not bmoe_segments()  # nothing of it in /dev/shm
    assert psutil.Process(server.proc.pid).memory_info().rss < rss_awake
    assert "sleeping: the model released after 1 s idle" in server.stderr
    for path in ("/health", "/v1/models", "/models", "/metrics", "/props"):
        assert httpx.get(server.url + path, headers=auth()).status_code == 200, path
    assert props(server)["is_sleeping"] is True  # none of them woke it
    assert completion(server) == before  # loaded again with the same settings: lossless
    assert props(server)["is_sleeping"] is False and server.workers()


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/tokenize", {"content": "Hello"}, "tokens"),
    ("/detokenize", {"tokens": [1, 2]}, "content"),
    ("/v1/chat/completions/input_tokens", {"messages": [{"role": "user", "content": "Hi"}]}, "input_tokens"),
    ("/v1/responses/input_tokens", {"input": "Hello world"}, "input_tokens"),
    ("/v1/messages/count_tokens", {"model": "x", "messages": [{"role": "user", "content": "Hi"}]}, "input_tokens"),
    ("/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}, "prompt"),
    ("/completion", {"prompt": PROMPT, "n_predict": 2}, "content"),
    ("/v1/embeddings", {"model": "x", "input": "Hello world"}, "data"),
    ("/api/generate", {"model": "x", "prompt": PROMPT, "stream": False, "options": {"num_predict": 2}}, "response"),
])
def test_every_route_that_needs_the_model_wakes_it(sleepy: tuple[Server, Path], path: str, body: dict,
                                                   field: str) -> None:
    server, _ = sleepy
    wait_asleep(server)
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    assert field in r.json()
    assert props(server)["is_sleeping"] is False


def test_concurrent_requests_wait_for_one_load(sleepy: tuple[Server, Path]) -> None:
    server, _ = sleepy
    wait_asleep(server)
    woken = server.stderr.count("awake: the model loaded again")
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: completion(server, n=4), range(4)))
    assert len(set(answers)) == 1 and answers[0].strip()
    assert server.stderr.count("awake: the model loaded again") == woken + 1


def test_a_load_that_fails_is_a_clear_503_and_the_next_request_tries_again(sleepy: tuple[Server, Path]) -> None:
    server, model = sleepy
    want = completion(server, n=4)
    wait_asleep(server)
    away = model.with_suffix(".away")
    model.rename(away)
    try:
        r = post(server, "/v1/completions", {"model": "x", "prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 503
        assert "could not be loaded again after sleeping" in r.json()["error"]["message"]
        assert props(server)["is_sleeping"] is True
    finally:
        away.rename(model)
    assert completion(server, n=4) == want
