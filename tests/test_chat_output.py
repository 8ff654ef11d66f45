"""Model answers → OpenAI reasoning_content / content / tool_calls, whole and piece by piece, for
each tool-call syntax (answers written as the models write them), and the grammars that force a
call on a real (random-weight) model: what it samples parses back to a valid call."""

from __future__ import annotations

import json
import random

import pytest

from bmoe.chat.grammar import GrammarError, schema_grammar
from bmoe.chat.output import OutputParser, Reading, Reply
from bmoe.chat.partial_json import value_end
from bmoe.chat.syntax import (
    COMMAND_R7B,
    DEEPSEEK_R1,
    HARMONY,
    HERMES,
    LLAMA3,
    MISTRAL,
    PLAIN,
    Syntax,
    check_tools,
    detect,
    tool_grammar,
    with_reasoning,
)
from tests.plain_llama import Plain

QWEN3 = Syntax(HERMES, ("<think>", "</think>"))
HERMES2 = Syntax(HERMES)
NEMO = Syntax(MISTRAL)
MISTRAL_ARGS = Syntax(MISTRAL, ("[THINK]", "[/THINK]"), args_form=True)
GPT_OSS = Syntax(HARMONY)
R1 = Syntax(PLAIN, ("<think>", "</think>"))
R1_TOOLS = Syntax(DEEPSEEK_R1, ("<think>", "</think>"))
V31 = Syntax(DEEPSEEK_R1, ("<think>", "</think>"), args_form=True)
R7B = Syntax(COMMAND_R7B, ("<|START_THINKING|>", "<|END_THINKING|>"))
LLAMA = Syntax(LLAMA3)
R1_CALL = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>")

