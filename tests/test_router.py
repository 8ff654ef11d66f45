"""Two bmoe-server replicas behind real HAProxy (issue 53; docs/deploy.md), opt-in:

    python -m pytest -m router tests/test_router.py

HAProxy runs deploy/haproxy.cfg as the repository has it (its addresses from the environment: free loopback
ports), in front of 2 replicas on the 8-expert demo model sharing one `--response-store sqlite:PATH`, driven by
the official `openai` client (max_retries=0: any retry is the router's); then all of it again with a Redis
store (skipped, saying why, without `redis-server` or the `redis` client). A conversation keyed by
`prompt_cache_key`, and a Responses conversation by its ids, keeps to one replica (X-Bmoe-Replica says which)
and hits its prompt cache as on one server; a replica's SIGTERM drains it while clients keep streaming through
the router, and no request fails or is cut; `previous_response_id` of a response the drained replica answered
goes on on the other, and on the first again once it is back. A replica SIGKILLed while it runs a stream and a
whole answer (a team of its own, `--parallel 2`, SQLite store) cuts the stream only, which the openai client
raises as `APIConnectionError`; the whole answer and the requests waiting for it in HAProxy's queue (maxconn =
the replicas' --parallel) are answered by the other.

HAProxy is Debian's (`apt-get install haproxy`): the test installs it when missing and it can (root with
apt-get), and skips saying why otherwise. A single replica's rules without a router (headers, ids, the shared
store, the drain) are in the default suite: tests/test_server_replicas.py.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from bmoe.shm_cache import segments_of
from tests.conftest import REPO
from tests.test_server import KEY, Server

pytestmark = pytest.mark.router

CONFIG = REPO / "deploy" / "haproxy.cfg"
FLAGS = ["-t", "1", "--io-threads", "2", "-c", "4096", "--cache-mb", "200"]  # each replica on one of the 2 cores
NAMES = ("r1", "r2")
STEPS = 4  # requests each client sends while a replica drains
CLIENTS = 4


def _haproxy() -> str:
    """Debian's haproxy, installed when missing and this process can; else the test skips, saying why."""
    found = shutil.which("haproxy")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "haproxy"], capture_output=True, timeout=600)
        found = shutil.which("haproxy")
    if found is None:
        pytest.skip("HAProxy is not installed and could not be (apt-get install haproxy, as root)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Router:
    """HAProxy with the repository's config in front of the replicas at `ports` (by name)."""

    def __init__(self, ports: dict[str, int], log: Path, parallel: int = 1) -> None:
        self.port, self.stats_port = _free_port(), _free_port()
        env = {**os.environ, "BMOE_LISTEN": f"127.0.0.1:{self.port}", "BMOE_STATS": f"127.0.0.1:{self.stats_port}",
               "BMOE_MAXCONN": str(parallel), **{f"BMOE_{n.upper()}": f"127.0.0.1:{p}" for n, p in ports.items()}}
        self.log = log
        with open(log, "wb") as out:  # HAProxy's notices (replicas up and down), read when it fails
            self.proc = subprocess.Popen([_haproxy(), "-db", "-f", str(CONFIG)], env=env, stdout=out, stderr=out)
        self.url = f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, dict[str, str]]:
        """HAProxy's stats of the replicas backend, by server name (and BACKEND); empty while it does not answer."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.stats_port}/;csv", timeout=5).text
        except httpx.TransportError:
            return {}
        return {r["svname"]: r for r in csv.DictReader(io.StringIO(text.lstrip("# "))) if r["pxname"] == "replicas"}

    def states(self) -> dict[str, str]:
        """Each replica's state as HAProxy's stats say it (UP, DOWN, ...)."""
        return {name: row["status"] for name, row in self.stats().items() if name in NAMES}

    def until(self, want: dict[str, str]) -> None:
        """Wait (as long as it takes) until HAProxy sees the replicas as `want` says."""
        while {k: v for k, v in self.states().items() if k in want} != want:
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.1)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=300)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def start_replica(model: Path, name: str, port: int, store: str, parallel: int = 1) -> Server:
    return Server("-m", str(model), *FLAGS, "--port", str(port), "--replica-id", name, "--response-store", store,
                  "--parallel", str(parallel), env={"BMOE_API_KEY": KEY})


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The replicas' --response-store: an SQLite file, or a Redis server (tests/conftest.py's `redis_url`)."""
    if request.param == "sqlite":
        return f"sqlite:{tmp_path_factory.mktemp('store') / 'responses.db'}"
    import redis

    url = request.getfixturevalue("redis_url") + "/3"
    redis.Redis.from_url(url).flushdb()
    return url


