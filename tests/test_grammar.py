"""Structured output: JSON schema → GBNF (llama-cpp-python's converter) enforced by llama.cpp's
grammar sampler, on a real (random-weight) model: whatever it samples is valid under the schema."""

from __future__ import annotations

import ctypes
import json
import threading
from pathlib import Path
from typing import Annotated, Literal

import llama_cpp
import pytest
from pydantic import BaseModel, Field

from bmoe.chat import grammar as grammar_module
from bmoe.chat.grammar import (
    Grammar,
    GrammarError,
    json_object_grammar,
    literal,
    response_format_grammar,
    schema_grammar,
)
from bmoe.chat.grammar_check import GrammarCheck
from bmoe.chat.limits import REPEAT_MAX
from bmoe.seam.llama import grammar_sampler
from tests.plain_llama import Plain


class Trip(BaseModel):
    city: Literal["Paris", "Oslo", "Rome"]
    days: int
    sunny: bool
    note: str = Field(max_length=12)
    tags: list[Annotated[str, Field(max_length=5)]] = Field(default_factory=list, max_length=3)


@pytest.fixture(scope="module")
def plain(synth) -> Plain:
    p = Plain(synth(arch="qwen3moe", layers=2, experts=4, top_k=2))
    yield p
    p.close()


@pytest.mark.parametrize("seed", range(4))
def test_every_sample_under_a_schema_grammar_validates(plain: Plain, seed: int) -> None:
    g = response_format_grammar({"type": "json_schema",
                                 "json_schema": {"name": "trip", "schema": Trip.model_json_schema()}})
    text, ended = plain.generate("Plan a trip:", g, n=160, temp=1.0, seed=seed)
    assert ended, f"the grammar closes the document and then allows only the end: {text!r}"
    Trip.model_validate_json(text)  # raises when invalid


def test_without_the_grammar_the_model_writes_no_json(plain: Plain) -> None:
    text, _ = plain.generate("Plan a trip:", None, n=40, temp=1.0, seed=0)
    with pytest.raises(ValueError):
        json.loads(text)


def test_json_object_gives_an_object(plain: Plain) -> None:
    # an unbounded object may run to the token limit on a random model; the prefix must still be an object's
    g = json_object_grammar()
    text, ended = plain.generate("Data:", g, n=48, temp=0.8, seed=3)
    assert text.lstrip().startswith("{")
    if ended:
        assert isinstance(json.loads(text), dict)


def test_a_json_string_never_holds_a_raw_control_character(plain: Plain) -> None:
    """The converter's own `char` rule allows a raw newline in a string (invalid JSON); ours does not."""
    g = schema_grammar({"type": "string"})
    smpl = grammar_sampler(plain.vocab, g.gbnf)
    try:
        n_vocab = llama_cpp.llama_vocab_n_tokens(plain.vocab.ptr)
        by_piece = {plain.piece(t): t for t in range(n_vocab)}
        quote, newline, letter = (by_piece[t] for t in (b'"', b"\n", b"a"))
        llama_cpp.llama_sampler_accept(smpl, quote)
        data = (llama_cpp.llama_token_data * 2)()
        for i, tok in enumerate((newline, letter)):
            data[i].id, data[i].logit, data[i].p = tok, 1.0, 0.0
        arr = llama_cpp.llama_token_data_array(data, 2, -1, False)
        llama_cpp.llama_sampler_apply(smpl, ctypes.byref(arr))
        assert data[0].logit == float("-inf") and data[1].logit == 1.0
    finally:
        llama_cpp.llama_sampler_free(smpl)


@pytest.mark.parametrize("schema, where", [
    ({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}}, "schema.properties.age.minimum"),
    ({"type": "array", "items": {"not": {"type": "null"}}}, "schema.items.not"),
    ({"anyOf": [{"type": "string"}, {"type": "object", "patternProperties": {}}]}, "schema.anyOf[1].patternProperties"),
])
def test_a_keyword_the_grammar_cannot_keep_is_refused_by_name(schema: dict, where: str) -> None:
    with pytest.raises(GrammarError) as e:
        schema_grammar(schema)
    assert str(e.value).startswith(f"{where}: ") and e.value.param == where