# (syntax, tools on, prompt ends inside the reasoning block, answer, reasoning, content, [(name, arguments)])
CASES = [
    ("qwen3 think + call", QWEN3, True, False,
     '<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n</tool_call>',
     "The user wants the weather in Paris. I should call get_weather.", "",
     [("get_weather", '{"location": "Paris", "unit": "celsius"}')]),
    ("qwen3 parallel", QWEN3, True, False,
     '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "", "", [("get_weather", '{"location": "Paris"}'), ("get_time", '{"zone": "CET"}')]),
    ("qwen3 answer", QWEN3, True, False,
     "<think>\nA greeting. Answer briefly.\n</think>\n\nHello! How can I help you today?",
     "A greeting. Answer briefly.", "Hello! How can I help you today?", []),
    ("qwen3 think:false answer", QWEN3, True, False, "The sky is blue because of Rayleigh scattering.",
     "", "The sky is blue because of Rayleigh scattering.", []),
    ("hermes content then call, arguments first", HERMES2, True, False,
     'Let me check that for you.\n<tool_call>\n{"arguments": {"code": "print(\\"}\\")", "n": [1, {"a": null}]}, '
     '"name": "run_python"}\n</tool_call>',
     "", "Let me check that for you.\n", [("run_python", '{"code": "print(\\"}\\")", "n": [1, {"a": null}]}')]),
    ("hermes with tool_choice none", HERMES2, False, False,
     '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
     "", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>', []),
    ("mistral nemo array", NEMO, True, False,
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "Paris"}, "id": "a1b2c3d4e"}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}, "id": "f5g6h7i8j"}]',
     "", "", [("get_weather", '{"location": "Paris"}'), ("get_time", '{"zone": "CET"}')]),
    ("mistral name[ARGS]", MISTRAL_ARGS, True, False,
     '[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
     "", "", [("get_weather", '{"location": "Paris"}'), ("get_time", '{"zone": "CET"}')]),
    ("magistral think + call", MISTRAL_ARGS, True, False,
     '[THINK]The user asks for the weather; call the tool.[/THINK][TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}',
     "The user asks for the weather; call the tool.", "", [("get_weather", '{"location": "Paris"}')]),
    ("gpt-oss analysis + call in the channel", GPT_OSS, True, False,
     "<|channel|>analysis<|message|>User asks weather in Paris. Use get_weather.<|end|><|start|>assistant"
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Paris"}',
     "User asks weather in Paris. Use get_weather.", "", [("get_weather", '{"location":"Paris"}')]),
    ("gpt-oss call in the role header", GPT_OSS, True, False,
     "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant to=functions.get_weather"
     '<|channel|>commentary json<|message|>{"location": "Paris"}',
     "Need the tool.", "", [("get_weather", '{"location": "Paris"}')]),
    ("gpt-oss final answer", GPT_OSS, True, False,
     "<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final<|message|>"
     "Hello! How can I help?",
     "Simple greeting.", "Hello! How can I help?", []),
    ("deepseek-r1 reasoning opened by the prompt", R1, False, True,
     "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2 + 2 is 4.", "The answer is 4.", []),
    ("deepseek-r1 think + two calls", R1_TOOLS, True, True,
     "The user wants weather and time.\n</think>\n\n<｜tool▁calls▁begin｜>"
     + R1_CALL.format("get_weather", '{"location": "Paris"}') + "\n" + R1_CALL.format("get_time", '{"zone": "CET"}')
     + "<｜tool▁calls▁end｜>",
     "The user wants weather and time.", "",
     [("get_weather", '{"location": "Paris"}'), ("get_time", '{"zone": "CET"}')]),
    ("deepseek-r1 content then a call", R1_TOOLS, True, True,
     "Short.</think>Let me look.<｜tool▁calls▁begin｜>" + R1_CALL.format("get_weather", '{"location": "Oslo"}')
     + "<｜tool▁calls▁end｜>",
     "Short.", "Let me look.", [("get_weather", '{"location": "Oslo"}')]),
    ("deepseek-r1 answer", R1_TOOLS, True, True, "Easy.\n</think>\n\nIt is 4.", "Easy.", "It is 4.", []),
    ("deepseek-v3.1 calls", V31, True, False,
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\": \"Paris\"}<｜tool▁call▁end｜>"
     "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"zone\": \"CET\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "", "", [("get_weather", '{"location": "Paris"}'), ("get_time", '{"zone": "CET"}')]),
    ("cohere2 moe answer", R7B, True, False, "<|START_TEXT|>Hello there.<|END_TEXT|>", "", "Hello there.", []),
    ("command-r7b plan + calls", R7B, True, False,
     '<|START_THINKING|>I will look up the weather.<|END_THINKING|><|START_ACTION|>[\n'
     '    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"location": "Paris"}},\n'
     '    {"tool_call_id": "1", "tool_name": "get_time", "parameters": {"zone": "CET"}}\n]<|END_ACTION|>',
     "I will look up the weather.", "",
     [("get_weather", '{"location": "Paris"}'), ("get_time", '{"zone": "CET"}')]),
    ("command-r7b answer", R7B, True, False,
     "<|START_THINKING|>A greeting.<|END_THINKING|><|START_RESPONSE|>Hello! How can I help?<|END_RESPONSE|>",
     "A greeting.", "Hello! How can I help?", []),
    ("llama3 call", LLAMA, True, False, '{"name": "get_weather", "parameters": {"location": "Paris"}}',
     "", "", [("get_weather", '{"location": "Paris"}')]),
    ("llama3 answer with braces", LLAMA, True, False, "Use {x} in a format string.", "",
     "Use {x} in a format string.", []),
    ("llama3 call spaced", LLAMA, True, False, '{ "name" : "get_weather", "parameters": {"location": "Oslo"}}',
     "", "", [("get_weather", '{"location": "Oslo"}')]),
    ("llama3 with tool_choice none", LLAMA, False, False, '{"name": "get_weather", "parameters": {}}', "",
     '{"name": "get_weather", "parameters": {}}', []),
]


def run(syntax: Syntax, tools: bool, think_open: bool, pieces: list[str]) -> tuple[dict, Reply]:
    """Feed `pieces`; the deltas joined (as a stream's client joins them) and the whole message."""
    p = OutputParser(syntax, tools, think_open)
    joined: dict = {"reasoning": "", "content": "", "calls": {}}
    for d in [*(p.push(x) for x in pieces), p.finish()]:
        joined["reasoning"] += d.reasoning
        joined["content"] += d.content
        for c in d.calls:
            assert c.index not in joined["calls"], "a call comes once, whole"
            assert json.loads(c.arguments) is not None, "a streamed call's arguments parse"
            joined["calls"][c.index] = {"id": c.id, "name": c.name, "arguments": c.arguments}
    return joined, p.message()


