"""The two other doors of `bmoe-server`, through the clients users have, on a real server: OpenAI's
Responses API (`openai`'s `responses.create` and `responses.stream`: text, a function call whose
arguments parse, a JSON-schema answer that validates, the event sequence, `previous_response_id`)
and Ollama's API (the official `ollama` client's `chat` streamed and not, with a tool, `generate`,
`list`, `show`, `ps`; refusals in Ollama's error shape).

One engine: a greedy answer through either door equals the chat (or completions) route's for the
same conversation (or prompt), so these tests compare with it rather than with fixed text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import httpx
import ollama
import openai
import pytest
from pydantic import BaseModel

from tests.plain_llama import plain_llama
from tests.test_server import KEY, METADATA_AT_BOUNDS, Server, auth, check_metadata_bounds, error_of
from tests.test_server_agents import FLAGS, TEMPLATES, THINK, qwen3_synth, thinker  # noqa: F401 (fixtures)

ALIAS = "tiny-moe"
HELLO = "hello there how are you"
ASK = "What is the weather in Paris for the next 3 days?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                           "days": {"type": "integer"}},
                          "required": ["city", "days"], "additionalProperties": False}}
# the chat route's tool, for the same request there
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k not in ("type", "strict")}}
# the call's opening marker in the chatml-tools template, as the demo model's tokens: Ollama has no tool_choice,
# and a 135M model seldom chooses a tool on its own; a logit bias (one of the sampling options) makes it
MARKER = "<tool_call>"


class Trip(BaseModel):
    city: Literal["Paris", "Oslo"]
    sunny: bool


@pytest.fixture(scope="module")
def demo(demo16: Path) -> Server:
    """The 16-expert demo with a ChatML template that shows tools, named by --alias."""
    s = Server("-m", str(demo16), *FLAGS, "--chat-template-file", str(TEMPLATES / "chatml-tools.jinja"),
               "--alias", ALIAS, env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


_answers: dict[str, str] = {}


def chat_text(server: Server, messages: list[dict], n: int) -> str:
    """The chat route's greedy answer: what either door must give for the same conversation (asked once)."""
    key = json.dumps([server.url, messages, n])
    if key not in _answers:
        r = server.client().chat.completions.create(model="x", messages=messages, max_tokens=n)
        _answers[key] = r.choices[0].message.content
    return _answers[key]


def wire_events(server: Server, body: dict) -> list[dict]:
    """A /v1/responses stream as sent: each event's data, its `event:` line checked against its type."""
    out, name = [], None
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, headers=auth(),
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, "the event line names the data's type"
                out.append(data)
    return out


def olla(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})


# ---- the Responses API -------------------------------------------------------------------------------


def test_a_response_is_the_chat_routes_answer_whole_and_streamed(demo: Server) -> None:
    c = demo.client()
    want = chat_text(demo, [{"role": "user", "content": HELLO}], 8)
    r = c.responses.create(model="x", input=HELLO, max_output_tokens=8)
    assert r.output_text == want and want.strip() and r.model == ALIAS and r.object == "response"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.id.startswith("resp_") and r.model_extra["bmoe"]["completion_tokens"] == 8

    events = wire_events(demo, {"input": HELLO, "max_output_tokens": 8})
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"], kinds
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == want
    last = events[-1]["response"]
    assert last["output"][0]["content"][0]["text"] == want and last["usage"]["output_tokens"] == 8
    assert events[0]["response"]["id"] == last["id"] and events[0]["response"]["status"] == "in_progress"


