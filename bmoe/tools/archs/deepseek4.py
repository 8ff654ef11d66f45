"""deepseek4 (src/models/deepseek4.cpp): hyper-connections (4 streams), single-KV-head attention with a
low-rank grouped output, compressed attention (ratio 4 with an indexer, 128 without) on some layers,
hash-routed first layers (ffn_gate_tid2eid: a token's experts, no bias), the others sqrt-softplus
routing with a selection bias; shared experts everywhere."""

from __future__ import annotations

from dataclasses import replace

from gguf import GGUFWriter

from bmoe.tools.synth_parts import SQRT_SOFTPLUS, Arch, Table, ffn, heads, nextn, register, routing
from bmoe.tools.synth_shape import Dsv4, Indexer, Shape


def _table(s: Shape, tb: Table) -> None:
    e, d, ix, hc = s.embd, s.dsv4, s.indexer, s.hyper
    assert d is not None and ix is not None
    hd, mix = s.head_dim, (2 + hc) * hc
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    tb.add("output_norm.weight", (e,), fill="ones")
    tb.add("output.weight", (s.n_vocab, e), "output", fill="output", std=3.0 * e**-0.5)
    tb.add("output_hc_fn.weight", (hc, hc * e), "matrix", std=(hc * e) ** -0.5)
    tb.add("output_hc_base.weight", (hc,), std=0.1)
    tb.add("output_hc_scale.weight", (1,), fill="ones")
    for i in range(s.all_layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        t("attn_sinks.weight", (s.n_head,), std=1.0)
        t("attn_q_a.weight", (d.q_lora, e), "matrix", std=e**-0.5)
        t("attn_q_a_norm.weight", (d.q_lora,), fill="ones")
        t("attn_q_b.weight", (s.n_head * hd, d.q_lora), "matrix", std=d.q_lora**-0.5)
        t("attn_kv.weight", (hd, e), "matrix", std=e**-0.5)
        t("attn_kv_a_norm.weight", (hd,), fill="ones")
        group_in = s.n_head * hd // d.o_groups
        t("attn_output_a.weight", (d.o_groups * d.o_lora, group_in), "matrix", std=group_in**-0.5)
        t("attn_output_b.weight", (e, d.o_groups * d.o_lora), "matrix", std=(d.o_groups * d.o_lora) ** -0.5)
        for part in ("attn", "ffn"):
            t(f"hc_{part}_fn.weight", (mix, hc * e), "matrix", std=(hc * e) ** -0.5)
            t(f"hc_{part}_base.weight", (mix,), std=0.1)
            t(f"hc_{part}_scale.weight", (3,), fill="ones")
        ratio = ix.ratios[i]
        if ratio:
            coff = 2 if ratio == 4 else 1
            t("attn_compressor_kv.weight", (coff * hd, e), "matrix", std=e**-0.5)
            t("attn_compressor_gate.weight", (coff * hd, e), "matrix", std=e**-0.5)
            t("attn_compressor_ape.weight", (ratio, coff * hd), std=0.02)
            t("attn_compressor_norm.weight", (hd,), fill="ones")
        if ratio == 4:
            t("indexer.proj.weight", (ix.heads, e), "matrix", std=e**-0.5)
            t("indexer.attn_q_b.weight", (ix.heads * ix.head_dim, d.q_lora), "matrix", std=d.q_lora**-0.5)
            t("indexer_compressor_kv.weight", (2 * ix.head_dim, e), "matrix", std=e**-0.5)
            t("indexer_compressor_gate.weight", (2 * ix.head_dim, e), "matrix", std=e**-0.5)
            t("indexer_compressor_ape.weight", (ratio, 2 * ix.head_dim), std=0.02)
            t("indexer_compressor_norm.weight", (ix.head_dim,), fill="ones")
        t("ffn_gate_inp.weight", (s.experts, e), "router", std=2.0 * e**-0.5)
        if i < d.hash_layers:
            t("ffn_gate_tid2eid.weight", (s.n_vocab, s.top_k), "i32", fill="expert_ids")
        else:
            t("exp_probs_b.bias", (s.experts,), std=0.1)
        t("ffn_norm.weight", (e,), fill="ones")
        t("ffn_gate_exps.weight", (s.experts, s.ff, e), "exps_gate", std=e**-0.5)
        t("ffn_down_exps.weight", (s.experts, e, s.ff), "exps_down", std=s.ff**-0.5)
        t("ffn_up_exps.weight", (s.experts, s.ff, e), "exps_up", std=e**-0.5)
        ffn(t, e, s.shared_ff, "_shexp")
        if i >= s.layers:
            nextn(t, s)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    d, ix = s.dsv4, s.indexer
    assert d is not None and ix is not None
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_shared_count", s.shared_ff // s.ff)
    routing(w, a, SQRT_SOFTPLUS, scale=1.5)
    w.add_float32(f"{a}.swiglu_clamp_exp", 10.0)
    heads(w, s, a, kv=1)
    w.add_uint32(f"{a}.attention.q_lora_rank", d.q_lora)
    w.add_uint32(f"{a}.attention.sliding_window", d.window)
    w.add_uint32(f"{a}.attention.output_group_count", d.o_groups)
    w.add_uint32(f"{a}.attention.output_lora_rank", d.o_lora)
    w.add_float32(f"{a}.attention.compress_rope_freq_base", 160000.0)
    w.add_array(f"{a}.attention.compress_ratios", list(ix.ratios))
    w.add_uint32(f"{a}.attention.indexer.head_count", ix.heads)
    w.add_uint32(f"{a}.attention.indexer.key_length", ix.head_dim)
    w.add_uint32(f"{a}.attention.indexer.top_k", ix.top_k)
    w.add_uint32(f"{a}.hyper_connection.count", s.hyper)
    w.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", 20)
    w.add_float32(f"{a}.hyper_connection.epsilon", 1e-6)
    w.add_uint32(f"{a}.hash_layer_count", d.hash_layers)


def _small(s: Shape) -> Shape:
    """Heads of 64 (llama.cpp's own test model's), one hash layer, compressed attention on every 3rd and
    4th layer."""
    ratios = tuple((0, 0, 4, 128)[i % 4] for i in range(s.all_layers))
    return replace(s, shared_ff=s.ff, hyper=4, head_dim=64, n_head=s.embd // 64, n_head_kv=1, rope_dims=32,
                   dsv4=Dsv4(q_lora=s.embd // 4, o_groups=2, o_lora=s.embd // 8, window=128, hash_layers=1),
                   indexer=Indexer(heads=8, head_dim=64, top_k=2048, ratios=ratios))


def _check(s: Shape) -> None:
    if s.experts < 2 * s.top_k:
        raise ValueError("deepseek4's hash layers need at least 2 x top_k experts")


register(Arch("deepseek4", 9, _table, _keys, _small, mtp=True, check=_check))