def splits(text: str) -> list[list[str]]:
    rng = random.Random(len(text))
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        chunks.append(text[i:i + n])
        i += n
    return [[text], list(text), chunks]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_an_answer_parses_the_same_whole_and_piece_by_piece(case: tuple) -> None:
    _, syntax, tools, think_open, text, reasoning, content, calls = case
    for pieces in splits(text):
        joined, msg = run(syntax, tools, think_open, pieces)
        assert (msg.reasoning, msg.content) == (reasoning, content)
        assert [(c.name, c.arguments) for c in msg.calls] == calls
        assert all(json.loads(c.arguments) is not None for c in msg.calls)
        assert joined["reasoning"] == reasoning
        streamed = [(c["name"], c["arguments"]) for _, c in sorted(joined["calls"].items())]
        assert streamed == calls and joined["content"] == content
        assert [c["id"] for _, c in sorted(joined["calls"].items())] == [c.id for c in msg.calls]


@pytest.mark.parametrize("syntax, whole, cut", [
    (HERMES2, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n',
     '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Par'),
    (HERMES2, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n',
     '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_'),
    (NEMO, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}, "id": "a1b2c3d4e"}, ',
     '{"name": "get_weather", "arguments": {"location": "Paris"}, "id": "f5g6h7i8j"}'),
    (MISTRAL_ARGS, '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', '[TOOL_CALLS]get_weather[ARGS]{"location": "Pa'),
    (R1_TOOLS, "<｜tool▁calls▁begin｜>" + R1_CALL.format("get_time", '{"zone": "CET"}') + "\n",
     R1_CALL.format("get_weather", '{"location": "Paris"}')[:-12]),
    (R7B, '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_time", "parameters": {"zone": "CET"}}, ',
     '{"tool_call_id": "1", "tool_name": "get_weather", "parameters": {"location": "Pa'),
], ids=["hermes-in-arguments", "hermes-in-close", "mistral-array", "mistral-args", "deepseek-r1", "command-r7b"])
def test_a_call_cut_off_is_dropped_whole_and_piece_by_piece(syntax: Syntax, whole: str, cut: str) -> None:
    """max_tokens cut the second call: the first is kept, the second is in neither calls nor content,
    and no piece of it was streamed."""
    for pieces in splits(whole + cut):
        joined, msg = run(syntax, True, False, pieces)
        assert [(c.name, c.arguments) for c in msg.calls] == [("get_time", '{"zone": "CET"}')]
        assert msg.content == "" and joined["content"] == ""
        assert [(c["name"], c["arguments"]) for c in joined["calls"].values()] == [("get_time", '{"zone": "CET"}')]


def test_a_repeated_call_is_dropped_and_a_different_one_kept() -> None:
    one = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n'
    same = '<tool_call>\n{"arguments": {"zone":"CET"}, "name": "get_time"}\n</tool_call>\n'
    other = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    for pieces in splits(one + same + other):
        joined, msg = run(HERMES2, True, False, pieces)
        assert [c.arguments for c in msg.calls] == ['{"zone": "CET"}', '{"zone": "UTC"}']
        assert [c["arguments"] for c in joined["calls"].values()] == ['{"zone": "CET"}', '{"zone": "UTC"}']
        assert sorted(joined["calls"]) == [0, 1] and [c["id"] for c in joined["calls"].values()] == \
            [c.id for c in msg.calls]


def test_a_call_that_ends_without_parsing_is_content() -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": CET}}\n</tool_call>'
    joined, msg = run(HERMES2, True, False, [text])
    assert msg.calls == () and msg.content == text == joined["content"] and not joined["calls"]


CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "%s"}}\n</tool_call>\n'


def ends_at(pieces: list[str], max_tokens: int) -> int | None:
    """Feed CallEnd one piece per token: the token it ends the answer at, or None."""
    watch = Reading(HERMES2, tools=True).call_end(max_tokens)
    assert watch is not None
    for n, piece in enumerate(pieces, 1):
        if watch.push(piece, n):
            return n
    return None