def test_a_function_call_and_a_json_schema_answer_with_the_openai_client(thinker: Server) -> None:  # noqa: F811
    """On the synth with Qwen3's template (its random weights think only when asked, and write valid calls
    and JSON because grammars hold them to them): quick tokens."""
    c = thinker.client()
    off = {"effort": "none"}  # thinking off
    ask = dict(model="x", input=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
               max_output_tokens=120, reasoning=off)
    r = c.responses.create(**ask)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"], r.output
    call = r.output[0]
    args = json.loads(call.arguments)
    assert call.name == "get_weather" and args["city"] in ("Paris", "Oslo") and isinstance(args["days"], int)
    assert call.call_id and call.id.startswith("fc_")
    # the call's output goes back as an item, after the response it answers; the answer after it is text
    after = c.responses.create(model="x", previous_response_id=r.id, max_output_tokens=8, tool_choice="none",
                               tools=[WEATHER], reasoning=off, input=[{
                                   "type": "function_call_output", "call_id": call.call_id,
                                   "output": json.dumps({"temp_c": 21, "sky": "clear"})}])
    assert [o.type for o in after.output] == ["message"] and after.output_text.strip()
    assert after.usage.input_tokens_details.cached_tokens > 0, "the call's KV is reused"

    with c.responses.stream(**ask) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"], kinds
    assert [(o.name, json.loads(o.arguments)) for o in final.output] == [("get_weather", args)], "greedy: the same"

    schema = {"type": "json_schema", "name": "trip", "strict": True, "schema": Trip.model_json_schema()}
    j = c.responses.create(model="x", input="Describe a trip to Paris as JSON", text={"format": schema},
                           max_output_tokens=60, reasoning=off)
    assert j.status == "completed" and Trip.model_validate_json(j.output_text)
    with c.responses.stream(model="x", input="Describe a trip to Paris as JSON", text_format=Trip,
                            max_output_tokens=60, reasoning=off) as s:
        parsed = s.get_final_response().output_parsed
    assert parsed == Trip.model_validate_json(j.output_text), "the client's own parse of the stream"
    # Ollama's format takes the same schema
    o = olla(thinker).generate(model="x", prompt="Describe a trip to Paris as JSON", format=Trip.model_json_schema(),
                               think=False, options={"num_predict": 60})
    assert Trip.model_validate_json(o.response) and o.done_reason == "stop"


def test_previous_response_id_is_the_whole_conversation_and_reuses_its_kv(demo: Server) -> None:
    c = demo.client()
    first = c.responses.create(model="x", input=HELLO, instructions="Be brief.", max_output_tokens=8)
    follow = c.responses.create(model="x", previous_response_id=first.id, input="and then what?",
                                instructions="Be brief.", max_output_tokens=8)
    b = follow.model_extra["bmoe"]
    assert b["prefill_tokens"] < b["prompt_tokens"], "it goes on in the KV that answered the first"
    assert follow.usage.input_tokens_details.cached_tokens == b["prompt_tokens"] - b["prefill_tokens"]
    whole = c.responses.create(model="x", instructions="Be brief.", max_output_tokens=8, input=[
        {"role": "user", "content": HELLO}, *(o.model_dump(exclude_none=True) for o in first.output),
        {"role": "user", "content": "and then what?"}])
    assert follow.output_text == whole.output_text and whole.output_text.strip()
    assert whole.usage.input_tokens == follow.usage.input_tokens
    assert follow.output_text == chat_text(demo, [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": HELLO},
                                                  {"role": "assistant", "content": first.output_text},
                                                  {"role": "user", "content": "and then what?"}], 8)
    # kept, read and dropped; one not kept is a 400 naming the field
    got = httpx.get(f"{demo.url}/v1/responses/{follow.id}", headers=auth(), timeout=60).json()
    assert got["id"] == follow.id and got["output"][0]["content"][0]["text"] == follow.output_text
    assert httpx.delete(f"{demo.url}/v1/responses/{follow.id}", headers=auth(), timeout=60).json()["deleted"]
    error_of(httpx.get(f"{demo.url}/v1/responses/{follow.id}", headers=auth(), timeout=60), 404)
    unstored = c.responses.create(model="x", input=HELLO, max_output_tokens=2, store=False)
    for rid in (follow.id, unstored.id, "resp_nothing"):
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="x", previous_response_id=rid, input="more", max_output_tokens=2)
        assert e.value.body["param"] == "previous_response_id" and "send the whole conversation" in e.value.message


