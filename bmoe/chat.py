"""A conversation rendered with the model's own chat template, as the session keeps it.

llama.cpp's `llama_chat_apply_template` renders what it recognises (exactly as one-shot `--chat`
renders a single turn); a template it does not know, or `think:false` on a template that reads
`enable_thinking`, is rendered with jinja2 (the template itself). See bmoe.session's notes.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp

from bmoe.llama import Vocab
from bmoe.errors import ConfigError


class Renderer:
    """A conversation → prompt text with the model's own chat template (see the module notes)."""

    def __init__(self, vocab: Vocab, template: bytes | None) -> None:
        self.vocab = vocab
        self.template = template
        self.reads_thinking = bool(self.template and b"enable_thinking" in self.template)
        self._jinja: Any = None

    def render(self, messages: list[dict[str, str]], think: bool) -> str:
        if self.template is None:
            return "".join(m["content"] for m in messages)
        if not think and self.reads_thinking:
            return self._render_jinja(messages, enable_thinking=False)
        text = self._render_llama(messages)
        return self._render_jinja(messages) if text is None else text

    def _render_llama(self, messages: list[dict[str, str]]) -> str | None:
        """llama_chat_apply_template, add_ass=True (what one-shot --chat does); None if unsupported."""
        msgs = (llama_cpp.llama_chat_message * len(messages))()
        keep = []  # the encoded strings must outlive the call
        for m, src in zip(msgs, messages):
            role, content = src["role"].encode(), src["content"].encode()
            keep += [role, content]
            m.role, m.content = role, content
        cap = 2 * sum(len(x) for x in keep) + 1024
        buf = ctypes.create_string_buffer(cap)
        n = llama_cpp.llama_chat_apply_template(self.template, msgs, len(messages), True, buf, cap)
        if n > cap:
            buf = ctypes.create_string_buffer(n)
            n = llama_cpp.llama_chat_apply_template(self.template, msgs, len(messages), True, buf, n)
        if n < 0:
            return None
        return buf.raw[:n].decode(errors="replace")

    def _token_text(self, tok: int) -> str:
        if tok < 0:
            return ""
        return (llama_cpp.llama_vocab_get_text(self.vocab.ptr, tok) or b"").decode(errors="replace")

    def _render_jinja(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        if self._jinja is None:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            bos = self._token_text(llama_cpp.llama_vocab_bos(self.vocab.ptr))
            eos = self._token_text(llama_cpp.llama_vocab_eos(self.vocab.ptr))
            self._jinja = (Jinja2ChatFormatter(self.template.decode(errors="replace"), eos, bos), bos)
        fmt, bos = self._jinja
        try:
            text = fmt(messages=messages, **kwargs).prompt
        except Exception as e:  # noqa: BLE001 - a template error is the request's, not the session's
            raise ConfigError(f"the model's chat template failed to render: {e}") from None
        # tokenize() adds BOS itself when the vocab asks for it: do not send a second one
        if bos and text.startswith(bos) and llama_cpp.llama_vocab_get_add_bos(self.vocab.ptr):
            text = text[len(bos):]
        return text


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
