"""Several answers to one request, and llama-server's reports on a prompt's prefill, on a real bmoe-server as
clients meet them: OpenAI's `n` (the official client, and its stream raw), several prompts in one completions
request, llama-server's `n_cmpl` and its list answer (raw HTTP), `return_progress` on each stream that takes
it, and llama-server's `n_predict` running to the context's end. Each choice is checked against a request of
its own with the seed it ran with: each is exactly what one generation with that seed gives (lossless).

One server: the small synthetic MoE, `-c 4096` (prompts decoded in calls of up to 2048 tokens), `--parallel 2`
(two KV sequences: `id_slot` has a choice) with `--batching turns`, so that each choice is decoded alone and
equals its request alone (a batch's rows need not be the floats of each row alone: tests/test_batch.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bmoe.engine import prompt_calls
from tests.test_server import CHAT_PROMPT, FLAGS, KEY, PROMPT, Server, auth, error_of

N = 8
CTX = 4096
SAMPLED = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 5}  # every token drawn: seeds give other texts
CHAT = {"messages": [{"role": "user", "content": CHAT_PROMPT}], "max_tokens": N, **SAMPLED}


@pytest.fixture(scope="module")
def server(small_moe) -> Iterator[Server]:
    s = Server("-m", str(small_moe), *FLAGS, "--parallel", "2", "--batching", "turns", env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=auth(), timeout=300)


def events(server: Server, path: str, body: dict) -> list[dict]:
    """A streamed answer's `data:` objects, in order (an OpenAI stream's `[DONE]` left out, and checked last)."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, headers=auth(), timeout=300) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    if path.startswith("/v1/"):
        assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1, lines
    return [json.loads(line) for line in lines if line != "[DONE]"]


LONG = 4000  # a prompt's tokens: decoded in two calls (2048 wide, the rest past the flash-attention tile)


