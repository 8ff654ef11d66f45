"""What agents send `bmoe-server`, through the official `openai` client on a real server: tools and
tool_choice (streamed and not, a second turn with the tool's answer), structured output
(`beta.chat.completions.parse` with a pydantic model), reasoning_content, and OpenAI-style 400s.

On the 16-expert demo model (its own template has no tools: it is served with a ChatML template
that has them, tests/data/templates/chatml-tools.jinja) and on a bmoe-synth model with Qwen3's
template; a random-weight model writes valid calls and JSON only because grammars hold it to them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.test_server import KEY, Server, auth

TEMPLATES = Path(__file__).parent / "data" / "templates"
FLAGS = ["-t", "2", "--io-threads", "2", "-c", "4096"]
# room for one forced call (parallel_tool_calls false; the demo model's takes ~38 tokens), after
# which the grammar ends the answer
MAX_CALLS = 120

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                                    "days": {"type": "integer"}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


class Trip(BaseModel):
    city: Literal["Paris", "Oslo", "Rome"]
    days: int
    sunny: bool
    note: str = Field(max_length=12)


@pytest.fixture(scope="module")
def qwen3_synth(synth, tmp_path_factory) -> str:
    from bmoe.tools.synth import write_model

    return str(write_model(tmp_path_factory.mktemp("q3") / "synth-qwen3.gguf", arch="qwen3moe", layers=4, experts=8,
                           top_k=2, chat_template=(TEMPLATES / "qwen3.jinja").read_text()))


@pytest.fixture(scope="module", params=["demo16", "synth-qwen3"])
def served(request, qwen3_synth) -> tuple[Server, dict]:
    """A server and what its requests need (the synth model thinks only when asked: its random
    weights would think until max_tokens)."""
    if request.param == "demo16":
        s = Server("-m", str(request.getfixturevalue("demo16")), *FLAGS,
                   "--chat-template-file", str(TEMPLATES / "chatml-tools.jinja"), env={"BMOE_API_KEY": KEY})
        yield s, {}
        s.stop()
    else:  # the same model and flags as `thinker`: its server, started once for the module
        yield request.getfixturevalue("thinker"), {"think": False}


def args_ok(call) -> dict:
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo", "Rome")
        assert isinstance(args["days"], int)
    else:
        assert call.function.name == "get_time" and args["zone"] in ("CET", "UTC")
    return args


def test_required_tool_call_streamed_and_not_then_the_tools_answer(served) -> None:
    server, extra = served
    c = server.client()
    # one call: with parallel_tool_calls false the grammar ends the answer after it
    r = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=MAX_CALLS, extra_body=extra)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and all(tc.type == "function" and tc.id for tc in calls)
    args_ok(calls[0])

    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [tc.model_dump() for tc in calls]},
            *({"role": "tool", "tool_call_id": tc.id, "content": json.dumps({"temp_c": 21, "sky": "clear"})}
              for tc in calls)]
    after = c.chat.completions.create(model="x", messages=turn, tools=[WEATHER, TIME], tool_choice="none",
                                      max_tokens=12, extra_body=extra)
    assert after.choices[0].finish_reason in ("stop", "length") and after.choices[0].message.tool_calls is None
    assert after.usage.prompt_tokens > r.usage.prompt_tokens, "the call and its answer are in the prompt"
    assert after.model_extra["bmoe"]["prefill_tokens"] < r.usage.prompt_tokens, \
        "the call sent back continues the conversation: its KV is reused"

    stream = c.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=MAX_CALLS, stream=True, extra_body=extra)
    got: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            g = got.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                g["id"], g["name"] = tc.id, tc.function.name
            g["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(g["name"], json.loads(g["arguments"])) for g in got.values()] == \
        [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls], "greedy: the same calls streamed"



def streamed_answer(stream) -> tuple[str, list[tuple[str, dict]], str | None, int]:
    """A stream joined: content, calls (name, parsed arguments), finish_reason, and how many chunks
    had an empty delta (no content, reasoning or calls; the first, the role's, and the last aside)."""
    content, calls, finish, empty = "", {}, None, 0
    for i, chunk in enumerate(stream):
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            assert tc.index not in calls and tc.id and tc.function.name, "a call streams whole, once"
            calls[tc.index] = (tc.function.name, json.loads(tc.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
        reasoning = (d.model_extra or {}).get("reasoning_content")
        if i and not chunk.choices[0].finish_reason and not (d.content or d.tool_calls or reasoning):
            empty += 1
    return content, [calls[k] for k in sorted(calls)], finish, empty


@pytest.mark.parametrize("budget, streamed_too", [(90, False), (1000, True)], ids=["next-cannot-end", "repeat"])
def test_required_with_parallel_calls_unset_ends_with_whole_calls(served, budget: int, streamed_too: bool) -> None:
    """OpenAI's default (parallel_tool_calls true), as instructor, litellm and a bare client send it:
    the demo model repeats its ~38-token call; the answer ends at the repeat (or before a call that
    could not end), finish_reason tool_calls, every call whole, no markup in content."""
    server, extra = served
    c = server.client()
    ask = dict(model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=budget,
               extra_body=extra)
    r = c.chat.completions.create(**ask)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content and choice.message.tool_calls
    for tc in choice.message.tool_calls:
        args_ok(tc)
    assert r.usage.completion_tokens < budget, "it ended before max_tokens"
    if not streamed_too:
        return
    content, calls, finish, empty = streamed_answer(c.chat.completions.create(**ask, stream=True))
    assert (content, finish, empty) == ("", "tool_calls", 0)
    assert calls == [(tc.function.name, json.loads(tc.function.arguments)) for tc in choice.message.tool_calls]


def test_a_call_max_tokens_cuts_is_dropped_not_leaked(served) -> None:
    server, extra = served
    c = server.client()
    ask = dict(model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=12,
               extra_body=extra)
    r = c.chat.completions.create(**ask)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    assert not r.choices[0].message.content, "the cut call's markup is not content"
    content, calls, finish, _ = streamed_answer(c.chat.completions.create(**ask, stream=True))
    assert (content, calls, finish) == ("", [], "length")


def test_a_named_tool_is_the_one_called(served) -> None:
    """Named, and one call only: the grammar ends the answer after it (finish_reason tool_calls)
    even though the question is about the weather."""
    server, extra = served
    r = server.client().chat.completions.create(
        model="x", messages=ASK, tools=[WEATHER, TIME], max_tokens=MAX_CALLS, extra_body=extra,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [tc.function.name for tc in calls] == ["get_time"]
    args_ok(calls[0])


def test_parse_gives_a_validated_pydantic_object(served) -> None:
    server, extra = served
    for client_parse in (server.client().beta.chat.completions.parse, server.client().chat.completions.parse):
        r = client_parse(model="x", messages=[{"role": "user", "content": "Plan a trip as JSON."}],
                         response_format=Trip, max_tokens=240, extra_body=extra)
        trip = r.choices[0].message.parsed
        assert isinstance(trip, Trip) and r.choices[0].finish_reason == "stop"
        assert Trip.model_validate_json(r.choices[0].message.content) == trip


def test_completions_take_a_json_schema_too(served) -> None:
    server, _ = served
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "score": {"type": "integer"}},
              "required": ["answer", "score"], "additionalProperties": False}
    r = server.client().completions.create(model="x", prompt="Is the sky blue? JSON:", max_tokens=200,
                                           extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                               "name": "a", "schema": schema}}})
    doc = json.loads(r.choices[0].text)
    assert doc["answer"] in ("yes", "no") and isinstance(doc["score"], int)


