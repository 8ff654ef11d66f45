"""How much one request may ask of the engine: the bounds every edge (API, session, server) applies
before any of it reaches llama.cpp or the generation loop.

Stop strings are matched on every token on the engine's thread, and a grammar is parsed and run
by llama.cpp's native code, where an input that is too large does not raise but crashes the
process (a JSON schema's `maxItems` 100000 becomes a hundred thousand nested groups, whose parse
overflows the stack). So both are bounded here, each bound named in the error with the part of the
request that broke it. The repetition bound is the most llama.cpp takes of what the JSON-schema
converter writes for one: `maxItems` N is N nested optional groups, and llama.cpp's parser refuses
more than 2000 rules under one repetition (`MAX_REPETITION_THRESHOLD` in llama-grammar.cpp), two
a group, so 1000 (tests/test_grammar.py pins it). The others leave room for any schema or tool list
seen in practice (docs/server.md lists them).
"""

from __future__ import annotations

from collections.abc import Sequence

from bmoe.base.errors import FieldError

STOP_STRINGS_MAX = 4  # stop strings in one request (OpenAI's own limit)
STOP_CHARS_MAX = 1024  # characters in one stop string

REPEAT_MAX = 1000  # one repetition of a grammar: minItems/maxItems, minLength/maxLength, {m,n}
REPEAT_TOTAL_MAX = 20_000  # every repetition of one schema together (each count is written out in the grammar)
SCHEMA_DEPTH_MAX = 64  # nesting of objects and arrays in one JSON schema
SCHEMA_NODES_MAX = 10_000  # objects and arrays in one JSON schema
GRAMMAR_BYTES_MAX = 1 << 20  # GBNF text handed to llama.cpp, a raw `grammar` or one made from a schema or tools
GRAMMAR_NESTING_MAX = 1100  # nested groups in GBNF (REPEAT_MAX writes that many, plus a schema's own)


def check_stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """A request's stop strings (one string, a list of them or None), within the bounds above."""
    strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) for s in strings):
        raise FieldError("stop is a string or a list of strings", "stop")
    if len(strings) > STOP_STRINGS_MAX:
        raise FieldError(f"stop: {len(strings)} stop strings, more than the {STOP_STRINGS_MAX} a request may have",
                         "stop")
    for i, s in enumerate(strings):
        if len(s) > STOP_CHARS_MAX:
            raise FieldError(f"stop[{i}]: {len(s)} characters, more than the {STOP_CHARS_MAX} a stop string may "
                               "have; shorten it", f"stop[{i}]")
    return strings
