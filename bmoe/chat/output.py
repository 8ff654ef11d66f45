"""A model's answer as an OpenAI message: reasoning, content and tool calls, also piece by piece.

`OutputParser.push` takes the generated text as it comes and returns what can be handed out now
(a Delta: reasoning, content and tool-call pieces, as `delta.reasoning_content`, `delta.content`
and `delta.tool_calls` of a stream); `finish` the rest; `message` the whole answer. Each push
re-reads the text so far (a few kB at most) and hands out only what no later text can change:
text that could be the start of a marker (`<tool_c…`) waits for the next piece, and a call is
handed out whole, in one piece, once its text is complete and its arguments parse. So a stream's
pieces, joined, are exactly the whole answer, and no client ever holds arguments that will not parse.

Rules where the syntaxes leave room (bmoe.chat.syntax has the syntaxes):
- reasoning is only a block at the very start of the answer (or the whole start when the prompt
  ends inside one); its surrounding whitespace, and the whitespace after it, are dropped.
- a tool call's `arguments` are the model's JSON text as written. A call the text ends inside (cut
  off by max_tokens) is dropped, from the calls and from the content; a call that ended but does
  not parse (written without a grammar) is content; a call that repeats an earlier call of the
  answer (same name, same arguments) is dropped: it is what a small model forced to call writes
  when it cannot stop, and `CallEnd` ends the generation there.
- text between and after calls that is not whitespace is content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from bmoe.chat.partial_json import WS, held, skip_ws, string_end, value_end
from bmoe.chat.syntax import (
    COMMAND_R7B,
    DEEPSEEK_R1,
    HARMONY,
    HERMES,
    LLAMA3,
    MISTRAL,
    OPENERS,
    R1_CALL,
    R1_CALL_END,
    R1_CALLS_END,
    R1_SEP,
    R7B_ACTION_END,
    R7B_RESPONSE,
    Syntax,
)

_NAME_ARGS = re.compile(r"([^\[]*?)(?:\[CALL_ID\][^\[]*)?\[ARGS\]")  # mistral's `name[CALL_ID]id[ARGS]`
# R1's call up to its arguments (its type, "function", then its name), and from them to its end
_R1_HEAD = re.compile(re.escape(R1_CALL) + r"[^<\n]*" + re.escape(R1_SEP) + r"([^\n]*)\n```(?:json)?\n")
_R1_TAIL = re.compile(r"\s*```\s*" + re.escape(R1_CALL_END))
_V31_HEAD = re.compile(re.escape(R1_CALL) + r"([^<\n]*)" + re.escape(R1_SEP))  # DeepSeek V3.1's: the name, then R1_SEP
_V31_TAIL = re.compile(r"\s*" + re.escape(R1_CALL_END))


@dataclass(frozen=True)
class CallDelta:
    """Tool call `index` of a stream, whole: a call is handed out once complete (see the module notes)."""

    index: int
    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


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
    closed: bool = False  # the call's text is complete (its closing marker, or what follows it, is there)
    open_end: bool = False  # the text ends inside the call: it may still grow (or was cut, once the text is whole)

    @property
    def complete(self) -> bool:
        return self.name is not None and self.done and self.closed and _parses(self.args)

    @property
    def key(self) -> str:
        """The call as a value (name and arguments, key order aside), to tell a repeat (call when complete)."""
        return json.dumps([self.name, json.loads(self.args)], sort_keys=True)


@dataclass
class _Scan:
    reasoning: str = ""
    content: str = ""
    calls: list[_Call] = field(default_factory=list)


# ---- a call written as a JSON object ------------------------------------------------------------


def _call_object(t: str, i: int, final: bool) -> tuple[_Call, int | None, bool]:
    """A call written as a JSON object with "name" and "arguments" (any order, other keys skipped):
    (the call so far, the index after it or None, whether it is well formed so far)."""
    call = _Call(None, "")
    i = skip_ws(t, i)
    if i >= len(t):
        return call, None, True
    if t[i] != "{":
        return call, None, False
    i += 1
    while True:
        i = skip_ws(t, i)
        if i >= len(t):
            return call, None, True
        if t[i] == "}":
            return call, i + 1, call.name is not None and call.done
        if t[i] == ",":
            i += 1
            continue
        if t[i] != '"':
            return call, None, False
        e = string_end(t, i)
        if e is None:
            return call, None, True
        key = json.loads(t[i:e])
        i = skip_ws(t, e)
        if i >= len(t):
            return call, None, True
        if t[i] != ":":
            return call, None, False
        i = skip_ws(t, i + 1)
        end = value_end(t, i, final)
        if key in ("arguments", "parameters"):
            call.args = t[i:len(t) if end is None else end]
            call.done = end is not None
        elif key in ("name", "tool_name") and end is not None:  # tool_name: Command R7B's
            try:
                call.name = json.loads(t[i:end])
            except ValueError:
                return call, None, False
        if end is None:
            return call, None, True
        i = end


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
        self._calls_sent = 0
        self.repeated = False  # a complete call repeated an earlier one (CallEnd ends the answer there)

    def push(self, piece: str) -> Delta:
        self.text += piece
        return self._emit(self._scan(self.text, final=False), final=False)

    def finish(self) -> Delta:
        return self._emit(self._scan(self.text, final=True), final=True)

    def message(self) -> Reply:
        """The whole answer (call after `finish`): the complete calls, a call that ended without parsing
        kept as content, a cut or repeated one dropped (see the module notes)."""
        s = self._scan(self.text, final=True)
        calls, extra = self._settle(s, final=True)
        return Reply(s.content + extra, s.reasoning,
                     tuple(ToolCall(self._id(k), c.name or "", c.args) for k, c in enumerate(calls)))

    def call_counts(self) -> tuple[int, int]:
        """How many calls the text so far has begun, and how many of them are complete (repeats not counted)."""
        s = self._scan(self.text, final=False)
        return len(s.calls), len(self._settle(s, final=False)[0])

    def _id(self, k: int) -> str:
        return self.syntax.call_id(self.salt, k)

    def _settle(self, s: _Scan, final: bool) -> tuple[list[_Call], str]:
        """The calls handed out so far (complete, in order, repeats dropped) and, once the text is
        whole, the text of calls that ended without parsing, which is content after all."""
        calls: list[_Call] = []
        seen: set[str] = set()
        extra = ""
        for c in s.calls:
            if c.complete:
                if c.key in seen:
                    self.repeated = True
                else:
                    seen.add(c.key)
                    calls.append(c)
            elif not final:
                break  # calls are handed out in order: a later one waits for this one
            elif not c.open_end:
                extra += c.raw  # ended, but not a call after all
        return calls, extra

    def _emit(self, s: _Scan, final: bool) -> Delta:
        d = Delta()
        sent = self._sent
        if s.reasoning.startswith(sent.reasoning):
            d.reasoning, sent.reasoning = s.reasoning[len(sent.reasoning):], s.reasoning
        calls, extra = self._settle(s, final)
        content = s.content + extra
        if content.startswith(sent.content):
            d.content, sent.content = content[len(sent.content):], content
        for k in range(self._calls_sent, len(calls)):
            c = calls[k]
            d.calls.append(CallDelta(k, self._id(k), c.name or "", c.args))
        self._calls_sent = max(self._calls_sent, len(calls))
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
        lead = skip_ws(t, 0)
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
            stop = len(t) if final else len(t) - held(t, close, start)
            s.reasoning = t[start:stop].strip(WS)  # trailing whitespace waits: it may come before the close
            return None
        s.reasoning = t[start:end].strip(WS)
        pos = skip_ws(t, end + len(close))
        return pos if (pos < len(t) or final) else None

    def _body(self, t: str, pos: int, final: bool, s: _Scan) -> None:
        name = self.syntax.name
        opener = OPENERS.get(name) if self.tools else None
        at, hold = _llama3_call(t, pos) if opener and name == LLAMA3 else \
            (t.find(opener, pos), held(t, opener, pos)) if opener else (-1, 0)
        if at < 0:
            s.content = t[pos:] if final else t[pos:len(t) - hold]
        else:
            s.content = t[pos:at]
            if name == HERMES:
                self._hermes(t, at, final, s)
            elif name == LLAMA3:
                self._objects(t, at, final, s)
            elif name == DEEPSEEK_R1:
                self._r1(t, at, final, s)
            elif name == MISTRAL and self.syntax.args_form:
                self._mistral_args(t, at, final, s)
            else:
                self._json_array(t, at, final, s)
        if name == COMMAND_R7B:  # its answer's markers are not content (one may be starting)
            for m in R7B_RESPONSE:
                s.content = s.content.replace(m, "")
            if not final:
                s.content = s.content[:len(s.content) - max(held(s.content, m) for m in R7B_RESPONSE)]

    def _after_calls(self, t: str, i: int, opener: str, final: bool, s: _Scan) -> int | None:
        """After a call: the index of the next call's opener, or None (the rest is content, or held)."""
        j = skip_ws(t, i)
        if t.startswith(opener, j):
            return j
        if not final and opener.startswith(t[j:]):
            return None
        if j < len(t):
            s.content += t[j:] if final else t[j:len(t) - held(t, opener, j)]
        return None

    def _hermes(self, t: str, at: int | None, final: bool, s: _Scan) -> None:
        open_, close = "<tool_call>", "</tool_call>"
        while at is not None:
            i = at + len(open_)
            call, end, ok = _call_object(t, i, final)
            s.calls.append(call)
            if not ok or end is None:
                call.raw, call.open_end = t[at:], ok
                return
            j = skip_ws(t, end)
            if not t.startswith(close, j):
                call.raw, call.open_end = t[at:], close.startswith(t[j:])
                if final or not call.open_end:
                    call.done = False  # malformed, or cut before its end: not a call
                return
            call.raw, call.closed = t[at:j + len(close)], True
            at = self._after_calls(t, j + len(close), open_, final, s)

    def _json_array(self, t: str, at: int, final: bool, s: _Scan) -> None:
        """A JSON array of call objects after the opener (mistral's, and Command R7B's, which closes it with
        its end marker)."""
        opener = OPENERS[self.syntax.name]
        i = skip_ws(t, at + len(opener))
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
                call.open_end = ok
                return
            i = skip_ws(t, end)
            if i < len(t) and t[i] == ",":
                call.closed = True
                i += 1
                continue
            if i < len(t) and t[i] == "]":
                call.closed = True
                i += 1
                if self.syntax.name == COMMAND_R7B:
                    i = skip_ws(t, i)
                    if t.startswith(R7B_ACTION_END, i):
                        i += len(R7B_ACTION_END)
                    elif R7B_ACTION_END.startswith(t[i:]):
                        return  # its end is coming (or was cut)
                nxt = self._after_calls(t, i, opener, final, s)
                if nxt is not None:
                    self._json_array(t, nxt, final, s)
            else:
                call.open_end = i >= len(t)
                if i < len(t) or final:
                    call.done = False
            return

    def _objects(self, t: str, at: int | None, final: bool, s: _Scan) -> None:
        """Llama 3's calls: JSON objects written as they are, the opener their start."""
        opener = OPENERS[self.syntax.name]
        while at is not None:
            call, end, ok = _call_object(t, at, final)
            s.calls.append(call)
            call.raw = t[at:end] if end is not None else t[at:]
            if not ok or end is None:
                call.open_end = ok
                if final or not ok:
                    call.done = call.done and ok
                return
            call.closed = True
            at = self._after_calls(t, end, opener, final, s)

    def _r1(self, t: str, at: int, final: bool, s: _Scan) -> None:
        """DeepSeek R1's calls after its opener, each
        `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>` (V3.1's
        `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`), up to `<｜tool▁calls▁end｜>`."""
        opener = OPENERS[self.syntax.name]
        i = at + len(opener)
        while True:
            i = skip_ws(t, i)
            if t.startswith(R1_CALLS_END, i):
                nxt = self._after_calls(t, i + len(R1_CALLS_END), opener, final, s)
                if nxt is not None:
                    self._r1(t, nxt, final, s)
                return
            m = (_V31_HEAD if self.syntax.args_form else _R1_HEAD).match(t, i)
            if m is None:  # the call's head is still coming, or this is no call
                if not (t.startswith(R1_CALL, i) or R1_CALL.startswith(t[i:]) or R1_CALLS_END.startswith(t[i:])):
                    s.content += t[i:]
                return  # (a call cut in its head is dropped)
            end = value_end(t, m.end(), final)
            call = _Call(m.group(1).strip(), t[m.end():len(t) if end is None else end], done=end is not None)
            s.calls.append(call)
            tail = (_V31_TAIL if self.syntax.args_form else _R1_TAIL).match(t, end) if end is not None else None
            call.raw = t[i:tail.end() if tail else len(t)]
            if tail is None:
                call.open_end = end is None or _r1_tail_coming(t[end:], self.syntax.args_form)
                if final or not call.open_end:
                    call.done = False
                return
            call.closed = True
            i = tail.end()

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
            call.done = call.closed = end is not None
            call.open_end = end is None
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
            body_end = len(t) if (e < 0 and final) else e if e >= 0 else len(t) - held(t, "<|end|>", b)
            body = t[b:body_end]
            if to and self.tools:
                ended = e >= 0 or value_end(t, b) is not None
                s.calls.append(_Call(to.group(1), body, ended or final, raw=t[i:body_end], closed=ended,
                                     open_end=not ended))
            elif channel and channel.group(1) == "analysis":
                s.reasoning += body
            else:
                s.content += body
            if e < 0:
                return
            i = e + len("<|end|>")


