"""gemma4 (src/models/gemma4.cpp): sliding-window attention and every full_every-th layer full
attention with wider heads (proportional RoPE), a dense FFN beside the experts in every layer, a
scaled router input and a per-expert scale of the down projection."""

from __future__ import annotations

from dataclasses import replace

from gguf import GGUFWriter

from bmoe.tools.synth_parts import Arch, Table, experts, ffn, head, register
from bmoe.tools.synth_shape import Shape


def _table(s: Shape, tb: Table) -> None:
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    tb.add("rope_freqs.weight", (s.full_head_dim // 2,), fill="ones")  # one table for the full-attention layers
    for i in range(s.layers):
        t = tb.block(i)
        hd = s.full_head_dim if s.is_full(i) else s.head_dim
        q_dim = s.n_head * hd
        kv_dim = (s.full_kv_heads if s.is_full(i) else s.n_head_kv) * hd
        t("attn_norm.weight", (e,), fill="ones")
        t("attn_q.weight", (q_dim, e), "attn_q", std=e**-0.5)
        t("attn_k.weight", (kv_dim, e), "attn_k", std=e**-0.5)
        t("attn_v.weight", (kv_dim, e), "attn_v", std=e**-0.5)
        t("attn_output.weight", (e, q_dim), "attn_output", std=q_dim**-0.5)
        t("attn_q_norm.weight", (hd,), fill="ones")
        t("attn_k_norm.weight", (hd,), fill="ones")
        t("ffn_norm.weight", (e,), fill="ones")
        t("post_attention_norm.weight", (e,), fill="ones")
        t("layer_output_scale.weight", (1,), fill="ones")
        ffn(t, e, s.dense_ff)
        t("post_ffw_norm.weight", (e,), fill="ones")
        t("ffn_gate_inp.scale", (e,), fill="positive", std=0.3)
        t("pre_ffw_norm_2.weight", (e,), fill="ones")
        t("post_ffw_norm_1.weight", (e,), fill="ones")
        t("post_ffw_norm_2.weight", (e,), fill="ones")
        experts(t, s)
        # the per-expert scale of the down projection (its generic .scale slot): each expert its own, so that
        # reading another expert's scale changes the output
        t("ffn_down_exps.scale", (s.experts,), fill="positive", std=0.3)
    head(s, tb)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.attention.sliding_window", s.sliding_window)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    full = [s.is_full(i) for i in range(s.layers)]  # per-layer head shapes: sliding layers, then every full_every-th
    w.add_array(f"{a}.attention.head_count_kv", [s.full_kv_heads if f else s.n_head_kv for f in full])
    w.add_array(f"{a}.attention.sliding_window_pattern", [not f for f in full])
    w.add_uint32(f"{a}.attention.key_length", s.full_head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.full_head_dim)
    w.add_uint32(f"{a}.attention.key_length_swa", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length_swa", s.head_dim)
    w.add_uint32(f"{a}.attention.shared_kv_layers", 0)
    w.add_uint32(f"{a}.embedding_length_per_layer_input", 0)
    w.add_uint32(f"{a}.rope.dimension_count_swa", s.head_dim)
    w.add_float32(f"{a}.rope.freq_base_swa", 10000.0)
    w.add_float32(f"{a}.final_logit_softcapping", 30.0)


def _small(s: Shape) -> Shape:
    return replace(s, dense_ff=s.ff, full_every=2, full_head_dim=2 * s.head_dim, full_kv_heads=1)


register(Arch("gemma4", 5, _table, _keys, _small, fused=True, kept_bytes=True))
