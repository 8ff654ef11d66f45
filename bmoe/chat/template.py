"""A conversation rendered with the model's own chat template, as the session keeps it.

By default llama.cpp's `llama_chat_apply_template` renders what it recognises (exactly as one-shot
`--chat` renders a single turn); a template it does not know, or thinking off on a template that
reads `enable_thinking`, is rendered with jinja2 (the template itself). See bmoe.edges.session's
notes. With `jinja` (--jinja: llama.cpp's and llama-server's default) every conversation is rendered
with jinja2, given what llama.cpp's jinja path gives a template: `enable_thinking` (true or false,
never left out), today's date as `date_string` ("%d %b %Y", Llama 3's) and `datetime` ("%b %d %Y",
firefunction's), `bos_token`, `eos_token`, and `tools` when there are any. A built-in template named
by --chat-template is llama.cpp's formatter alone (it has no jinja, so no tools).

Thinking: a request's word wins; without one, --reasoning (`reasoning`) decides: off renders
`enable_thinking=False`, on true, auto true, except that with `jinja` a template that does not read
`enable_thinking` gets false (llama-server passes a template that shows no thinking false).

Tools, and conversations with tool calls or tool results in them, always go through jinja2, which
passes the template `tools` as llama.cpp's jinja path does. Messages reach the template as the
common templates expect them (llama.cpp adapts them the same way): a tool call's `arguments` as an
object rather than JSON text, a missing content as "", and `reasoning_content` also as `thinking`
(gpt-oss's name for it).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

from bmoe.base.errors import ConfigError
from bmoe.chat.jinja_render import JinjaTemplate
from bmoe.seam import llama
from bmoe.seam.llama import Vocab


class Renderer:
    """A conversation → prompt text with the model's own chat template (see the module notes)."""

    def __init__(self, vocab: Vocab, template: bytes | None, jinja: bool = False, reasoning: str = "auto") -> None:
        self.vocab = vocab
        self.template = template
        self.jinja = jinja
        self.reasoning = reasoning
        self.builtin = template is not None and template.decode(errors="replace") in llama.builtin_templates()
        self.reads_thinking = bool(self.template and b"enable_thinking" in self.template) and not self.builtin
        self._jinja: JinjaTemplate | None = None  # compiled on first use
        self._tools: bool | None = None

    def thinks(self, think: bool | None) -> bool:
        """Whether a conversation renders with thinking on: `think` (the request's word), else --reasoning's
        (see the module notes)."""
        if think is not None:
            return think
        if self.reasoning == "off":
            return False
        return self.reasoning == "on" or not self.jinja or self.reads_thinking

    def render(self, messages: Sequence[Mapping[str, Any]], think: bool | None,
               tools: Sequence[Mapping[str, Any]] | None = None, prompt: bool = True) -> str:
        """The conversation as prompt text; `think` None is --reasoning's; `prompt` False leaves out the
        generation prompt that opens the assistant's turn (a request's `add_generation_prompt: false`)."""
        if self.template is None:
            return "".join(m.get("content") or "" for m in messages)
        on = self.thinks(think)
        structured = bool(tools) or any(set(m) - {"role", "content"} or m["role"] == "tool" for m in messages)
        if self.builtin or not (self.jinja or structured or (self.reads_thinking and not on)):
            text = llama.apply_template(self.template, [(m["role"], m["content"] or "") for m in messages], prompt)
            if text is not None:
                return text
            if self.builtin:
                raise ConfigError(f"llama.cpp's {self.template.decode()} template failed to render the conversation")
        thinking = {"enable_thinking": on} if self.jinja or not on else {}
        return self._render_jinja(template_messages(messages), prompt, tools=tools,
                                  **thinking, **_today())

    @property
    def supports_tools(self) -> bool:
        """Whether the template shows the model its tools: a tool named only here must appear in
        the prompt (the way llama.cpp's jinja path probes a template)."""
        if self._tools is None and self.builtin:
            self._tools = False  # llama.cpp's formatter has no tools
        if self._tools is None:
            probe = {"type": "function", "function": {"name": "bmoe_probe_tool_7f3a", "description": "probe",
                                                      "parameters": {"type": "object", "properties": {}}}}
            try:
                text = self._render_jinja([{"role": "user", "content": "hi"}], True, tools=[probe])
            except ConfigError:
                text = ""
            self._tools = "bmoe_probe_tool_7f3a" in text
        return self._tools

    def _render_jinja(self, messages: Sequence[Mapping[str, Any]], prompt: bool = True,
                      tools: Sequence[Mapping[str, Any]] | None = None, **context: Any) -> str:
        assert self.template is not None  # render() uses llama.cpp's own formatting without one
        bos = self.vocab.text(self.vocab.bos)
        try:
            if self._jinja is None:
                self._jinja = JinjaTemplate(self.template.decode(errors="replace"))
            text = self._jinja.render(messages, prompt, bos_token=bos, eos_token=self.vocab.text(self.vocab.eos),
                                      **({"tools": list(tools)} if tools else {}), **context)
        except Exception as e:  # noqa: BLE001 - a template error is the request's, not the session's
            raise ConfigError(f"the model's chat template failed to render: {e}") from None
        # tokenize() adds BOS itself when the vocab asks for it: do not send a second one
        if bos and text.startswith(bos) and self.vocab.adds_bos:
            text = text[len(bos):]
        return text


def _today() -> dict[str, str]:
    """Today's date as llama.cpp's jinja path gives it to every template (local time)."""
    now = datetime.datetime.now()
    return {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y")}


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates read them (see the module notes)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("reasoning_content") and "thinking" not in m:
            m["thinking"] = m["reasoning_content"]
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                c = dict(c)
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass  # not JSON: the template gets the text
                c["function"] = fn
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
