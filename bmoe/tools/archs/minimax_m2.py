"""minimax-m2 (src/models/minimax-m2.cpp): q/k norms over all heads, sigmoid routing with a selection
bias; the experts' width is feed_forward_length."""

from __future__ import annotations

from dataclasses import replace

from gguf import GGUFWriter

from bmoe.tools.synth_parts import SIGMOID, Arch, Table, experts, head, heads, qkvo, register, routing
from bmoe.tools.synth_shape import Shape


def _table(s: Shape, tb: Table) -> None:
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.layers):
        t = tb.block(i)
        q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
        qkvo(t, s)
        t("attn_norm.weight", (e,), fill="ones")
        t("attn_q_norm.weight", (q_dim,), fill="ones")
        t("attn_k_norm.weight", (kv_dim,), fill="ones")
        t("ffn_norm.weight", (e,), fill="ones")
        experts(t, s, probs_bias=True)
    head(s, tb)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    routing(w, a, SIGMOID)
    heads(w, s, a)


def _small(s: Shape) -> Shape:
    return replace(s, rope_dims=s.head_dim // 2)


register(Arch("minimax-m2", 17, _table, _keys, _small, experts_ff=True))
