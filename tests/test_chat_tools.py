"""Tools and tool turns rendered through a model's own chat template (bmoe.chat.template.Renderer), on the
real templates of Qwen3, gpt-oss and Mistral Nemo (tests/data/templates)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bmoe.chat.syntax import HARMONY, HERMES, MISTRAL, PLAIN, detect
from bmoe.chat.template import Renderer
from bmoe.seam.llama import Vocab, init_backend, load_model

TEMPLATES = Path(__file__).parent / "data" / "templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.fixture(scope="module")
def vocab(synth) -> Vocab:
    init_backend()
    return Vocab(load_model(synth(arch="qwen3moe", layers=2, experts=4, top_k=2)))


def renderer(vocab: Vocab, name: str | None) -> Renderer:
    from bmoe.tools.synth_vocab import CHAT_TEMPLATE

    text = CHAT_TEMPLATE if name is None else (TEMPLATES / f"{name}.jinja").read_text()
    return Renderer(vocab, text.encode())


def turn(call_id: str) -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temp_c": 21}'},
    ]


@pytest.mark.parametrize("name, syntax, tools", [
    ("qwen3", HERMES, True), ("gpt-oss", HARMONY, True), ("mistral-nemo", MISTRAL, True),
    ("chatml-tools", HERMES, True), (None, PLAIN, False),
])
def test_the_syntax_and_tool_support_come_from_the_template(vocab, name, syntax, tools) -> None:
    r = renderer(vocab, name)
    assert detect(r.template.decode()).name == syntax
    assert r.supports_tools is tools


def test_qwen3_shows_the_tools_and_reads_back_a_call_and_its_result(vocab) -> None:
    r = renderer(vocab, "qwen3")
    text = r.render(turn("call_1"), think=True, tools=[WEATHER])
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text, \
        "arguments as an object, not JSON text in a string"
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")
    off = r.render(turn("call_1"), think=False, tools=[WEATHER])
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_gpt_oss_gets_the_call_in_harmony_and_reasoning_as_thinking(vocab) -> None:
    r = renderer(vocab, "gpt-oss")
    msgs = turn("call_1")
    msgs[1]["reasoning_content"] = "Need the weather tool."
    text = r.render(msgs, think=True, tools=[WEATHER])
    assert "namespace functions {\n\n// Weather in a city\ntype get_weather = (_: {" in text
    assert ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"city": "Paris"}<|call|>') in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" in text
    assert text.endswith("<|start|>assistant")


def test_mistral_nemo_takes_nine_character_call_ids(vocab) -> None:
    r = renderer(vocab, "mistral-nemo")
    text = r.render(turn("a1b2c3d4e"), think=True, tools=[WEATHER])
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]' in text
    assert '[TOOL_RESULTS]{"content": {"temp_c": 21}, "call_id": "a1b2c3d4e"}[/TOOL_RESULTS]' in text
    with pytest.raises(Exception, match="length 9"):
        r.render(turn("call_abcdefghijkl"), think=True, tools=[WEATHER])


def test_chatml_tools_gives_the_demo_vocabulary_hermes_calls(vocab) -> None:
    r = renderer(vocab, "chatml-tools")
    text = r.render([{"role": "system", "content": "Be brief."}, *turn("call_1")], think=True, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call functions.")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert text.endswith('<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n')


def test_a_plain_conversation_renders_as_before(vocab) -> None:
    r = renderer(vocab, None)
    msgs = [{"role": "user", "content": "Hello"}]
    assert r.render(msgs, think=True) == r.render(msgs, think=True, tools=None) == \
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_bmoe_synth_stores_another_models_template(tmp_path: Path) -> None:
    import llama_cpp

    from bmoe.tools.synth import write_model

    qwen3 = (TEMPLATES / "qwen3.jinja").read_text()
    model = load_model(write_model(tmp_path / "q.gguf", layers=2, experts=4, chat_template=qwen3))
    try:
        assert llama_cpp.llama_model_chat_template(model, None).decode() == qwen3
    finally:
        llama_cpp.llama_model_free(model)


def test_a_special_token_is_written_out_only_when_asked(vocab) -> None:
    """What lets a syntax's markers (gpt-oss's <|channel|>, Mistral's [TOOL_CALLS]) reach the parser:
    Generation writes the Request's `specials` with their text (bmoe.chat.request.ChatFormat.markers)."""
    (tok,) = vocab.tokenize("<|im_start|>", add_special=False)
    assert vocab.piece(tok, special=True) == b"<|im_start|>" and vocab.piece(tok) == b""
