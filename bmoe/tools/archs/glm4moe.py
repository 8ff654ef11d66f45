"""glm4moe (src/models/glm4-moe.cpp): biased q/k/v with q/k norms, leading dense layers, sigmoid
routing with a selection bias and shared experts."""

from __future__ import annotations

from dataclasses import replace

from gguf import GGUFWriter

from bmoe.tools.synth_parts import SIGMOID, Arch, Table, ffn_or_experts, head, heads, nextn, qkvo, register, routing
from bmoe.tools.synth_shape import Shape


def _table(s: Shape, tb: Table) -> None:
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.all_layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        qkvo(t, s, biased=True)
        t("attn_q_norm.weight", (s.head_dim,), fill="ones")
        t("attn_k_norm.weight", (s.head_dim,), fill="ones")
        t("post_attention_norm.weight", (e,), fill="ones")
        ffn_or_experts(t, s, i, probs_bias=True, shared="plain")
        if i >= s.layers:
            nextn(t, s)
    head(s, tb)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_shared_count", s.shared_ff // s.ff)
    w.add_uint32(f"{a}.leading_dense_block_count", s.dense_lead)
    routing(w, a, SIGMOID, scale=2.5)
    heads(w, s, a)


def _small(s: Shape) -> Shape:
    return replace(s, shared_ff=s.ff, dense_lead=1, dense_ff=2 * s.ff, rope_dims=s.head_dim // 2)


register(Arch("glm4moe", 11, _table, _keys, _small, mtp=True))