@contextmanager
def running_team(model: Path, store: str, folder: Path, parallel: int = 1
                 ) -> Iterator[tuple[Router, dict[str, Server]]]:
    """The replicas (`--parallel`, HAProxy's maxconn) and HAProxy in front of them, all up; all stopped at the end."""
    ports = {n: _free_port() for n in NAMES}
    replicas = {n: start_replica(model, n, ports[n], store, parallel) for n in NAMES}
    router = Router(ports, folder / "haproxy.log", parallel)
    try:
        router.until(dict.fromkeys(NAMES, "UP"))
        yield router, replicas
    finally:
        router.stop()
        for s in replicas.values():
            s.stop()  # nothing happens to one a test stopped
            for seg in segments_of(s.proc.pid):  # a killed one's shared memory, when its test failed before its restart
                seg.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def team(demo8: Path, store: str, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[Router, dict[str, Server]]]:
    with running_team(demo8, store, tmp_path_factory.mktemp("haproxy")) as running:
        yield running


def _turns(c: openai.OpenAI, key: str, n: int) -> tuple[set[str], list[int]]:
    """A chat of `n` turns keyed by `key`: the replicas that answered, each turn's cached prompt tokens."""
    messages: list[dict[str, str]] = []
    replicas, cached = set(), []
    for i in range(n):
        messages.append({"role": "user", "content": f"tell me about the number {i}"})
        raw = c.chat.completions.with_raw_response.create(model="x", messages=messages, max_tokens=8,
                                                          prompt_cache_key=key)
        r = raw.parse()
        replicas.add(raw.headers["x-bmoe-replica"])
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return replicas, cached


def test_a_conversation_keeps_to_one_replica_and_hits_its_cache(team: tuple[Router, dict[str, Server]]) -> None:
    router, _ = team
    c = router.client()
    seen = set()
    for key in ("alice", "bob", "carol", "dave"):
        replicas, cached = _turns(c, key, 3)
        assert len(replicas) == 1, f"{key}'s turns went to {replicas}"
        assert all(n > 0 for n in cached[1:]), f"{key}'s later turns hit its replica's KV: {cached}"
        seen |= replicas
    assert seen == set(NAMES), "four keys, two replicas: both serve (each new one went to the least busy)"

    first = c.responses.with_raw_response.create(model="x", input="what is the sky made of", max_output_tokens=6)
    r, home = first.parse(), first.headers["x-bmoe-replica"]
    assert r.id.endswith("_" + home)
    for turn in ("and then?", "why?"):
        raw = c.responses.with_raw_response.create(model="x", previous_response_id=r.id, input=turn,
                                                   max_output_tokens=6)
        r = raw.parse()
        assert raw.headers["x-bmoe-replica"] == home and r.usage.input_tokens_details.cached_tokens > 0


def _keys_on(c: openai.OpenAI, replica: str, n: int) -> list[str]:
    """`n` conversation keys HAProxy keeps on `replica` while it is up."""
    keys: list[str] = []
    for i in range(64):
        raw = c.chat.completions.with_raw_response.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=1, prompt_cache_key=f"key{i}")
        if raw.headers["x-bmoe-replica"] == replica:
            keys.append(f"key{i}")
            if len(keys) == n:
                return keys
    raise AssertionError(f"64 keys, fewer than {n} on {replica}")


