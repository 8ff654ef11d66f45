"""`bmoe-server` as a user runs it: a real process on a real loopback port, the official `openai`
client for completions and chat (streaming and not), raw HTTP (httpx) for the error cases."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from bmoe.base import telemetry
from tests import spec_lines
from tests.conftest import REPO, bmoe_segments, run_cli

KEY = "test-key-123"
PROMPT = "Once upon a time there was a king"
CHAT_PROMPT = "hello there how are you"
FLAGS = ["-t", "1", "--io-threads", "2", "--cache-mb", "1", "-c", "4096"]
LONG = 3500  # max_tokens of a generation the test stops long before its end


class Server:
    """bmoe-server on a free loopback port (--port 0); ready once it said where and /health answers."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bmoe.server", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.stderr_lines: list[str] = []
        self.url = ""
        self._said = threading.Event()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self._said.wait(600)
        assert self.url, f"bmoe-server did not start: {self.stderr}"
        assert httpx.get(self.url + "/health").json()["status"] == "ok"

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            self.stderr_lines.append(line)
            m = re.match(r"bmoe: serving \S+ at (http://\S+)/v1 ", line)
            if m:
                self.url = m.group(1)
                self._said.set()
        self._said.set()  # it ended

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    def workers(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children()

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(60)
        finally:
            self.proc.kill()


@pytest.fixture(scope="module")
def model(small_moe) -> str:
    return str(small_moe)


@pytest.fixture(scope="module")
def server(model: str) -> Server:
    s = Server("-m", model, *FLAGS, "--queue", "1", env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def cli_answer(model: str, prompt: str, n: int, *args: str) -> str:
    r = run_cli("-m", model, "-p", prompt, "-n", str(n), "--progress", *FLAGS, *args)
    assert r.returncode == 0, r.stderr
    return telemetry.parse_output(r.stdout).answer


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def completion(server: Server, prompt: str = PROMPT, n: int = 16) -> str:
    return server.client().completions.create(model="x", prompt=prompt, max_tokens=n).choices[0].text


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=auth()).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


# ---- answers -------------------------------------------------------------------------------------


def test_completions_equal_bmoe_cli_streamed_or_not(model: str, server: Server) -> None:
    c = server.client()
    assert [m.id for m in c.models.list()] == [os.path.basename(model)[:-len(".gguf")]]
    want = cli_answer(model, PROMPT, 16)
    assert want.strip() and want == cli_answer(model, PROMPT, 16, "--no-stream")
    r = c.completions.create(model="x", prompt=PROMPT, max_tokens=16)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == r.model_extra["bmoe"]["prompt_tokens"] > 0
    b = r.model_extra["bmoe"]
    assert b["tok_s"] > 0 and b["mib_per_token"] > 0 and 0 <= b["cache_hit_pct"] <= 100 and "stall_s_per_token" in b
    chunks = list(c.completions.create(model="x", prompt=PROMPT, max_tokens=16, stream=True,
                                       stream_options={"include_usage": True}))
    *chunks, used = chunks  # usage on request, in a last chunk of its own
    assert "".join(ch.choices[0].text for ch in chunks) == want
    tokens = [ch.model_extra["bmoe"] for ch in chunks[:-1]]
    assert [t["step"] for t in tokens] == list(range(1, 17)) and tuple(tokens[0]) == spec_lines.PROGRESS_KEYS[:-1]
    assert chunks[-1].choices[0].finish_reason == "length" and used.choices == [] and used.usage.completion_tokens == 16


def test_chat_equals_bmoe_cli_chat_streamed_or_not(model: str, server: Server) -> None:
    c = server.client()
    want = cli_answer(model, CHAT_PROMPT, 12, "--chat")
    msgs = [{"role": "user", "content": CHAT_PROMPT}]
    r = c.chat.completions.create(model="x", messages=msgs, max_tokens=12)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model="x", messages=msgs, max_tokens=12, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].model_extra["bmoe"]["completion_tokens"] == 12
    # the backend configuration, as OpenAI's answers name it: the program and its version, on every object
    fingerprint = f"bmoe-{importlib.metadata.version('bmoe')}"
    assert r.system_fingerprint == fingerprint and {ch.system_fingerprint for ch in chunks} == {fingerprint}


