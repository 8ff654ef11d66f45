"""The request fields of `bmoe-server`'s completion routes as clients meet them (issue 51): `max_tokens` left
out fills the context instead of a 400, llama-server's `n_predict` and `json_schema`, a chat's
`continue_final_message` and `add_generation_prompt`, the cache counts in `usage`; and a walk of every field
OpenAI's and Anthropic's clients (their installed packages' request types, so it grows when they do) and
llama-server (a literal list, from the pinned llama-cpp-python's vendor/llama.cpp/tools/server: README.md and
server-schema.cpp) document for these routes: each is honoured (the server's known fields) or a 400 naming it.

One server: a small synthetic MoE with Qwen3's chat template (ChatML that reads enable_thinking), a
context of 512 tokens (Qwen3's tool preamble takes 350) and `-n 64`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import openai.types.responses.response_create_params as responses_params
import pytest
from anthropic.types import message_count_tokens_params, message_create_params

from bmoe.server import anthropic_wire, openai_wire, responses_wire
from bmoe.server.request_base import known_fields
from tests.test_server import KEY, Server, auth, error_of

TEMPLATE = Path(__file__).parent / "data" / "templates" / "qwen3.jinja"
N_CTX, N_PREDICT = 512, 64
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(small_moe: Path) -> Iterator[Server]:
    s = Server("-m", str(small_moe), "-t", "1", "--io-threads", "2", "--cache-mb", "1", "-c", str(N_CTX),
               "-n", str(N_PREDICT), "--chat-template-file", str(TEMPLATE), env={"BMOE_API_KEY": KEY})
    yield s
    s.stop()


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=auth(), timeout=120)


def prompt_of(server: Server, tokens: int) -> str:
    """A prompt of `tokens` tokens, or one more (the words are counted by the server itself)."""
    words = tokens
    while True:
        text = " ".join(["king"] * words)
        n = server.client().completions.create(model="x", prompt=text, max_tokens=1).usage.prompt_tokens
        if n >= tokens:
            return text
        words += tokens - n


# ---- max_tokens left out ---------------------------------------------------------------------------------


def test_no_max_tokens_fills_the_context_on_every_route(server: Server) -> None:
    text = prompt_of(server, N_CTX - N_PREDICT // 2)
    c = server.client()
    done = c.completions.create(model="x", prompt=text)
    assert done.choices[0].finish_reason == "length" and done.usage.total_tokens == N_CTX, done.usage
    chat = c.chat.completions.create(model="x", messages=[{"role": "user", "content": text}])
    assert chat.choices[0].finish_reason == "length" and chat.usage.total_tokens == N_CTX, chat.usage
    r = c.responses.create(model="x", input=text)
    assert r.status == "incomplete" and r.usage.total_tokens == N_CTX, r.usage
    g = httpx.post(server.url + "/api/generate", json={"prompt": text, "stream": False, "raw": True},
                   headers=auth(), timeout=120).json()
    assert g["done_reason"] == "length" and g["prompt_eval_count"] + g["eval_count"] == N_CTX, g
    # a short prompt still gets -n, not the whole context
    assert c.completions.create(model="x", prompt="Once").usage.completion_tokens == N_PREDICT


def test_the_context_errors_name_max_tokens_only_when_it_was_sent(server: Server) -> None:
    text = prompt_of(server, N_CTX - N_PREDICT // 2)
    sent = error_of(post(server, "/v1/completions", {"prompt": text, "max_tokens": N_PREDICT}), 400)
    assert sent["code"] == "context_length_exceeded" and "max_tokens" in sent["message"]
    whole = text + " king" * N_PREDICT  # past the context
    for path, body in (("/v1/completions", {"prompt": whole}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": whole}]})):
        err = error_of(post(server, path, body), 400)
        assert err["code"] == "context_length_exceeded" and "max_tokens" not in err["message"], err
    r = post(server, "/v1/responses", {"input": whole})
    assert "max_output_tokens" not in error_of(r, 400)["message"]
    # Anthropic's max_tokens is required: a prompt that leaves too little room is the client's to shorten
    m = post(server, "/v1/messages", {"max_tokens": N_PREDICT, "messages": [{"role": "user", "content": text}]})
    assert m.status_code == 400 and "max_tokens" in m.json()["error"]["message"]


# ---- llama-server's names --------------------------------------------------------------------------------


def test_n_predict_is_max_tokens(server: Server) -> None:
    for path, body in (("/v1/completions", {"prompt": "Once"}), ("/v1/chat/completions", {"messages": HELLO})):
        assert post(server, path, {**body, "n_predict": 3}).json()["usage"]["completion_tokens"] == 3
        assert post(server, path, {**body, "n_predict": 3, "max_tokens": 3}).status_code == 200
        assert error_of(post(server, path, {**body, "n_predict": 3, "max_tokens": 5}), 400)["param"] == "n_predict"


def test_json_schema_holds_the_answer_as_response_format_does(server: Server) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    for path, body in (("/v1/completions", {"prompt": "Once"}),
                       ("/v1/chat/completions", {"messages": HELLO, "think": False})):
        got = post(server, path, {**body, "json_schema": schema, "max_tokens": 12}).json()
        want = post(server, path, {**body, "max_tokens": 12, "response_format": {"type": "json_object",
                                                                                  "schema": schema}}).json()
        text = got["choices"][0].get("text") or got["choices"][0]["message"]["content"]
        assert text == (want["choices"][0].get("text") or want["choices"][0]["message"]["content"])
        assert text.startswith('{"a":') or text.startswith('{ "a"'), text
    bad = post(server, "/v1/chat/completions", {"messages": HELLO, "json_schema": {"type": "nonsense"}})
    assert error_of(bad, 400)["param"].startswith("json_schema")
    both = post(server, "/v1/chat/completions", {"messages": HELLO, "json_schema": schema,
                                                 "response_format": {"type": "json_object"}})
    assert error_of(both, 400)["param"] == "json_schema"


# ---- how the conversation ends ---------------------------------------------------------------------------


def test_continue_final_message_continues_the_assistants_text(server: Server) -> None:
    c = server.client()
    turns = [*HELLO, {"role": "assistant", "content": "Once upon a"}]
    cont = c.chat.completions.create(model="x", messages=turns, max_tokens=6,
                                     extra_body={"continue_final_message": True})
    same = c.completions.create(model="x", max_tokens=6, prompt="<|im_start|>user\nhello there<|im_end|>\n"
                                                                "<|im_start|>assistant\nOnce upon a")
    assert cont.usage.prompt_tokens == same.usage.prompt_tokens
    assert cont.choices[0].message.content == same.choices[0].text
    for wrong in ({"continue_final_message": True, "add_generation_prompt": True},
                  {"continue_final_message": "reasoning_content"}):
        assert error_of(post(server, "/v1/chat/completions", {"messages": turns, **wrong}), 400)["param"] == \
            "continue_final_message"
    assert error_of(post(server, "/v1/chat/completions", {"messages": HELLO, "continue_final_message": True}),
                    400)["param"] == "continue_final_message"


def test_add_generation_prompt_false_opens_no_turn(server: Server) -> None:
    c = server.client()
    bare = c.chat.completions.create(model="x", messages=HELLO, max_tokens=6,
                                     extra_body={"add_generation_prompt": False})
    same = c.completions.create(model="x", max_tokens=6, prompt="<|im_start|>user\nhello there<|im_end|>\n")
    assert bare.usage.prompt_tokens == same.usage.prompt_tokens
    assert bare.choices[0].message.content == same.choices[0].text


def test_thinking_off_by_llama_servers_and_openais_fields(server: Server) -> None:
    def prompt_tokens(**extra: Any) -> int:
        return post(server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 1, **extra}).json()[
            "usage"]["prompt_tokens"]

    on, off = prompt_tokens(), prompt_tokens(think=False)
    assert off > on, "thinking off adds the template's closed <think></think> block"
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == off
    assert prompt_tokens(reasoning_effort="none") == off and prompt_tokens(reasoning_effort="high") == on
    bad = post(server, "/v1/chat/completions", {"messages": HELLO, "chat_template_kwargs": {"tools_in_user": 1}})
    assert error_of(bad, 400)["param"] == "chat_template_kwargs.tools_in_user"


# ---- usage -----------------------------------------------------------------------------------------------


def test_usage_counts_the_prompt_read_from_the_cache(server: Server) -> None:
    """A chat that goes on reuses its KV: the prompt's tokens read from it are counted apart."""
    c = server.client()
    system = {"role": "system", "content": "You are a careful assistant."}
    first = c.chat.completions.create(model="x", messages=[system, *HELLO], max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    more = [system, *HELLO, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "and you?"}]
    again = c.chat.completions.create(model="x", messages=more, max_tokens=1)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached == again.usage.prompt_tokens - again.model_extra["bmoe"]["prefill_tokens"]

    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    m = claude.messages.create(model="x", max_tokens=2, system=system["content"], messages=HELLO)
    body = {"max_tokens": 1, "system": system["content"], "messages": [
        *HELLO, {"role": "assistant", "content": m.content[0].text}, {"role": "user", "content": "and you?"}]}
    u = claude.messages.create(model="x", **body)
    assert u.usage.cache_creation_input_tokens == 0 and u.usage.cache_read_input_tokens > 0
    assert u.usage.input_tokens == u.model_extra["bmoe"]["prefill_tokens"]
    assert u.usage.input_tokens + u.usage.cache_read_input_tokens == u.model_extra["bmoe"]["prompt_tokens"]
    with httpx.stream("POST", server.url + "/v1/messages", headers=auth(), timeout=120,
                      json={**body, "stream": True}) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    start, delta = data[0]["message"]["usage"], next(d for d in data if d["type"] == "message_delta")["usage"]
    assert {"cache_creation_input_tokens", "cache_read_input_tokens"} <= set(start) & set(delta)
    assert delta["input_tokens"] + delta["cache_read_input_tokens"] == start["input_tokens"], "the whole prompt"


