"""`bmoe-cli --session` driven over pipes, as an app drives it (shared/spec/telemetry.md, Session mode)."""

from __future__ import annotations

import itertools
import json
import os
import queue
import random
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from bmoe.base import telemetry
from bmoe.edges.session_client import SessionClient
from bmoe.tools.bench_sys import drop_file_cache
from tests import spec_lines
from tests.conftest import REPO, bmoe_segments, run_cli, still_running

FAST = ["-t", "1", "--io-threads", "2"]
ALL_CACHED = ["--cache-mb", "100"]  # holds every expert of the model below
SMALL_CACHE = ["--cache-mb", "2"]  # a fraction of them: the chat turns evict
PLAIN = ["--no-stream"]  # plain llama.cpp: the reference every streamed answer must equal
P1 = "Tell me a story about a king and his people"
P2 = "What problem did the early family solve with money"
TURNS = ["hello there how are you", "and then what happened", "tell me more about the king"]


@pytest.fixture(scope="module")
def model(synth) -> str:
    return str(synth(arch="qwen3moe", layers=4, experts=32, top_k=2))


def start(model: str, *args: str) -> SessionClient:
    return SessionClient(["-m", model, *FAST, *args], cwd=str(REPO))


def read_mb(events: list) -> float:
    return sum(ev["read_mb"] for tag, ev in events if tag == "PROGRESS")


def check_turn(events: list, rid: int, n_predict: int, cancelled: bool = False) -> dict:
    """BEGIN, then per token an optional LOAD and a PROGRESS (as one-shot --progress), then DONE."""
    assert events[0] == ("BEGIN", {"id": rid}), events[:2]
    tag, done = events[-1]
    assert tag == "DONE", events[-1]
    assert tuple(done) == (*spec_lines.DONE_KEYS, "page_cache_mib")  # the spec's keys, in its order, then bmoe's
    for (k, v), (_, want) in zip(done.items(), spec_lines.TAGGED["DONE"]):
        assert type(v) is want, (k, v)
    assert done["id"] == rid and done["cancelled"] is cancelled
    assert done["spec_recall_pct"] == -1 or 0 <= done["spec_recall_pct"] <= 100  # -1: no spec-gate running
    steps = [ev for t, ev in events if t == "PROGRESS"]
    assert [ev["step"] for ev in steps] == list(range(1, len(steps) + 1)) and len(steps) == done["tokens"]
    assert all(ev["steps"] == n_predict and tuple(ev) == spec_lines.PROGRESS_KEYS for ev in steps)
    body = events[1:-1]
    for i, (t, ev) in enumerate(body):
        assert t in ("LOAD", "PROGRESS"), (t, ev)
        if t == "LOAD":
            nxt = body[i + 1]
            assert nxt[0] == "PROGRESS" and nxt[1]["read_mb"] > 0 and ev["mb"] == nxt[1]["read_mb"]
        elif ev["read_mb"] > 0:
            assert i > 0 and body[i - 1][0] == "LOAD"
    if steps and not cancelled:
        assert steps[-1]["text"] == done["text"] or done["text"].startswith(steps[-1]["text"])
    assert done["n_past"] >= done["n_prompt"] + done["tokens"] or cancelled
    return done


def one_shot(model: str, prompt: str, n: int, *args: str) -> telemetry.ParsedRun:
    r = run_cli("-m", model, "-p", prompt, "-n", str(n), "--chat", "--progress", *FAST, *args)
    assert r.returncode == 0, r.stderr
    return telemetry.parse_output(r.stdout)


def chat(s: SessionClient, turns: list[str], n: int, first_id: int = 1) -> list[dict]:
    out = []
    for i, prompt in enumerate(turns):
        evs, _ = s.ask(first_id + i, prompt, n_predict=n, clear_kv=i == 0)
        out.append(check_turn(evs, first_id + i, n))
    return out


