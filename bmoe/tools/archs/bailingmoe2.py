"""bailingmoe2 (src/models/bailingmoe2.cpp): fused qkv with q/k norms, leading dense layers, sigmoid
group-limited routing with a selection bias, shared experts; an MTP layer is kept in the file and
skipped by the loader."""

from __future__ import annotations

from dataclasses import replace

from gguf import GGUFWriter

from bmoe.tools.synth_parts import SIGMOID, Arch, Table, ffn_or_experts, head, heads, nextn, register, routing
from bmoe.tools.synth_shape import Shape


def _table(s: Shape, tb: Table) -> None:
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.all_layers):
        t = tb.block(i)
        kv_dim = s.n_head_kv * s.head_dim
        t("attn_norm.weight", (e,), fill="ones")
        t("attn_qkv.weight", (e + 2 * kv_dim, e), "attn_v", std=e**-0.5)
        t("attn_output.weight", (e, e), "attn_output", std=e**-0.5)
        t("attn_q_norm.weight", (s.head_dim,), fill="ones")
        t("attn_k_norm.weight", (s.head_dim,), fill="ones")
        t("ffn_norm.weight", (e,), fill="ones")
        ffn_or_experts(t, s, i, probs_bias=True, shared="plain")
        if i >= s.layers:
            nextn(t, s)
            t("layer_output_norm.weight", (e,), fill="ones")
    head(s, tb)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_shared_count", s.shared_ff // s.ff)
    w.add_uint32(f"{a}.leading_dense_block_count", s.dense_lead)
    routing(w, a, SIGMOID, scale=2.5, groups=4, groups_used=2)
    heads(w, s, a)


def _small(s: Shape) -> Shape:
    return replace(s, shared_ff=s.ff, dense_lead=1, dense_ff=2 * s.ff, rope_dims=s.head_dim // 2)


register(Arch("bailingmoe2", 15, _table, _keys, _small, mtp=True))