@pytest.fixture(scope="module")
def long_prompt(server: Server) -> list[int]:
    """A prompt of LONG token ids (a text's, over and over)."""
    ids = post(server, "/tokenize", {"content": PROMPT + ". "}).json()["tokens"]
    assert LONG % 512 >= prompt_calls.FA_TILE
    return (ids * (LONG // len(ids) + 1))[:LONG]


# ---- n: choices, each its seed's ---------------------------------------------------------------------


def test_chat_choices_are_each_what_a_request_with_its_seed_gives(server: Server) -> None:
    client = server.client()
    asked = {k: v for k, v in CHAT.items() if k != "top_k"}  # top_k: an extension, the client's extra_body
    alone = [client.chat.completions.create(model="x", **{**asked, "seed": 5 + i}, extra_body={"top_k": 0})
             for i in range(3)]
    texts = [a.choices[0].message.content for a in alone]
    assert len(set(texts)) > 1, texts  # sampled with other seeds: other answers
    r = client.chat.completions.create(model="x", n=3, **asked, extra_body={"top_k": 0})
    assert [c.index for c in r.choices] == [0, 1, 2] and [c.message.content for c in r.choices] == texts
    assert all(c.finish_reason == alone[c.index].choices[0].finish_reason for c in r.choices)
    # the prompt counted once, every choice's tokens
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    # streamed: the choices' chunks interleaved, each with its index; one opening chunk, one finish each; then
    # one usage chunk and one [DONE]
    chunks = events(server, "/v1/chat/completions", {**CHAT, "n": 3, "stream_options": {"include_usage": True}})
    assert len({c["id"] for c in chunks}) == 1
    *choices, used = chunks
    for i in range(3):
        mine = [c["choices"][0] for c in choices if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": None}
        assert "".join(c["delta"].get("content") or "" for c in mine) == texts[i]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [alone[i].choices[0].finish_reason]
    assert used["choices"] == [] and used["usage"]["completion_tokens"] == r.usage.completion_tokens
    assert used["usage"]["prompt_tokens"] == r.usage.prompt_tokens
    # llama-server's name for n
    by_n_cmpl = post(server, "/v1/chat/completions", {**CHAT, "n_cmpl": 3}).json()
    assert [c["message"]["content"] for c in by_n_cmpl["choices"]] == texts


def test_several_prompts_and_choices_in_one_completions_request(server: Server) -> None:
    prompts = [PROMPT, "The sea was"]
    body = {"max_tokens": N, **SAMPLED}
    alone = {(p, i): post(server, "/v1/completions", {**body, "prompt": p, "seed": 5 + i}).json()
             for p in prompts for i in range(2)}
    want = [alone[p, i]["choices"][0]["text"] for p in prompts for i in range(2)]
    r = post(server, "/v1/completions", {**body, "prompt": prompts, "n": 2}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3] and [c["text"] for c in r["choices"]] == want
    assert r["usage"]["prompt_tokens"] == sum(alone[p, 0]["usage"]["prompt_tokens"] for p in prompts)
    assert r["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone.values())
    streamed = events(server, "/v1/completions", {**body, "prompt": prompts, "n": 2})
    assert ["".join(c["choices"][0]["text"] for c in streamed if c["choices"][0]["index"] == i)
            for i in range(4)] == want
    # a prompt as token ids, and a list of those, are prompts too
    ids = post(server, "/tokenize", {"content": PROMPT, "add_special": True}).json()["tokens"]
    by_ids = post(server, "/v1/completions", {**body, "prompt": [ids, prompts[1]], "n": 2}).json()
    assert [c["text"] for c in by_ids["choices"]] == want
    one = post(server, "/v1/completions", {**body, "prompt": ids}).json()
    assert [c["text"] for c in one["choices"]] == want[:1]


def test_llama_servers_n_cmpl_and_prompts_answer_a_list(server: Server) -> None:
    ids = post(server, "/tokenize", {"content": PROMPT, "add_special": True}).json()["tokens"]
    body = {"n_predict": N, **SAMPLED}
    alone = [post(server, "/completion", {**body, "prompt": PROMPT, "seed": 5 + i}).json() for i in range(2)]
    got = post(server, "/completion", {**body, "prompt": [ids, {"prompt_string": PROMPT}], "n_cmpl": 2}).json()
    assert isinstance(got, list) and [a["index"] for a in got] == [0, 1, 2, 3]
    assert [a["content"] for a in got] == [a["content"] for a in alone] * 2
    assert [a["generation_settings"]["seed"] for a in got] == [5, 6, 5, 6]
    # streamed: each answer's pieces with its index, each ending with its own stop: true
    streamed = events(server, "/completion", {**body, "prompt": [PROMPT, PROMPT], "n": 2})
    for i in range(4):
        mine = [e for e in streamed if e["index"] == i]
        assert "".join(e["content"] for e in mine) == alone[i % 2]["content"] and mine[-1]["stop"] is True
        assert [e["stop"] for e in mine].count(True) == 1
    # one prompt, one choice: one object, not a list; ids with texts among them are one prompt (the texts
    # tokenized without BOS after the first item, as llama-server's)
    mixed = [ids[0], " upon", *ids[-2:]]
    pieces = post(server, "/tokenize", {"content": " upon"}).json()["tokens"]
    as_ids = post(server, "/completion", {"prompt": [ids[0], *pieces, *ids[-2:]], "n_predict": N}).json()
    got_mixed = post(server, "/completion", {"prompt": mixed, "n_predict": N}).json()
    assert isinstance(got_mixed, dict) and got_mixed["content"] == as_ids["content"]
    assert got_mixed["tokens_evaluated"] == as_ids["tokens_evaluated"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "n": 17}, "n"),
    ("/v1/chat/completions", {**CHAT, "n": 11}, "n"),  # more than the 2 sequences and 8 queued the server holds
    ("/v1/completions", {"prompt": [PROMPT] * 9, "n": 2}, "n"),
    ("/v1/completions", {"prompt": [PROMPT, {"text": PROMPT}]}, "prompt[1].prompt_string"),
    ("/v1/chat/completions", {**CHAT, "n": 2, "n_cmpl": 3}, "n_cmpl"),
    ("/completion", {"prompt": [PROMPT] * 17}, "n"),
])
def test_past_the_choices_bound_or_malformed_is_a_400_naming_the_field(server: Server, path: str, body: dict,
                                                                       param: str) -> None:
    err = error_of(post(server, path, body), 400)
    assert err["param"] == param and param in err["message"], err


def test_id_slot_runs_on_that_kv_sequence(server: Server) -> None:
    short = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": N}
    long = {"messages": [{"role": "user", "content": CHAT_PROMPT * 3}], "max_tokens": N}
    on1 = post(server, "/v1/chat/completions", {**short, "id_slot": 1}).json()["bmoe"]["kv_tokens"]
    on0 = post(server, "/completion", {"prompt": PROMPT * 3, "n_predict": N, "id_slot": 0}).json()["bmoe"]["kv_tokens"]
    slots = httpx.get(server.url + "/slots", headers=auth()).json()
    assert [s["kv_tokens"] for s in slots] == [on0, on1] and on0 != on1, slots
    on1 = post(server, "/v1/chat/completions", {**long, "id_slot": 1}).json()["bmoe"]["kv_tokens"]
    assert [s["kv_tokens"] for s in httpx.get(server.url + "/slots", headers=auth()).json()] == [on0, on1]
    # llama-server's test: n choices with the first pinned (its copies take any slot), again and again
    for _ in range(2):
        got = post(server, "/v1/chat/completions", {**CHAT, "n": 2, "id_slot": 0}).json()
        assert [c["index"] for c in got["choices"]] == [0, 1], got
    err = error_of(post(server, "/v1/chat/completions", {**short, "id_slot": 2}), 400)
    assert err["param"] == "id_slot" and "0 to 1" in err["message"]


# ---- return_progress ---------------------------------------------------------------------------------


def check_reports(got: list[dict], total: int, cache: int = 0) -> list[dict]:
    """The progress reports of a stream: before its first token, one when the prefill starts and one after each of
    the calls it is decoded in; with the timings so far. Returns them."""
    reports = [e for e in got if "prompt_progress" in e]
    assert reports == got[:len(reports)], "the reports come before the first token"
    p = [r["prompt_progress"] for r in reports]
    calls = prompt_calls.calls(total - cache, 2048)
    assert [x["processed"] for x in p] == [cache + sum(calls[:k]) for k in range(len(calls) + 1)], p
    assert all(x["total"] == total and x["cache"] == cache for x in p), p
    assert [x["time_ms"] for x in p] == sorted(x["time_ms"] for x in p)
    return reports


def test_return_progress_reports_the_prefill_per_call(server: Server, long_prompt: list[int]) -> None:
    text, n = long_prompt, LONG
    got = events(server, "/completion", {"prompt": text, "n_predict": 2, "return_progress": True,
                                         "timings_per_token": True})
    reports = check_reports(got, n)
    assert len(reports) == 3  # a prompt of about 4000 tokens: two calls
    t = [r["timings"] for r in reports]
    assert t[0]["prompt_n"] == 0 and t[0]["prompt_ms"] == 0.0 and t[0]["predicted_n"] == 0
    assert [x["prompt_n"] for x in t] == [r["prompt_progress"]["processed"] for r in reports]
    assert [x["prompt_ms"] for x in t] == sorted(x["prompt_ms"] for x in t) and t[-1]["prompt_ms"] > 0
    assert all(r["content"] == "" and r["tokens"] == [] and r["stop"] is False for r in reports)
    assert "".join(e["content"] for e in got) == post(server, "/completion", {"prompt": text, "n_predict": 2}
                                                      ).json()["content"]  # the same answer
    # asked for nothing: no report; a whole answer has none
    assert not any("prompt_progress" in e for e in events(server, "/completion", {"prompt": text, "n_predict": 2}))
    assert "prompt_progress" not in post(server, "/completion", {"prompt": PROMPT, "n_predict": 2,
                                                                 "return_progress": True}).json()


def test_return_progress_on_the_chat_completions_and_responses_streams(server: Server) -> None:
    first = [{"role": "user", "content": CHAT_PROMPT}]
    chat = {"messages": first, "max_tokens": N, "return_progress": True}
    got = events(server, "/v1/chat/completions", chat)
    opening, *rest = got
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": None}
    reports = check_reports(rest, got[-1]["bmoe"]["prompt_tokens"])
    assert all(r["choices"][0]["delta"] == {"role": "assistant", "content": None} for r in reports)
    answer = "".join(c["choices"][0]["delta"].get("content") or "" for c in rest)
    # a chat that goes on: the first report counts the KV it reuses as cache
    more = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    got = events(server, "/v1/chat/completions", {**chat, "messages": more})
    bmoe: dict[str, Any] = got[-1]["bmoe"]
    cache = bmoe["prompt_tokens"] - bmoe["prefill_tokens"]
    assert cache > 0 and check_reports(got[1:], bmoe["prompt_tokens"], cache)
    got = events(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": N, "return_progress": True})
    assert all(r["choices"][0]["text"] == "" for r in check_reports(got, got[-1]["bmoe"]["prompt_tokens"]))
    # the Responses stream: response.in_progress events with the progress; deltas with the timings so far
    with httpx.stream("POST", server.url + "/v1/responses", headers=auth(), timeout=300, json={
            "input": CHAT_PROMPT, "max_output_tokens": N, "stream": True, "return_progress": True,
            "timings_per_token": True}) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    progress = [d for d in data if "prompt_progress" in d]
    assert progress and all(d["type"] == "response.in_progress" for d in progress)
    assert progress[0]["prompt_progress"]["processed"] == 0 and progress[-1]["timings"]["prompt_n"] > 0
    deltas = [d for d in data if d["type"] == "response.output_text.delta"]
    assert deltas and all(d["timings"]["predicted_n"] >= 1 for d in deltas)
    assert data[-1]["type"] in ("response.completed", "response.incomplete") and "timings" in data[-1]


# ---- n_predict past the context ----------------------------------------------------------------------


def test_n_predict_past_the_context_runs_to_its_end(server: Server, long_prompt: list[int]) -> None:
    text, room = long_prompt, CTX - LONG
    got = post(server, "/completion", {"prompt": text, "n_predict": 10 ** 6, "ignore_eos": True}).json()
    assert got["tokens_predicted"] == room and got["truncated"] is True and got["stop_type"] == "limit", got
    assert got["generation_settings"]["n_predict"] == room
    # OpenAI's route takes llama-server's n_predict as llama-server does; OpenAI's max_tokens stays a 400
    r = post(server, "/v1/completions", {"prompt": text, "n_predict": 10 ** 6, "ignore_eos": True}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == room, r
    err = error_of(post(server, "/v1/completions", {"prompt": text, "max_tokens": 10 ** 6}), 400)
    assert err["code"] == "context_length_exceeded" and "max_tokens" in err["message"]
    # a prompt that leaves no room is still the context's 400, which asks to lower nothing it did not send
    err = error_of(post(server, "/completion", {"prompt": text + text, "n_predict": 4}), 400)
    assert err["type"] == "exceed_context_size_error" and "n_predict" not in err["message"]