def test_a_chat_that_goes_on_reuses_the_kv(server: Server) -> None:
    c = server.client()
    msgs = [{"role": "user", "content": CHAT_PROMPT}]
    first = c.chat.completions.create(model="x", messages=msgs, max_tokens=8)
    b1 = first.model_extra["bmoe"]
    assert b1["prefill_tokens"] == b1["prompt_tokens"]
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "and then what happened"}]
    second = c.chat.completions.create(model="x", messages=msgs, max_tokens=8)
    b2 = second.model_extra["bmoe"]
    assert b2["prompt_tokens"] - b2["prefill_tokens"] >= b1["prompt_tokens"], (b1, b2)
    # the first message alone again is a new chat: prefilled whole, the same answer
    again = c.chat.completions.create(model="x", messages=msgs[:1], max_tokens=8)
    assert again.model_extra["bmoe"]["prefill_tokens"] == b1["prompt_tokens"]
    assert again.choices[0].message.content == first.choices[0].message.content


def test_stop_and_sampling_options(server: Server) -> None:
    c = server.client()
    full = completion(server, n=12)
    word = full.split()[3]
    r = c.completions.create(model="x", prompt=PROMPT, max_tokens=12, stop=[word])
    assert r.choices[0].text == full[:full.index(word)] and r.choices[0].finish_reason == "stop"
    kw = dict(model="x", prompt=PROMPT, max_tokens=12, temperature=1.5, top_p=1.0, extra_body={"top_k": 0})
    a = c.completions.create(seed=3, **kw).choices[0].text
    assert a == c.completions.create(seed=3, **kw).choices[0].text
    assert len({c.completions.create(seed=s, **kw).choices[0].text for s in range(4)}) > 1
    assert completion(server, n=12) == full


# ---- bad requests --------------------------------------------------------------------------------


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err and "code" in err
    assert "Traceback" not in r.text
    return err


BAD_BODIES = [
    {"prompt": PROMPT, "max_tokens": "5"},
    {"prompt": PROMPT, "max_tokens": 0},
    {"prompt": PROMPT, "temperature": -1},
    {"prompt": PROMPT, "top_p": 0},
    {"prompt": PROMPT, "n": 17},
    {"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]},
    {"prompt": PROMPT, "stream": "yes"},
    {"prompt": [PROMPT, 2.5]},
    {"prompt": 5},
    {},
]
BAD_CHATS = [{"messages": []}, {"messages": [{"role": "robot", "content": "hi"}]},
             {"messages": [{"role": "user"}]}, {"messages": "hi"},
             {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}]


def _malformed(rng: random.Random) -> bytes:
    kind = rng.random()
    good = json.dumps({"prompt": PROMPT, "max_tokens": 4}).encode()
    if kind < 0.3:
        return good[:rng.randint(0, len(good) - 1)]
    if kind < 0.5:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 60)))
    if kind < 0.7:
        return json.dumps(rng.choice([None, 1, "x", [1, 2], True, 2.5])).encode()
    if kind < 0.8:
        return b"[" * rng.randint(10, 3000)
    b = bytearray(good)
    b[rng.randrange(1, len(b) - 1)] = ord(rng.choice('{}[]",:'))
    return bytes(b)


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server: Server) -> None:
    want = completion(server)
    url = server.url + "/v1"
    with httpx.Client(headers=auth(), timeout=60) as h:
        for body in BAD_BODIES:
            error_of(h.post(url + "/completions", json=body), 400)
        for body in BAD_CHATS:
            error_of(h.post(url + "/chat/completions", json=body), 400)
        err = error_of(h.post(url + "/completions", json={"prompt": "word " * 5000, "max_tokens": 4}), 400)
        assert err["code"] == "context_length_exceeded" and "exceeds the context of 4096 tokens" in err["message"]
        err = error_of(h.post(url + "/completions", content=b'{"prompt": "x",',
                              headers={"content-type": "application/json"}), 400)
        assert err["code"] == "invalid_json"
        rng = random.Random(15)
        malformed = [b for b in (_malformed(rng) for _ in range(200)) if not _runs(b)][:100]
        assert len(malformed) == 100
        for body in malformed:
            error_of(h.post(url + "/completions", content=body, headers={"content-type": "application/json"}), 400)
        err = error_of(h.post(url + "/completions", json={"prompt": "x" * 2_000_000}), 413)
        assert err["code"] == "request_too_large"
        error_of(h.get(url + "/nowhere"), 404)
        error_of(h.get(url + "/completions"), 405)
    assert completion(server) == want
    assert server.proc.poll() is None


