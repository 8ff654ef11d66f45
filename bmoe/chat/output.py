"""A model's answer as an OpenAI message: reasoning, content and tool calls, also piece by piece.

`OutputParser.push` takes the generated text as it comes and returns what can be handed out now
(a Delta: reasoning, content and tool-call pieces, as `delta.reasoning_content`, `delta.content`
and `delta.tool_calls` of a stream); `finish` the rest; `message` the whole answer. Each push
re-reads the text so far (a few kB at most) and hands out only what no later text can change:
text that could be the start of a marker (`<tool_c…`) waits for the next piece, and a call is
handed out once its name is known, then its arguments as they grow. So a stream's pieces, joined,
are exactly the whole answer.

Rules where the syntaxes leave room (bmoe.chat.syntax has the syntaxes):
- reasoning is only a block at the very start of the answer (or the whole start when the prompt
  ends inside one); its surrounding whitespace, and the whitespace after it, are dropped.
- a tool call's `arguments` are the model's JSON text as written; a call whose arguments do not
  parse (cut off by max_tokens, or written without a grammar) is left out of `message` and its
  text is kept as content.
- text between and after calls that is not whitespace is content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from bmoe.chat.syntax import HARMONY, HERMES, MISTRAL, Syntax

_WS = " \t\r\n"
_SCALAR = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null")
_NAME_ARGS = re.compile(r"([^\[]*?)(?:\[CALL_ID\][^\[]*)?\[ARGS\]")  # mistral's `name[CALL_ID]id[ARGS]`


@dataclass
class CallDelta:
    """A piece of tool call `index`: its first piece has the id and name, every piece some arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict:
        fn: dict = {"arguments": self.arguments}
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            fn = {"name": self.name, **fn}
        return {**out, "function": fn}


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Reply:
    content: str
    reasoning: str
    calls: tuple[ToolCall, ...]


@dataclass
class _Call:
    name: str | None
    args: str  # the arguments' JSON text so far
    done: bool = False  # the arguments are complete
    raw: str = ""  # the call's own text (content again, if it turns out not to parse)


@dataclass
class _Scan:
    reasoning: str = ""
    content: str = ""
    calls: list[_Call] = field(default_factory=list)


# ---- JSON, as far as it goes --------------------------------------------------------------------


def _skip_ws(t: str, i: int) -> int:
    while i < len(t) and t[i] in _WS:
        i += 1
    return i


