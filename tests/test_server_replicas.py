"""bmoe-server as one of several replicas behind a router (issue 53; docs/deploy.md), here without the router:
real servers on loopback ports sharing one `--response-store sqlite:PATH`, driven by the official `openai` client
and raw HTTP. Every answer names its replica (X-Bmoe-Replica), refusals too; a Responses id ends with it; a
conversation stored on one replica goes on on the other (the same text; only the replica that answered it reuses
its KV) and after a replica's restart. SIGTERM drains: the request in flight runs to its end while new ones get 503
with Retry-After and /health says draining, then the process exits 143; one still running at --drain-seconds ends
with the shutdown's error event. tests/test_router.py (opt-in) puts HAProxy in front; here HAProxy only checks
deploy/haproxy.cfg (skipped where it is not installed)."""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import REPO
from tests.test_close import _killed_at_the_end, _said
from tests.test_server import FLAGS, KEY, LONG, Server, _first_token, _stream, auth, error_of, metric

HELLO = "hello there how are you"
ENDS = ("response.completed", "response.incomplete")  # a Responses stream's last event when it did not fail
ASK = "what is the sky made of"  # a conversation no replica has seen before


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:{tmp_path_factory.mktemp('store') / 'responses.db'}"


def replica(model: Path, name: str, store: str) -> Server:
    return Server("-m", str(model), *FLAGS, "--replica-id", name, "--response-store", store,
                  env={"BMOE_API_KEY": KEY})


@pytest.fixture(scope="module")
def pair(small_moe: Path, store: str) -> Iterator[dict[str, Server]]:
    servers = {name: replica(small_moe, name, store) for name in ("a", "b")}
    yield servers
    for s in servers.values():
        s.stop()  # nothing happens to one a test stopped


