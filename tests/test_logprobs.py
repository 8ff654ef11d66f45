"""logprobs: each generated token's log-probability and its likeliest alternatives (bmoe.generation.logprobs),
through a real bmoe-server with the openai client in OpenAI's shapes (chat's `content` list, the legacy
completions' parallel lists), streamed and not, and through bmoe.load. Exact: the tokens' text joined is
the answer's text (a stop string's cut and split UTF-8 characters included) and, of a chat answer read
into reasoning and tool calls, its content; under greedy the likeliest alternative is the chosen token."""

from __future__ import annotations

import math

import httpx
import pytest

import bmoe
from bmoe.api import TokenLogprob, content_logprobs
from bmoe.chat.output import Reading
from tests.test_chat_output import CASES as ANSWERS
from tests.test_server import KEY, Server, auth, error_of
from tests.test_server_agents import FLAGS, TEMPLATES, THINK

PROMPT = "Once upon a time"
N = 12


@pytest.fixture(scope="module")
def demo(demo_default) -> str:
    return str(demo_default[0])


@pytest.fixture(scope="module")
def server(demo: str) -> Server:
    s = Server("-m", demo, "-c", "1024", "--io-threads", "2", env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def _greedy_tops(tokens: list[str], logprobs: list[float], tops: list[list[tuple[str, float]]]) -> None:
    """Under greedy each token is its step's likeliest: the first alternative, with the same log-probability."""
    for tok, lp, top in zip(tokens, logprobs, tops):
        assert lp <= 0 and math.isfinite(lp)
        assert top[0] == (tok, lp), (tok, lp, top)
        assert [p for _, p in top] == sorted((p for _, p in top), reverse=True)


def test_completions_logprobs_whole_and_streamed(server: Server) -> None:
    c = server.client()
    plain = c.completions.create(model="x", prompt=PROMPT, max_tokens=N)
    assert plain.choices[0].logprobs is None  # not asked for: none (and none computed)
    r = c.completions.create(model="x", prompt=PROMPT, max_tokens=N, logprobs=3)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text == plain.choices[0].text and len(lp.tokens) == r.usage.completion_tokens == N
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(N)]
    assert all(len(t) == 3 for t in lp.top_logprobs)
    _greedy_tops(lp.tokens, lp.token_logprobs, [sorted(t.items(), key=lambda kv: -kv[1]) for t in lp.top_logprobs])

    streamed, tokens, logprobs = "", [], []
    for chunk in c.completions.create(model="x", prompt=PROMPT, max_tokens=N, logprobs=3, stream=True):
        ch = chunk.choices[0]
        streamed += ch.text
        if ch.logprobs is not None:
            tokens += ch.logprobs.tokens
            logprobs += ch.logprobs.token_logprobs
    assert streamed == text and tokens == lp.tokens and logprobs == lp.token_logprobs


def test_chat_logprobs_whole_and_streamed(server: Server) -> None:
    c = server.client()
    msgs = [{"role": "user", "content": "Tell me a story about a king"}]
    r = c.chat.completions.create(model="x", messages=msgs, max_tokens=N, logprobs=True, top_logprobs=2)
    content, lp = r.choices[0].message.content, r.choices[0].logprobs.content
    assert content and "".join(t.token for t in lp) == content and len(lp) == N
    assert b"".join(bytes(t.bytes) for t in lp) == content.encode()
    assert all(len(t.top_logprobs) == 2 for t in lp)
    _greedy_tops([t.token for t in lp], [t.logprob for t in lp],
                 [[(a.token, a.logprob) for a in t.top_logprobs] for t in lp])

    streamed, got = "", []
    for chunk in c.chat.completions.create(model="x", messages=msgs, max_tokens=N, logprobs=True, top_logprobs=2,
                                           stream=True):
        ch = chunk.choices[0]
        streamed += ch.delta.content or ""
        if ch.logprobs is not None:
            got += ch.logprobs.content
    assert streamed == content and [(t.token, t.logprob) for t in got] == [(t.token, t.logprob) for t in lp]

    r = c.chat.completions.create(model="x", messages=msgs, max_tokens=4, logprobs=True)
    assert all(t.top_logprobs == [] for t in r.choices[0].logprobs.content)
    assert c.chat.completions.create(model="x", messages=msgs, max_tokens=4).choices[0].logprobs is None


def test_a_stop_string_cuts_the_tokens_where_it_cuts_the_text(server: Server) -> None:
    c = server.client()
    full = c.completions.create(model="x", prompt=PROMPT, max_tokens=N).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]  # likely inside a token: that token is cut
    for stream in (False, True):
        r = c.completions.create(model="x", prompt=PROMPT, max_tokens=N, logprobs=1, stop=[stop], stream=stream)
        chunks = list(r) if stream else [r]
        text = "".join(ch.choices[0].text for ch in chunks)
        tokens = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
        assert text == full[:full.index(stop)] and "".join(tokens) == text