# ---- the walk --------------------------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
# llama-server's fields of /completion and its OpenAI routes (tools/server/README.md, server-schema.cpp)
LLAMA_SERVER = (
    "n_predict", "n_indent", "n_keep", "n_cmpl", "n_cache_reuse", "n_discard", "stream", "stop", "temperature",
    "dynatemp_range", "dynatemp_exponent", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n",
    "presence_penalty", "frequency_penalty", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
    "dry_sequence_breakers", "xtc_probability", "xtc_threshold", "mirostat", "mirostat_tau", "mirostat_eta",
    "grammar", "json_schema", "seed", "ignore_eos", "logit_bias", "n_probs", "min_keep", "t_max_predict_ms",
    "t_max_prompt_ms", "id_slot", "cache_prompt", "return_tokens", "samplers", "timings_per_token", "return_progress",
    "sse_ping_interval", "post_sampling_probs", "response_fields", "lora", "top_n_sigma", "adaptive_target",
    "adaptive_decay", "backend_sampling", "verbose", "echo", "image_data", "multimodal_data", "grammar_lazy",
    "grammar_triggers", "preserved_tokens", "reasoning_budget_tokens", "reasoning_budget_message",
    "reasoning_budget_start_tag", "reasoning_budget_end_tags", "stream_options")