def test_independent_prompts_warm_the_cache_and_equal_one_shot(model: str) -> None:
    before = bmoe_segments()
    drop_file_cache([model])  # cold: a warm file's layers would read llama.cpp's mapping, not the cache
    with start(model, *ALL_CACHED) as s:
        assert s.ready["arch"] == "qwen3moe" and s.ready["n_ctx"] == 2048
        assert isinstance(s.ready["load_s"], float)
        ev1, _ = s.ask(1, P1, n_predict=16)
        ev2, _ = s.ask(2, P2, n_predict=16)
        d1, d2 = check_turn(ev1, 1, 16), check_turn(ev2, 2, 16)
        assert d1["n_past"] == d1["n_prompt"] + d1["tokens"] and d2["n_past"] == d2["n_prompt"] + d2["tokens"]
        # the second prompt finds the first one's experts: it reads less (nothing at all, when the first
        # turn happened to touch every expert it routes to; how many it shares depends on the CPU's kernels)
        assert read_mb(ev2) < read_mb(ev1), (read_mb(ev1), read_mb(ev2))
        assert d2["cache_hit_pct"] >= d1["cache_hit_pct"], (d1["cache_hit_pct"], d2["cache_hit_pct"])
        assert d1["cache_budget_mib"] == 100.0 and 0 < d1["cache_resident_mib"] <= d2["cache_resident_mib"]
        assert s.close() == 0
    assert not s.stray
    assert not bmoe_segments() - before
    for prompt, evs, done in ((P1, ev1, d1), (P2, ev2, d2)):
        ref = one_shot(model, prompt, 16, *ALL_CACHED)
        assert done["text"] == ref.answer and done["text"].strip()
        # the per-token lines are the one-shot ones: same keys, same texts token by token
        assert [ev["text"] for t, ev in evs if t == "PROGRESS"] == \
               [ev["text"] for t, ev in ref.events if t == "PROGRESS"]


def test_chat_turns_prefill_only_their_suffix(model: str) -> None:
    with start(model, *SMALL_CACHE) as s:
        got = chat(s, TURNS, 12)
        assert s.close() == 0
    assert not s.stray and "KV holds" not in s.stderr
    for prev, cur in itertools.pairwise(got):
        kept = cur["n_past"] - cur["n_prompt"] - cur["tokens"]
        # the previous turn's whole KV (prompt + answer) is reused; only the new turn is prefilled
        assert kept == prev["n_past"], (prev, cur)
        assert cur["n_prompt"] < 40 and cur["n_past"] > prev["n_past"]
    # the same history fed turn by turn to a fresh plain-llama.cpp session (after an unrelated
    # chat that clear_kv must drop) gives the same answers
    with start(model, *PLAIN) as ref:
        _, other = ref.ask(1, P1, n_predict=12)
        assert other[0] == "DONE" and other[1]["cache_budget_mib"] == 0 and other[1]["cache_hit_pct"] == -1
        want = chat(ref, TURNS, 12, first_id=10)
        assert ref.close() == 0
    assert [d["text"] for d in got] == [d["text"] for d in want]
    assert [(d["n_prompt"], d["n_past"]) for d in got] == [(d["n_prompt"], d["n_past"]) for d in want]