def test_a_killed_replica_cuts_only_its_running_stream(demo8: Path, tmp_path: Path) -> None:
    """r2 (`--parallel 2`) is SIGKILLed while it runs two requests, a stream and a whole answer, with two more for it
    (one streamed, one not) waiting in HAProxy's queue (its maxconn is the replicas' --parallel): the running stream
    ends with the error the openai client raises for a connection closed in the middle of a body (no SSE error
    event: the process is gone); the whole answer, of which no byte had gone out, is computed again on r1; the
    waiting requests go to r1 and are answered there; r1 keeps answering r2's conversations, and keeps those it
    answered once r2 is back, which takes new ones. r2's lanes end on their own; its shared memory, which a killed
    process cannot remove, is swept by its next start. A team of its own: the module's stays whole for the other
    tests."""
    store = f"sqlite:{tmp_path / 'responses.db'}"
    with running_team(demo8, store, tmp_path, parallel=2) as (router, replicas):
        _kill_r2_mid_stream(router, replicas, demo8, store)


def _kill_r2_mid_stream(router: Router, replicas: dict[str, Server], model: Path, store: str) -> None:
    c = router.client()
    long_key, whole_key, *waiting_keys = _keys_on(c, "r2", 4)
    first_text = threading.Event()
    outcome: dict[str, object] = {}

    def running() -> None:
        chunks = 0
        try:
            with c.chat.completions.with_streaming_response.create(
                    model="x", messages=[{"role": "user", "content": "count to a thousand"}], max_tokens=3000,
                    stream=True, prompt_cache_key=long_key, extra_body={"ignore_eos": True}) as raw:
                outcome["replica"] = raw.headers["x-bmoe-replica"]
                for ch in raw.parse():
                    chunks += 1
                    if ch.choices and ch.choices[0].delta.content:
                        first_text.set()
            outcome["ended"] = f"cleanly after {chunks} chunks"
        except Exception as e:  # noqa: BLE001  (what the client raises is the point)
            outcome["error"] = e
        first_text.set()

    def waiting(key: str, stream: bool, tokens: int = 8) -> None:
        """A request that has not begun streaming when r2 dies: (the replica that answered, its text)."""
        try:
            messages = [{"role": "user", "content": f"waiting {key}"}]
            if stream:
                with c.chat.completions.with_streaming_response.create(model="x", messages=messages, max_tokens=8,
                                                                       stream=True, prompt_cache_key=key) as raw:
                    text = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
            else:
                raw = c.chat.completions.with_raw_response.create(model="x", messages=messages, max_tokens=tokens,
                                                                  prompt_cache_key=key,
                                                                  extra_body={"ignore_eos": True})
                text = raw.parse().choices[0].message.content or ""
            outcome[key] = (raw.headers["x-bmoe-replica"], text)
        except Exception as e:  # noqa: BLE001
            outcome[key] = e

    threads = [threading.Thread(target=running)]
    threads[0].start()
    first_text.wait(300)
    assert outcome.get("replica") == "r2" and "error" not in outcome, outcome
    threads.append(threading.Thread(target=waiting, args=(whole_key, False, 400)))  # runs beside the stream
    threads[1].start()
    killed = replicas["r2"]
    while httpx.get(killed.url + "/health").json()["generating"] < 2:
        assert threads[0].is_alive() and threads[1].is_alive(), outcome
        time.sleep(0.05)
    threads += [threading.Thread(target=waiting, args=(k, s)) for k, s in zip(waiting_keys, (True, False))]
    for t in threads[2:]:
        t.start()
    while int((r2 := router.stats()["r2"])["qcur"]) < 2:  # both wait in HAProxy's queue for r2
        assert int(r2["scur"]) <= 2, f"r2 was sent more than its --parallel: {r2['scur']} (BMOE_MAXCONN?)"
        assert threads[0].is_alive() and threads[1].is_alive(), outcome
        time.sleep(0.05)
    lanes = killed.workers()
    killed.proc.kill()
    assert killed.proc.wait(30) == -signal.SIGKILL
    for t in threads:
        t.join(300)

    # what the openai client raises: "Connection error.", from its HTTP library's (httpx2's, openai 3) broken body
    error = outcome.get("error")
    assert isinstance(error, openai.APIConnectionError), outcome
    assert type(error.__cause__).__name__ == "RemoteProtocolError", repr(error.__cause__)
    assert "incomplete chunked read" in str(error.__cause__), error.__cause__
    for key in (whole_key, *waiting_keys):  # none of them had begun: each answered by r1
        assert isinstance(outcome[key], tuple) and outcome[key][0] == "r1" and outcome[key][1], outcome
    _, alive = psutil.wait_procs(lanes, timeout=30)
    assert not alive, f"r2's lanes outlived it: {alive}"
    left = segments_of(killed.proc.pid)
    assert left, "a SIGKILLed server cannot remove its shared memory"
    router.until({"r2": "DOWN"})
    retried = router.stats()["BACKEND"]
    assert int(retried["wretr"]) >= 1 and int(retried["wredis"]) >= 1, retried  # HAProxy sent them to r1
    raw = c.chat.completions.with_raw_response.create(model="x", messages=[{"role": "user", "content": "again"}],
                                                      max_tokens=4, prompt_cache_key=long_key)
    assert raw.headers["x-bmoe-replica"] == "r1" and raw.parse().choices[0].message.content

    # back: r2 again on its port (the team's teardown stops it); its start sweeps the dead one's shared memory
    replicas["r2"] = start_replica(model, "r2", int(killed.url.rsplit(":", 1)[1]), store, parallel=2)
    router.until({"r2": "UP"})
    assert not any(p.exists() for p in left)
    for key in (long_key, *waiting_keys):  # a conversation that moved stays where its KV now is
        raw = c.chat.completions.with_raw_response.create(model="x", messages=[{"role": "user", "content": "back"}],
                                                          max_tokens=4, prompt_cache_key=key)
        assert raw.headers["x-bmoe-replica"] == "r1", key
    assert _keys_on(c, "r2", 1), "the restarted replica takes new conversations"


