"""Tools and tool turns rendered through a model's own chat template (bmoe.chat.template.Renderer), on the
real templates of Qwen3, gpt-oss, Mistral Nemo, DeepSeek R1 and Llama 3.3 (tests/data/templates), and what
llama.cpp's jinja path gives a template (--jinja: enable_thinking as --reasoning decides, today's date)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from bmoe.chat.syntax import DEEPSEEK_R1, HARMONY, HERMES, LLAMA3, MISTRAL, PLAIN, detect
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


def renderer(vocab: Vocab, name: str | None, jinja: bool = False, reasoning: str = "auto") -> Renderer:
    from bmoe.tools.synth_vocab import CHAT_TEMPLATE

    text = CHAT_TEMPLATE if name is None else (TEMPLATES / f"{name}.jinja").read_text()
    return Renderer(vocab, text.encode(), jinja, reasoning)


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
    ("chatml-tools", HERMES, True), (None, PLAIN, False), ("deepseek-r1-tools", DEEPSEEK_R1, True),
    ("deepseek-r1-distill", DEEPSEEK_R1, False), ("llama-3.3", LLAMA3, True),
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


HELLO = [{"role": "user", "content": "What is today?"}]


@pytest.mark.parametrize("reasoning, think, end", [
    ("auto", None, "<｜Assistant｜><think>\n"), ("on", None, "<｜Assistant｜><think>\n"),
    ("off", None, "<｜Assistant｜><think>\n</think>"), ("off", True, "<｜Assistant｜><think>\n"),
    ("on", False, "<｜Assistant｜><think>\n</think>"),
])
def test_jinja_gives_the_template_enable_thinking_as_reasoning_and_the_request_decide(vocab, reasoning, think,
                                                                                      end) -> None:
    """R1's template (llama.cpp's copy) closes the think block unless enable_thinking is true: llama-server's
    --reasoning sets the default, a request's own word wins."""
    r = renderer(vocab, "deepseek-r1-distill", jinja=True, reasoning=reasoning)
    assert r.render(HELLO, think).endswith(end)


def test_without_jinja_a_template_llama_cpp_knows_renders_with_its_formatter(vocab) -> None:
    """The default: llama.cpp's own formatter (no think block opened: it does not run the template), unless
    thinking is off on a template that reads enable_thinking."""
    r = renderer(vocab, "deepseek-r1-distill")
    assert r.render(HELLO, None).endswith("<｜Assistant｜>")
    assert r.render(HELLO, False).endswith("<｜Assistant｜><think>\n</think>")
    assert renderer(vocab, "deepseek-r1-distill", reasoning="off").render(HELLO, None).endswith("</think>")


def test_llama3_gets_todays_date_and_its_tools_in_the_first_user_message(vocab) -> None:
    r = renderer(vocab, "llama-3.3", jinja=True)
    text = r.render(HELLO, None, tools=[WEATHER])
    assert f"Today Date: {datetime.date.today().strftime('%d %b %Y')}\n" in text
    assert json.dumps(WEATHER, indent=4) + "\n\nWhat is today?<|eot_id|>" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_built_in_template_by_name_is_llama_cpps_formatter(vocab) -> None:
    """--chat-template command-r: llama.cpp's formatter for the name (what llama-server renders), no tools."""
    r = Renderer(vocab, b"command-r")
    msgs = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
    assert r.render(msgs, None) == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
        "<|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    assert r.supports_tools is False


def test_a_string_joined_to_null_is_the_string_and_a_filters_result_is_json() -> None:
    """llama.cpp's jinja engine, not jinja2's: firefunction's template adds `functions`, which llama.cpp never
    defines, to its text; R1's writes `tools | map(attribute='function') | tojson`."""
    from bmoe.chat.jinja_render import JinjaTemplate

    t = JinjaTemplate("{{ 'Functions:' + functions }}|{{ none + 'x' }}|"
                      "{{ tools | map(attribute='function') | tojson }}")
    assert t.render([], True, tools=[{"function": {"name": "f"}}]) == 'Functions:|x|[{"name": "f"}]'
