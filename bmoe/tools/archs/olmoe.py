"""olmoe (src/models/olmoe.cpp): attention with q/k norms over all heads, routed experts."""

from __future__ import annotations

from gguf import GGUFWriter

from bmoe.tools.synth_parts import Arch, Table, experts, head, heads, qkvo, register
from bmoe.tools.synth_shape import Shape


def _table(s: Shape, tb: Table) -> None:
    e = s.embd
    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        qkvo(t, s)
        t("attn_q_norm.weight", (q_dim,), fill="ones")
        t("attn_k_norm.weight", (kv_dim,), fill="ones")
        t("ffn_norm.weight", (e,), fill="ones")
        experts(t, s)
    head(s, tb)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    heads(w, s, a)


register(Arch("olmoe", 3, _table, _keys, kept_bytes=True))