def tokens(text: str, size: int = 4) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def test_an_answer_ends_at_a_repeated_call() -> None:
    first, repeat = tokens(CALL % "CET"), tokens(CALL % "CET")
    assert ends_at(first + repeat + tokens(CALL % "UTC"), 1000) == len(first) + len(repeat)
    assert ends_at(tokens(CALL % "CET" + CALL % "UTC"), 1000) is None


def test_an_answer_ends_when_the_next_call_could_not_end() -> None:
    calls = tokens(CALL % "CET" + CALL % "UTC" + CALL % "EST")
    n = len(tokens(CALL % "CET"))  # tokens per call (the three are as long)
    assert ends_at(calls, 4 * n) is None, "room for a fourth"
    assert ends_at(calls, 4 * n - 1) == 3 * n, "no room for a fourth: the answer ends after the third"
    assert ends_at(calls, 3 * n - 1) == 2 * n, "the third could not end: the answer ends after the second"
    assert ends_at(tokens("Let me see. " * 20) + calls, 1000) is None, "text before the calls is not a call's"
    assert Reading(HERMES2, tools=False).call_end(100) is None


def test_a_marker_is_held_back_until_the_text_decides() -> None:
    p = OutputParser(HERMES2)
    assert p.push("Sure <tool_").content == "Sure "
    assert p.push("ca").content == ""
    assert p.push("t> is a tag").content == "<tool_cat> is a tag"


def test_a_call_streams_whole_once_complete() -> None:
    p = OutputParser(HERMES2)
    assert not p.push('<tool_call>\n{"name": "get_w')
    assert not p.push('eather", "arguments": {"location": "Paris"}}\n</tool')
    d = p.push('_call>')
    assert [(c.index, c.name, c.arguments) for c in d.calls] == [(0, "get_weather", '{"location": "Paris"}')]
    assert d.calls[0].openai() == {"index": 0, "id": d.calls[0].id, "type": "function",
                                   "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}
    assert d.calls[0].id.startswith("call_") and not p.finish()


def test_mistral_call_ids_are_nine_letters_and_digits() -> None:
    _, msg = run(NEMO, True, False, ['[TOOL_CALLS][{"name": "f", "arguments": {}}]'])
    assert len(msg.calls[0].id) == 9 and msg.calls[0].id.isalnum()


@pytest.mark.parametrize("text, end", [('{"a": "}"} x', 10), ('[1, [2]]', 8), ('"a\\"b"', 6), ("12 ", 2),
                                       ("12", None), ('{"a": [', None), ("true,", 4)])
def test_value_end_follows_strings_and_nesting(text: str, end: int | None) -> None:
    assert value_end(text, 0) == end


@pytest.mark.parametrize("template, syntax", [
    ("{{ '<|start|>assistant<|channel|>final<|message|>' }}", Syntax(HARMONY)),
    ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS][", Syntax(MISTRAL)),
    ("[THINK][TOOL_CALLS]{{ name }}[ARGS]", Syntax(MISTRAL, ("[THINK]", "[/THINK]"), True)),
    ("<tool_call>\n{{ tool_call.arguments | tojson }}</tool_call> <think>", QWEN3),
    ("<tool_call>", HERMES2),
    ("{{ '<think>' }}", R1),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", Syntax(PLAIN)),
    ("{{ '<｜Assistant｜><｜tool▁calls▁begin｜>' }}<think>```json", R1_TOOLS),
    ("{{ '<｜Assistant｜><｜tool▁calls▁begin｜>' }}<think>", V31),
    ("<|START_THINKING|>{{ x }}<|END_THINKING|><|START_ACTION|>", R7B),
    ("<|start_header_id|>user<|end_header_id|>Respond in the format {\"name\": function name, \"parameters\": ...}",
     LLAMA),
])
def test_the_syntax_is_read_from_the_template(template: str, syntax: Syntax) -> None:
    assert detect(template) == syntax


# ---- tools and tool_choice -----------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"]}}}


@pytest.mark.parametrize("tools, choice, param", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([{"type": "retrieval"}], None, "tools[0]"),
])
def test_bad_tools_name_the_field(tools: object, choice: object, param: str) -> None:
    with pytest.raises(GrammarError) as e:
        check_tools(tools, choice)
    assert e.value.param == param