@pytest.mark.parametrize("schema, words", [
    ({"type": "string", "pattern": "[a-z]+"}, 'Pattern must start with "^"'),
    ({"type": "mystery"}, "Unrecognized schema"),
    ({"$ref": "other.json#/x"}, "Unsupported ref"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
])
def test_what_the_converter_cannot_convert_says_so(schema: dict, words: str) -> None:
    with pytest.raises(GrammarError) as e:
        schema_grammar(schema, "response_format.json_schema.schema")
    msg = str(e.value)
    assert msg.startswith("response_format.json_schema.schema: this schema cannot be turned into a grammar")
    assert words in msg


@pytest.mark.parametrize("rf, param", [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}, "response_format.json_schema.schema"),
])
def test_a_malformed_response_format_names_the_field(rf: object, param: str) -> None:
    with pytest.raises(GrammarError) as e:
        response_format_grammar(rf)
    assert e.value.param == param and str(e.value).startswith(param)


def test_text_response_format_has_no_grammar() -> None:
    assert response_format_grammar({"type": "text"}) is None and response_format_grammar(None) is None


def test_llama_cpp_refusing_a_grammar_is_a_grammar_error(plain: Plain) -> None:
    with pytest.raises(GrammarError, match=r"llama.cpp rejected the grammar"):
        grammar_sampler(plain.vocab, Grammar("root ::= undefined-rule").gbnf)


def test_a_lazy_grammar_is_free_until_its_trigger(plain: Plain) -> None:
    # the prompt's text, when it is generated, sets off a grammar that then forces " done"
    free, _ = plain.generate("Once upon a time", None, n=6)
    first_word = free.split()[0]
    g = Grammar(f"root ::= {literal(first_word)} {literal(' done')}", triggers=(first_word,))
    text, ended = plain.generate("Once upon a time", g, n=12)
    assert ended and text.endswith(first_word + " done"), text


def test_literal_escapes_what_gbnf_needs() -> None:
    assert literal('a"b\\c\nd') == r'"a\"b\\c\nd"'


# ---- what a grammar may hold (bmoe.chat.limits) and the checker process (bmoe.chat.grammar_check) ---------

def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


# each was sent as a request and crashed or stalled the server before these bounds (issue 32)
@pytest.mark.parametrize("schema, where, words", [
    ({"type": "array", "items": {"type": "string"}, "maxItems": 100000}, "schema.maxItems",
     "100000 is more than the 1000"),
    ({"type": "array", "items": {"type": "string"}, "minItems": 1001}, "schema.minItems", "1001 is more than the 1000"),
    ({"type": "string", "maxLength": 10_000_000}, "schema.maxLength", "10000000 is more than the 1000"),
    ({"type": "string", "minLength": 5000}, "schema.minLength", "5000 is more than the 1000"),
    ({"type": "string", "pattern": "^a{0,100000}$"}, "schema.pattern {0,100000}", "100000 is more than the 1000"),
    ({"type": "string", "pattern": "^(ab){3000}$"}, "schema.pattern {3000}", "3000 is more than the 1000"),
    ({"type": "object", "properties": {"a": {"type": "array", "maxItems": -1}}}, "schema.properties.a.maxItems",
     "a whole number, 0 or more"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 1000} for i in range(21)}},
     "schema.properties.p20", "add up to more than the 20000"),
    (_nested(100), "schema" + ".items" * 65, "nests deeper than 64 levels"),
    ({"anyOf": [{"type": "string"}] * 10_001}, "schema.anyOf[9999]", "more than 10000 sub-schemas"),
    ({"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(12_000)}, "$ref": "#/$defs/d0"},
     "schema.$defs.d9999", "more than 10000 sub-schemas"),
])
def test_a_schema_past_a_bound_is_refused_before_the_converter(schema: dict, where: str, words: str) -> None:
    with pytest.raises(GrammarError) as e:
        schema_grammar(schema)
    assert str(e.value).startswith(f"{where}: ") and words in str(e.value), str(e.value)
    assert e.value.param == where.split(" ")[0]  # the field; the message also names the part of its text


def test_a_schema_at_the_bounds_makes_a_grammar_the_checker_passes(checker: GrammarCheck) -> None:
    g = schema_grammar({"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 1000}, "maxItems": 1000},
        "name": {"type": "string", "minLength": 1000, "maxLength": 1000},
        "code": {"type": "string", "pattern": "^[A-Z]{1000}$"}}})
    checker.check(g)