def test_cancel_mid_generation_rolls_the_turn_back(model: str) -> None:
    with start(model, *ALL_CACHED, "-c", "4096") as s:
        first = chat(s, TURNS[:1], 12)[0]
        s.send({"cmd": "generate", "id": 2, "prompt": "go on forever", "n_predict": 3000, "clear_kv": False})
        evs = []
        for tag, ev in s.events_until(2):
            evs.append((tag, ev))
            if tag == "PROGRESS" and ev["step"] == 3:
                s.send({"cmd": "cancel"})
        done = check_turn(evs, 2, 3000, cancelled=True)
        assert 3 <= done["tokens"] < 3000 and done["text"]
        assert done["n_past"] == first["n_past"]  # rolled back to the reused prefix
        # a cancel right behind its request: it may land before the prefill starts (mid-prefill:
        # test_cancel_mid_prefill_rolls_a_half_filled_kv_back), either way nothing of the turn stays
        s.send('{"cmd":"generate","id":3,"prompt":"%s","n_predict":8,"clear_kv":false}\n{"cmd":"cancel"}'
               % ("the king said " * 600))
        done = check_turn(list(s.events_until(3)), 3, 8, cancelled=True)
        assert done["tokens"] == 0 and done["n_prompt"] > 1000 and done["n_past"] == first["n_past"]
        # a cancel with nothing in flight is ignored: the next lines are the next request's
        s.send({"cmd": "cancel"})
        evs, _ = s.ask(4, TURNS[1], n_predict=12, clear_kv=False)
        follow = check_turn(evs, 4, 12)
        assert follow["n_past"] - follow["n_prompt"] - follow["tokens"] == first["n_past"]
        assert s.close() == 0
    assert not s.stray and "KV holds" not in s.stderr
    assert [first["text"], follow["text"]] == [d["text"] for d in plain_chat(model, TURNS[:2], 12)]


def plain_chat(model: str, turns: list[str], n: int) -> list[dict]:
    """The same chat in a fresh plain-llama.cpp session: what a rolled-back conversation must answer."""
    with start(model, *PLAIN) as ref:
        want = chat(ref, turns, n)
        assert ref.close() == 0
    return want


class LocalSession:
    """bmoe.edges.session.Session over a real Engine (as a bmoe.api.Model) in this process, for a test that must act at
    a known point inside a generation: requests go through a pipe to the session's own reader thread,
    generations run on a thread of their own, protocol lines come back through a queue."""

    def __init__(self, model: str, *flags: str) -> None:
        from bmoe.api import Model
        from bmoe.edges.session import Output, Session
        from tests.conftest import engine_for

        self.notices: list[str] = []
        self.lines: queue.Queue[str] = queue.Queue()
        self._partial = ""
        self.engine = engine_for(model, *FAST, *flags)
        try:
            self.session = Session(Model(self.engine), Output(self), n_predict=64, notice=self.notices.append)
            self.rfd, self.wfd = os.pipe()
        except BaseException:
            self.engine.close()
            raise
        self.threads = [threading.Thread(target=self.session.read_requests, args=(self.rfd,), daemon=True),
                        threading.Thread(target=self.session.serve, daemon=True)]
        for t in self.threads:
            t.start()

    def write(self, text: str) -> None:  # Output's stream
        self._partial += text
        *done, self._partial = self._partial.split("\n")
        for line in done:
            self.lines.put(line)

    def flush(self) -> None:
        pass

    def send(self, obj: dict) -> None:
        os.write(self.wfd, (json.dumps(obj) + "\n").encode())

    def events_until(self, rid: int) -> list:
        evs = []
        while not evs or not (evs[-1][0] in ("DONE", "ERROR") and evs[-1][1]["id"] == rid):
            line = self.lines.get(timeout=600)  # a hung generation fails the test instead of hanging it
            ev = telemetry.parse_tagged(line)
            assert ev is not None, f"not a protocol line: {line!r}"
            evs.append(ev)
        return evs

    def close(self) -> None:
        try:
            self.send({"cmd": "close"})
            for t in self.threads:
                t.join(600)
            assert not any(t.is_alive() for t in self.threads), "the session did not end on close"
        finally:
            self.engine.close()
            os.close(self.wfd)
            os.close(self.rfd)