def _string_end(t: str, i: int) -> int | None:
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
    i = _skip_ws(t, i)
    if i >= len(t):
        return None
    c = t[i]
    if c == '"':
        return _string_end(t, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(t):
            c = t[j]
            if c == '"':
                e = _string_end(t, j)
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


def _call_object(t: str, i: int, final: bool) -> tuple[_Call, int | None, bool]:
    """A call written as a JSON object with "name" and "arguments" (any order, other keys skipped):
    (the call so far, the index after it or None, whether it is well formed so far)."""
    call = _Call(None, "")
    i = _skip_ws(t, i)
    if i >= len(t):
        return call, None, True
    if t[i] != "{":
        return call, None, False
    i += 1
    while True:
        i = _skip_ws(t, i)
        if i >= len(t):
            return call, None, True
        if t[i] == "}":
            return call, i + 1, call.name is not None and call.done
        if t[i] == ",":
            i += 1
            continue
        if t[i] != '"':
            return call, None, False
        e = _string_end(t, i)
        if e is None:
            return call, None, True
        key = json.loads(t[i:e])
        i = _skip_ws(t, e)
        if i >= len(t):
            return call, None, True
        if t[i] != ":":
            return call, None, False
        i = _skip_ws(t, i + 1)
        end = value_end(t, i, final)
        if key in ("arguments", "parameters"):
            call.args = t[i:len(t) if end is None else end]
            call.done = end is not None
        elif key == "name" and end is not None:
            try:
                call.name = json.loads(t[i:end])
            except ValueError:
                return call, None, False
        if end is None:
            return call, None, True
        i = end


def _hold(t: str, marker: str, start: int = 0) -> int:
    """How many characters at the end of t[start:] could be the beginning of `marker`."""
    for k in range(min(len(marker) - 1, len(t) - start), 0, -1):
        if t.endswith(marker[:k]):
            return k
    return 0


# ---- the parser ---------------------------------------------------------------------------------


class OutputParser:
    """One answer's text → reasoning, content and tool calls (see the module notes).

    `tools` False: calls are not looked for (tool_choice none, or a request without tools);
    `think_open`: the prompt ends inside the reasoning block, so the answer starts in it.
    """

    def __init__(self, syntax: Syntax, tools: bool = True, think_open: bool = False, salt: str = "") -> None:
        self.syntax = syntax
        self.salt = salt or secrets.token_hex(8)  # one request's: its calls' ids
        self.tools = tools and syntax.tools
        self.think_open = think_open and syntax.think is not None
        self.text = ""
        self._sent = _Scan()
        self._args_sent: list[int] = []

    def push(self, piece: str) -> Delta:
        self.text += piece
        return self._emit(self._scan(self.text, final=False))

    def finish(self) -> Delta:
        return self._emit(self._scan(self.text, final=True))

    def message(self) -> Reply:
        """The whole answer (call after `finish`): calls that parse, with the ones that do not kept as content."""
        s = self._scan(self.text, final=True)
        calls, content = [], s.content
        for k, c in enumerate(s.calls):
            if c.done and c.name is not None and _parses(c.args):
                calls.append(ToolCall(self._id(k), c.name, c.args))
            else:
                content += c.raw
        return Reply(content, s.reasoning, tuple(calls))

    def _id(self, k: int) -> str:
        return self.syntax.call_id(self.salt, k)

    def _emit(self, s: _Scan) -> Delta:
        d = Delta()
        sent = self._sent
        if s.reasoning.startswith(sent.reasoning):
            d.reasoning, sent.reasoning = s.reasoning[len(sent.reasoning):], s.reasoning
        if s.content.startswith(sent.content):
            d.content, sent.content = s.content[len(sent.content):], s.content
        for k, c in enumerate(s.calls):
            if c.name is None:
                break  # calls are handed out in order, each once its name is known
            if k == len(self._args_sent):
                self._args_sent.append(0)
                d.calls.append(CallDelta(k, self._id(k), c.name, c.args))
                self._args_sent[k] = len(c.args)
            elif len(c.args) > self._args_sent[k]:
                d.calls.append(CallDelta(k, arguments=c.args[self._args_sent[k]:]))
                self._args_sent[k] = len(c.args)
        return d

    # -- scanning the text so far --

    def _scan(self, t: str, final: bool) -> _Scan:
        s = _Scan()
        if self.syntax.name == HARMONY:
            self._harmony(t, final, s)
            return s
        pos = self._reasoning(t, final, s)
        if pos is not None:
            self._body(t, pos, final, s)
        return s

    def _reasoning(self, t: str, final: bool, s: _Scan) -> int | None:
        """Fill the reasoning; the index where content starts, or None if the text so far is all reasoning."""
        if self.syntax.think is None:
            return 0
        open_, close = self.syntax.think
        lead = _skip_ws(t, 0)
        if self.think_open:
            start = 0
        elif t.startswith(open_, lead):
            start = lead + len(open_)
        elif not final and open_.startswith(t[lead:]):
            return None  # it may still open
        else:
            return 0
        end = t.find(close, start)
        if end < 0:
            stop = len(t) if final else len(t) - _hold(t, close, start)
            s.reasoning = t[start:stop].strip(_WS)  # trailing whitespace waits: it may come before the close
            return None
        s.reasoning = t[start:end].strip(_WS)
        pos = _skip_ws(t, end + len(close))
        return pos if (pos < len(t) or final) else None

    def _body(self, t: str, pos: int, final: bool, s: _Scan) -> None:
        name = self.syntax.name
        opener = {HERMES: "<tool_call>", MISTRAL: "[TOOL_CALLS]"}.get(name) if self.tools else None
        at = t.find(opener, pos) if opener else -1
        if at < 0:
            s.content = t[pos:] if (final or not opener) else t[pos:len(t) - _hold(t, opener, pos)]
            return
        s.content = t[pos:at]
        if name == HERMES:
            self._hermes(t, at, final, s)
        elif self.syntax.args_form:
            self._mistral_args(t, at, final, s)
        else:
            self._mistral_array(t, at, final, s)

    def _after_calls(self, t: str, i: int, opener: str, final: bool, s: _Scan) -> int | None:
        """After a call: the index of the next call's opener, or None (the rest is content, or held)."""
        j = _skip_ws(t, i)
        if t.startswith(opener, j):
            return j
        if not final and opener.startswith(t[j:]):
            return None
        if j < len(t):
            s.content += t[j:] if final else t[j:len(t) - _hold(t, opener, j)]
        return None

    def _hermes(self, t: str, at: int | None, final: bool, s: _Scan) -> None:
        open_, close = "<tool_call>", "</tool_call>"
        while at is not None:
            i = at + len(open_)
            call, end, ok = _call_object(t, i, final)
            s.calls.append(call)
            if not ok or end is None:
                call.raw = t[at:]
                return
            j = _skip_ws(t, end)
            if not t.startswith(close, j):
                call.raw = t[at:]
                if final or not close.startswith(t[j:]):
                    call.done = False  # malformed: not a call after all
                return
            call.raw = t[at:j + len(close)]
            at = self._after_calls(t, j + len(close), open_, final, s)

    def _mistral_array(self, t: str, at: int, final: bool, s: _Scan) -> None:
        i = _skip_ws(t, at + len("[TOOL_CALLS]"))
        if i >= len(t):
            return
        if t[i] != "[":
            s.content += t[at:]
            return
        i += 1
        while True:
            call, end, ok = _call_object(t, i, final)
            s.calls.append(call)
            call.raw = t[i:end] if end is not None else t[i:]
            if not ok or end is None:
                return
            i = _skip_ws(t, end)
            if i < len(t) and t[i] == ",":
                i += 1
                continue
            if i < len(t) and t[i] == "]":
                nxt = self._after_calls(t, i + 1, "[TOOL_CALLS]", final, s)
                if nxt is not None:
                    self._mistral_array(t, nxt, final, s)
            elif i < len(t) or final:
                call.done = False
            return

    def _mistral_args(self, t: str, at: int | None, final: bool, s: _Scan) -> None:
        opener = "[TOOL_CALLS]"
        while at is not None:
            i = at + len(opener)
            m = _NAME_ARGS.match(t, i)
            if m is None:  # the name is still coming (or this is no call: content, once the text is whole)
                if final:
                    s.content += t[at:]
                return
            call = _Call(m.group(1).strip(), "")
            s.calls.append(call)
            end = value_end(t, m.end(), final)
            call.args = t[m.end():len(t) if end is None else end]
            call.done = end is not None
            call.raw = t[at:len(t) if end is None else end]
            if end is None:
                return
            at = self._after_calls(t, end, opener, final, s)

    def _harmony(self, t: str, final: bool, s: _Scan) -> None:
        """Messages
        `[<|start|>assistant][ to=functions.X]<|channel|>CH[ to=functions.X][ <|constrain|>json]<|message|>BODY<|end|>`;
        the first comes after the prompt's `<|start|>assistant`. A call's body ends the text (its
        end, `<|call|>`, ends the generation)."""
        i = 0
        while i < len(t):
            m = t.find("<|message|>", i)
            if m < 0:
                if final:
                    s.content += t[i:]
                return  # the header is still coming
            header = t[i:m]
            channel = re.search(r"<\|channel\|>(\w+)", header)
            to = re.search(r"to=functions\.([^\s<]+)", header)
            b = m + len("<|message|>")
            e = t.find("<|end|>", b)
            body_end = len(t) if (e < 0 and final) else e if e >= 0 else len(t) - _hold(t, "<|end|>", b)
            body = t[b:body_end]
            if to and self.tools:
                done = e >= 0 or final or value_end(t, b) is not None
                s.calls.append(_Call(to.group(1), body, done, raw=t[i:body_end]))
            elif channel and channel.group(1) == "analysis":
                s.reasoning += body
            else:
                s.content += body
            if e < 0:
                return
            i = e + len("<|end|>")


def _parses(args: str) -> bool:
    try:
        json.loads(args)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Reading:
    """How one request's answer is read: the template's syntax, whether tool calls are looked for,
    and whether the prompt left the reasoning block open."""

    syntax: Syntax
    tools: bool = False
    think_open: bool = False
    salt: str = field(default_factory=lambda: secrets.token_hex(8))  # this request's: its calls' ids

    def parser(self) -> OutputParser:
        return OutputParser(self.syntax, self.tools, self.think_open, self.salt)

    def read(self, text: str) -> Reply:
        """A whole answer's message."""
        p = self.parser()
        p.push(text)
        p.finish()
        return p.message()

    def turn(self, text: str) -> dict:
        """The answer as the assistant message a client sends back in its next request (content, and
        tool calls as bmoe.chat.request checks them; reasoning is not sent back)."""
        m = self.read(text)
        if not m.calls:
            return {"role": "assistant", "content": m.content}
        return {"role": "assistant", "content": m.content or None, "tool_calls": [c.openai() for c in m.calls]}