def test_one_repetition_more_than_the_bound_is_more_than_llama_cpp_takes(checker: GrammarCheck,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """REPEAT_MAX is llama.cpp's own limit on the converter's nested optional groups, not a guess."""
    monkeypatch.setattr(grammar_module, "REPEAT_MAX", 10**9)
    checker.check(schema_grammar({"type": "array", "items": {"type": "string"}, "maxItems": REPEAT_MAX}))
    with pytest.raises(GrammarError, match=r"llama.cpp rejected the grammar"):
        checker.check(schema_grammar({"type": "array", "items": {"type": "string"}, "maxItems": REPEAT_MAX + 1}))


@pytest.mark.parametrize("text, words", [
    ('root ::= "a"{0,100000}', "grammar {0,100000}: 100000 is more than the 1000"),
    ('root ::= [a-z]{5000}', "grammar {5000}: 5000 is more than the 1000"),
    ("root ::= " + "(" * 5000 + '"a"' + ")" * 5000, "nests 5000 groups deep, more than the 1100"),
    ("root ::= " + '"ab" ' * 300_000, "bytes, more than the 1048576"),
])
def test_gbnf_past_a_bound_is_refused_before_llama_cpp(checker: GrammarCheck, text: str, words: str) -> None:
    with pytest.raises(GrammarError) as e:
        checker.check(Grammar(text))
    assert str(e.value).startswith("grammar") and e.value.param == "grammar" and words in str(e.value), str(e.value)
    assert checker.checkers[0].proc is None, "refused by reading the text: no process was asked"


def test_braces_and_parentheses_inside_literals_and_classes_are_text(checker: GrammarCheck) -> None:
    checker.check(Grammar('root ::= "{0,100000}" [(]{2} "((((" # a comment (((( {9999}\n'))


@pytest.fixture
def checker(plain_path: Path) -> GrammarCheck:
    c = GrammarCheck(str(plain_path))
    yield c
    c.close()


@pytest.fixture(scope="module")
def plain_path(synth) -> Path:
    return synth(arch="qwen3moe", layers=2, experts=4, top_k=2)


def test_a_grammar_that_crashes_llama_cpp_takes_down_only_the_checker(checker: GrammarCheck,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With the nesting bound lifted, 200000 nested groups overflow llama.cpp's recursive parser's
    stack: the checker process dies of it, the caller gets an error, and the next grammar is
    checked by a new process."""
    checker.check(Grammar('root ::= "a"'))
    first = checker.checkers[0].proc
    assert first is not None
    monkeypatch.setattr(grammar_module, "GRAMMAR_NESTING_MAX", 10**9)
    with pytest.raises(GrammarError, match=r"^grammar: llama.cpp's grammar parser crashed on this grammar \(signal "):
        checker.check(Grammar("root ::= " + "(" * 200_000 + '"a"' + ")" * 200_000))
    assert first.poll() is not None and checker.checkers[0].proc is None
    checker.check(Grammar('root ::= "b"'))
    assert checker.checkers[0].proc is not None and checker.checkers[0].proc.pid != first.pid


def test_a_grammar_llama_cpp_refuses_names_its_complaint(checker: GrammarCheck) -> None:
    with pytest.raises(GrammarError, match=r"^grammar: llama.cpp rejected the grammar \(.*Undefined rule"):
        checker.check(Grammar("root ::= undefined-rule"))
    checker.check(Grammar('root ::= "ok"'))  # the same process goes on


def test_a_slow_grammar_holds_one_checker_while_another_checks_a_new_grammar(plain_path: Path) -> None:
    """With two checkers, a grammar llama.cpp takes minutes to parse (its first stacks are deduplicated
    pairwise: 150000 alternatives) holds one of them until its deadline; a new grammar is checked by the
    other meanwhile, and the slow one is refused as past its bound."""
    c = GrammarCheck(str(plain_path), deadline_s=5, checkers=2, bound="the test's deadline")
    refused: list[GrammarError] = []

    def slow() -> None:
        with pytest.raises(GrammarError) as e:
            c.check(Grammar("root ::= " + "|".join(['"a"'] * 150_000)))
        refused.append(e.value)

    waiting = threading.Thread(target=slow)
    try:
        waiting.start()
        while c.idle.qsize() == 2 and waiting.is_alive():  # until the slow grammar took a checker
            waiting.join(0.01)
        c.check(Grammar('root ::= "b"'))
        assert waiting.is_alive(), "the new grammar was checked only after the slow one"
        assert c.known(Grammar('root ::= "b"')) and not c.known(Grammar('root ::= "c"'))
        waiting.join()
    finally:
        c.close()
    [e] = refused
    assert str(e) == ("grammar: llama.cpp took longer than 5 s to parse the grammar (the bound: the test's deadline); "
                      "simplify it"), str(e)


def test_a_parse_past_the_deadline_is_refused_and_the_checker_replaced(plain_path: Path) -> None:
    c = GrammarCheck(str(plain_path), deadline_s=0)
    try:
        with pytest.raises(GrammarError, match=r"took longer than 0 s to parse the grammar"):
            c.check(Grammar('root ::= "a"'))
        assert c.checkers[0].proc is None
        c.deadline_s = 60
        c.check(Grammar('root ::= "a"'))
    finally:
        c.close()
    assert c.checkers[0].proc is None