def test_cancel_mid_prefill_rolls_a_half_filled_kv_back(model: str) -> None:
    """The cancel lands while the prompt's second llama_decode call is being computed (-c 2560:
    calls of up to 2048 tokens, bmoe.engine.prompt_calls), so the KV already holds the first one;
    the turn must roll back to the prefix it reused and the conversation go on as if the cancelled
    turn had never been asked.

    The hook stops the prefill at the second call's first routed layer, sends the cancel down
    the request pipe and waits until the session's reader thread has handed it to the Engine."""
    s = LocalSession(model, *SMALL_CACHE, "-c", "2560")  # (a cache that holds every expert soon stops nowhere)
    try:
        engine = s.engine
        first_layer = min(engine.streamer.layers)
        route, cancel, keep = engine.hook.stops.on_route, engine.interrupt, engine.kv_keep
        cancelled, armed = threading.Event(), threading.Event()
        calls: list[tuple[int, int]] = []  # (tokens in the call, KV length) at each prefill call
        kept: list[tuple[int, int]] = []  # (KV length, n) at each kv_keep(n)

        def on_route(layer, ids):
            route(layer, ids)
            if armed.is_set() and layer == first_layer and len(ids) > 1:
                calls.append((len(ids), engine.kv_len()))
                if len(calls) == 2:
                    s.send({"cmd": "cancel"})
                    assert cancelled.wait(600), "the cancel never reached the engine"

        def cancel_seen():
            cancel()
            cancelled.set()

        def kv_keep(n, seq=0):
            kept.append((engine.kv_len(seq), n))
            return keep(n, seq)

        engine.hook.stops.on_route, engine.interrupt, engine.kv_keep = on_route, cancel_seen, kv_keep
        s.send({"cmd": "generate", "id": 1, "prompt": TURNS[0], "n_predict": 12})
        first = check_turn(s.events_until(1), 1, 12)
        armed.set()
        s.send({"cmd": "generate", "id": 2, "prompt": "the king said " * 720, "n_predict": 8, "clear_kv": False})
        done = check_turn(s.events_until(2), 2, 8, cancelled=True)
        armed.clear()
        assert done["tokens"] == 0 and done["n_prompt"] > 2048 + 64 and done["n_past"] == first["n_past"]
        (n0, kv0), (_n1, kv1) = calls
        assert n0 == 2048 and kv0 > first["n_past"] and kv1 >= first["n_past"] + 2048, calls
        # the rollback had work to do: the aborted prefill left the first call in the KV
        assert kept[-1][1] == first["n_past"] and kept[-1][0] >= first["n_past"] + 2048, kept
        assert engine.kv_len() == first["n_past"]
        s.send({"cmd": "generate", "id": 3, "prompt": TURNS[1], "n_predict": 12, "clear_kv": False})
        follow = check_turn(s.events_until(3), 3, 12)
        assert follow["n_past"] - follow["n_prompt"] - follow["tokens"] == first["n_past"]
    finally:
        s.close()
    assert not any("KV holds" in n for n in s.notices), s.notices
    assert [first["text"], follow["text"]] == [d["text"] for d in plain_chat(model, TURNS[:2], 12)]


BAD = [  # (line, id the ERROR must carry)
    ('{"cmd":"generate","id":10,"prompt":"%s","n_predict":200}' % ("word " * 120), 10),  # > n_ctx
    ("{not json", -1),
    ('[1, 2, 3]', -1),
    ('"generate"', -1),
    ('{"cmd":"explode","id":11}', 11),
    ('{"id":12,"prompt":"x"}', 12),
    ('{"cmd":"generate","id":13}', 13),
    ('{"cmd":"generate","prompt":"x"}', -1),
    ('{"cmd":"generate","id":"14","prompt":"x"}', -1),
    ('{"cmd":"generate","id":15,"prompt":"x","n_predict":"5"}', 15),
    ('{"cmd":"generate","id":16,"prompt":"x","n_predict":0}', 16),
    ('{"cmd":"generate","id":17,"prompt":"x","n_predict":2.0}', 17),
    ('{"cmd":"generate","id":18,"prompt":"x","think":"yes"}', 18),
    ('{"cmd":"generate","id":19,"prompt":"x","clear_kv":1}', 19),
    ('{"cmd":"generate","id":20,"prompt":5}', 20),
    ('{"cmd":"generate","id":21,"prompt":"\\ud800"}', 21),
    (b'\xff\xfe{"cmd":"generate"}', -1),
    (b'{"cmd":"generate","id":22,"prompt":"caf\xe9"}', -1),  # Latin-1 inside valid JSON: the line is not UTF-8
]
NOT_UTF8 = {line for line, _ in BAD if isinstance(line, bytes)}


