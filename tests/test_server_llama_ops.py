"""What llama-server's operators and their tools meet, on a real bmoe-server (raw HTTP): several `--host`
addresses on one port, `--allowed-origin localhost` (every loopback page, any port; CORS and the Origin
check agreeing), `/slots` (each KV sequence's state, `fail_on_no_slot`, slot files refused by name),
llama-server's `llamacpp:*` series on /metrics and its Process-Start-Time-Unix header, llama-server's
error types on its routes, the public files a browser that used llama-server's UI asks for, and
`--no-slots`, `--no-metrics`, `--no-webui` (501s and 404s)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from importlib import metadata

import httpx
import psutil
import pytest

from tests.conftest import REPO
from tests.test_server import FLAGS, KEY, PROMPT, Server, auth, error_of, metric

LOOPBACK_PAGES = ("http://localhost", "http://localhost:8080", "http://127.0.0.1", "http://127.0.0.1:3000",
                  "http://[::1]", "http://[::1]:3000", "https://app.localhost:5173")
FOREIGN_PAGES = ("http://web.mydomain.fr", "http://evil.com", "http://notlocalhost", "http://localhost.evil.com",
                 "null")


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def keyed(small_moe) -> Iterator[Server]:
    """Two sequences, a key, every loopback page admitted, IPv6's loopback beside IPv4's when it has one, and
    two names and two tags for the model."""
    hosts = "127.0.0.1,::1" if ipv6_loopback() else "127.0.0.1"
    s = Server("-m", str(small_moe), *FLAGS, "--parallel", "2", "--host", hosts, "--allowed-origin", "localhost",
               "--alias", "b-moe, a-moe,b-moe", "--tags", "small,chat", env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def bare(small_moe) -> Iterator[Server]:
    """No key (the Origin check on), every loopback page admitted, and no /slots, /metrics or chat page."""
    s = Server("-m", str(small_moe), *FLAGS, "--allowed-origin", "localhost", "--no-slots", "--no-metrics",
               "--no-webui", env={k: v for k, v in os.environ.items() if k != "BMOE_API_KEY"})
    yield s
    s.stop()


def port(server: Server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def post(url: str, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=120)


def preflight(server: Server, origin: str) -> httpx.Response:
    return httpx.options(server.url + "/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"})


# ---- several addresses ---------------------------------------------------------------------------


def test_every_listen_address_serves_the_same_server(keyed: Server) -> None:
    if not ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback")
    for url in (keyed.url, f"http://[::1]:{port(keyed)}"):
        assert httpx.get(url + "/health").status_code == 200
        error_of(post(url, "/v1/completions", {}), 401)
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True},
                          headers=auth(), timeout=120) as r:
            assert r.status_code == 200 and sum(line.startswith("data: ") for line in r.iter_lines()) > 1


def test_an_address_that_cannot_listen_or_needs_a_key_is_refused_before_the_model_loads(small_moe) -> None:
    env = {k: v for k, v in os.environ.items() if k != "BMOE_API_KEY"}
    cmd = [sys.executable, "-m", "bmoe.server", "-m", str(small_moe), "--port", "0"]
    r = subprocess.run([*cmd, "--host", "127.0.0.1, 127.0.0.1"], capture_output=True, text=True, cwd=REPO,
                       timeout=120, env=env)  # the second socket finds the first's port taken
    assert r.returncode == 1 and re.search(r"cannot listen on 127\.0\.0\.1:\d+", r.stderr), r.stderr
    r = subprocess.run([*cmd, "--host", "127.0.0.1,0.0.0.0"], capture_output=True, text=True, cwd=REPO,
                       timeout=120, env=env)
    assert r.returncode == 2 and "--host 0.0.0.0 lets other machines reach the model" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# ---- CORS for the loopback pages -----------------------------------------------------------------


def test_allowed_origin_localhost_admits_every_loopback_page_and_no_other(keyed: Server, bare: Server) -> None:
    for origin in LOOPBACK_PAGES:  # the header spelt as llama-server spells it, for who looks it up so
        r = preflight(keyed, origin)
        assert r.status_code == 200 and dict(r.headers.raw)[b"Access-Control-Allow-Origin"] == origin.encode()
        r = post(bare.url, "/completion", {"prompt": PROMPT, "n_predict": 1}, origin=origin)  # no key: Origin checked
        assert r.status_code == 200 and dict(r.headers.raw)[b"Access-Control-Allow-Origin"] == origin.encode()
    for origin in FOREIGN_PAGES:
        # as llama-server answers it: 200 and no CORS header, so the browser refuses the page's request
        r = preflight(keyed, origin)
        assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers), origin
        r = post(bare.url, "/completion", {"prompt": PROMPT, "n_predict": 1}, origin=origin)
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers, origin
        assert error_of(r, 403)["type"] == "permission_error"  # llama-server's type on its route


def test_an_origin_flag_that_names_no_origin_is_refused(small_moe) -> None:
    r = subprocess.run([sys.executable, "-m", "bmoe.server", "-m", str(small_moe), "--allowed-origin", "web.example"],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and "'web.example' is not an origin" in r.stderr and "localhost" in r.stderr


# ---- /metrics ------------------------------------------------------------------------------------


def llama_series(server: Server) -> tuple[httpx.Response, dict[str, tuple[str, float]]]:
    """/metrics and its llamacpp: samples by name (a labeled one's with its labels): (type, value); each series has
    its own HELP and TYPE lines."""
    r = httpx.get(server.url + "/metrics", headers=auth())
    assert r.status_code == 200
    types = dict(re.findall(r"^# TYPE (llamacpp:\S+) (\w+)$", r.text, re.M))
    out = {}
    for name, value in re.findall(r"^(llamacpp:\S+) (\S+)$", r.text, re.M):
        series = name.split("{")[0]
        assert series in types and f"# HELP {series} " in r.text, name
        out[name] = (types[series], float(value))
    return r, out


def test_metrics_has_llama_servers_series(keyed: Server) -> None:
    r, before = llama_series(keyed)
    started = dict(r.headers.raw)[b"Process-Start-Time-Unix"]  # spelt as llama-server spells it
    assert abs(int(started) - psutil.Process(keyed.proc.pid).create_time()) < 2
    got = []
    for n in (1, 4, 8):  # each scraped right after its answer: counted before the answer was sent
        t = post(keyed.url, "/completion", {"prompt": PROMPT, "n_predict": n}, **auth()).json()["timings"]
        got.append(t)
        _, now = llama_series(keyed)
        assert now["llamacpp:tokens_predicted_total"][1] == before["llamacpp:tokens_predicted_total"][1] + sum(
            x["predicted_n"] for x in got)
    _, after = llama_series(keyed)
    for name, key in (("prompt_tokens_total", "prompt_n"), ("prompt_tokens_cached_total", "cache_n"),
                      ("tokens_predicted_total", "predicted_n")):
        grew = after[f"llamacpp:{name}"][1] - before[f"llamacpp:{name}"][1]
        assert grew == sum(x[key] for x in got), name
    assert after["llamacpp:n_decode_total"][1] > before["llamacpp:n_decode_total"][1]
    assert after["llamacpp:requests_processing"] == ("gauge", 0.0)
    assert after["llamacpp:prompt_seconds_total"][0] == "counter" and after["llamacpp:n_tokens_max"][1] > 0
    assert after["llamacpp:spec_decode_num_drafts_total"] == ("counter", 0.0)
    assert httpx.get(keyed.url + "/props", headers=auth()).json()["endpoint_metrics"] is True


def test_metrics_count_an_answer_before_the_client_hears_it(keyed: Server) -> None:
    """A scrape that races the answer's end: a watcher scrapes the moment the stream's last event arrives."""
    _, before = llama_series(keyed)
    seen: list[float] = []
    arrived = threading.Event()

    def scrape() -> None:
        arrived.wait(120)
        seen.append(llama_series(keyed)[1]["llamacpp:tokens_predicted_total"][1])

    watcher = threading.Thread(target=scrape)
    watcher.start()
    with httpx.stream("POST", keyed.url + "/completion", json={"prompt": PROMPT, "n_predict": 6, "stream": True},
                      headers=auth(), timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["stop"]:
                arrived.set()
    watcher.join()
    assert seen == [before["llamacpp:tokens_predicted_total"][1] + 6]


# ---- /slots --------------------------------------------------------------------------------------


def first_event(server: Server, stack: ExitStack) -> Iterator[str]:
    """A long streamed completion, left running once its first token came (the stack closes it); its lines,
    which the caller holds (a line iterator let go closes the response)."""
    r = stack.enter_context(httpx.stream("POST", server.url + "/completion", json={
        "prompt": PROMPT, "n_predict": 3000, "stream": True}, headers=auth(), timeout=120))
    assert r.status_code == 200
    lines = r.iter_lines()
    while not next(lines).startswith("data: "):
        pass
    return lines


def test_slots_tell_what_each_sequence_does(keyed: Server) -> None:
    done = post(keyed.url, "/completion", {"prompt": PROMPT, "n_predict": 4}, **auth()).json()
    slots = httpx.get(keyed.url + "/slots", headers=auth()).json()
    assert [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == 4096 for s in slots)
    assert not any(s["is_processing"] or s["speculative"] for s in slots)
    assert done["tokens_evaluated"] + done["tokens_predicted"] in [s["kv_tokens"] for s in slots]
    assert not any(k in s for s in slots for k in ("prompt", "generated", "params"))  # the clients' text stays theirs
    with ExitStack() as stack:
        running = [first_event(keyed, stack)]
        assert sum(s["is_processing"] for s in httpx.get(keyed.url + "/slots", headers=auth()).json()) == 1
        assert httpx.get(keyed.url + "/slots?fail_on_no_slot=1", headers=auth()).status_code == 200
        running.append(first_event(keyed, stack))
        err = error_of(httpx.get(keyed.url + "/slots?fail_on_no_slot=1", headers=auth()), 503)
        assert err["type"] == "unavailable_error"
    err = error_of(post(keyed.url, "/slots/0?action=save", {"filename": "s.bin"}, **auth()), 501)
    assert err["type"] == "not_supported_error" and err["param"] == "action" and "--prompt-cache" in err["message"]
    assert error_of(post(keyed.url, "/slots/0?action=drop", {}, **auth()), 400)["param"] == "action"
    assert httpx.get(keyed.url + "/props", headers=auth()).json()["endpoint_slots"] is True


def test_errors_on_llama_servers_routes_carry_its_types(keyed: Server) -> None:
    for path in ("/completion", "/completions", "/slots", "/props"):
        r = httpx.request("POST" if path.startswith("/compl") else "GET", keyed.url + path,
                          headers={"Authorization": "Bearer wrong"})
        assert error_of(r, 401)["type"] == "authentication_error", path
    assert error_of(post(keyed.url, "/v1/completions", {}), 401)["type"] == "invalid_request_error"  # OpenAI's
    err = error_of(post(keyed.url, "/completion", {"prompt": PROMPT * 600, "n_predict": 4}, **auth()), 400)
    assert err["type"] == "exceed_context_size_error" and err["code"] == "context_length_exceeded"


# ---- the model's names and tags -----------------------------------------------------------------


def test_every_alias_names_the_model_and_the_tags_are_told(keyed: Server, small_moe) -> None:
    client = keyed.client()
    (listed,) = client.models.list().data
    assert listed.id == "a-moe" and listed.model_extra == {"aliases": ["a-moe", "b-moe"], "tags": ["chat", "small"]}
    assert httpx.get(keyed.url + "/models", headers=auth()).json()["data"][0]["id"] == "a-moe"
    for name in ("a-moe", "b-moe", small_moe.stem):
        assert client.models.retrieve(name).id == "a-moe"
    assert error_of(httpx.get(keyed.url + "/v1/models/c-moe", headers=auth()), 404)["code"] == "model_not_found"
    assert client.completions.create(model="b-moe", prompt=PROMPT, max_tokens=1).model == "a-moe"


# ---- the public files, and the routes turned off -------------------------------------------------


def test_the_files_a_browser_asks_for_are_public(keyed: Server, bare: Server) -> None:
    for path in ("/", "/sw.js", "/manifest.webmanifest", "/_app/version.json"):
        assert httpx.get(keyed.url + path).status_code == 200, path  # no key
    worker = httpx.get(keyed.url + "/sw.js")
    assert worker.headers["content-type"].startswith("text/javascript") and "unregister()" in worker.text
    assert httpx.get(keyed.url + "/_app/version.json").json() == {"version": f"bmoe-{metadata.version('bmoe')}"}
    assert httpx.get(keyed.url + "/manifest.webmanifest").json()["start_url"] == "/"
    assert httpx.get(bare.url + "/sw.js").status_code == 200  # a worker to remove either way
    for path in ("/", "/manifest.webmanifest", "/_app/version.json"):
        assert httpx.get(bare.url + path).status_code == 404, path


def test_no_slots_and_no_metrics_answer_501_naming_the_flag(bare: Server) -> None:
    for path, flag in (("/slots", "--no-slots"), ("/metrics", "--no-metrics")):
        err = error_of(httpx.get(bare.url + path), 501)
        assert err["type"] == "not_supported_error" and flag in err["message"], path
    props = httpx.get(bare.url + "/props").json()
    assert props["endpoint_slots"] is False and props["endpoint_metrics"] is False


# ---- Vertex AI's prediction route ----------------------------------------------------------------


def test_vertex_ai_predicts_each_instance_through_its_route(small_moe) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    s = Server("-m", str(small_moe), *FLAGS, env={"BMOE_API_KEY": KEY, "AIP_MODE": "PREDICTION",
                                                  "AIP_HTTP_PORT": str(free), "AIP_HEALTH_ROUTE": "healthz"})
    try:
        assert port(s) == free and httpx.get(s.url + "/healthz").json()["status"] == "ok"  # Vertex's, no key
        chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        want = post(s.url, "/v1/chat/completions", chat, **auth()).json()["choices"][0]["message"]["content"]
        body = {"instances": [{"@requestFormat": "chatCompletions", **chat},
                              {"@requestFormat": "/v1/completions", "prompt": PROMPT, "max_tokens": 2},
                              {"@requestFormat": "completion", "prompt": PROMPT, "n_predict": 2},
                              {"@requestFormat": "nowhere"}, {"@requestFormat": "completion", "prompt": PROMPT,
                                                              "stream": True}, "text",
                              {"@requestFormat": "completion", "prompt": PROMPT, "n_predict": 2, "mirostat": 2}],
                "parameters": {}}
        error_of(post(s.url, "/predict", body), 401)
        chats = metric(s, 'bmoe_requests_total{route="/v1/chat/completions",status="200"}')
        got = post(s.url, "/predict", body, **auth())
        assert got.status_code == 200, got.text
        p = got.json()["predictions"]
        assert p[0]["choices"][0]["message"]["content"] == want and p[0]["model"] == small_moe.stem
        assert p[1]["object"] == "text_completion" and p[2]["stop"] is True and p[2]["tokens_predicted"] == 2
        assert [p[i]["error"]["param"] for i in (3, 4, 5, 6)] == ["@requestFormat", "stream", "instances", "mirostat"]
        # each instance was a request of its own, counted under its route
        assert metric(s, 'bmoe_requests_total{route="/v1/chat/completions",status="200"}') == chats + 1
        err = error_of(post(s.url, "/predict", {"instances": [{}] * 129}, **auth()), 400)
        assert "instances" in err["message"]
    finally:
        s.stop()


def test_vertex_ais_environment_is_checked(small_moe) -> None:
    env = {**os.environ, "AIP_MODE": "PREDICTION"}
    cmd = [sys.executable, "-m", "bmoe.server", "-m", str(small_moe), "--port", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**env, "AIP_HTTP_PORT": "http"})
    assert r.returncode == 1 and "AIP_HTTP_PORT='http' is not a port number" in r.stderr, r.stderr
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**env, "AIP_HTTP_PORT": "0", "AIP_PREDICT_ROUTE": "/v1/chat/completions"})
    assert r.returncode == 1 and "/v1/chat/completions is one of bmoe-server's routes" in r.stderr, r.stderr