LLAMA_SERVER_CHAT = (
    "chat_template_kwargs", "reasoning_effort", "reasoning_format", "reasoning_control", "generation_prompt",
    "parse_tool_calls", "parallel_tool_calls", "add_generation_prompt", "continue_final_message", "chat_format",
    "chat_parser", "response_format", "tools", "tool_choice")
LLAMA_SERVER_MESSAGES = ("temperature", "top_p", "top_k")  # its /v1/messages' sampling fields

# a value of each field that asks for something (a field refused must be refused for what it asks)
VALUES: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"}, "frequency_penalty": 0.5, "presence_penalty": 0.5,
    "function_call": "auto", "functions": [{"name": "f", "parameters": {"type": "object"}}], "logit_bias": {"1": 1},
    "max_completion_tokens": 2, "metadata": {"k": "v"}, "modalities": ["text", "audio"],
    "moderation": {"model": "omni-moderation-latest"}, "n": 2, "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "x"}, "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "explicit", "ttl": "30m"}, "prompt_cache_retention": "24h",
    "reasoning_effort": "low", "response_format": {"type": "json_object"}, "safety_identifier": "u",
    "service_tier": "flex", "seed": 7, "stop": ["\n\n"], "store": True, "stream": True,
    "stream_options": {"include_usage": True}, "temperature": 0.5, "tools": [TOOL], "tool_choice": "none",
    "top_logprobs": 2, "top_p": 0.9, "user": "u", "verbosity": "low", "web_search_options": {}, "best_of": 2,
    "echo": True, "suffix": "x",
    # llama-server's
    "n_predict": 1, "n_indent": 2, "n_keep": 4, "n_cmpl": 2, "n_cache_reuse": 8, "n_discard": 4, "top_k": 5,
    "dynatemp_range": 0.5, "dynatemp_exponent": 2.0, "min_p": 0.1, "typical_p": 0.5, "repeat_penalty": 1.2,
    "repeat_last_n": 8, "dry_multiplier": 0.8, "dry_base": 2.0, "dry_allowed_length": 3, "dry_penalty_last_n": 8,
    "dry_sequence_breakers": ["\n"], "xtc_probability": 0.5, "xtc_threshold": 0.2, "mirostat": 2,
    "mirostat_tau": 4.0, "mirostat_eta": 0.2, "grammar": 'root ::= "a"', "json_schema": {"type": "integer"},
    "ignore_eos": True, "n_probs": 2, "min_keep": 2, "t_max_predict_ms": 100, "t_max_prompt_ms": 100, "id_slot": 0,
    "cache_prompt": False, "return_tokens": True, "samplers": ["top_k"], "timings_per_token": True,
    "return_progress": True, "sse_ping_interval": 1, "post_sampling_probs": True, "response_fields": ["content"],
    "lora": [{"id": 0, "scale": 0.5}], "top_n_sigma": 1.0, "adaptive_target": 0.5, "adaptive_decay": 0.5,
    "backend_sampling": True, "verbose": True, "image_data": [{"data": "AAAA", "id": 1}],
    "multimodal_data": ["AAAA"], "grammar_lazy": True, "grammar_triggers": [{"type": 0, "value": "x"}],
    "preserved_tokens": ["<x>"], "reasoning_budget_tokens": 4, "reasoning_budget_message": "enough",
    "reasoning_budget_start_tag": "<think>", "reasoning_budget_end_tags": ["</think>"],
    "chat_template_kwargs": {"enable_thinking": False}, "reasoning_format": "none", "reasoning_control": True,
    "generation_prompt": "<think>", "parse_tool_calls": False, "add_generation_prompt": False,
    "continue_final_message": True, "chat_format": 1, "chat_parser": "x",
}
# where a route's field takes another shape (or another field with it)
ROUTE_VALUES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"logprobs": 2},
    "/v1/chat/completions": {"logprobs": True, "top_logprobs": {"top_logprobs": 2, "logprobs": True},
                             "tool_choice": {"tool_choice": "none", "tools": [TOOL]},
                             "continue_final_message": {"continue_final_message": True, "messages": [
                                 *HELLO, {"role": "assistant", "content": "Well"}]}},
    "/v1/responses": {
        "access_programs": {"cyber": "standard"}, "background": True, "background_options": {"completion_window": "2h"},
        "context_management": [{"type": "compaction"}], "conversation": "conv_1",
        "image": {"context_compression": "enabled"}, "include": ["reasoning.encrypted_content"],
        "instructions": "Be brief.", "max_output_tokens": 2, "max_tool_calls": 2, "previous_response_id": "resp_x",
        "prompt": {"id": "pmpt_1"}, "reasoning": {"effort": "none"}, "store": False,
        "text": {"format": {"type": "json_object"}}, "tools": [{"type": "function", "name": "f",
                                                                 "parameters": {"type": "object"}}],
        "truncation": "auto", "top_logprobs": 2},
    "/v1/messages": {
        "cache_control": {"type": "ephemeral"}, "container": "c", "diagnostics": {"previous_message_id": "msg_1"},
        "inference_geo": "us", "metadata": {"user_id": "u"}, "service_tier": "auto", "speed": "fast",
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
        "stop_sequences": ["\n\n"], "system": "Be brief.", "thinking": {"type": "disabled"},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "none"},
        "user_profile_id": "u", "workspace_id": "w", "temperature": 0.5, "top_k": 5},
}
ROUTE_VALUES["/v1/messages/count_tokens"] = ROUTE_VALUES["/v1/messages"]


