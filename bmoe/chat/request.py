"""What a chat request asks beyond its text, checked and made ready for a generation: the
conversation (tool calls and tool results included), `tools`/`tool_choice`, `response_format`, a
raw `grammar`, and the reading of the answer (reasoning, content, tool calls).

`ChatFormat` is one model's: its chat template (bmoe.chat.template.Renderer), the syntax that
template writes calls and reasoning in (bmoe.chat.syntax) and the token ids of that syntax's
markers, which generation writes out as text so that the answer can be read. Every check raises a
FieldError naming the field (a GrammarError for what a grammar cannot hold), which the server
answers with a 400.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bmoe.base.errors import ConfigError, FieldError
from bmoe.chat.grammar import Grammar, GrammarError, response_format_grammar
from bmoe.chat.output import Reading
from bmoe.chat.syntax import HARMONY, check_tools, detect, tool_grammar, with_reasoning

if TYPE_CHECKING:
    from bmoe.chat.grammar_check import GrammarCheck
    from bmoe.chat.template import Renderer
    from bmoe.seam.llama import Vocab

ROLES = ("system", "developer", "user", "assistant", "tool")
_PROBE = "\u2063bmoe\u2063"  # a last message's stand-in, to find where a conversation's stable prefix ends


def check_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    """OpenAI chat messages, checked: a role and text content; an assistant's may be null when it
    has `tool_calls`; a tool result's has its `tool_call_id`. `developer` is a system message."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise FieldError("messages: a non-empty list of {\"role\", \"content\"}", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise FieldError(f"{where}: a message has a role ({', '.join(ROLES)})", f"{where}.role")
        role, content, calls = m["role"], m.get("content"), m.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)):
            raise FieldError(f"{where}.tool_calls: a list, on an assistant message", f"{where}.tool_calls")
        if not isinstance(content, str) and not (content is None and calls):
            raise FieldError(f"{where}.content: text" + (" (or null with tool_calls)" if role == "assistant" else ""),
                               f"{where}.content")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if calls:
            msg["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise FieldError(f"{where}.tool_call_id: the id of the call this answers", f"{where}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        for key in ("name", "reasoning_content"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return tuple(out)


def _call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise FieldError(f"{where}: {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                           where)
    return {"id": str(c.get("id", "")), "type": "function",
            "function": {"name": fn["name"], "arguments": fn["arguments"]}}


@dataclass(frozen=True)
class ChatParts:
    """A chat request ready to tokenize: its prompt text and how generation treats it."""

    text: str
    messages: tuple[dict[str, Any], ...]  # checked
    grammar: Grammar | None
    reading: Reading | None
    specials: frozenset[int]
    tools: tuple[Mapping[str, Any], ...] | None


class ChatFormat:
    """One model's chat template, the syntax it uses, and its markers' token ids."""

    def __init__(self, renderer: Renderer, vocab: Vocab, grammars: GrammarCheck) -> None:
        self.renderer = renderer
        self.vocab = vocab
        self.grammars = grammars
        self.syntax = detect((renderer.template or b"").decode(errors="replace"))
        ids = [vocab.tokenize(m, add_special=False) for m in self.syntax.markers]
        self.markers = frozenset(t[0] for t in ids if len(t) == 1)

    def parts(self, messages: Sequence[Mapping[str, Any]], think: bool | None = None, tools: Any = None,
              tool_choice: Any = None, parallel_tool_calls: Any = None, response_format: Any = None,
              grammar: str | None = None, verify: bool = True, prompt: bool = True, continued: bool = False
              ) -> ChatParts:
        """Check a chat request and render it (see the module notes); `verify` False leaves llama.cpp's parse of
        its grammar to the caller (Model.prepare). `prompt` False renders no generation prompt after the last
        message; `continued` continues a last assistant message instead of closing its turn (the turns before
        it, the generation prompt, then its text: llama-server's prefill). `think` None is the server's
        --reasoning (bmoe.chat.template.Renderer.thinks)."""
        msgs = check_messages(messages)
        if continued and (msgs[-1]["role"] != "assistant" or msgs[-1].get("tool_calls")):
            raise FieldError("continue_final_message: the last message must be an assistant's text to continue "
                             "(without tool calls)", "continue_final_message")
        t = check_tools(tools, tool_choice, parallel_tool_calls)
        g = self.check_grammar(response_format, grammar)
        syntax, r = self.syntax, self.renderer
        think = r.thinks(think)
        if t is not None and not r.supports_tools:
            raise GrammarError("tools: the model's chat template does not show the model any tools (it would "
                               "answer as if there were none); serve it with --chat-template-file naming a template "
                               "that does", "tools")
        calls = t is not None and t.choice != "none"
        if calls and g is not None:
            raise GrammarError("response_format (or grammar) and tools cannot both hold the answer; send "
                               "tool_choice none to keep the tools without calls, or drop one", "response_format")
        shown = tuple(tools) if t is not None else None
        shown_tools = list(shown) if shown else None
        text = (r.render(list(msgs[:-1]), think, shown_tools) + (msgs[-1]["content"] or "") if continued else
                r.render(list(msgs), think, shown_tools, prompt))
        think_open = bool(syntax.think and text.rstrip().endswith(syntax.think[0]))
        closed = bool(syntax.think and text.rstrip().endswith(syntax.think[1]))  # the prompt closed the block
        thinking = syntax.think is not None and (think or not r.reads_thinking) and not closed
        if calls:
            assert t is not None  # calls come with tools
            g = tool_grammar(syntax, t, thinking, think_open)
        elif g is not None and response_format is not None and (thinking or think_open or syntax.name == HARMONY):
            g = with_reasoning(syntax, g, think_open)
        reading = (Reading(syntax, calls, think_open)
                   if calls or syntax.think or syntax.name == HARMONY else None)
        if g is not None and verify:
            self.verify(g)
        return ChatParts(text, msgs, g, reading, self.markers if reading else frozenset(), shown)

    def check_grammar(self, response_format: Any, grammar: str | None) -> Grammar | None:
        """The grammar `response_format` or a raw GBNF `grammar` asks for (one of them)."""
        g = response_format_grammar(response_format)
        if grammar is not None:
            if not isinstance(grammar, str) or not grammar.strip():
                raise GrammarError("grammar: GBNF text with a root rule", "grammar")
            if g is not None:
                raise GrammarError("grammar and response_format both constrain the answer; send one", "grammar")
            g = Grammar(grammar)
        return g

    def verify(self, g: Grammar) -> None:
        """GrammarError when llama.cpp would not take `g`, or `g` could harm the process that parses it
        (bmoe.chat.grammar_check), before the request queues."""
        self.grammars.check(g)

    def stable_prefix(self, messages: Sequence[Mapping[str, Any]], think: bool | None, tools: Any,
                      tokens: Sequence[int], tokenize: Any) -> int:
        """How many of a chat prompt's `tokens` do not depend on its last message (the system prompt,
        tools and earlier turns): what a prompt cache keeps. A conversation of one message (a
        session's first turn, `bmoe-cli --chat`) keeps all of it, as a plain prompt does."""
        from bmoe.chat.template import common_prefix

        msgs = [dict(m) for m in check_messages(messages)]
        if len(msgs) == 1:
            return len(tokens)
        msgs[-1]["content"] = _PROBE + (msgs[-1].get("content") or "")[::-1]
        try:
            other = tokenize(self.renderer.render(msgs, think, tools=list(tools) if tools else None))
        except ConfigError:  # the template refused the stand-in: keep nothing
            return 0
        return common_prefix(list(tokens), other)