def test_every_rejected_request_leaves_the_session_serving(model: str) -> None:
    with start(model, *ALL_CACHED, "-c", "256") as s:
        good = None
        for i, (line, rid) in enumerate(BAD):
            s.send(line)
            tag, ev = s.next_event(60)
            assert tag == "ERROR" and ev["fatal"] is False and ev["id"] == rid, (line, tag, ev)
            assert ev["msg"]
            if line in NOT_UTF8:
                assert ev["msg"] == "malformed request: the line is not valid UTF-8", ev
            evs, _ = s.ask(100 + i, TURNS[0], n_predict=3)
            done = check_turn(evs, 100 + i, 3)
            good = good or done["text"]
            assert done["text"] == good
        assert "exceeds the context of 256 tokens" in json.dumps(s.lines)
        # a second generate while one runs: both lines arrive together, so the first is in flight
        s.send('{"cmd":"generate","id":30,"prompt":"a","n_predict":60}\n'
               '{"cmd":"generate","id":31,"prompt":"b","n_predict":60}')
        evs = list(s.events_until(30))
        errors = [ev for tag, ev in evs if tag == "ERROR"]
        assert len(errors) == 1 and errors[0]["id"] == 31 and errors[0]["fatal"] is False
        assert "still running" in errors[0]["msg"]
        check_turn([e for e in evs if e[0] != "ERROR"], 30, 60)
        evs, _ = s.ask(32, TURNS[0], n_predict=3)
        assert check_turn(evs, 32, 3)["text"] == good
        assert s.close() == 0
    assert not s.stray


@pytest.mark.parametrize("how", ["close", "eof", "close-mid-generation"])
def test_close_and_eof_end_with_exit_0_and_no_shared_memory(model: str, how: str) -> None:
    before = bmoe_segments()
    s = start(model, *ALL_CACHED, "-c", "4096")
    lanes = psutil.Process(s.proc.pid).children()
    assert len(lanes) == 2 and bmoe_segments() - before
    try:
        if how == "close-mid-generation":
            s.send({"cmd": "generate", "id": 1, "prompt": P1, "n_predict": 4000})
            assert s.next_event()[0] == "BEGIN" and s.next_event()[0] in ("LOAD", "PROGRESS")
            s.send({"cmd": "close"})
            evs = list(s.events_until(1))
            assert evs[-1][0] == "DONE" and evs[-1][1]["cancelled"] is True
        else:
            evs, _ = s.ask(1, P1, n_predict=4)
            check_turn(evs, 1, 4)
        if how == "eof":
            s.proc.stdin.close()
            rc = s.proc.wait(600)
        else:
            rc = s.close()
    finally:
        s.kill()
    assert rc == 0, s.stderr
    assert not s.stray and not any("ERROR" in line for line in s.lines)
    assert not bmoe_segments() - before
    assert not still_running(lanes)


def test_a_failed_load_is_one_fatal_line(tmp_path) -> None:
    r = run_cli("--session", "-m", str(tmp_path / "nope.gguf"), input="")
    assert r.returncode == 1
    (line,) = r.stdout.splitlines()
    tag, ev = telemetry.parse_tagged(line)
    assert tag == "ERROR" and ev["fatal"] is True and ev["id"] == -1 and "does not exist" in ev["msg"]


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signals_end_the_session_with_a_fatal_line(model: str, sig: int, code: int) -> None:
    before = bmoe_segments()
    s = start(model, *ALL_CACHED, "-c", "4096")
    try:
        s.send({"cmd": "generate", "id": 5, "prompt": P1, "n_predict": 4000})
        while s.next_event()[0] != "PROGRESS":
            pass
        s.proc.send_signal(sig)
        rc = s.proc.wait(600)
    finally:
        s.kill()
    assert rc == code
    last = telemetry.parse_tagged(s.lines[-1])
    assert last[0] == "ERROR" and last[1]["fatal"] is True and last[1]["id"] == 5
    assert not s.stray and not bmoe_segments() - before


