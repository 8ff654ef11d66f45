"""Structured output: JSON schema → GBNF (llama-cpp-python's converter) enforced by llama.cpp's
grammar sampler, on a real (random-weight) model: whatever it samples is valid under the schema."""

from __future__ import annotations

import ctypes
import json
from typing import Annotated, Literal

import llama_cpp
import pytest
from pydantic import BaseModel, Field

from bmoe.grammar import Grammar, GrammarError, json_object_grammar, literal, response_format_grammar, schema_grammar
from bmoe.llama import grammar_sampler
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
    smpl = grammar_sampler(plain.vocab, g)
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
        grammar_sampler(plain.vocab, Grammar("root ::= undefined-rule"))


def test_a_lazy_grammar_is_free_until_its_trigger(plain: Plain) -> None:
    # the prompt's text, when it is generated, sets off a grammar that then forces " done"
    free, _ = plain.generate("Once upon a time", None, n=6)
    first_word = free.split()[0]
    g = Grammar(f"root ::= {literal(first_word)} {literal(' done')}", triggers=(first_word,))
    text, ended = plain.generate("Once upon a time", g, n=12)
    assert ended and text.endswith(first_word + " done"), text


def test_literal_escapes_what_gbnf_needs() -> None:
    assert literal('a"b\\c\nd') == r'"a\"b\\c\nd"'