def test_what_the_responses_route_cannot_take_is_a_400_naming_it(demo: Server) -> None:
    url = demo.url + "/v1/responses"
    cases = [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search' is not a function tool"),
        ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[1].type", "file_search"),
        ({"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1,
                     "environment": "linux"}]}, "tools[0].type", "computer_use_preview"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
        ({"background": True}, "background", "does not implement"),
        ({"truncation": "auto"}, "truncation", "does not implement"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]", "message.output_text.logprobs"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "does not implement"),
        ({"text": {"format": {"type": "xml"}}}, "text.format", "json_schema"),
        ({"reasoning": {"effort": "maximal"}}, "reasoning.effort", "minimal"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0]", "text only"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "send the item itself"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type", "'web_search_call' items"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "user, system"),
        ({"max_output_tokens": 0}, "max_output_tokens", ""),
        ({"max_output_tokens": 1_000_000_000}, "input", "context"),
        ({"temperature": 3}, "temperature", ""),
        ({"input": None}, "input", "text, or a list of items"),
    ]
    with httpx.Client(headers=auth(), timeout=60) as h:
        for body, param, words in cases:
            err = error_of(h.post(url, json={"input": HELLO, **body}), 400)
            assert err["param"] == param and words in err["message"], (body, err)
        ok = h.post(url, json={"input": HELLO, "max_output_tokens": 2, "include": ["reasoning.encrypted_content"],
                               "metadata": {"k": "v"}, "user": "u", "some_vendor_field": 1})
        assert ok.status_code == 200 and ok.json()["metadata"] == {"k": "v"}, ok.text



def test_responses_metadata_is_held_to_openais_bounds_and_echoed(demo: Server) -> None:
    c = demo.client()
    r = check_metadata_bounds(lambda metadata: c.responses.create(model="x", input=HELLO, max_output_tokens=2,
                                                                  metadata=metadata))
    assert r.status == "completed" or r.status == "incomplete"
    assert r.metadata == METADATA_AT_BOUNDS

def test_a_thinking_model_gives_a_reasoning_item_streamed_and_not(thinker: Server) -> None:  # noqa: F811
    c = thinker.client()
    r = c.responses.create(model="x", input="Why is the sky blue?", max_output_tokens=80,
                           extra_body={"grammar": THINK})
    assert [o.type for o in r.output] == ["reasoning", "message"], r.output
    thought = r.output[0].summary[0].text
    assert thought and "<think>" not in r.output_text and "</think>" not in thought
    events = wire_events(thinker, {"input": "Why is the sky blue?", "max_output_tokens": 80, "grammar": THINK})
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_summary_part.added") < kinds.index("response.reasoning_summary_text.done") \
        < kinds.index("response.content_part.added") and kinds[-1] == "response.completed"
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta") == thought
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == r.output_text
    # the reasoning item sent back is the turn's reasoning; the conversation's KV is reused
    again = c.responses.create(model="x", max_output_tokens=4, extra_body={"grammar": r'root ::= [a-z ]{3,30}'},
                               input=[{"role": "user", "content": "Why is the sky blue?"},
                                      *(o.model_dump(exclude_none=True) for o in r.output),
                                      {"role": "user", "content": "More?"}])
    assert again.model_extra["bmoe"]["prefill_tokens"] < again.usage.input_tokens
    # Ollama's chat puts it in message.thinking
    o = httpx.post(thinker.url + "/api/chat", headers=auth(), timeout=120, json={
        "model": "x", "messages": [{"role": "user", "content": "Why is the sky blue?"}], "stream": False,
        "grammar": THINK, "options": {"num_predict": 80}}).json()
    assert o["message"]["thinking"] == thought and o["message"]["content"] == r.output_text


# ---- Ollama's API ------------------------------------------------------------------------------------


def test_ollama_chats_streamed_and_not_as_the_chat_route(demo: Server) -> None:
    c = olla(demo)
    msgs = [{"role": "user", "content": HELLO}]
    want = chat_text(demo, msgs, 8)
    r = c.chat(model=ALIAS, messages=msgs, options={"num_predict": 8})
    assert r.message.content == want and r.message.role == "assistant" and r.done and r.done_reason == "length"
    assert r.eval_count == 8 and r.prompt_eval_count > 0 and r.model == ALIAS
    assert r.total_duration >= r.prompt_eval_duration > 0 and r.eval_duration > 0
    parts = list(c.chat(model=ALIAS, messages=msgs, options={"num_predict": 8}, stream=True))
    assert "".join(p.message.content for p in parts) == want
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].eval_count == 8
    # the same as JSON lines, and options bmoe cannot change named in warnings
    with httpx.stream("POST", demo.url + "/api/chat", headers=auth(), timeout=80, json={
            "model": "x", "messages": msgs, "options": {"num_predict": 4, "num_ctx": 8192, "temperature": 0},
            "keep_alive": "5m"}) as s:
        assert s.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in s.iter_lines()]
    assert lines[-1]["done"] and all(not x["done"] for x in lines[:-1])
    assert [w.split(":")[0] for w in lines[-1]["warnings"]] == ["options.num_ctx", "keep_alive"]


