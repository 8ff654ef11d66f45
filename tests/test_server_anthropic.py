"""Anthropic's Messages API on `bmoe-server`, through the official `anthropic` client on a real
server: plain, system, multi-turn, stop sequences, tools with a `tool_result` turn, streaming (the
event sequence, the same text as a whole answer), thinking on a reasoning template, count_tokens,
the key, errors in Anthropic's shape; and the OpenAI details of the same server: `--alias`,
`GET /v1/models/{id}`, usage in a stream only on request, text-only content parts.

One engine: a greedy Anthropic answer equals the OpenAI chat route's for the same conversation.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.test_server import KEY, Server, auth
from tests.test_server_agents import FLAGS, TEMPLATES, THINK, qwen3_synth, thinker  # noqa: F401 (fixtures)

ALIAS = "tiny-moe"
HELLO = [{"role": "user", "content": "hello there how are you"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                             "days": {"type": "integer"}},
                            "required": ["city", "days"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def demo(demo16: Path) -> Server:
    """The 16-expert demo with a ChatML template that shows tools, named by --alias."""
    s = Server("-m", str(demo16), *FLAGS, "--chat-template-file", str(TEMPLATES / "chatml-tools.jinja"),
               "--alias", ALIAS, env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def claude(server: Server, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def prompt_of(usage) -> int:
    """The whole prompt's tokens: Anthropic's input tokens are those decoded, the rest were read from the cache."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def text_of(m) -> str:
    return "".join(b.text for b in m.content if b.type == "text")


def events_of(server: Server, **kw) -> tuple[list[str], list]:
    """The stream's event types and its events, as the client reads them (it skips pings)."""
    with claude(server).messages.create(stream=True, **kw) as stream:
        events = list(stream)
    return [e.type for e in events], events


def wire_events(server: Server, body: dict) -> list[tuple[str, dict]]:
    """The stream as sent: each event's `event:` name and its data."""
    out, name = [], None
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, headers=auth(),
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, "the event line names the data's type"
                out.append((name, data))
    return out


# ---- answers ---------------------------------------------------------------------------------------


def test_a_greedy_answer_equals_the_openai_chat_routes_whole_and_streamed(demo: Server) -> None:
    m = claude(demo).messages.create(model="anything", max_tokens=12, messages=HELLO)
    o = demo.client().chat.completions.create(model="x", messages=HELLO, max_tokens=12)
    assert text_of(m) == o.choices[0].message.content and text_of(m).strip()
    assert m.type == "message" and m.role == "assistant" and m.model == ALIAS == o.model
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert prompt_of(m.usage) == o.usage.prompt_tokens and m.usage.output_tokens == 12
    assert m.id.startswith("msg_") and m.model_extra["bmoe"]["completion_tokens"] == 12

    sent = [name for name, _ in wire_events(demo, {"model": "x", "max_tokens": 12, "messages": HELLO})]
    assert sent == ["message_start", "content_block_start", "ping", *["content_block_delta"] * (len(sent) - 6),
                    "content_block_stop", "message_delta", "message_stop"], sent
    types, events = events_of(demo, model="x", max_tokens=12, messages=HELLO)
    assert types == [t for t in sent if t != "ping"]
    assert prompt_of(events[0].message.usage) == prompt_of(m.usage) and events[0].message.stop_reason is None
    assert events[1].content_block.type == "text"
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text_of(m)
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 12
    # the client's own accumulation of the same stream
    with claude(demo).messages.stream(model="x", max_tokens=12, messages=HELLO) as s:
        final = s.get_final_message()
    assert text_of(final) == text_of(m) and final.stop_reason == "max_tokens"


def test_system_and_multi_turn_as_the_chat_route_renders_them(demo: Server) -> None:
    c, o = claude(demo), demo.client()
    system = "You are a terse assistant."
    m = c.messages.create(model="x", max_tokens=8, system=[{"type": "text", "text": system}], messages=HELLO)
    want = o.chat.completions.create(model="x", max_tokens=8, messages=[{"role": "system", "content": system},
                                                                         *HELLO])
    assert text_of(m) == want.choices[0].message.content
    assert prompt_of(m.usage) == want.usage.prompt_tokens > claude(demo).messages.count_tokens(
        model="x", messages=HELLO).input_tokens
    turns = [*HELLO, {"role": "assistant", "content": m.content}, {"role": "user", "content": "and then what?"}]
    second = c.messages.create(model="x", max_tokens=8, system=system, messages=turns)
    want2 = o.chat.completions.create(model="x", max_tokens=8, messages=[
        {"role": "system", "content": system}, *HELLO, {"role": "assistant", "content": text_of(m)},
        {"role": "user", "content": "and then what?"}])
    assert text_of(second) == want2.choices[0].message.content
    b = second.model_extra["bmoe"]
    assert b["prefill_tokens"] < b["prompt_tokens"], "the conversation goes on: its KV is reused"


