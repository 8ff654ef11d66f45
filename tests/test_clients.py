"""The client matrix: agent libraries nobody here wrote, with their default settings, against a real
`bmoe-server` on the 16-expert demo model — instructor (Mode.TOOLS), litellm, the OpenAI Agents SDK (its
chat-completions model and its default, the Responses API), langchain-openai and the official `openai`
client's tool loop, streamed and not, `parallel_tool_calls` left unset (OpenAI's default, true) as they all
leave it. The next regression in a client's path fails here.

The libraries are heavy (litellm alone pulls boto3, aiohttp, tokenizers) and pin an older `openai`
than the test extra's, so they live in their own venv and extra, and this module is opt-in:

    python3 -m venv .venv-clients && .venv-clients/bin/pip install -e '.[test,clients]'
    .venv-clients/bin/python -m pytest -q tests/test_clients.py

In the default suite (without the extra) the module is skipped, saying so; the openai client's own
tool loop with parallel_tool_calls unset runs there too (tests/test_server_agents.py), and so do its
Responses API and the `ollama` client (tests/test_server_responses_ollama.py).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from tests.test_server import KEY, Server, metric
from tests.test_server_agents import ASK, FLAGS, TEMPLATES, TIME, WEATHER, args_ok

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would fetch its price list from GitHub
for _library in ("instructor", "litellm", "agents", "langchain_openai"):
    pytest.importorskip(_library, reason="the client matrix is opt-in: pip install -e '.[test,clients]'")

MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")


class Weather(BaseModel):
    city: Literal["Paris", "Oslo", "Rome"]
    days: int


@pytest.fixture(scope="module")
def server(demo16: Path) -> Iterator[Server]:
    s = Server("-m", str(demo16), *FLAGS, "--chat-template-file", str(TEMPLATES / "chatml-tools.jinja"),
               env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def no_markup(text: str | None) -> None:
    assert not any(m in (text or "") for m in MARKUP), f"tool-call markup leaked into content: {text!r}"


# ---- the official openai client ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_tool_loop_required_then_result_then_none(server: Server, stream: bool) -> None:
    c = server.client()
    tools = [WEATHER, TIME]
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in c.chat.completions.create(model="x", messages=ASK, tools=tools, tool_choice="required",
                                               max_tokens=200, stream=True):
            d = chunk.choices[0].delta
            no_markup(d.content)
            for tc in d.tool_calls or []:
                json.loads(tc.function.arguments)  # whole: it parses as it comes
                calls[tc.index] = {"id": tc.id, "type": "function",
                                   "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and calls
        sent = [calls[k] for k in sorted(calls)]
    else:
        r = c.chat.completions.create(model="x", messages=ASK, tools=tools, tool_choice="required", max_tokens=200)
        assert r.choices[0].finish_reason == "tool_calls"
        no_markup(r.choices[0].message.content)
        for tc in r.choices[0].message.tool_calls:
            args_ok(tc)
        sent = [tc.model_dump() for tc in r.choices[0].message.tool_calls]
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": sent},
            *({"role": "tool", "tool_call_id": tc["id"], "content": '{"temp_c": 21}'} for tc in sent)]
    after = c.chat.completions.create(model="x", messages=turn, tools=tools, tool_choice="none", max_tokens=16)
    assert after.choices[0].message.tool_calls is None and after.choices[0].finish_reason in ("stop", "length")
    no_markup(after.choices[0].message.content)


# ---- instructor ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "partial-stream"])
def test_instructor_tools_mode_gives_a_validated_model(server: Server, stream: bool) -> None:
    import instructor

    client = instructor.from_openai(server.client(), mode=instructor.Mode.TOOLS)
    ask = dict(model="x", messages=ASK, response_model=Weather, max_tokens=200, max_retries=0)
    if stream:
        parts = list(client.chat.completions.create_partial(**ask))
        got = parts[-1]
    else:
        got = client.chat.completions.create(**ask)
    assert isinstance(got, Weather) and got.city in ("Paris", "Oslo", "Rome") and isinstance(got.days, int)


# ---- litellm ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_litellm_required_tool_choice(server: Server, stream: bool) -> None:
    import litellm

    ask: dict[str, Any] = dict(model="openai/x", api_base=server.url + "/v1", api_key=KEY, messages=ASK,
                               tools=[WEATHER, TIME], tool_choice="required", max_tokens=200)
    if stream:
        chunks = list(litellm.completion(**ask, stream=True))
        msg = litellm.stream_chunk_builder(chunks, messages=ASK).choices[0]
    else:
        msg = litellm.completion(**ask).choices[0]
    assert msg.finish_reason == "tool_calls", msg
    no_markup(msg.message.content)
    assert msg.message.tool_calls
    for tc in msg.message.tool_calls:
        args_ok(tc)


# ---- the OpenAI Agents SDK ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_calls_the_tool_and_answers(server: Server, stream: bool) -> None:
    import agents
    import openai

    agents.set_tracing_disabled(True)
    seen: list[dict] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Rome"], days: int) -> str:
        """Current weather in a city."""
        seen.append({"city": city, "days": days})
        return json.dumps({"temp_c": 21, "sky": "clear"})

    model = agents.OpenAIChatCompletionsModel(
        model="x", openai_client=openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0))
    agent = agents.Agent(name="weather", instructions="You are a helpful assistant.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=120))

    async def run() -> Any:
        if not stream:
            return await agents.Runner.run(agent, ASK[-1]["content"], max_turns=3)
        result = agents.Runner.run_streamed(agent, ASK[-1]["content"], max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert seen and seen[0]["city"] in ("Paris", "Oslo", "Rome"), "the agent called its tool with valid arguments"
    for item in result.new_items:
        if item.type == "message_output_item":
            text = agents.ItemHelpers.text_message_output(item)
            no_markup(text)
            assert text.strip(), "no empty assistant message"
    assert isinstance(result.final_output, str)


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_default_responses_model_runs_the_tool_loop(server: Server, stream: bool) -> None:
    """The SDK's default model (OpenAI's Responses API), nothing changed but the client's base URL: the
    agent calls its tool, reads the result and answers. A response cut by max_output_tokens
    (`incomplete`) would fail the run, as it fails against OpenAI."""
    import agents
    import openai

    agents.set_tracing_disabled(True)
    seen: list[dict] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Rome"], days: int) -> str:
        """Current weather in a city."""
        seen.append({"city": city, "days": days})
        return json.dumps({"temp_c": 21, "sky": "clear"})

    agent = agents.Agent(name="weather", instructions="You are a helpful assistant.", tools=[get_weather],
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200))

    async def run() -> Any:
        agents.set_default_openai_client(openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY,
                                                            max_retries=0))
        if not stream:
            return await agents.Runner.run(agent, ASK[-1]["content"], max_turns=3)
        result = agents.Runner.run_streamed(agent, ASK[-1]["content"], max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    answered = metric(server, 'bmoe_requests_total{route="/v1/responses",status="200"}')
    result = asyncio.run(run())
    assert metric(server, 'bmoe_requests_total{route="/v1/responses",status="200"}') >= answered + 2, \
        "the SDK's default model asks the Responses API: the call, then the answer after its result"
    assert seen and seen[0]["city"] in ("Paris", "Oslo", "Rome"), "the agent called its tool with valid arguments"
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds
    assert isinstance(result.final_output, str) and result.final_output.strip()
    no_markup(result.final_output)


# ---- langchain-openai ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_langchain_bind_tools_required(server: Server, stream: bool) -> None:
    import langchain_openai as lc

    llm = lc.ChatOpenAI(model="x", base_url=server.url + "/v1", api_key=KEY, max_tokens=200, max_retries=0)
    bound = llm.bind_tools([WEATHER, TIME], tool_choice="required")
    msgs = [(m["role"], m["content"]) for m in ASK]
    if stream:
        got = None
        for part in bound.stream(msgs):
            got = part if got is None else got + part
    else:
        got = bound.invoke(msgs)
    assert got is not None and got.tool_calls and not got.invalid_tool_calls
    no_markup(got.content if isinstance(got.content, str) else json.dumps(got.content))
    for tc in got.tool_calls:
        assert tc["name"] in ("get_weather", "get_time") and isinstance(tc["args"], dict)
