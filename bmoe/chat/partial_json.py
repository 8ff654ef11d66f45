"""JSON as far as a model has written it: where a value ends (or that it has not ended yet), following only
its structure (strings, nesting) and leaving validity to `json`; and how much of a text's end could be the
start of a marker. The answer parsers (bmoe.chat.output) read calls with these while the text still grows."""

from __future__ import annotations

import re

WS = " \t\r\n"
_SCALAR = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null")


def skip_ws(t: str, i: int) -> int:
    while i < len(t) and t[i] in WS:
        i += 1
    return i


def string_end(t: str, i: int) -> int | None:
    """The index after the JSON string starting at t[i] == '"', or None if it does not end yet."""
    j = i + 1
    while j < len(t):
        c = t[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(t: str, i: int, final: bool = False) -> int | None:
    """The index after the JSON value starting at t[i] (after whitespace), or None if the text ends
    before it does. Only the structure is followed (strings, nesting); validity is json's to judge."""
    i = skip_ws(t, i)
    if i >= len(t):
        return None
    c = t[i]
    if c == '"':
        return string_end(t, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(t):
            c = t[j]
            if c == '"':
                e = string_end(t, j)
                if e is None:
                    return None
                j = e
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = _SCALAR.match(t, i)
    if m is None:
        return i  # not JSON: let json say so
    return m.end() if (m.end() < len(t) or final) else None


def held(t: str, marker: str, start: int = 0) -> int:
    """How many characters at the end of t[start:] could be the beginning of `marker`."""
    for k in range(min(len(marker) - 1, len(t) - start), 0, -1):
        if t.endswith(marker[:k]):
            return k
    return 0