def test_stop_sequences_end_the_answer_and_are_named(demo: Server) -> None:
    c = claude(demo)
    full = text_of(c.messages.create(model="x", max_tokens=12, messages=HELLO))
    word = full.split()[2]
    m = c.messages.create(model="x", max_tokens=12, messages=HELLO, stop_sequences=["zzqx", word])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert text_of(m) == full[:full.index(word)]
    _, events = events_of(demo, model="x", max_tokens=12, messages=HELLO, stop_sequences=[word])
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", word)
    ended = c.messages.create(model="x", max_tokens=12, messages=HELLO, extra_body={"grammar": 'root ::= "Fine."'})
    assert (ended.stop_reason, ended.stop_sequence, text_of(ended)) == ("end_turn", None, "Fine."), "its own end"


def test_output_config_holds_the_answer_to_a_schema(demo: Server) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    m = claude(demo).messages.create(model="x", max_tokens=40, messages=[{"role": "user", "content": "Is it blue?"}],
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(text_of(m))["answer"] in ("yes", "no") and m.stop_reason == "end_turn"


# ---- tools -----------------------------------------------------------------------------------------


def test_tool_use_then_tool_result_streamed_and_not(demo: Server) -> None:
    c = claude(demo)
    kw = dict(model="x", max_tokens=120, tools=[WEATHER], messages=ASK,
              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    m = c.messages.create(**kw)
    assert m.stop_reason == "tool_use", m
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id and set(use.input) == {"city", "days"}
    assert use.input["city"] in ("Paris", "Oslo") and isinstance(use.input["days"], int)

    turn = [*ASK, {"role": "assistant", "content": m.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": [{"type": "text", "text": '{"temp_c": 21}'}]}]}]
    after = c.messages.create(model="x", max_tokens=10, tools=[WEATHER], tool_choice={"type": "none"}, messages=turn)
    assert after.stop_reason in ("end_turn", "max_tokens") and [b.type for b in after.content] == ["text"]
    assert prompt_of(after.usage) > prompt_of(m.usage) + 5, "the call and its result are in the prompt"
    assert after.model_extra["bmoe"]["prefill_tokens"] < prompt_of(m.usage), \
        "the call sent back (its input an object again) continues the conversation: its KV is reused"

    types, events = events_of(demo, **kw)
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    args = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(args) == use.input and events[-2].delta.stop_reason == "tool_use"
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    call = {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}
    o = demo.client().chat.completions.create(
        model="x", max_tokens=10, tool_choice="none", messages=[
            *ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": use.id, "content": '{"temp_c": 21}'}],
        tools=[{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}])
    assert text_of(after) == o.choices[0].message.content and prompt_of(after.usage) == o.usage.prompt_tokens
    # a named tool, and an error result
    named = c.messages.create(**{**kw, "tool_choice": {"type": "tool", "name": "get_weather",
                                                        "disable_parallel_tool_use": True}})
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_weather"]
    failed = [*turn[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": "no network", "is_error": True}]}]
    assert c.messages.count_tokens(model="x", tools=[WEATHER], messages=failed).input_tokens > \
        c.messages.count_tokens(model="x", tools=[WEATHER], messages=[*turn[:2], {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "no network"}]}]).input_tokens


def test_count_tokens_is_what_a_request_decodes(demo: Server) -> None:
    c = claude(demo)
    for kw in (dict(messages=HELLO), dict(messages=ASK, system="Be brief.", tools=[WEATHER])):
        counted = c.messages.count_tokens(model="x", **kw).input_tokens
        assert counted == prompt_of(c.messages.create(model="x", max_tokens=1, **kw).usage) > 0


# ---- thinking ----------------------------------------------------------------------------------------


def test_thinking_blocks_from_a_reasoning_template(thinker: Server) -> None:  # noqa: F811
    c = claude(thinker)
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    m = c.messages.create(model="x", max_tokens=80, messages=ask, extra_body={"grammar": THINK})
    assert [b.type for b in m.content] == ["thinking", "text"], m.content
    thought, answer = m.content
    assert thought.thinking and thought.signature == "" and "<think>" not in answer.text
    assert "</think>" not in thought.thinking and answer.text.strip()
    types, events = events_of(thinker, model="x", max_tokens=80, messages=ask, extra_body={"grammar": THINK})
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"] and types.count("content_block_stop") == 2
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thought.thinking
    assert "".join(d.text for d in deltas if d.type == "text_delta") == answer.text
    # the thinking block sent back in the next turn is taken; thinking disabled renders the closed block
    again = c.messages.create(model="x", max_tokens=4, messages=[*ask, {"role": "assistant", "content": m.content},
                                                                {"role": "user", "content": "More?"}])
    assert prompt_of(again.usage) > prompt_of(m.usage)
    assert again.model_extra["bmoe"]["prefill_tokens"] < prompt_of(again.usage), "the conversation's KV is reused"
    on = c.messages.count_tokens(model="x", messages=ask).input_tokens
    off = c.messages.count_tokens(model="x", messages=ask, thinking={"type": "disabled"}).input_tokens
    assert off > on, "thinking disabled adds the closed <think></think> block"


# ---- the key and errors ------------------------------------------------------------------------------


def test_a_wrong_key_is_anthropics_401_and_either_header_works(demo: Server) -> None:
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude(demo, "wrong").messages.create(model="x", max_tokens=2, messages=HELLO)
    assert e.value.status_code == 401 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error" and "x-api-key" in e.value.body["error"]["message"]
    body = {"model": "x", "max_tokens": 2, "messages": HELLO}
    ok = httpx.post(demo.url + "/v1/messages", json=body, timeout=60,
                    headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    assert httpx.post(demo.url + "/v1/messages", json=body, headers={"x-api-key": "no"}).status_code == 401
    assert httpx.post(demo.url + "/v1/messages", json=body, headers=auth()).status_code == 200


@pytest.mark.parametrize("body, status, kind, words", [
    ({"messages": HELLO}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, 400, "invalid_request_error",
     "messages.0.content.0: this model takes text only; the 'image' block cannot be read"),
    ({"max_tokens": 4, "messages": [*HELLO, {"role": "assistant", "content": "Sure"}]}, 400,
     "invalid_request_error", "does not continue a last assistant turn"),
    ({"max_tokens": 4, "messages": HELLO, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "tools.0.type: 'web_search_20250305' is one of Anthropic's own tools"),
    ({"max_tokens": 4, "messages": HELLO, "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"max_tokens": 4, "messages": HELLO, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, 400,
     "invalid_request_error", "mcp_servers: bmoe-server connects to no MCP servers"),
])
def test_bad_requests_get_anthropic_errors(demo: Server, body: dict, status: int, kind: str, words: str) -> None:
    r = httpx.post(demo.url + "/v1/messages", json={"model": "x", **body}, headers=auth(), timeout=60)
    assert r.status_code == status and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == kind and words in r.json()["error"]["message"], r.json()
    with pytest.raises(anthropic.BadRequestError, match="takes text only"):
        claude(demo).messages.create(model="x", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "hi"}}]}])
    r = httpx.post(demo.url + "/v1/messages/batches", json={}, headers=auth())
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# ---- OpenAI details of the same server -----------------------------------------------------------------


def test_the_alias_is_listed_echoed_and_looked_up(demo: Server, demo16: Path) -> None:
    o = demo.client()
    assert [m.id for m in o.models.list()] == [ALIAS]
    assert o.models.retrieve(ALIAS).id == ALIAS == o.models.retrieve(demo16.name[:-len(".gguf")]).id
    with pytest.raises(openai.NotFoundError) as e:
        o.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found" and "this server serves 'tiny-moe'" in e.value.body["message"]
    r = o.completions.create(model="whatever-the-client-says", prompt="Once upon a time", max_tokens=2)
    assert r.model == ALIAS, "a request's model is not checked (llama-server's way); the answer names the alias"


def test_usage_is_streamed_only_on_request_in_its_own_chunk(demo: Server) -> None:
    o = demo.client()
    for chat in (True, False):
        kw = dict(model="x", max_tokens=6, stream=True)
        make = (lambda **k: o.chat.completions.create(messages=HELLO, **k)) if chat else \
            (lambda **k: o.completions.create(prompt="Once upon a time", **k))
        plain = list(make(**kw))
        assert all(ch.usage is None for ch in plain) and plain[-1].choices[0].finish_reason == "length"
        assert "bmoe" in plain[-1].model_extra, "the finish chunk keeps the request's telemetry"
        asked = list(make(stream_options={"include_usage": True}, **kw))
        last = asked[-1]
        assert last.choices == [] and last.usage.completion_tokens == 6 and last.usage.prompt_tokens > 0
        assert all(ch.usage is None for ch in asked[:-1]) and asked[-2].choices[0].finish_reason == "length"
        text = (lambda ch: ch.choices[0].delta.content or "") if chat else (lambda ch: ch.choices[0].text)
        assert "".join(map(text, asked[:-1])) == "".join(map(text, plain))


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "f"}}])
def test_a_part_that_is_not_text_is_named(demo: Server, part: dict) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        demo.client().chat.completions.create(model="x", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, part]}])
    err = e.value.body
    assert err["param"] == "messages.0.content" and "(and" not in err["message"]
    assert f"this model takes text only; the '{part['type']}' part cannot be read" in err["message"]