# OpenAI's bounds on `metadata` (bmoe.server.request_base): 16 keys at the bounds, and one past each bound
METADATA_AT_BOUNDS = {f"{i:064d}": "v" * 512 for i in range(16)}
METADATA_PAST = [({f"k{i}": "v" for i in range(17)}, "metadata", "at most 16 keys"),
                 ({"k" * 65: "v"}, "metadata." + "k" * 65, "a key of at most 64 characters"),
                 ({"k": "v" * 513}, "metadata.k", "a value of at most 512 characters")]


def check_metadata_bounds(create: Callable[[dict[str, str]], Any]) -> Any:
    """`create(metadata)`, a route's call through the openai client: a 400 naming the field past each of
    OpenAI's bounds; at them, the answer (returned)."""
    for metadata, param, words in METADATA_PAST:
        with pytest.raises(openai.BadRequestError) as e:
            create(metadata)
        assert e.value.body["param"] == param and words in e.value.message, (param, e.value.body)
    return create(METADATA_AT_BOUNDS)


def test_chat_metadata_is_held_to_openais_bounds(server: Server) -> None:
    c = server.client()
    r = check_metadata_bounds(lambda metadata: c.chat.completions.create(
        model="x", messages=[{"role": "user", "content": CHAT_PROMPT}], max_tokens=2, metadata=metadata))
    assert r.choices[0].message.content is not None