def test_ollama_calls_a_tool_and_reads_its_result(demo: Server, demo16: Path) -> None:
    vocab = plain_llama(demo16, vocab_only=True)
    bias = {str(t): 10 for t in vocab.tokenize(MARKER.encode(), add_bos=False)}
    c = olla(demo)
    msgs = [{"role": "user", "content": ASK}]
    # a tool as Ollama takes it (OpenAI's function shape); its enum keeps the biased marker out of the city
    r = c.chat(model=ALIAS, messages=msgs, tools=[CHAT_WEATHER], options={"num_predict": 80, "logit_bias": bias})
    calls = r.message.tool_calls
    assert calls and r.message.content == "" and r.done_reason == "stop", r.message
    assert calls[0].function.name == "get_weather" and calls[0].function.arguments["city"] in ("Paris", "Oslo")
    assert isinstance(calls[0].function.arguments["days"], int)
    after = c.chat(model=ALIAS, options={"num_predict": 4}, tools=[CHAT_WEATHER], messages=[
        *msgs, r.message, {"role": "tool", "content": json.dumps({"temp_c": 21}), "tool_name": "get_weather"}])
    assert after.message.content.strip() and not after.message.tool_calls
    assert after.prompt_eval_count > r.prompt_eval_count, "the call and its result are in the prompt"


def test_ollama_generates_lists_shows_and_refuses_by_its_rules(demo: Server, demo16: Path) -> None:
    c = olla(demo)
    g = c.generate(model=ALIAS, prompt=HELLO, options={"num_predict": 8})
    assert g.response == chat_text(demo, [{"role": "user", "content": HELLO}], 8) and g.done_reason == "length"
    raw = c.generate(model=ALIAS, prompt="Once upon a time", raw=True, options={"num_predict": 8})
    assert raw.response == demo.client().completions.create(model="x", prompt="Once upon a time",
                                                            max_tokens=8).choices[0].text

    listed = c.list().models
    assert [m.model for m in listed] == [ALIAS, demo16.stem] and listed[0].size == demo16.stat().st_size
    assert listed[0].details.format == "gguf" and listed[0].details.family == "llama"
    assert listed[0].details.quantization_level and listed[0].details.parameter_size.endswith(("M", "B"))
    shown = c.show(demo16.stem + ":latest")
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.expert_count"] == 16
    assert shown.modelinfo["general.parameter_count"] > 0 and "tools" in shown.capabilities
    assert "<tool_call>" in shown.template and "num_ctx" in shown.parameters
    running = c.ps().models
    assert [m.model for m in running] == [ALIAS, demo16.stem] and running[0].context_length == 4096
    assert httpx.get(demo.url + "/api/version", headers=auth(), timeout=60).json()["version"]
    assert c.pull(ALIAS).status == "success", "the served model is here already"

    for call, status, words in [
            (lambda: c.pull("llama3.2"), 400, "serves one model"), (lambda: c.delete(ALIAS), 400, "deletes none"),
            (lambda: c.copy(ALIAS, "other"), 400, "copies none"), (lambda: c.show("llama3.2"), 404, "not found"),
            (lambda: c.embed(model=ALIAS, input="x"), 400, "embeddings API is not served"),
            (lambda: c.chat(model=ALIAS, messages=[{"role": "user", "content": "x"}], options={"temprature": 1}),
             400, "options.temprature: not an option"),
            (lambda: c.chat(model=ALIAS, messages=[{"role": "user", "content": "x"}], options={"mirostat": 2}),
             400, "options.mirostat"),
            (lambda: c.chat(model=ALIAS, messages=[{"role": "user", "content": "x", "images": [b"\x89PNG"]}]),
             400, "text only"),
            (lambda: c.generate(model=ALIAS, prompt="x", options={"num_predict": 10**9}), 400, "context"),
            (lambda: c.chat(model=ALIAS, messages=[{"role": "user", "content": "x"}], options={"top_p": 0}),
             400, "options.top_p")]:
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == status and words in e.value.error, (words, e.value.error)
    empty = c.chat(model=ALIAS, messages=[])
    assert empty.done and empty.done_reason == "load" and empty.message.content == ""