def test_every_answer_names_its_replica(pair: dict[str, Server]) -> None:
    a, b = pair["a"], pair["b"]
    raw = a.client().chat.completions.with_raw_response.create(
        model="x", messages=[{"role": "user", "content": HELLO}], max_tokens=2)
    assert raw.headers["x-bmoe-replica"] == "a" and raw.parse().choices[0].message.content
    refused = httpx.get(a.url + "/v1/models")  # no key: refused before any route runs, and still named
    assert refused.status_code == 401 and refused.headers["x-bmoe-replica"] == "a"
    health = httpx.get(b.url + "/health")
    assert health.headers["x-bmoe-replica"] == "b" and health.json()["replica"] == "b"
    with httpx.stream("POST", b.url + "/v1/responses", headers=auth(), timeout=60,
                      json={"input": HELLO, "max_output_tokens": 2, "stream": True}) as r:
        assert r.headers["x-bmoe-replica"] == "b"
        created = next(json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: "))
    assert created["response"]["id"].endswith("_b")


def test_a_store_busy_with_another_replicas_write_holds_the_answers_end_not_the_server(
        pair: dict[str, Server], store: str) -> None:
    """Another process holds the SQLite file's write lock (as a replica does while it keeps a response): the
    answer's text streams, its end waits for the store (so a client that goes on from it at once finds it), and
    meanwhile the server answers /health and /metrics (before this was off the event loop, it answered nothing
    for the store's 5 s wait and then failed the answer with a 503); once the lock is let go the answer ends
    and is kept."""
    a, b = pair["a"], pair["b"]
    events: list[dict] = []
    texting = threading.Event()  # its first token came: the job runs

    def read() -> None:
        with httpx.stream("POST", a.url + "/v1/responses", headers=auth(), timeout=600,
                          json={"input": ASK, "max_output_tokens": 4, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1]["type"] == "response.output_text.delta":
                        texting.set()

    kept = metric(a, "bmoe_stored_responses")
    other = sqlite3.connect(store.removeprefix("sqlite:"), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # the write lock, held until COMMIT
    reader = threading.Thread(target=read)
    try:
        reader.start()
        assert texting.wait(600)
        while httpx.get(a.url + "/health").json()["generating"]:  # each answered while the store waits
            pass
        assert metric(a, "bmoe_stored_responses") == kept  # the scrape answers too (its gauges query the store)
        assert all(e["type"] not in (*ENDS, "error") for e in events)  # the end waits for the store
    finally:
        other.execute("COMMIT")
        other.close()
        reader.join()
    last = events[-1]
    assert last["type"] in ENDS, last  # ended (at max_output_tokens: incomplete), not failed
    assert b.client().responses.retrieve(last["response"]["id"]).output_text == last["response"]["output"][0][
        "content"][0]["text"]


def test_a_conversation_goes_on_on_either_replica_and_after_a_restart(pair: dict[str, Server], small_moe: Path,
                                                                     store: str) -> None:
    ca, cb = pair["a"].client(), pair["b"].client()
    first = ca.responses.create(model="x", input=ASK, max_output_tokens=6)
    assert first.id.startswith("resp_") and first.id.endswith("_a")
    on_b = cb.responses.create(model="x", previous_response_id=first.id, input="and then?", max_output_tokens=6)
    on_a = ca.responses.create(model="x", previous_response_id=first.id, input="and then?", max_output_tokens=6)
    assert on_b.id.endswith("_b") and on_b.output_text == on_a.output_text and on_a.output_text.strip()
    assert on_b.usage.input_tokens == on_a.usage.input_tokens
    # only the replica that answered the conversation held its KV: what the router's affinity is for
    assert on_a.usage.input_tokens_details.cached_tokens > 0 == on_b.usage.input_tokens_details.cached_tokens
    assert cb.responses.retrieve(first.id).output_text == first.output_text

    assert pair["a"].stop() == 143  # idle: the drain has nothing to wait for
    again = replica(small_moe, "a", store)
    try:
        c = again.client()
        assert c.responses.retrieve(on_b.id).output_text == on_b.output_text
        more = c.responses.create(model="x", previous_response_id=on_b.id, input="why?", max_output_tokens=4)
        assert more.usage.input_tokens > on_b.usage.input_tokens and more.id.endswith("_a")
        c.responses.delete(on_b.id)
    finally:
        assert again.stop() == 143
    with pytest.raises(openai.BadRequestError, match="send the whole conversation as input"):
        cb.responses.create(model="x", previous_response_id=on_b.id, input="why?", max_output_tokens=4)


def test_sigterm_drains_the_request_in_flight_and_refuses_new_ones(small_moe: Path) -> None:
    """The lanes are stopped (SIGSTOP) after the stream's first token, so its generation waits for reads while the
    drain is looked at; let go, it runs to its end and the server exits."""
    s = Server("-m", str(small_moe), *FLAGS, "--lane-timeout", "600")
    lanes = s.workers()
    with _killed_at_the_end(s, lanes), httpx.Client(timeout=600) as h, _stream(h, s, 12) as r:
        lines = r.iter_lines()
        _first_token(lines)
        for lane in lanes:
            lane.suspend()
        s.proc.send_signal(signal.SIGTERM)
        _said(s, "draining")
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert "x-bmoe-replica" not in health.headers and "replica" not in health.json(), \
            "a server started without --replica-id names no machine"
        new = httpx.post(s.url + "/v1/completions", json={"prompt": HELLO, "max_tokens": 2})
        assert error_of(new, 503)["code"] == "draining" and new.headers["retry-after"] == "1"
        assert new.headers["connection"] == "close"
        assert metric(s, "bmoe_draining") == 1 and metric(s, "bmoe_requests_in_flight") == 1
        assert metric(s, 'bmoe_requests_total{route="/v1/completions",status="503"}') == 1
        for lane in lanes:
            lane.resume()
        rest = list(lines)
    events = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
    assert not [e for e in events if "error" in e] and events[-1]["choices"][0]["finish_reason"] == "length"
    assert rest[-2:] == ["data: [DONE]", ""]
    assert s.proc.wait(60) == 143 and "drained: every request in flight has ended" in s.stderr


def test_a_request_still_running_at_the_drains_bound_ends_with_an_error(small_moe: Path) -> None:
    s = Server("-m", str(small_moe), *FLAGS, "--drain-seconds", "1")
    with httpx.Client(timeout=120) as h, _stream(h, s, LONG) as r:
        lines = r.iter_lines()
        _first_token(lines)
        s.proc.send_signal(signal.SIGTERM)
        rest = list(lines)
    events = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
    assert events[-1]["error"]["code"] == "shutting_down" and rest[-2:] == ["data: [DONE]", ""]
    assert s.stop() == 143 and "the drain's 1 s have passed: the 1 still in flight end now" in s.stderr


def test_the_routers_config_in_the_repository_is_valid() -> None:
    """deploy/haproxy.cfg as HAProxy reads it (tests/test_router.py, opt-in, runs it in front of replicas)."""
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("HAProxy is not installed (apt-get install haproxy)")
    checked = subprocess.run([haproxy, "-c", "-f", str(REPO / "deploy" / "haproxy.cfg")], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0 and "Configuration file is valid" in checked.stdout, checked.stderr