def _runs(body: bytes) -> bool:
    """A mutated body that is still a valid completion request (it would run, not fail)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and isinstance(obj.get("prompt"), str)


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}


STRINGS = {"type": "array", "items": {"type": "string"}}
# (endpoint, body, the param the 400 names, words of its message): each crashed or stalled the
# server before bmoe.chat.limits (issue 32)
HOSTILE = [
    ("chat", _schema({**STRINGS, "maxItems": 100000}), "response_format.json_schema.schema.maxItems",
     "100000 is more than the 1000 repetitions"),
    ("chat", _schema({**STRINGS, "minItems": 100000}), "response_format.json_schema.schema.minItems", "100000"),
    ("chat", _schema({"type": "string", "maxLength": 10_000_000}), "response_format.json_schema.schema.maxLength",
     "10000000 is more than the 1000"),
    ("completions", _schema({"type": "string", "minLength": 50_000}), "response_format.json_schema.schema.minLength",
     "50000 is more than the 1000"),
    ("completions", _schema({"type": "string", "pattern": "^x{1,1000000}$"}),
     "response_format.json_schema.schema.pattern", "pattern {1,1000000}: 1000000 is more than the 1000"),
    ("chat", {"grammar": 'root ::= "a"{0,100000}'}, "grammar", "grammar {0,100000}: 100000 is more than the 1000"),
    ("completions", {"grammar": "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000}, "grammar",
     "nests 100000 groups deep"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": {**STRINGS, "maxItems": 100000}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters.properties.xs.maxItems", "100000 is more than the 1000"),
    ("completions", {"stop": ["x" * 1_000_000]}, "stop[0]", "1000000 characters, more than the 1024"),
    ("completions", {"stop": [f"s{i}" for i in range(5000)]}, "stop", "4"),
    ("completions", {"max_tokens": 1_000_000_000}, "prompt", "context"),
    ("chat", {"n": 1000}, "n", ""),
]


def hostile_requests() -> list[tuple[str, dict, str, str]]:
    """HOSTILE as each route takes it, the Responses API's and Ollama's too: (path, body, the field its
    400 names as that route's API does, words of its message). `n` is the chat route's alone."""
    out = []
    for endpoint, body, param, words in HOSTILE:
        chat = endpoint == "chat"
        base = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": PROMPT}
        out.append((f"/v1/{'chat/completions' if chat else 'completions'}", {**base, "max_tokens": 4, **body},
                    param, words))
        if "n" in body:
            continue
        responses: dict = {"input": "Hi", "max_output_tokens": 4}
        ollama: dict = {**base, "stream": False, "options": {"num_predict": 4}}
        if not chat:
            ollama["raw"] = True
        for key, value in body.items():
            if key == "response_format":
                schema = value["json_schema"]["schema"]
                responses["text"] = {"format": {"type": "json_schema", "name": "n", "schema": schema}}
                ollama["format"] = schema
            elif key == "tools":
                responses["tools"] = [{"type": "function", **t["function"]} for t in value]
                ollama["tools"] = value
            elif key in ("stop", "max_tokens"):
                responses["max_output_tokens" if key == "max_tokens" else key] = value
                ollama["options"]["num_predict" if key == "max_tokens" else key] = value
            else:
                responses[key] = ollama[key] = value
        out.append(("/v1/responses", responses, param.replace("response_format.json_schema.schema",
                                                              "text.format.schema")
                    .replace("tools[0].function.", "tools[0].").replace("prompt", "input"), words))
        out.append(("/api/chat" if chat else "/api/generate", ollama,
                    param.replace("response_format.json_schema.schema", "format").replace("stop", "options.stop"),
                    words))
    return out


def test_hostile_grammars_and_stops_get_400s_while_another_stream_goes_on(server: Server) -> None:
    """Each request of HOSTILE, on every route that takes its fields, gets its 400 naming the bound while
    another client's stream runs, which goes on generating; the server answers the next request as before.
    Ollama's error object is the message alone, which names the field first (or, for the context, in it)."""
    want = completion(server)
    with httpx.Client(headers=auth(), timeout=120) as other, httpx.Client(headers=auth(), timeout=120) as h:
        with _stream(other, server, LONG) as running:
            tokens = running.iter_lines()
            _first_token(tokens)
            for path, body, param, words in hostile_requests():
                r = h.post(server.url + path, json=body)
                if path.startswith("/api/"):
                    assert r.status_code == 400, (path, r.text)
                    message = r.json()["error"]
                    assert param in message and words in message, (path, param, message)
                    continue
                err = error_of(r, 400)
                assert err["param"] == param and words in err["message"], (path, param, err)
            _first_token(tokens)  # the stream beside them goes on
    assert completion(server) == want
    assert server.proc.poll() is None


def test_the_api_key_guards_every_route_but_health(server: Server) -> None:
    url = server.url
    for path in ("/v1/models", "/metrics"):
        error_of(httpx.get(url + path), 401)
        assert error_of(httpx.get(url + path, headers=auth("wrong")), 401)["code"] == "invalid_api_key"
        assert httpx.get(url + path, headers=auth()).status_code == 200
    error_of(httpx.post(url + "/v1/completions", json={"prompt": PROMPT}), 401)
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").completions.create(model="x", prompt=PROMPT, max_tokens=2)
    assert httpx.get(url + "/health").status_code == 200


def test_every_route_is_counted_under_a_metrics_label_of_its_own() -> None:
    """`bmoe_requests_total` labels a request with the path its route was declared with: every registered
    path gets its own label (one for every /v1/responses/{response_id}), and a path no route has is
    "other". The app is built over a stand-in model: no request here reaches it (the key is missing)."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient
    from starlette.routing import Route

    from bmoe.server.app import UNROUTED, create_app
    from bmoe.server.connections import BodyLimits
    from bmoe.server.grammar_pool import GrammarPool

    stats = SimpleNamespace(engine=SimpleNamespace(resident_bytes=0, budget_bytes=0), load_s=0.0)
    model = SimpleNamespace(name="m", slots=[], stats=stats)
    sched = SimpleNamespace(waiting=[], active=[], capacity=1, batching=SimpleNamespace(steps={}),
                            close=lambda: None, join=lambda: None, decodes=0, prefills=0, decoding=0,
                            embedded_tokens=0, embedded_s=0.0)
    limits = BodyLimits(size=1024, timeout=10.0, rate=1024.0, total=1 << 20)
    app = create_app(model, sched, api_key=KEY, limits=limits, grammars=GrammarPool("m.gguf", 1, 0, 1.0), n_predict=8)
    routes = [r for r in app.routes if isinstance(r, Route)]
    assert len({r.path for r in routes}) >= 28  # every API's routes, the metrics, the events, the pages
    with TestClient(app) as client:
        for r in routes:
            client.request(sorted(r.methods)[0], re.sub(r"\{[^}]+\}", "x", r.path))
        client.get("/v1/no/such/route")
        text = client.get("/metrics", headers=auth()).text
    labels = re.findall(r'^bmoe_requests_total\{route="([^"]+)"', text, re.M)
    assert set(labels) == {r.path for r in routes} | {UNROUTED}


def test_a_network_address_needs_a_key_or_insecure(model: str) -> None:
    r = subprocess.run([sys.executable, "-m", "bmoe.server", "-m", model, "--host", "0.0.0.0"], capture_output=True,
                       text=True, cwd=REPO, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "BMOE_API_KEY"})
    assert r.returncode == 2 and "--host 0.0.0.0 lets other machines reach the model" in r.stderr
    assert "--insecure" in r.stderr and "Traceback" not in r.stderr


def test_help_has_examples() -> None:
    r = subprocess.run([sys.executable, "-m", "bmoe.server", "--help"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "examples:" in r.stdout and "curl" in r.stdout and "--api-key" in r.stdout
    assert "--cache-mb" in r.stdout and "--session" not in r.stdout


# ---- the queue, disconnects, shutdown ------------------------------------------------------------


def _stream(h: httpx.Client, server: Server, max_tokens: int, prompt: str = PROMPT):
    return h.stream("POST", server.url + "/v1/completions",
                    json={"prompt": prompt, "max_tokens": max_tokens, "stream": True})


def _first_token(lines) -> dict:
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("the stream ended before its first token")


def test_the_queue_reports_positions_and_is_full_with_429(server: Server) -> None:
    want = completion(server, n=8)
    with httpx.Client(headers=auth(), timeout=120) as a, httpx.Client(headers=auth(), timeout=120) as b:
        with _stream(a, server, LONG) as running:
            assert running.headers["x-queue-position"] == "0"
            tokens = running.iter_lines()  # kept: a dropped iterator closes the connection
            _first_token(tokens)  # it is generating
            with b.stream("POST", server.url + "/v1/completions",
                          json={"prompt": PROMPT, "max_tokens": 8, "stream": True}) as waiting:
                assert waiting.headers["x-queue-position"] == "1"
                full = httpx.post(server.url + "/v1/completions", headers=auth(), json={"prompt": PROMPT})
                assert error_of(full, 429)["code"] == "queue_full"
                full = httpx.post(server.url + "/v1/messages", headers=auth(), json={
                    "model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": PROMPT}]})
                assert full.status_code == 529 and full.json()["error"]["type"] == "overloaded_error", \
                    "Anthropic's clients read a full queue as overloaded"
                running.close()  # the client goes: its generation stops, the waiting one runs
                lines = list(waiting.iter_lines())
        assert ": queue position 1" in lines and ": running" in lines and lines[-2:] == ["data: [DONE]", ""]
        text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines
                       if x.startswith("data: {"))
        assert text == want


def test_a_client_that_drops_cancels_its_generation(server: Server) -> None:
    want = completion(server, n=8)
    cancelled, generated = metric(server, 'bmoe_generations_total{finish_reason="cancelled"}'), \
        metric(server, "bmoe_generated_tokens_total")
    with httpx.Client(headers=auth(), timeout=120) as h:  # mid-stream
        with _stream(h, server, LONG) as r:
            _first_token(r.iter_lines())
    t0 = time.monotonic()
    assert completion(server, n=8) == want
    took = time.monotonic() - t0

    async def drop_a_waiting_answer() -> None:  # a non-streamed request, mid-generation
        async with httpx.AsyncClient(headers=auth(), timeout=120) as h:
            task = asyncio.create_task(h.post(server.url + "/v1/completions",
                                              json={"prompt": PROMPT, "max_tokens": LONG}))
            async with httpx.AsyncClient() as probe:
                while not (await probe.get(server.url + "/health")).json()["generating"]:
                    assert not task.done()
            task.cancel()

    asyncio.run(drop_a_waiting_answer())
    assert completion(server, n=8) == want
    assert metric(server, 'bmoe_generations_total{finish_reason="cancelled"}') == cancelled + 2
    # both stopped long before their LONG tokens: all of these generations together made far fewer
    assert metric(server, "bmoe_generated_tokens_total") - generated < LONG
    assert took < 30, f"the next request waited {took:.1f} s"


def test_sigterm_mid_stream_exits_143_and_leaves_nothing(model: str) -> None:
    """Without a drain (--drain-seconds 0: tests/test_server_replicas.py has the drain), SIGTERM cuts the stream."""
    before = bmoe_segments()
    s = Server("-m", model, *FLAGS, "--drain-seconds", "0")
    workers = s.workers()
    assert len(workers) == 2 and bmoe_segments() - before
    with httpx.Client(timeout=120) as h, _stream(h, s, LONG) as r:
        lines = r.iter_lines()
        _first_token(lines)
        s.proc.send_signal(signal.SIGTERM)
        rest = list(lines)
    rc = s.stop()
    assert rc == 143, s.stderr
    events = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
    assert events[-1]["error"]["code"] == "shutting_down" and rest[-2:] == ["data: [DONE]", ""]
    assert "Traceback" not in s.stderr
    assert bmoe_segments() == before
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_while_idle_exits_with_its_code(model: str, sig: int, code: int) -> None:
    before = bmoe_segments()
    s = Server("-m", model, *FLAGS)
    workers = s.workers()
    assert s.stop(sig) == code and bmoe_segments() == before
    assert "Traceback" not in s.stderr
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


def test_a_lane_failure_is_a_500_and_ends_the_server_with_exit_1(model: str) -> None:
    """Lanes that keep dying (past the pool's restarts) fail the request and end the server, as the session."""
    before = bmoe_segments()
    s = Server("-m", model, "-t", "1", "--io-threads", "2", "--cache-mb", "0", "-c", "4096")
    with httpx.Client(timeout=120) as h, _stream(h, s, LONG) as r:
        lines = r.iter_lines()
        _first_token(lines)
        while s.proc.poll() is None:
            try:
                lanes = s.workers()
                for lane in lanes:
                    lane.kill()
                psutil.wait_procs(lanes, timeout=10)
                s.proc.wait(0.05)  # it ends, or its new lanes are killed in turn
            except (psutil.Error, subprocess.TimeoutExpired):
                pass
        rest = list(lines)
    assert s.proc.wait() == 1, s.stderr
    errors = [json.loads(x[6:])["error"] for x in rest if x.startswith('data: {"error"')]
    assert errors and errors[-1]["code"] == "internal_error" and "generation failed" in errors[-1]["message"]
    ref = re.search(r"\(error ([0-9a-f]+);", errors[-1]["message"])  # the details are on stderr under its id
    assert rest[-2:] == ["data: [DONE]", ""] and "bmoe-server: error:" in s.stderr
    assert ref and re.search(rf"error {ref.group(1)}: .*lane", s.stderr, re.I), (errors, s.stderr)
    assert bmoe_segments() == before


# ---- the demo model (no -m) -------------------------------------------------------------------


def test_no_model_argument_serves_the_demo_model(demo_default: tuple[Path, float]) -> None:
    path, _ = demo_default
    s = Server("-t", "2")
    try:
        c = s.client("none")
        assert [m.id for m in c.models.list()] == [path.stem]
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        got = c.chat.completions.create(model="x", messages=msgs, max_tokens=6).choices[0].message.content
    finally:
        assert s.stop() == 143
    r = run_cli("-p", "What is the capital of France?", "-n", "6", "--chat", "--progress", "-t", "2", timeout=600)
    assert r.returncode == 0, r.stderr
    assert got == telemetry.parse_output(r.stdout).answer and got.strip()
