"""llama with experts (src/models/llama.cpp; Mixtral's layout): plain attention, routed experts."""

from __future__ import annotations

from gguf import GGUFWriter

from bmoe.tools.synth_parts import Arch, Table, experts, head, heads, qkvo, register
from bmoe.tools.synth_shape import Shape


def _table(s: Shape, tb: Table) -> None:
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        qkvo(t, s)
        t("ffn_norm.weight", (e,), fill="ones")
        experts(t, s)
    head(s, tb)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    heads(w, s, a)


register(Arch("llama", 2, _table, _keys, kept_bytes=True))
