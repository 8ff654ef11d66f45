"""Grammars that constrain sampling: a JSON schema or any JSON object (`response_format`).

The GBNF comes from the JSON-schema converter llama-cpp-python ships
(`SchemaConverter`, a port of llama.cpp's, reached through bmoe.seam.llama) and is enforced while sampling
by llama.cpp's own grammar sampler (bmoe.seam.llama.make_sampler), so every token sampled keeps the
text a prefix of a valid document. Two things are added around the converter, not in place of it:

- The converter skips a schema keyword it does not understand (`minimum`, `not`,
  `patternProperties`, ...) and the grammar would then accept documents the schema rejects. Such
  a keyword is refused up front, with where it is, rather than promised and not kept.
- Its `char` rule lets a raw control character (a newline) into a JSON string, which JSON
  forbids; the rule is replaced with the one llama.cpp's current converter writes.

A Grammar may be lazy (tool calls with `tool_choice` auto, bmoe.tool_syntax): the sampler is free
until the generated text matches one of its trigger patterns, then constrained from the match on
(llama.cpp's `llama_sampler_init_grammar_lazy_patterns`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bmoe.base.errors import GrammarError
from bmoe.chat.limits import (
    GRAMMAR_BYTES_MAX,
    GRAMMAR_NESTING_MAX,
    REPEAT_MAX,
    REPEAT_TOTAL_MAX,
    SCHEMA_DEPTH_MAX,
    SCHEMA_NODES_MAX,
)

# keywords the converter would silently skip: refusing them keeps "valid under the grammar" = "valid under the schema"
UNSUPPORTED = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "not", "if", "then", "else",
    "dependentRequired", "dependentSchemas", "dependencies", "patternProperties", "propertyNames", "uniqueItems",
    "contains", "minContains", "maxContains", "minProperties", "maxProperties", "unevaluatedProperties",
    "unevaluatedItems", "contentSchema",
})
# the converter's own rule lets control characters into strings; this is llama.cpp's current one
_CHAR_RULE = re.compile(r"^char ::= .*$", re.M)
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_STRICT_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})'


@dataclass(frozen=True)
class Grammar:
    """GBNF for llama.cpp's grammar sampler. With `triggers` (regular expressions, llama.cpp's
    std::regex syntax) it is lazy: it applies from the first match on (from the match's first
    capture group, if it has one)."""

    text: str
    root: str = "root"
    triggers: tuple[str, ...] = ()
    where: str = "grammar"  # the part of the request it comes from, for errors

    @property
    def lazy(self) -> bool:
        return bool(self.triggers)

    @property
    def gbnf(self) -> tuple[str, str, tuple[str, ...]]:
        """As llama.cpp takes it (bmoe.seam.llama.Gbnf)."""
        return self.text, self.root, self.triggers


def _converter() -> Any:
    from bmoe.seam.llama import schema_converter

    return schema_converter()


_COUNTS = ("minItems", "maxItems", "minLength", "maxLength")  # each is written out that many times in the grammar
_QUANTIFIER = re.compile(r"(?<!\\)\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")  # {m}, {m,}, {m,n} in a regex or GBNF


def _too_many(here: str, count: object, what: str = "") -> GrammarError:
    """`here` is the field (the error's param); `what` the part of its text."""
    return GrammarError(f"{here}{what}: {count} is more than the {REPEAT_MAX} repetitions a grammar can hold "
                        "(llama.cpp's bound); lower it, or check the length after the answer", here)


def _quantified(text: str, here: str) -> int:
    """The repetitions the {m,n} quantifiers of a regex or GBNF ask for together; GrammarError for one too large."""
    total = 0
    for m in _QUANTIFIER.finditer(text):
        count = max(int(n) for n in m.groups() if n) if any(m.groups()) else 0
        if count > REPEAT_MAX:
            raise _too_many(here, count, f" {m.group(0)}")
        total += count
    return total


def check_schema(schema: Any, where: str = "schema") -> None:
    """GrammarError naming the first part of `schema` a grammar cannot enforce, or that would make a
    grammar larger than llama.cpp can safely hold (bmoe.chat.limits). Walks without recursion,
    so a schema nested however deep gets its error, not a RecursionError."""
    todo: list[tuple[Any, str, int]] = [(schema, where, 0)]
    nodes = repeats = 0
    while todo:
        node, here, depth = todo.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, Mapping):
            raise GrammarError(f"{here}: a JSON schema is an object (or true/false), not {type(node).__name__}", here)
        nodes += 1
        if depth > SCHEMA_DEPTH_MAX or nodes > SCHEMA_NODES_MAX:
            what = (f"nests deeper than {SCHEMA_DEPTH_MAX} levels" if depth > SCHEMA_DEPTH_MAX
                    else f"has more than {SCHEMA_NODES_MAX} sub-schemas")
            raise GrammarError(f"{here}: the schema {what}, more than a grammar may hold; simplify it", here)
        subs: list[tuple[Any, str]] = []
        for key, value in node.items():
            at = f"{here}.{key}"
            if key in UNSUPPORTED:
                raise GrammarError(f"{at}: '{key}' is not supported by the JSON-schema grammar (it could not be "
                                   "enforced while sampling); remove it from the schema and check it after", at)
            if key in _COUNTS:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise GrammarError(f"{at}: a whole number, 0 or more (not {value!r})", at)
                if value > REPEAT_MAX:
                    raise _too_many(at, value)
                repeats += value
            elif key == "pattern" and isinstance(value, str):
                repeats += _quantified(value, at)
            elif key in ("properties", "$defs", "definitions") and isinstance(value, Mapping):
                subs += [(sub, f"{at}.{name}") for name, sub in value.items()]
            elif key in ("items", "additionalProperties") and isinstance(value, (Mapping, bool)):
                subs.append((value, at))
            elif key in ("anyOf", "oneOf", "allOf", "prefixItems", "items") and isinstance(value, list):
                subs += [(sub, f"{at}[{i}]") for i, sub in enumerate(value)]
        if repeats > REPEAT_TOTAL_MAX:
            raise GrammarError(f"{here}: the schema's repetitions (minItems, maxItems, minLength, maxLength, "
                               f"pattern counts) add up to more than the {REPEAT_TOTAL_MAX} a grammar may hold; "
                               "lower them", here)
        todo += [(sub, at, depth + 1) for sub, at in reversed(subs)]


