"""How bmoe-server renders a chat and reads its tool calls where llama-server's own handling decides it
(issue 51), as clients meet it: `--jinja` (every chat through the template, given enable_thinking and today's
date, as llama-server's default renders), `--reasoning` (the server's thinking default; a request's own word
wins), `--chat-template NAME` (llama.cpp's built-in templates by name), and the tool-call syntaxes of Llama 3.x
and DeepSeek R1, whole and streamed, through the official `openai` client.

Each server is the small synthetic MoE with one of the templates of tests/data/templates (README there)."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_server import KEY, Server, auth, error_of

TEMPLATES = Path(__file__).parent / "data" / "templates"
HELLO = [{"role": "user", "content": "What is today?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}


def start(model: Path, *flags: str) -> Server:
    return Server("-m", str(model), "-t", "1", "--io-threads", "2", "--cache-mb", "1", "-c", "2048", "-n", "48",
                  *flags, env={"BMOE_API_KEY": KEY})


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=auth(), timeout=120)


def prompt(server: Server, **body: Any) -> str:
    r = post(server, "/apply-template", {"messages": HELLO, **body})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


@pytest.fixture(scope="module")
def r1_off(small_moe: Path) -> Iterator[Server]:
    """R1's template (llama.cpp's copy, which reads enable_thinking), --jinja --reasoning off."""
    s = start(small_moe, "--jinja", "--reasoning", "off", "--chat-template-file",
              str(TEMPLATES / "deepseek-r1-distill.jinja"))
    yield s
    s.stop()


def test_reasoning_off_is_the_default_a_request_turns_back_on(r1_off: Server) -> None:
    assert prompt(r1_off).endswith("<｜Assistant｜><think>\n</think>")
    for on in ({"chat_template_kwargs": {"enable_thinking": True}}, {"think": True}):
        assert prompt(r1_off, **on).endswith("<｜Assistant｜><think>\n")
    # the chat route renders what /apply-template shows: the same prompt tokens
    c = r1_off.client()
    for on, extra in (({}, {}), ({"chat_template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True})):
        ids = post(r1_off, "/tokenize", {"content": prompt(r1_off, **on), "add_special": True}).json()["tokens"]
        chat = c.chat.completions.create(model="x", messages=HELLO, max_tokens=2,
                                         extra_body={"chat_template_kwargs": extra} if extra else None)
        assert chat.usage.prompt_tokens == len(ids)
    # a template that shows no tools still refuses them (llama-server would answer as if there were none)
    err = error_of(post(r1_off, "/v1/chat/completions", {"messages": HELLO, "tools": [WEATHER]}), 400)
    assert err["param"] == "tools"


@pytest.fixture(scope="module")
def llama3(small_moe: Path) -> Iterator[Server]:
    s = start(small_moe, "--jinja", "--chat-template-file", str(TEMPLATES / "llama-3.3.jinja"))
    yield s
    s.stop()


def test_llama3_gets_todays_date_and_its_json_calls_are_read_whole_and_streamed(llama3: Server) -> None:
    assert f"Today Date: {datetime.date.today().strftime('%d %b %Y')}\n" in prompt(llama3)
    assert '"name": "get_weather"' in prompt(llama3, tools=[WEATHER])
    c = llama3.client()
    r = c.chat.completions.create(model="x", messages=HELLO, tools=[WEATHER], tool_choice="required", max_tokens=200)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    chunks = list(c.chat.completions.create(model="x", messages=HELLO, tools=[WEATHER], tool_choice="required",
                                            max_tokens=200, stream=True))
    streamed = [t for ch in chunks if ch.choices for t in (ch.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [("get_weather", call.function.arguments)]
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


@pytest.fixture(scope="module")
def r1_tools(small_moe: Path) -> Iterator[Server]:
    """llama.cpp's own DeepSeek R1 template, which shows the tools; without --jinja (the default)."""
    s = start(small_moe, "--chat-template-file", str(TEMPLATES / "deepseek-r1-tools.jinja"))
    yield s
    s.stop()


def test_deepseek_r1_shows_the_tools_and_its_calls_are_read(r1_tools: Server) -> None:
    shown = prompt(r1_tools, tools=[WEATHER])
    assert '"name": "get_weather"' in shown and shown.endswith("<｜Assistant｜><think>\n")
    # the prompt opens the think block; continuing an assistant turn that closes it, the forced call comes at once
    closed = [*HELLO, {"role": "assistant", "content": "</think>\n\n"}]
    body = {"messages": closed, "continue_final_message": True, "tools": [WEATHER], "tool_choice": "required",
            "max_tokens": 300}
    r = post(r1_tools, "/v1/chat/completions", body).json()
    msg = r["choices"][0]["message"]
    assert r["choices"][0]["finish_reason"] == "tool_calls", json.dumps(r, ensure_ascii=False)[:1500]
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather" and set(json.loads(call["function"]["arguments"])) == {"city"}
    assert not msg["content"] and "｜" not in json.dumps(msg, ensure_ascii=False)
    with httpx.stream("POST", r1_tools.url + "/v1/chat/completions", json={**body, "stream": True}, headers=auth(),
                      timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [t for e in events for t in e["choices"][0]["delta"].get("tool_calls") or []]
    assert [t["function"] for t in streamed] == [call["function"]]


@pytest.fixture(scope="module")
def command_r(small_moe: Path) -> Iterator[Server]:
    s = start(small_moe, "--chat-template", "command-r")
    yield s
    s.stop()


def test_a_built_in_template_by_name_renders_as_llama_server_does(command_r: Server) -> None:
    msgs = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
    assert post(command_r, "/apply-template", {"messages": msgs}).json()["prompt"] == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
        "<|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    assert httpx.get(command_r.url + "/props", headers=auth()).json()["chat_template"] == "command-r"
    err = error_of(post(command_r, "/v1/chat/completions", {"messages": msgs, "tools": [WEATHER]}), 400)
    assert err["param"] == "tools"


def test_a_name_llama_cpp_does_not_have_is_refused_at_start(small_moe: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "bmoe.server", "-m", str(small_moe), "--chat-template", "nope"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "not one of llama.cpp's built-in templates" in r.stderr and "command-r" in r.stderr