def fields_of(*typed_dicts: type) -> set[str]:
    return {name for t in typed_dicts for name in t.__annotations__}


ROUTES: dict[str, tuple[dict[str, Any], set[str], frozenset[str]]] = {
    # the route: a request without the field, the documented fields, the fields the server takes
    "/v1/completions": ({"prompt": "Once", "max_tokens": 1},
                        fields_of(completion_params.CompletionCreateParamsBase,
                                  completion_params.CompletionCreateParamsStreaming) | set(LLAMA_SERVER),
                        known_fields(openai_wire.CompletionBody)),
    "/v1/chat/completions": ({"messages": HELLO, "max_tokens": 1},
                             fields_of(chat_params.CompletionCreateParamsBase,
                                       chat_params.CompletionCreateParamsStreaming)
                             | set(LLAMA_SERVER) | set(LLAMA_SERVER_CHAT),
                             known_fields(openai_wire.ChatBody)),
    "/v1/responses": ({"input": "hello there", "max_output_tokens": 1},
                      fields_of(responses_params.ResponseCreateParamsBase,
                                responses_params.ResponseCreateParamsStreaming),
                      known_fields(responses_wire.ResponsesBody)),
    "/v1/messages": ({"messages": HELLO, "max_tokens": 1},
                     fields_of(message_create_params.MessageCreateParamsBase,
                               message_create_params.MessageCreateParamsStreaming) | set(LLAMA_SERVER_MESSAGES),
                     known_fields(anthropic_wire.MessagesBody, anthropic_wire.ANTHROPIC_NO_EFFECT)),
    "/v1/messages/count_tokens": ({"messages": HELLO}, fields_of(message_count_tokens_params.MessageCountTokensParams),
                                  known_fields(anthropic_wire.CountBody, anthropic_wire.ANTHROPIC_NO_EFFECT)),
}


