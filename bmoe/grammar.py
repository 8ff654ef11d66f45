"""Grammars that constrain sampling: a JSON schema or any JSON object (`response_format`).

The GBNF comes from the JSON-schema converter llama-cpp-python ships
(`llama_cpp.llama_grammar.SchemaConverter`, a port of llama.cpp's) and is enforced while sampling
by llama.cpp's own grammar sampler (bmoe.llama.make_sampler), so every token sampled keeps the
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

from bmoe.errors import ConfigError

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


class GrammarError(ConfigError):
    """A schema or grammar that cannot be enforced; the message names the part and the fix."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Grammar:
    """GBNF for llama.cpp's grammar sampler. With `triggers` (regular expressions, llama.cpp's
    std::regex syntax) it is lazy: it applies from the first match on (from the match's first
    capture group, if it has one)."""

    text: str
    root: str = "root"
    triggers: tuple[str, ...] = ()

    @property
    def lazy(self) -> bool:
        return bool(self.triggers)


def _converter() -> Any:
    from llama_cpp.llama_grammar import SchemaConverter

    return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def check_schema(schema: Any, where: str = "schema") -> None:
    """GrammarError naming the first part of `schema` a grammar cannot enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise GrammarError(f"{where}: a JSON schema is an object (or true/false), not {type(schema).__name__}", where)
    for key, value in schema.items():
        here = f"{where}.{key}"
        if key in UNSUPPORTED:
            raise GrammarError(f"{here}: '{key}' is not supported by the JSON-schema grammar (it could not be "
                               "enforced while sampling); remove it from the schema and check it after", here)
        if key in ("properties", "$defs", "definitions") and isinstance(value, Mapping):
            for name, sub in value.items():
                check_schema(sub, f"{here}.{name}")
        elif key in ("items", "additionalProperties") and isinstance(value, (Mapping, bool)):
            check_schema(value, here)
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems", "items") and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, f"{here}[{i}]")


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
    return Grammar(_text(conv))


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