def test_lane_failure_is_fatal_and_cleans_up(model: str) -> None:
    """Lanes that keep dying (past the pool's restarts) end the session with a fatal line."""
    before = bmoe_segments()
    s = start(model, "--cache-mb", "0", "-c", "4096")
    try:
        s.send({"cmd": "generate", "id": 7, "prompt": P1, "n_predict": 4000})
        assert s.next_event()[0] == "BEGIN"
        deadline = time.monotonic() + 600
        while s.proc.poll() is None and time.monotonic() < deadline:
            try:
                for lane in psutil.Process(s.proc.pid).children():
                    lane.kill()
            except psutil.Error:
                pass
            time.sleep(0.05)
        rc = s.proc.wait(600)
    finally:
        s.kill()
    tag, ev = telemetry.parse_tagged(s.lines[-1])
    assert tag == "ERROR" and ev["fatal"] is True and ev["id"] == 7 and "lane" in ev["msg"], s.lines[-3:]
    assert rc == 1 and not s.stray and not bmoe_segments() - before


QWEN_LIKE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def test_rendering_the_conversation(model: str) -> None:
    """The model's own template renders the conversation (one-shot --chat renders its one turn with
    the same Renderer); think:false reaches templates that read it."""
    from bmoe.chat.template import Renderer
    from tests.conftest import engine_for

    e = engine_for(model, "-c", 256, "-t", 1, "--no-stream")
    try:
        r = Renderer(e.vocab, e.chat_template())
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "more"}]
        assert r.render(msgs[:1], think=True) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        full = r.render(msgs, think=True)
        assert full == r.render(msgs, think=False)  # this template does not read enable_thinking
        assert full == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs) \
            + "<|im_start|>assistant\n"
        r.template, r.reads_thinking = QWEN_LIKE.encode(), True
        assert r.render(msgs, think=True) == full
        assert r.render(msgs, think=False) == full + "<think>\n\n</think>\n\n"
        r.template = None  # no chat template: plain text continuation
        assert r.render(msgs, think=True) == "hiyomore"
    finally:
        e.close()


# ---- fuzz ----------------------------------------------------------------------------------------

FIELDS = {"id": [0, -5, 7, 2**70, "7", 7.5, True, None, [], {}],
          "prompt": ["hi", "", 5, None, ["a"], {"x": 1}, True],
          "n_predict": [0, -1, "3", 3.0, None, True, 10**9, []],
          "think": ["yes", 1, None, 0, "true"],
          "clear_kv": ["no", 0, None, 1.0, []]}
GOOD_GENERATE = {"cmd": "generate", "id": 1, "prompt": "hello there", "n_predict": 2}


def _bad_generate(rng: random.Random) -> dict:
    """A generate request with at least one field missing or invalid per the contract."""
    obj = dict(GOOD_GENERATE)
    broken = rng.sample(sorted(FIELDS), rng.randint(1, 3))
    for k in broken:
        if k in obj and rng.random() < 0.3 and k in ("id", "prompt"):
            del obj[k]
        else:
            bad = [v for v in FIELDS[k] if not (k == "id" and type(v) is int)] if k != "n_predict" else FIELDS[k]
            obj[k] = rng.choice(bad)
    return obj