def fates_in_the_docs() -> dict[str, set[str]]:
    """The fields docs/server.md's "Every field's fate" lists, by route."""
    text = (Path(__file__).parents[1] / "docs" / "server.md").read_text()
    section = text.split("## Every field's fate", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    route = ""
    for line in section.splitlines():
        if line.startswith("`POST "):
            route = line.split()[1].rstrip("`:")
            out[route] = set()
        elif line.startswith("| `") and route:
            out[route].add(line.split("`")[1])
    return out


def named(r: httpx.Response, field: str) -> bool:
    """Whether a 400 names `field`, in OpenAI's or Anthropic's error object."""
    err = r.json()["error"]
    return (err.get("param") or "").split(".")[0].split("[")[0] == field or f"{field}:" in err["message"] or \
        f"{field}." in err["message"].split(":")[0]


@pytest.mark.parametrize("path", list(ROUTES))
def test_every_documented_field_is_honoured_or_refused_by_name(server: Server, path: str) -> None:
    base, documented, known = ROUTES[path]
    silent, unvalued = [], []
    for field in sorted(documented - set(base) - {"model", "messages", "prompt", "input"}):
        value = ROUTE_VALUES.get(path, {}).get(field, VALUES.get(field, KeyError))
        if value is KeyError:
            unvalued.append(field)
            continue
        extra = value if isinstance(value, dict) and field in value else {field: value}
        r = post(server, path, {**base, **extra})
        if r.status_code == 400:
            assert named(r, field), f"{path} {field}: a 400 that does not name it: {r.text}"
        else:
            assert r.status_code == 200, f"{path} {field}: {r.status_code} {r.text}"
            if field not in known:
                silent.append(field)
    assert not unvalued, f"{path}: documented fields without a value to send here (add one to VALUES): {unvalued}"
    missing = documented - set(base) - {"model", "messages", "prompt", "input"} - fates_in_the_docs().get(path, set())
    assert not missing, f"{path}: fields docs/server.md's \"Every field's fate\" does not list: {sorted(missing)}"
    assert not silent, f"{path}: fields answered 200 that the server does not take (silently ignored): {silent}"
