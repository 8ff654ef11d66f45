"""A conversation rendered with the model's own chat template, as the session keeps it.

llama.cpp's `llama_chat_apply_template` renders what it recognises (exactly as one-shot `--chat`
renders a single turn); a template it does not know, or `think:false` on a template that reads
`enable_thinking`, is rendered with jinja2 (the template itself). See bmoe.edges.session's notes.

Tools, and conversations with tool calls or tool results in them, always go through jinja2, which
passes the template `tools` as llama.cpp's jinja path does. Messages reach the template as the
common templates expect them (llama.cpp adapts them the same way): a tool call's `arguments` as an
object rather than JSON text, a missing content as "", and `reasoning_content` also as `thinking`
(gpt-oss's name for it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from bmoe.base.errors import ConfigError
from bmoe.seam import llama
from bmoe.seam.llama import Vocab


class Renderer:
    """A conversation → prompt text with the model's own chat template (see the module notes)."""

    def __init__(self, vocab: Vocab, template: bytes | None) -> None:
        self.vocab = vocab
        self.template = template
        self.reads_thinking = bool(self.template and b"enable_thinking" in self.template)
        self._formatters: dict[bool, Any] = {}  # jinja's, by whether it adds the generation prompt; made on use
        self._tools: bool | None = None

    def render(self, messages: Sequence[Mapping[str, Any]], think: bool,
               tools: Sequence[Mapping[str, Any]] | None = None, prompt: bool = True) -> str:
        """The conversation as prompt text; `prompt` False leaves out the generation prompt that opens the
        assistant's turn (a request's `add_generation_prompt: false`)."""
        if self.template is None:
            return "".join(m.get("content") or "" for m in messages)
        thinking = {} if think or not self.reads_thinking else {"enable_thinking": False}
        if tools or any(set(m) - {"role", "content"} or m["role"] == "tool" for m in messages):
            return self._render_jinja(template_messages(messages), prompt, tools=list(tools) if tools else None,
                                      **thinking)
        if thinking:
            return self._render_jinja(list(messages), prompt, **thinking)
        assert self.template is not None
        text = llama.apply_template(self.template, [(m["role"], m["content"]) for m in messages], prompt)
        return self._render_jinja(list(messages), prompt) if text is None else text

    @property
    def supports_tools(self) -> bool:
        """Whether the template shows the model its tools: a tool named only here must appear in
        the prompt (the way llama.cpp's jinja path probes a template)."""
        if self._tools is None:
            probe = {"type": "function", "function": {"name": "bmoe_probe_tool_7f3a", "description": "probe",
                                                      "parameters": {"type": "object", "properties": {}}}}
            try:
                text = self._render_jinja([{"role": "user", "content": "hi"}], True, tools=[probe])
            except ConfigError:
                text = ""
            self._tools = "bmoe_probe_tool_7f3a" in text
        return self._tools

    def _render_jinja(self, messages: Sequence[Mapping[str, Any]], prompt: bool = True, **kwargs: Any) -> str:
        assert self.template is not None  # render() uses llama.cpp's own formatting without one
        bos = self.vocab.text(self.vocab.bos)
        fmt = self._formatters.get(prompt)
        if fmt is None:  # whether it adds the generation prompt is the formatter's, not the call's
            eos = self.vocab.text(self.vocab.eos)
            fmt = self._formatters[prompt] = llama.jinja_formatter(self.template.decode(errors="replace"), eos, bos,
                                                                   prompt)
        try:
            text = fmt(messages=messages, **kwargs).prompt
        except Exception as e:  # noqa: BLE001 - a template error is the request's, not the session's
            raise ConfigError(f"the model's chat template failed to render: {e}") from None
        # tokenize() adds BOS itself when the vocab asks for it: do not send a second one
        if bos and text.startswith(bos) and self.vocab.adds_bos:
            text = text[len(bos):]
        return text


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
