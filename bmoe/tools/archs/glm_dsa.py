"""glm-dsa (src/models/glm-dsa.cpp): deepseek2's MLA layers with a DSA indexer on the layers that
compute their own top-k (Indexer.full), sigmoid routing with a selection bias."""

from __future__ import annotations

from dataclasses import replace

from gguf import GGUFWriter

from bmoe.tools.synth_parts import Arch, Table, ffn_or_experts, head, mla, mla_moe_keys, mla_moe_small, nextn, register
from bmoe.tools.synth_shape import Indexer, Shape


def _table(s: Shape, tb: Table) -> None:
    e, m, ix = s.embd, s.mla, s.indexer
    assert m is not None and ix is not None
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.all_layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        mla(t, s)
        t("ffn_norm.weight", (e,), fill="ones")
        if i >= s.layers or ix.full[i]:
            t("indexer.k_norm.weight", (ix.head_dim,), fill="ones")
            t("indexer.k_norm.bias", (ix.head_dim,), std=0.02)
            t("indexer.proj.weight", (ix.heads, e), "matrix", std=e**-0.5)
            t("indexer.attn_k.weight", (ix.head_dim, e), "matrix", std=e**-0.5)
            t("indexer.attn_q_b.weight", (ix.heads * ix.head_dim, m.q_lora), "matrix", std=m.q_lora**-0.5)
        ffn_or_experts(t, s, i, probs_bias=True, shared="plain")
        if i >= s.layers:
            nextn(t, s)
    head(s, tb)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    mla_moe_keys(w, s, a)
    ix = s.indexer
    assert ix is not None
    w.add_uint32(f"{a}.attention.indexer.head_count", ix.heads)
    w.add_uint32(f"{a}.attention.indexer.key_length", ix.head_dim)
    w.add_uint32(f"{a}.attention.indexer.top_k", ix.top_k)
    w.add_array(f"{a}.attention.indexer.types", [int(f) for f in ix.full])


def _small(s: Shape) -> Shape:
    """deepseek2's small model with GLM-5.2's indexer types: layers 0-2 and then every 4th compute their own."""
    s = mla_moe_small(s)
    return replace(s, indexer=Indexer(heads=4, head_dim=64, top_k=2048,
                                      full=tuple(i < 3 or i % 4 == 2 for i in range(s.layers))))


register(Arch("glm-dsa", 8, _table, _keys, _small, mtp=True))