def _llama3_call(t: str, pos: int) -> tuple[int, int]:
    """Where Llama 3's call starts in t[pos:] (a "{" then, past whitespace, "name"), or -1 and how many
    characters at the end may be its start."""
    i = t.find("{", pos)
    while i >= 0:
        j = skip_ws(t, i + 1)
        if t.startswith('"name"', j):
            return i, 0
        if '"name"'.startswith(t[j:]):
            return -1, len(t) - i
        i = t.find("{", i + 1)
    return -1, 0


def _r1_tail_coming(rest: str, v31: bool) -> bool:
    """Whether `rest`, the text after an R1 (V3.1) call's arguments, may still grow into the call's end."""
    rest = rest.lstrip(WS)
    if v31:
        return R1_CALL_END.startswith(rest)
    if not rest.startswith("```"):
        return "```".startswith(rest)
    return R1_CALL_END.startswith(rest[3:].lstrip(WS))


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

    def call_end(self, max_tokens: int) -> CallEnd | None:
        """Where the generation should end for its tool calls; None when calls are not looked for."""
        return CallEnd(self, max_tokens) if self.tools else None

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


class CallEnd:
    """Where a tool-calling answer ends before the model ends it. A small model held to a call
    grammar that lets calls follow one another (`parallel_tool_calls`, OpenAI's default) often
    cannot stop: it repeats the call until max_tokens cuts one in half. The answer ends, with the
    calls it has, as soon as
    - a complete call repeats an earlier one of the answer (the repeat is dropped), or
    - a call is complete and fewer tokens are left than the longest call so far took: the next
      one could not end.
    A call cut anyway (max_tokens too small for one) is dropped (finish_reason "length")."""

    def __init__(self, reading: Reading, max_tokens: int) -> None:
        self.parser = reading.parser()
        self.max_tokens = max_tokens
        self.begun = self.complete = 0  # calls
        self.start = 0  # where the call under way began to cost tokens
        self.longest = 0  # tokens, of the calls complete so far

    def push(self, piece: str, n_tokens: int) -> bool:
        """The answer's text grew by `piece`, now `n_tokens` tokens: whether it should end here."""
        if not piece:
            return False
        p = self.parser
        p.text += piece
        begun, complete = p.call_counts()
        if begun and not self.begun:  # the first call's cost counts from its opening (text before it is not its)
            self.start = n_tokens - 1
        self.begun = begun
        if p.repeated:
            return True
        if complete == self.complete:
            return False
        self.complete, self.longest = complete, max(self.longest, n_tokens - self.start)
        self.start = n_tokens  # the next call's cost counts from here (what comes between calls included)
        return self.max_tokens - n_tokens < self.longest