def test_bad_logprobs_fields_are_400s_naming_them(server: Server) -> None:
    with httpx.Client(headers=auth(), timeout=60) as h:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for body, param in [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21},
                                                                    "top_logprobs"), ({"logprobs": 3}, "logprobs")]:
            err = error_of(h.post(server.url + "/v1/chat/completions", json={**chat, **body}), 400)
            assert param in err["message"], err
        err = error_of(h.post(server.url + "/v1/completions", json={"prompt": "hi", "logprobs": 21}), 400)
        assert "logprobs" in err["message"]


def test_split_utf8_characters_through_the_python_api(demo: str) -> None:
    """A character split across tokens: the tokens before the last have no text, the last the whole
    character; their bytes are the character's. Teacher-forced, so the text is known."""
    text = "Caf\u00e9 \u2603 \u65e5\u672c \U0001f600!"
    with bmoe.load(demo, io_threads=2, n_ctx=512, notice=lambda _: None) as m:
        forced = m.tokenize(text)[len(m.tokenize("")):]  # without a BOS the vocab adds
        done = m.run(m.prepare(bmoe.Ask(prompt="Say:", forced=forced, logprobs=2)))
        assert done.text == text
        lp = done.logprobs
        assert [t.id for t in lp] == forced and "".join(t.text for t in lp) == text
        assert b"".join(t.bytes for t in lp) == text.encode()
        assert any(t.text == "" for t in lp), "the test needs a character split across tokens"
        assert all(len(t.top) == 2 for t in lp)
        chunks = list(m.stream("Once upon a time", max_tokens=N, logprobs=0, stop=["king"]))
        said = "".join(c.text for c in chunks)
        assert "".join(t.text for c in chunks for t in c.logprobs) == said
        assert not any(c.logprobs for c in m.stream("Once upon a time", max_tokens=3))


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> Server:
    """A qwen3 template's model (random weights, held to think then answer by a grammar)."""
    from bmoe.tools.synth import write_model

    path = write_model(tmp_path_factory.mktemp("q3") / "synth-qwen3.gguf", arch="qwen3moe", layers=4, experts=8,
                       top_k=2, chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    s = Server("-m", str(path), *FLAGS, "--cache-mb", "1", env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def test_a_thinking_answers_logprobs_are_its_contents_streamed_and_not(thinker: Server) -> None:
    c = thinker.client()
    ask = dict(model="x", messages=[{"role": "user", "content": "Why is the sky blue?"}], max_tokens=80,
               logprobs=True, top_logprobs=1, extra_body={"grammar": THINK})
    r = c.chat.completions.create(**ask)
    m, lp = r.choices[0].message, r.choices[0].logprobs.content
    assert m.model_extra["reasoning_content"] and m.content
    assert "".join(t.token for t in lp) == m.content
    assert len(lp) < r.usage.completion_tokens, "the reasoning's and the markup's tokens are left out"
    streamed, got = "", []
    for chunk in c.chat.completions.create(stream=True, **ask):
        streamed += chunk.choices[0].delta.content or ""
        got += chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else []
    assert streamed == m.content and [(t.token, t.logprob) for t in got] == [(t.token, t.logprob) for t in lp]


def _tokens(answer: str, size: int) -> list[tuple[str, tuple[TokenLogprob, ...]]]:
    """The answer as a stream's pieces of `size` characters, one token each."""
    return [(answer[i:i + size], (TokenLogprob(i, answer[i:i + size], answer[i:i + size].encode(), -1.0, (), i),))
            for i in range(0, len(answer), size)]


@pytest.mark.parametrize("case", ANSWERS, ids=[c[0] for c in ANSWERS])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_a_chat_answers_logprobs_are_its_contents_tokens(case: tuple, size: int) -> None:
    """Reasoning and tool-call markup are left out: the tokens' text joined is the content as streamed."""
    _, syntax, tools, think_open, answer, _, _, _ = case
    reading = Reading(syntax, tools, think_open)
    parser = reading.parser()
    streamed = "".join(parser.push(text).content for text, _ in _tokens(answer, size)) + parser.finish().content
    got = content_logprobs(reading, _tokens(answer, size))
    assert "".join(t.text for t in got) == streamed
    for t in got:  # each is one of the answer's tokens, its text a part of that token's
        assert t.text and t.text in answer[t.offset:t.offset + size]