def _line(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.15:  # random bytes
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 80)))
    if kind < 0.25:  # random printable text
        return "".join(chr(rng.randint(32, 0x2FF)) for _ in range(rng.randint(0, 60))).encode()
    if kind < 0.30:  # whitespace only
        return rng.choice([b"", b" ", b"\t", b"\r", b"   \t "])
    if kind < 0.40:  # other JSON values
        return json.dumps(rng.choice([None, 1, "cancel", [1, {"cmd": "close"}], 2.5, True, []])).encode()
    if kind < 0.50:  # unknown or mistyped commands
        return json.dumps({"cmd": rng.choice(["gen", "CLOSE", "Cancel", "", None, 3, ["close"], "generate "]),
                           "id": rng.randint(0, 99)}).encode()
    if kind < 0.55:  # cancel with nothing in flight
        return b'{"cmd":"cancel"}'
    if kind < 0.60:  # very long
        return (b'{"cmd":"generate","id":1,"prompt":"' + b"x" * rng.randint(10_000, 60_000))
    if kind < 0.62:  # deep nesting
        return b"[" * rng.randint(100, 5000)
    good = json.dumps(rng.choice([GOOD_GENERATE, {"cmd": "close"}, {"cmd": "cancel"}])).encode()
    if kind < 0.80:  # truncated valid requests (never complete: those would run or close)
        return good[:rng.randint(0, len(good) - 1)]
    if kind < 0.95:  # invalid generates
        return json.dumps(_bad_generate(rng)).encode()
    # byte-level mutations of a valid request
    b = bytearray(good)
    for _ in range(rng.randint(1, 4)):
        b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


def _well_typed_generate(obj: dict) -> bool:
    """The contract's field rules (the context limit aside)."""
    return (type(obj.get("id")) is int and isinstance(obj.get("prompt"), str)
            and ("n_predict" not in obj or (type(obj["n_predict"]) is int and obj["n_predict"] >= 1))
            and all(k not in obj or type(obj[k]) is bool for k in ("think", "clear_kv")))