def test_an_unconvertible_tool_schema_names_the_tool() -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1}}}}}
    with pytest.raises(GrammarError) as e:
        check_tools([bad], "required")
    assert e.value.param == "tools[0].function.parameters.properties.n.minimum"
    pattern = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string", "pattern": "[a-z]"}}}}}
    with pytest.raises(GrammarError,
                       match=r'tools.call-f: this schema cannot be turned into a grammar \(Pattern must start'):
        tool_grammar(HERMES2, check_tools([pattern], "required"))


@pytest.fixture(scope="module")
def plain(synth) -> Plain:
    p = Plain(synth(arch="qwen3moe", layers=2, experts=4, top_k=2))
    yield p
    p.close()


@pytest.mark.parametrize("syntax", [HERMES2, QWEN3, NEMO, MISTRAL_ARGS, GPT_OSS, R1_TOOLS, V31, R7B, LLAMA],
                         ids=lambda s: f"{s.name}{'-args' if s.args_form else ''}{'-think' if s.think else ''}")
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_a_forced_call_is_a_valid_call_even_from_a_random_model(plain: Plain, syntax: Syntax, choice: object) -> None:
    tools = check_tools([WEATHER, TIME], choice, parallel=False)
    g = tool_grammar(syntax, tools)
    for seed in range(3):
        # R1's and Command R7B's markers are not one token each in this vocabulary: spelt out, they take more
        text, ended = plain.generate("Call a tool:", g, n=400 if syntax.name in (DEEPSEEK_R1, COMMAND_R7B) else 120,
                                     temp=1.0, seed=seed)
        assert ended, text
        _, msg = run(syntax, True, False, [text])
        assert len(msg.calls) == 1 and msg.content == "", text
        call = msg.calls[0]
        args = json.loads(call.arguments)
        if choice == "required":
            assert call.name in ("get_weather", "get_time")
        else:
            assert call.name == "get_time"
        assert set(args) == ({"city", "days"} if call.name == "get_weather" else {"zone"})


def test_parallel_calls_may_follow_one_another(plain: Plain) -> None:
    g = tool_grammar(HERMES2, check_tools([WEATHER, TIME], "required", parallel=True))
    text, _ = plain.generate("Calls:", g, n=400, temp=1.0, seed=0, endless=True)
    _, msg = run(HERMES2, True, False, [text])
    assert len(msg.calls) > 1, "with parallel_tool_calls the grammar lets another call follow one"


def test_auto_leaves_the_model_free_until_it_opens_a_call(plain: Plain) -> None:
    tools = check_tools([WEATHER], "auto")
    g = tool_grammar(HERMES2, tools)
    assert g.lazy
    free, _ = plain.generate("Say something:", None, n=10)
    text, _ = plain.generate("Say something:", g, n=10)
    assert text == free


def test_a_reasoning_block_may_come_before_a_forced_json_answer(plain: Plain) -> None:
    answer = schema_grammar({"enum": ["yes", "no"]})
    opened = with_reasoning(QWEN3, answer, think_open=True)
    assert plain.accepts(opened, ' I weigh it up.\n</think>\n"yes"')
    assert not plain.accepts(opened, ' "yes"'), "the prompt opened the block: it must close before the answer"
    optional = with_reasoning(QWEN3, answer, think_open=False)
    assert plain.accepts(optional, '<think>\nHm.\n</think>\n\n"no"')
    assert plain.accepts(optional, '"no"') and not plain.accepts(optional, '"maybe"')
    assert with_reasoning(Syntax(PLAIN), answer, think_open=False) is answer


def test_llama3_auto_gets_no_grammar_and_the_marked_syntaxes_a_lazy_one() -> None:
    """As llama.cpp: a lazy grammar needs a marker to wake on, and Llama 3's calls have none."""
    auto = check_tools([WEATHER], "auto")
    assert tool_grammar(LLAMA, auto) is None and tool_grammar(LLAMA, check_tools([WEATHER], "required")) is not None
    assert tool_grammar(R1_TOOLS, auto).triggers == ("<｜tool▁calls▁begin｜>",)
    assert tool_grammar(R7B, auto).triggers == (r"<\|START_ACTION\|>",)
