"""The chat page and its events: `GET /v1/bmoe/events` read with httpx against a real bmoe-server on
the 16-expert demo, and the page itself in a real browser (Debian's chromium, driven by Playwright)
on a real port: it loads, asks for the API key once, streams an answer, stops a long one (the
server's generation ends with it), and its panel shows the numbers the server reports elsewhere.

Screenshots go to $BMOE_WEBUI_SHOTS when set (the lead's reports), else to the test's tmp_path.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REPO
from tests.test_server import KEY, Server, auth, metric
from tests.test_server_agents import THINK, WEATHER

EVENTS = "/v1/bmoe/events"
CHROMIUM = Path("/usr/bin/chromium")
REBOUND = "rebind.example"  # the browser resolves it to 127.0.0.1, as after a DNS rebinding
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1"]
WAIT_S = 300  # the longest any one wait here may take on a loaded 2-core machine
STATIC = REPO / "bmoe" / "server" / "static"
TEMPLATES = REPO / "tests" / "data" / "templates"


class Watcher:
    """GET /v1/bmoe/events followed on a thread: each event as (kind, data) into `events`."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.client = httpx.Client(timeout=httpx.Timeout(30, read=None))
        self.status = 0
        self.opened, self.ended = threading.Event(), threading.Event()
        threading.Thread(target=self._read, args=(url, headers), daemon=True).start()
        assert self.opened.wait(60), "the events stream did not open"

    def _read(self, url: str, headers: dict[str, str]) -> None:
        try:
            with self.client.stream("GET", url, headers=headers) as r:
                self.status = r.status_code
                self.opened.set()
                kind = ""
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        kind = line.removeprefix("event: ")
                    elif line.startswith("data: "):
                        self.events.put((kind, json.loads(line.removeprefix("data: "))))
        except httpx.HTTPError:
            pass  # closed under it (close) or by the server
        finally:
            self.opened.set()
            self.ended.set()

    def next(self, kind: str, where: Any = lambda e: True) -> dict[str, Any]:
        """The next event of `kind` that `where` accepts (others are skipped)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            got, data = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            if got == kind and where(data):
                return data

    def close(self) -> None:
        self.client.close()


def until(check: Any, what: str) -> Any:
    """Wait for a condition the server reports (no event to wait on from outside): poll it."""
    deadline = time.monotonic() + WAIT_S
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


@pytest.fixture(scope="module")
def demo(demo_default: tuple[Path, float]) -> tuple[str, float]:
    path, budget_mib = demo_default
    return str(path), budget_mib


@pytest.fixture(scope="module")
def server(demo: tuple[str, float]) -> Iterator[Server]:
    """The demo with Qwen3's template (the demo's own has neither tools nor reasoning), so one server
    can answer with reasoning and tool calls too; the key makes the page ask for it."""
    path, budget_mib = demo
    s = Server("-m", path, "-t", "1", "--io-threads", "2", "--cache-mb", str(budget_mib), "-c", "4096",
               "--chat-template-file", str(TEMPLATES / "qwen3.jinja"), env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def chat(server: Server, content: str, max_tokens: int, **extra: Any) -> httpx.Response:
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth(), timeout=WAIT_S,
                   json={"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra})
    assert r.status_code == 200, r.text
    return r


def answer_numbers(bmoe: dict[str, Any]) -> dict[str, Any]:
    """An answer's `bmoe` object as a generation event carries it (the event adds flash_mib_s; the answer
    its queue position)."""
    return {k: v for k, v in bmoe.items() if k != "queue_position"}


# ---- the events route ------------------------------------------------------------------------------


def test_each_generation_is_an_event_with_its_answers_numbers(server: Server, demo: tuple[str, float]) -> None:
    assert httpx.get(server.url + EVENTS).status_code == 401  # the key, as on every API route
    w = Watcher(server.url + EVENTS, auth())
    try:
        assert w.status == 200
        first = w.next("snapshot")
        assert first["cache"]["budget_mib"] == pytest.approx(demo[1])
        assert first["cache"]["full_mib"] > first["cache"]["budget_mib"] > 0 and first["memory"]["room_mib"] > 0
        layers = first["residency"]
        assert len(layers) == 30 and all(re.fullmatch("[01]{16}", x["experts"]) for x in layers)
        assert until(lambda: metric(server, "bmoe_event_watchers") == 1, "the watcher to count")

        # a whole answer, while the stream is open: it runs at once (a watcher holds no slot)
        r = chat(server, "Why is the sky blue?", 8)
        assert r.headers["X-Queue-Position"] == "0"
        g = w.next("generation")
        assert answer_numbers(r.json()["bmoe"]) == {k: v for k, v in g.items() if k != "flash_mib_s"}
        io_s = g["io_s_per_token"] * g["completion_tokens"]
        assert io_s > 0 and g["flash_mib_s"] == pytest.approx(g["read_mib"] / io_s)

        # a streamed one: a snapshot taken while it runs has its figures so far (a watcher that connects
        # then gets one at once); then its event
        body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 32, "stream": True}
        last: dict[str, Any] = {}
        with httpx.stream("POST", server.url + "/v1/chat/completions", headers=auth(), json=body,
                          timeout=WAIT_S) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    last = json.loads(line.removeprefix("data: "))
                    if last.get("bmoe", {}).get("step") == 2:
                        late = Watcher(server.url + EVENTS, auth())
                        live = late.next("snapshot")
                        late.close()
        assert live["generating"] == 1 and 2 <= live["running"][0]["tokens"] < 32 and live["running"][0]["tok_s"] > 0
        g = w.next("generation")
        assert last["choices"][0]["finish_reason"] == "length"
        assert answer_numbers(last["bmoe"]) == {k: v for k, v in g.items() if k != "flash_mib_s"}
        assert g["completion_tokens"] == 32

        # the residency it reports fits the budget: what is lit is in the cache, which holds to its budget
        # (the layer being computed may pin its routed 4 experts past it)
        after = w.next("snapshot", lambda e: e["generating"] == 0)
        lit = sum(x["experts"].count("1") for x in after["residency"])
        per_expert = after["cache"]["full_mib"] / (30 * 16)
        assert 0 < lit * per_expert <= after["cache"]["budget_mib"] + 4 * per_expert
    finally:
        w.close()
    assert w.ended.wait(60)
    assert metric(server, f'bmoe_requests_total{{route="{EVENTS}",status="401"}}') >= 1  # counted by its route
    until(lambda: metric(server, "bmoe_event_watchers") == 0, "the server to let the watcher go")


def test_without_the_page_root_is_404_and_shutdown_ends_the_events(demo: tuple[str, float]) -> None:
    path, budget_mib = demo
    s = Server("-m", path, "-t", "1", "--io-threads", "2", "--cache-mb", str(budget_mib), "--no-webui")
    try:
        assert "chat page" not in s.stderr
        for route in ("/", "/webui/chat.js", "/webui/chat.css"):
            assert httpx.get(s.url + route).status_code == 404, route
        w = Watcher(s.url + EVENTS, {})
        assert w.status == 200 and w.next("snapshot")["generating"] == 0
        t0 = time.monotonic()
        assert s.stop(signal.SIGTERM) == 143
        took = time.monotonic() - t0
        assert w.ended.wait(10), "the events stream did not end when the server did"
    finally:
        s.proc.kill()
    # uvicorn waits up to 10 s for open responses, then cancels them: the stream must end before that
    assert "timeout graceful shutdown exceeded" not in s.stderr and took < 8, (took, s.stderr)


# ---- the page's files ------------------------------------------------------------------------------


def test_the_page_loads_nothing_from_elsewhere() -> None:
    files = sorted(p.name for p in STATIC.iterdir())
    assert files == ["chat.css", "chat.js", "index.html", "manifest.webmanifest", "sw.js"]
    for name in files:
        text = (STATIC / name).read_text()
        assert not re.search(r"(https?:)?//[\w.-]+\.\w", re.sub(r"^\s*//.*$", "", text, flags=re.M)), name
        assert "@import" not in text and "url(" not in text, name


def test_a_wheel_ships_the_page(tmp_path: Path) -> None:
    """A non-editable install has the page's files (package data), not only a checkout. (Built from a
    copy: pip builds in the source tree and would leave build/ in the checkout.)"""
    src = tmp_path / "src"
    shutil.copytree(REPO / "bmoe", src / "bmoe", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(src)],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("bmoe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"bmoe/server/static/{p.name}" for p in STATIC.iterdir()} <= names


# ---- the page in a browser -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(f"no browser: Debian's chromium is not at {CHROMIUM} (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


def tokens_at_least(page: Any, nth: int, n: int) -> None:
    """Wait until the nth answer on the page has streamed n tokens."""
    page.wait_for_function(f"() => Number(document.querySelectorAll('.msg.assistant')[{nth}]?.dataset.tokens || 0) "
                           f">= {n}", timeout=WAIT_S * 1000)


def test_the_page_streams_stops_and_shows_what_the_server_reports(server: Server, demo: tuple[str, float],
                                                                  browser: Any, tmp_path: Path) -> None:
    shots = Path(os.environ.get("BMOE_WEBUI_SHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1200, "height": 760})
    page.set_default_timeout(WAIT_S * 1000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")

    # the server has a key: the page asks for it once, then its events stream goes live
    page.wait_for_selector("#link[data-state=error]")
    assert page.text_content("#link") == "API key needed" and page.is_visible("#api_key")
    page.fill("#api_key", KEY)
    page.press("#api_key", "Tab")
    page.wait_for_selector("#link[data-state=live]")
    page.wait_for_selector("#panel[data-snapshots]")
    assert page.text_content("#model") == Path(demo[0]).stem

    # an answer streams: tokens appear one after another while the panel follows it live
    page.fill("#max_tokens", "64")  # a second or more even on a fast machine: the panel's live snapshots come every 1 s
    page.fill("#prompt", "Why is the sky blue?")
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").nth(0)
    tokens_at_least(page, 0, 4)
    assert answer.get_attribute("data-state") == "streaming" and answer.locator(".content").inner_text().strip()
    assert page.is_disabled("#send") and page.is_enabled("#stop")
    page.wait_for_selector("#panel[data-source=live]")
    page.screenshot(path=str(shots / "mid-stream.png"))
    page.wait_for_selector(".msg.assistant[data-state=done]")
    assert answer.get_attribute("data-finish") == "length" and answer.get_attribute("data-tokens") == "64"

    # its panel shows the numbers of the answer it streamed, as the server's /metrics has them
    page.wait_for_selector("#panel[data-source=answer]")
    for measure, digits in (("cache_hit_pct", 1), ("mib_per_token", 2)):
        served = metric(server, f'bmoe_last_request{{measure="{measure}"}}')
        assert float(page.get_attribute(f"#{measure}", "data-value")) == served, measure  # from the events
        assert float(answer.get_attribute(f"data-{measure}")) == served, measure  # the answer's `bmoe` field
        assert page.text_content(f"#{measure}") == page.evaluate(f"v => v.toFixed({digits})", served)
    assert int(page.get_attribute("#heatmap", "data-resident")) > 0
    assert float(page.get_attribute("#budget_mib", "data-value")) > 0
    page.locator("#panel").screenshot(path=str(shots / "panel.png"))

    # stop during a long answer: the server's generation ends with it, and the server is free again
    cancelled = metric(server, 'bmoe_generations_total{finish_reason="cancelled"}')
    generated = metric(server, "bmoe_generated_tokens_total")
    page.fill("#max_tokens", "3000")
    page.fill("#prompt", "Tell me a long story about a dragon and a king.")
    page.press("#prompt", "Enter")
    tokens_at_least(page, 1, 4)
    page.click("#stop")
    page.wait_for_selector(".msg.assistant[data-state=stopped]")
    until(lambda: metric(server, 'bmoe_generations_total{finish_reason="cancelled"}') == cancelled + 1,
          "the server to cancel the generation")
    assert httpx.get(server.url + "/health").json()["generating"] == 0
    assert 4 <= metric(server, "bmoe_generated_tokens_total") - generated < 200
    page.wait_for_function("() => document.getElementById('figures_of').textContent.includes('cancelled')")
    page.screenshot(path=str(shots / "stopped.png"))
    assert page.is_enabled("#send")
    r = chat(server, "Why is the sky blue?", 4)
    assert r.headers["X-Queue-Position"] == "0" and r.json()["choices"][0]["finish_reason"] == "length"

    # the key was kept: a reload goes live without asking again
    page.reload()
    page.wait_for_selector("#link[data-state=live]")
    assert page.input_value("#api_key") == KEY
    assert not errors, errors


def test_the_page_shows_reasoning_folded_and_tool_calls(server: Server, browser: Any, tmp_path: Path) -> None:
    """The page sends no tools and no grammar; the test adds them to its requests on their way out
    (as a client extension would), and the real server's answer is what the page renders."""
    page = browser.new_page(viewport={"width": 1200, "height": 760})
    page.set_default_timeout(WAIT_S * 1000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.add_init_script(f"localStorage.setItem('bmoe.apiKey', {json.dumps(KEY)})")
    page.goto(server.url + "/")
    page.wait_for_selector("#link[data-state=live]")

    def ask(text: str, **extra: Any) -> Any:
        def add(route: Any) -> None:
            route.continue_(post_data=json.dumps({**json.loads(route.request.post_data), **extra}))

        page.route("**/v1/chat/completions", add)
        page.click("#clear")
        page.fill("#prompt", text)
        page.press("#prompt", "Enter")
        page.wait_for_selector(".msg.assistant[data-state=done]")
        page.unroute("**/v1/chat/completions")
        return page.locator(".msg.assistant")

    answer = ask("Why is the sky blue?", grammar=THINK, max_tokens=80)
    folded = answer.locator("details.reasoning")
    assert folded.count() == 1 and folded.get_attribute("open") is None
    thought = folded.locator(".text").text_content()
    content = answer.locator(".content").text_content()
    assert re.fullmatch("[a-z ]{3,30}", thought) and re.fullmatch("[a-z ]{3,30}", content), (thought, content)
    assert not folded.locator(".text").is_visible()
    folded.locator("summary").click()
    assert folded.locator(".text").is_visible()
    page.screenshot(path=str(Path(os.environ.get("BMOE_WEBUI_SHOTS") or tmp_path) / "reasoning.png"))

    answer = ask("What is the weather in Paris?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                 max_tokens=120)
    assert answer.get_attribute("data-finish") == "tool_calls"
    call = answer.locator(".tool")
    assert call.count() == 1
    m = re.fullmatch(r"tool call get_weather\((.*)\)", call.text_content(), re.S)
    assert m, call.text_content()
    args = json.loads(m.group(1))
    assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo", "Rome")
    page.screenshot(path=str(Path(os.environ.get("BMOE_WEBUI_SHOTS") or tmp_path) / "tool-call.png"))
    assert not errors, errors


def test_without_a_key_the_page_works_from_its_own_origin_only(small_moe: Path, browser: Any, tmp_path: Path) -> None:
    """No key: the page at 127.0.0.1 and at localhost streams an answer (its fetches carry its own
    origin); at a name rebound to 127.0.0.1 the browser gets the server's 403 and no page; and a
    request the page sends to the server under another origin (localhost's page to 127.0.0.1: a
    cross-origin POST, as a foreign site's would be) is refused before it runs."""
    s = Server("-m", str(small_moe), "-t", "1", "--io-threads", "2", "--cache-mb", "1", "-c", "4096",
               env={k: v for k, v in os.environ.items() if k != "BMOE_API_KEY"})
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=other.serve_forever, daemon=True).start()
    foreign = f"http://127.0.0.1:{other.server_address[1]}/"
    try:
        port = s.url.rsplit(":", 1)[1]
        page = browser.new_page(viewport={"width": 1200, "height": 760})
        page.set_default_timeout(WAIT_S * 1000)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        for n, name in enumerate(("127.0.0.1", "localhost")):
            page.goto(f"http://{name}:{port}/")
            page.wait_for_selector("#link[data-state=live]")  # its events stream, without a key
            page.evaluate("() => { document.getElementById('settings').open = true; }")  # closed: no key to ask
            page.fill("#max_tokens", "4")
            page.fill("#prompt", "Why is the sky blue?")
            page.press("#prompt", "Enter")
            page.wait_for_selector(".msg.assistant[data-state=done]")
            assert page.locator(".msg.assistant").get_attribute("data-finish") == "length", name
            assert metric(s, "bmoe_generations_total") == n + 1

        # a page of another origin (another server on this machine) POSTs a chat, as a form would
        page.goto(foreign)
        page.evaluate(f"""() => fetch("http://127.0.0.1:{port}/v1/chat/completions", {{method: "POST",
            mode: "no-cors", body: JSON.stringify({{messages: [{{role: "user", content: "hi"}}], max_tokens: 2}})}})
            .then(() => null)""")
        assert metric(s, 'bmoe_requests_total{route="/v1/chat/completions",status="403"}') == 1
        assert metric(s, "bmoe_generations_total") == 2

        r = page.goto(f"http://{REBOUND}:{port}/")
        assert r.status == 403 and f"--allowed-host {REBOUND}" in r.json()["error"]["message"]
        assert page.locator("#prompt").count() == 0
        assert not errors, errors
    finally:
        other.shutdown()
        s.stop()