def _would_act(line: bytes) -> bool:
    """A line the session would run or close on (the fuzz keeps to lines it must reject or ignore)."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and (obj.get("cmd") == "close" or (
        obj.get("cmd") == "generate" and _well_typed_generate(obj)))


def _ignored(line: bytes) -> bool:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return False
    if not text.strip():
        return True
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and obj.get("cmd") == "cancel"


def test_fuzzed_lines_never_break_the_protocol(model: str) -> None:
    rng = random.Random(20261129)
    lines = []
    while len(lines) < 2000:
        line = _line(rng).replace(b"\n", b" ")
        if not _would_act(line):
            lines.append(line)
    want_errors = sum(1 for line in lines if not _ignored(line))
    with start(model, *ALL_CACHED, "-c", "512") as s:
        for i in range(0, len(lines), 50):
            s.send(b"\n".join(lines[i:i + 50]) + b"\n")
        evs, _done = s.ask(424242, TURNS[0], n_predict=4)
        check_turn([e for e in evs if e[0] != "ERROR"], 424242, 4)
        errors = [ev for tag, ev in evs if tag == "ERROR"]
        assert len(errors) == want_errors
        assert all(ev["fatal"] is False and isinstance(ev["msg"], str) and type(ev["id"]) is int for ev in errors)
        assert s.proc.poll() is None
        assert s.close() == 0
    assert not s.stray
    assert all(telemetry.parse_tagged(line) and telemetry.parse_tagged(line)[0] in spec_lines.TAGGED
               for line in s.lines)


# ---- the demo model (realistic routing) ----------------------------------------------------------


def test_demo_model_session(demo8: Path) -> None:
    """The session on a real-routing model: the small demo model the suite builds anyway (8 experts,
    top-2, as tests/test_demo.py and tests/test_speculation.py use), with a budget holding every expert."""
    from bmoe.base.model_files import read_model_files
    from bmoe.base.units import MiB

    path = demo8
    every = read_model_files(path).expert_bytes * 1.05 / MiB  # every expert, page rounding included
    budget = ["--cache-mb", f"{every:.0f}", "-t", "1"]
    fact, more, n = "What is the capital of France?", "And of Italy?", 8
    with SessionClient(["-m", str(path), *budget], cwd=str(REPO)) as s:
        assert s.ready["arch"] == "llama"
        ev1, _ = s.ask(1, fact, n_predict=n)
        ev2, _ = s.ask(2, fact, n_predict=n)
        ev3, _ = s.ask(3, more, n_predict=n, clear_kv=False)
        d1, d2, d3 = check_turn(ev1, 1, n), check_turn(ev2, 2, n), check_turn(ev3, 3, n)
        assert s.close() == 0
    assert not s.stray
    # the session started with an empty cache and the budget holds every expert: nothing is evicted,
    # so the same prompt again decodes without a read. (Its prefill may read experts its layers do
    # not route: whole layers are read ahead, and the first turn may have cancelled such a read in time.)
    assert d1["cache_budget_mib"] == float(f"{every:.0f}") and d1["cache_resident_mib"] > 0
    assert d2["cache_resident_mib"] >= d1["cache_resident_mib"] and read_mb(ev2) == 0
    assert d2["cache_hit_pct"] == 100.0 and d2["text"] == d1["text"] and d1["text"].strip()
    # clear_kv:false continues the conversation: it prefills only the new turn, and answers as a
    # fresh plain-llama.cpp session given the same two turns does
    assert d3["n_prompt"] < d2["n_prompt"] and d3["n_past"] > d2["n_past"]
    with SessionClient(["-m", str(path), *PLAIN, "-t", "1"], cwd=str(REPO)) as ref:
        want = [check_turn(ref.ask(i + 1, p, n_predict=n, clear_kv=i == 0)[0], i + 1, n)
                for i, p in enumerate((fact, more))]
        assert ref.close() == 0
    assert [d2["text"], d3["text"]] == [w["text"] for w in want]
    assert [(d2["n_prompt"], d2["n_past"]), (d3["n_prompt"], d3["n_past"])] == \
           [(w["n_prompt"], w["n_past"]) for w in want]
    # one-shot --chat answers the first turn as the session did
    r = run_cli("-m", str(path), "-p", fact, "-n", str(n), "--chat", "--progress", *budget, timeout=600)
    assert r.returncode == 0, r.stderr
    assert d1["text"] == telemetry.parse_output(r.stdout).answer


def test_profile_on_demand_goes_to_stderr(model: str) -> None:
    """{"cmd":"profile"} prints the per-process table on stderr; stdout stays protocol-only."""
    with SessionClient(["-m", model, "--cache-mb", "0", "--io-threads", "2", "-t", "1"]) as s:
        s.send({"cmd": "profile"})
        events = list(s.generate(1, "hello there", n_predict=4))
        assert events[-1][0] == "DONE"
        deadline = time.monotonic() + 600
        while "io_lane 1" not in s.stderr and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "coordinator" in s.stderr and "io_lane 0" in s.stderr and "io_lane 1" in s.stderr
        assert not s.stray
        assert s.close() == 0


def test_model_file_changed_under_the_session_is_fatal(model: str, tmp_path) -> None:
    """A size or mtime change is found before the next generate: a fatal line naming the file and
    the fix, exit 1, and nothing left behind."""
    copy = tmp_path / "changing.gguf"
    copy.write_bytes(open(model, "rb").read())
    before = bmoe_segments()
    s = start(str(copy), "--cache-mb", "2")
    lanes = psutil.Process(s.proc.pid).children()
    try:
        evs, _ = s.ask(1, P1, n_predict=3)
        check_turn(evs, 1, 3)
        with open(copy, "ab") as f:
            f.write(b"\0" * 4096)
        size = copy.stat().st_size
        evs = list(s.generate(2, P2, n_predict=3))
        rc = s.proc.wait(600)
    finally:
        s.kill()
    assert [tag for tag, _ in evs] == ["ERROR"]
    ev = evs[0][1]
    assert ev["fatal"] is True and ev["id"] == 2
    assert ev["msg"] == (f"generation 2 failed: model file {copy} changed since it was loaded "
                         f"(size {size - 4096} -> {size} bytes); restart the session to load it again")
    assert rc == 1 and not s.stray and not bmoe_segments() - before
    assert not still_running(lanes)