# ---- reasoning ---------------------------------------------------------------------------------------

THINK = r'root ::= "<think>\n" [a-z ]{3,30} "\n</think>\n\n" [a-z ]{3,30}'


@pytest.fixture(scope="module")
def thinker(qwen3_synth) -> Server:
    s = Server("-m", qwen3_synth, *FLAGS, "--cache-mb", "1", env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def test_reasoning_goes_to_reasoning_content_streamed_and_not(thinker: Server) -> None:
    c = thinker.client()
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    r = c.chat.completions.create(model="x", messages=ask, max_tokens=80, extra_body={"grammar": THINK})
    m = r.choices[0].message
    reasoning = m.model_extra["reasoning_content"]
    assert reasoning and m.content and "<think>" not in m.content and "</think>" not in reasoning
    assert reasoning == reasoning.strip() and all(ch.isalpha() or ch == " " for ch in reasoning + m.content)
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in c.chat.completions.create(model="x", messages=ask, max_tokens=80, stream=True,
                                           extra_body={"grammar": THINK}):
        d = chunk.choices[0].delta
        streamed["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
        streamed["content"] += d.content or ""
    assert streamed == {"reasoning_content": reasoning, "content": m.content}


def test_think_false_still_renders_the_empty_block_and_answers_plainly(thinker: Server) -> None:
    c = thinker.client()
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    on = c.chat.completions.create(model="x", messages=ask, max_tokens=8)
    off = c.chat.completions.create(model="x", messages=ask, max_tokens=8,
                                    extra_body={"think": False, "grammar": r'root ::= [a-z ]{3,30}'})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens, "think false adds the closed <think></think> block"
    assert "reasoning_content" not in off.choices[0].message.model_extra and off.choices[0].message.content


# ---- errors ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_tools(synth) -> Server:
    s = Server("-m", str(synth(arch="qwen3moe", layers=2, experts=4, top_k=2)), *FLAGS, "--cache-mb", "1",
               env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [WEATHER], "tool_choice": "required"}, "tools", "chat template does not show the model any tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}}}},
     "response_format.json_schema.schema.properties.n.minimum", "'minimum' is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "mystery"}}}},
     "response_format.json_schema.schema", "Unrecognized schema"),
    ({"grammar": "root ::= missing"}, "grammar",
     "llama.cpp rejected the grammar (Undefined rule identifier 'missing')"),
])
def test_bad_requests_get_openai_400s(no_tools: Server, body: dict, param: str | None, words: str) -> None:
    r = httpx.post(no_tools.url + "/v1/chat/completions", headers=auth(), timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and words in err["message"], err


def test_an_unknown_tool_in_tool_choice_is_a_400(thinker: Server) -> None:
    r = httpx.post(thinker.url + "/v1/chat/completions", headers=auth(), timeout=60,
                   json={"messages": ASK, "max_tokens": 4, "tools": [WEATHER],
                         "tool_choice": {"type": "function", "function": {"name": "launch"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "no tool is named 'launch'; the tools are: get_weather" in r.json()["error"]["message"]


# ---- the same in-process (bmoe.load) ------------------------------------------------------------------


def test_the_python_api_takes_response_format_and_tools(qwen3_synth, synth) -> None:
    import bmoe
    from bmoe.base.errors import ConfigError

    with bmoe.load(qwen3_synth, cache_mb=1, threads=2, io_threads=2) as m:
        text = m.chat([{"role": "user", "content": "Plan a trip."}], think=False, max_tokens=240,
                      response_format={"type": "json_schema", "json_schema": {"name": "trip",
                                                                              "schema": Trip.model_json_schema()}})
        Trip.model_validate_json(text)
        msg = m.chat_message(ASK, think=False, tools=[WEATHER, TIME], tool_choice="required",
                             parallel_tool_calls=False, max_tokens=240)
        assert len(msg.calls) == 1 and msg.content == ""
        json.loads(msg.calls[0].arguments)
        thought = m.chat_message([{"role": "user", "content": "Why?"}], max_tokens=80, grammar=THINK)
        assert thought.reasoning and thought.content and "<think>" not in thought.content
    with bmoe.load(str(synth(arch="qwen3moe", layers=2, experts=4, top_k=2)), cache_mb=1, threads=2) as m:
        with pytest.raises(ConfigError, match="does not show the model any tools"):
            m.chat(ASK, tools=[WEATHER])
