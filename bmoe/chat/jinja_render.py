"""A chat template rendered in jinja2 as llama.cpp's own jinja engine (common/jinja) renders it.

The environment is the one Hugging Face's transformers renders chat templates in (a sandbox with
`trim_blocks`, `lstrip_blocks`, loop controls, the `{% generation %}` tag passed through, `tojson`
as Python's json.dumps without ASCII escapes, `raise_exception`, `strftime_now`), which llama.cpp's
engine follows, plus what llama.cpp's engine does its own way and templates rely on: a filter's result
(`map(...)`) is an array `tojson` writes (jinja2's is a generator it cannot), and a string joined with
`+` to null or an undefined name is the string (firefunction's template adds `functions`, which
llama.cpp never defines). A template is given only the variables the caller names and
`add_generation_prompt` (llama.cpp leaves it undefined when false, which the few templates that default
an undefined one to true read as true: bmoe passes false, so that a client's `add_generation_prompt:
false` is honoured by every template).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _Generation(Extension):
    """transformers' `{% generation %}…{% endgeneration %}`: its body, as written."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension declares it so

    def parse(self, parser: Any) -> Any:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _null(v: Any) -> bool:
    return v is None or isinstance(v, jinja2.Undefined)


class _Environment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"+"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """llama.cpp's `str + null` (either side) is the string."""
        if operator == "+" and ((isinstance(left, str) and _null(right)) or (isinstance(right, str) and _null(left))):
            return left if isinstance(left, str) else right
        return super().call_binop(context, operator, left, right)


def _listed(x: Any) -> list[Any]:
    """A filter's lazy sequence (`map`, `select`, ...) as the array llama.cpp's engine makes of it."""
    if isinstance(x, Iterable) and not isinstance(x, (str, bytes, Mapping)):
        return list(x)
    raise TypeError(f"Object of type {type(x).__name__} is not JSON serializable")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                      default=_listed)


def _raise(message: str) -> None:
    raise ValueError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class JinjaTemplate:
    """One chat template's source, compiled once."""

    def __init__(self, source: str) -> None:
        env = _Environment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                           extensions=[_Generation, loopcontrols])
        env.filters["tojson"] = _tojson
        self._template = env.from_string(source)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, **context: Any) -> str:
        """The conversation as text; `context` the other variables (bos_token, eos_token, tools, ...).
        Raises what the template raises (jinja2's errors, ValueError from raise_exception)."""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     raise_exception=_raise, strftime_now=_strftime_now, **context)