def check_gbnf(g: Grammar) -> None:
    """GrammarError when GBNF text is larger than llama.cpp's parser can safely take: too long, groups
    nested too deep (its recursive-descent parse would overflow the stack) or a {m,n} past llama.cpp's
    repetition bound. Reads the text only; llama.cpp's own parse comes after (bmoe.chat.grammar_check)."""
    size = len(g.text.encode())
    if size > GRAMMAR_BYTES_MAX:
        raise GrammarError(f"{g.where}: the grammar is {size} bytes, more than the {GRAMMAR_BYTES_MAX} a grammar may "
                           "hold; simplify it", g.where)
    depth = deepest = 0
    i, text = 0, g.text
    outside: list[str] = []  # the text outside literals, character classes and comments
    while i < len(text):
        c = text[i]
        if c in "\"[":
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < len(text) and text[j] != close:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            outside.append(" ")
            continue
        if c == "#":
            j = text.find("\n", i)
            i = len(text) if j < 0 else j
            continue
        if c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        outside.append(c)
        i += 1
    if deepest > GRAMMAR_NESTING_MAX:
        raise GrammarError(f"{g.where}: the grammar nests {deepest} groups deep, more than the {GRAMMAR_NESTING_MAX} "
                           "llama.cpp's parser can safely take; simplify it", g.where)
    _quantified("".join(outside), g.where)


def _visit(conv: Any, schema: Any, where: str, name: str = "") -> str:
    """Add `schema` to the converter `conv` as rule `name` ("" → root), its `$ref`s resolved within
    itself; the rule's name. GrammarError naming `where` for what the converter cannot take."""
    check_schema(schema, where)
    try:
        resolved = conv.resolve_refs(json.loads(json.dumps(schema)), where)
        return conv.visit(resolved, name)
    except (AssertionError, ValueError, KeyError, TypeError, RecursionError) as e:
        detail = str(e) or type(e).__name__
        raise GrammarError(f"{where}: this schema cannot be turned into a grammar ({detail}); simplify that part",
                           where) from None


def _text(conv: Any, extra: str = "") -> str:
    return _CHAR_RULE.sub(lambda _m: _STRICT_CHAR, conv.format_grammar()) + extra


def schema_grammar(schema: Any, where: str = "schema") -> Grammar:
    """A Grammar whose documents are exactly the JSON texts `schema` accepts (within what is supported)."""
    if schema is True:
        schema = {}
    if schema is False:
        raise GrammarError(f"{where}: false accepts no document; give a schema", where)
    conv = _converter()
    _visit(conv, schema, where)
    return Grammar(_text(conv), where=where)


def json_object_grammar() -> Grammar:
    """Any JSON object (`response_format` {"type": "json_object"})."""
    return schema_grammar({"type": "object"})


def schema_rules(schemas: Mapping[str, Any], where: str) -> tuple[str, dict[str, str]]:
    """GBNF rules for several schemas in one grammar (no root): the text and each schema's rule
    name. Each schema's `$ref`s resolve within itself."""
    conv = _converter()
    names = {key: _visit(conv, schema, f"{where}.{key}" if where else key, re.sub(r"[^a-zA-Z0-9-]+", "-", key))
             for key, schema in schemas.items()}
    return _text(conv), names


def not_containing(text: str) -> str:
    """A GBNF expression for one piece of text that cannot begin `text` (repeat it with `*` for any
    run of text without `text`): the converter's own helper."""
    return _converter().not_literal(text)


def literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    return '"' + "".join(_ESCAPES.get(c, c) for c in text) + '"'


def response_format_grammar(rf: Any, param: str = "response_format") -> Grammar | None:
    """The Grammar an OpenAI `response_format` asks for: None for {"type": "text"} (or none)."""
    if rf is None:
        return None
    if not isinstance(rf, Mapping) or not isinstance(rf.get("type"), str):
        raise GrammarError(f"{param}: an object with a 'type' (text, json_object or json_schema)", param)
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema")  # llama-server's extension: a json_object may carry a schema
        return json_object_grammar() if schema is None else schema_grammar(schema, f"{param}.schema")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping):
            raise GrammarError(f"{param}.json_schema: an object with a 'name' and a 'schema'", f"{param}.json_schema")
        schema = js.get("schema", {})
        return schema_grammar(schema, f"{param}.json_schema.schema")
    raise GrammarError(f"{param}.type: {kind!r} is not one of text, json_object, json_schema", f"{param}.type")
