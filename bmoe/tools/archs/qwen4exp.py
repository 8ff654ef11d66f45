"""qwen4exp (src/models/qwen4exp.cpp): qwen35moe's layers with hyper-connections in place of every
norm (two mixers a layer and one before the output), an indexer on the attention layers, and n-gram
hash embeddings (Ple) on one recurrent layer."""

from __future__ import annotations

from dataclasses import replace

from gguf import GGUFValueType, GGUFWriter

from bmoe.tools.synth_parts import (
    Arch,
    Table,
    experts,
    gdn,
    gdn_hybrid_keys,
    gdn_hybrid_small,
    qkvo,
    register,
    rope_sections,
)
from bmoe.tools.synth_shape import Indexer, Ple, Shape


def _table(s: Shape, tb: Table) -> None:
    e, hc, lr, ix, ple = s.embd, s.hyper, s.hyper_rank, s.indexer, s.ple
    assert ix is not None
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    tb.add("output_hc_norm.weight", (hc, e), fill="ones")
    tb.add("output_hc_down.weight", (lr, hc * e), "matrix", std=(hc * e) ** -0.5)
    tb.add("output_hc_up.weight", (hc * e, lr), "matrix", std=lr**-0.5)
    if ple:  # a token embedding table by name (llama-quant types it as one)
        tb.add("per_layer_token_embd.weight", (ple.rows, ple.dim), "token_embd", std=1.0)
    for i in range(s.layers):
        t = tb.block(i)
        if ple and i == ple.layer:
            t("ple_key.weight", (hc * e, e), "matrix", std=e**-0.5)
            t("ple_value.weight", (e, e), "matrix", std=e**-0.5)
            for part in ("key", "query", "conv"):
                t(f"ple_norm_{part}.weight", (hc, e), fill="ones")
            t("ple_conv1d.weight", (hc * e, ple.conv), std=0.5)
        for part in ("attn", "ffn"):
            t(f"hc_{part}_norm.weight", (hc, e), fill="ones")
            t(f"hc_{part}_down.weight", (lr, hc * e), "matrix", std=(hc * e) ** -0.5)
            t(f"hc_{part}_up.weight", (hc * e, lr), "matrix", std=lr**-0.5)
            t(f"hc_{part}_inject.weight", (hc, hc * e), "matrix", std=(hc * e) ** -0.5)
        if s.is_full(i):
            qkvo(t, s, gated=True)
            t("attn_q_norm.weight", (s.head_dim,), fill="ones")
            t("attn_k_norm.weight", (s.head_dim,), fill="ones")
            t("indexer.q_proj.weight", (ix.heads * ix.head_dim, e), "f16", std=e**-0.5)
            t("indexer.k_proj.weight", (ix.head_dim, e), "f16", std=e**-0.5)
            t("indexer.q_norm.weight", (ix.head_dim,), fill="ones")
            t("indexer.k_norm.weight", (ix.head_dim,), fill="ones")
        else:
            gdn(t, s, fused_ba=False)
        experts(t, s, shared="gated")
    tb.add("output.weight", (s.n_vocab, e), "output", fill="output", std=3.0 * e**-0.5)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    gdn_hybrid_keys(w, s, a)
    w.add_array(f"{a}.rope.dimension_sections", rope_sections(s.rope_dims))
    ix = s.indexer
    assert ix is not None
    w.add_uint32(f"{a}.hyper_connection.count", s.hyper)
    w.add_uint32(f"{a}.hyper_connection.low_rank", s.hyper_rank)
    w.add_uint32(f"{a}.attention.indexer.head_count", ix.heads)
    w.add_uint32(f"{a}.attention.indexer.key_length", ix.head_dim)
    w.add_uint32(f"{a}.attention.indexer.top_k", ix.top_k)
    w.add_array(f"{a}.attention.compress_ratios", list(ix.ratios))
    if s.ple:
        _ple_keys(w, s.ple, a)


def _ple_keys(w: GGUFWriter, ple: Ple, a: str) -> None:
    """The n-gram hash constants: head h reads rows offset[h] + hash % vocab[h] of the table (the rows
    split evenly between the heads)."""
    u32, u64 = GGUFValueType.UINT32, GGUFValueType.UINT64
    per_head = ple.rows // ple.heads
    w.add_key_value(f"{a}.ple.layers", [ple.layer], GGUFValueType.ARRAY, sub_type=u32)
    w.add_uint32(f"{a}.ple.ngram_size", ple.ngram)
    w.add_uint32(f"{a}.ple.heads_per_ngram", ple.heads_per_ngram)
    w.add_uint32(f"{a}.ple.conv_kernel", ple.conv)
    w.add_uint32(f"{a}.ple.eos_token_id", 2)
    w.add_uint32(f"{a}.embedding_length_per_layer_input", ple.dim)
    w.add_key_value(f"{a}.ple.layer_multipliers", [1 + 2 * n for n in range(ple.ngram)], GGUFValueType.ARRAY,
                    sub_type=u64)
    w.add_key_value(f"{a}.ple.head_offsets", [h * per_head for h in range(ple.heads)], GGUFValueType.ARRAY,
                    sub_type=u64)
    w.add_key_value(f"{a}.ple.head_vocab_sizes", [per_head] * ple.heads, GGUFValueType.ARRAY, sub_type=u64)


def _small(s: Shape) -> Shape:
    """qwen35moe's small model with 4 hyper-connection streams, an indexer on the attention layers and
    n-gram embeddings of 4 heads on layer 0, 4 x 32 rows per head."""
    s = gdn_hybrid_small(s)
    return replace(s, hyper=4, hyper_rank=8, indexer=Indexer(
        heads=2, head_dim=s.head_dim, top_k=2048, ratios=tuple(4 if s.is_full(i) else 0 for i in range(s.layers))),
        ple=Ple(rows=4 * 4 * 32, dim=s.embd // 4, layer=0, ngram=3, heads_per_ngram=2, conv=4))


register(Arch("qwen4exp", 7, _table, _keys, _small, fused=True))