def test_a_drained_replica_cuts_no_request_and_its_conversations_go_on(
        team: tuple[Router, dict[str, Server]], demo8: Path, store: str) -> None:
    """Clients without a key (each request to the replica with the fewest in flight) stream through the router
    while r1 drains."""
    router, replicas = team
    c = router.client()
    made = {n: "" for n in NAMES}  # a response id each replica answered
    while not all(made.values()):
        r = c.responses.create(model="x", input=f"say something {time.monotonic()}", max_output_tokens=2)
        made[r.id.rsplit("_", 1)[1]] = r.id

    failures: list[str] = []
    served: list[tuple[str, float]] = []
    started = threading.Barrier(CLIENTS + 1)

    def client(k: int) -> None:
        own = router.client()
        started.wait()
        for step in range(STEPS):
            try:
                with own.chat.completions.with_streaming_response.create(
                        model="x", messages=[{"role": "user", "content": f"client {k} step {step}"}], max_tokens=24,
                        stream=True) as raw:
                    chunks = [ch for ch in raw.parse() if ch.choices]
                    served.append((raw.headers["x-bmoe-replica"], time.monotonic()))
                if chunks[-1].choices[0].finish_reason != "length":
                    failures.append(f"client {k} step {step}: ended {chunks[-1].choices[0].finish_reason}")
            except openai.OpenAIError as e:
                failures.append(f"client {k} step {step}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    started.wait()
    drained = replicas["r1"]
    while not httpx.get(drained.url + "/health").json()["generating"]:  # r1 is answering one of the streams
        assert any(t.is_alive() for t in threads), "the clients ended before r1 answered one of them"
        time.sleep(0.05)
    drained.proc.send_signal(signal.SIGTERM)
    assert drained.proc.wait(120) == 143
    gone = time.monotonic()
    for t in threads:
        t.join(600)
    assert not failures, failures
    assert "drained: every request in flight has ended" in drained.stderr
    assert {name for name, at in served if at > gone} <= {"r2"}, "once r1 is out, r2 answers"
    router.until({"r1": "DOWN"})

    # r1's conversation goes on on r2 (the shared store), then on r1 again once it is back
    raw = c.responses.with_raw_response.create(model="x", previous_response_id=made["r1"], input="go on",
                                               max_output_tokens=4)
    assert raw.headers["x-bmoe-replica"] == "r2" and raw.parse().output_text
    again = start_replica(demo8, "r1", int(drained.url.rsplit(":", 1)[1]), store)
    try:
        router.until({"r1": "UP"})
        raw = c.responses.with_raw_response.create(model="x", previous_response_id=made["r1"], input="go on",
                                                   max_output_tokens=4)
        assert raw.headers["x-bmoe-replica"] == "r1" and raw.parse().output_text
    finally:
        assert again.stop() == 143
