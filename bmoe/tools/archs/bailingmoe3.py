"""bailingmoe3 (src/models/bailingmoe3.cpp): Kimi delta attention layers and every full_every-th a
gated MLA, leading dense layers, sigmoid routing with a selection bias and shared experts."""

from __future__ import annotations

from dataclasses import replace

from gguf import GGUFWriter

from bmoe.tools.synth_parts import SIGMOID, Arch, Table, ffn_or_experts, head, mla, mla_keys, nextn, register, routing
from bmoe.tools.synth_shape import Mla, Recurrent, Shape


def _table(s: Shape, tb: Table) -> None:
    e, r = s.embd, s.recurrent
    assert r is not None
    d_inner = r.head_dim * s.n_head
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.all_layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        if s.is_full(i) or i >= s.layers:
            mla(t, s)
            t("attn_gate.weight", (s.n_head, e), "matrix", std=e**-0.5)
        else:
            for part in ("q", "k", "v"):
                t(f"ssm_conv1d_{part}.weight", (1, d_inner, 1, r.conv), std=0.5)
            t("attn_q.weight", (d_inner, e), "attn_q", std=e**-0.5)
            t("attn_k.weight", (d_inner, e), "attn_k", std=e**-0.5)
            t("attn_v.weight", (d_inner, e), "attn_v", std=e**-0.5)
            t("ssm_f_a.weight", (d_inner, e), "matrix", std=e**-0.5)
            t("ssm_beta.weight", (s.n_head, e), "matrix", std=e**-0.5)
            t("ssm_a", (s.n_head, 1), std=0.5)
            t("ssm_dt.bias", (d_inner,), std=0.5)
            t("ssm_g_a.weight", (d_inner, e), "matrix", std=e**-0.5)
            t("ssm_norm.weight", (r.head_dim,), fill="ones")
            t("attn_output.weight", (e, d_inner), "attn_output", std=d_inner**-0.5)
        t("ffn_norm.weight", (e,), fill="ones")
        ffn_or_experts(t, s, i, probs_bias=True, shared="plain")
        if i >= s.layers:
            nextn(t, s)
            t("layer_output_norm.weight", (e,), fill="ones")
    head(s, tb)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    r, m = s.recurrent, s.mla
    assert r is not None and m is not None
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_shared_count", s.shared_ff // s.ff)
    w.add_uint32(f"{a}.leading_dense_block_count", s.dense_lead)
    routing(w, a, SIGMOID, scale=2.5)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_array(f"{a}.attention.head_count_kv",
                [1 if s.is_full(i) or i >= s.layers else 0 for i in range(s.all_layers)])
    w.add_uint32(f"{a}.attention.key_length", m.kv_lora + m.qk_rope)
    w.add_uint32(f"{a}.attention.value_length", m.kv_lora)
    mla_keys(w, s, a)
    w.add_uint32(f"{a}.ssm.conv_kernel", r.conv)
    w.add_uint32(f"{a}.kda.head_dim", r.head_dim)
    w.add_bool(f"{a}.kda.safe_gate", True)
    w.add_float32(f"{a}.kda.gate_lower_bound", -5.0)


def _small(s: Shape) -> Shape:
    hd = s.head_dim
    return replace(s, shared_ff=s.ff, dense_lead=1, dense_ff=2 * s.ff, full_every=2, n_head_kv=1, rope_dims=hd // 2,
                   recurrent=Recurrent(conv=4, head_dim=hd),
                   mla=Mla(q_lora=0, kv_lora=s.embd // 2, qk_nope=hd, qk_rope=hd // 2, v_head=hd))


register(Arch("bailingmoe3", 16, _table, _keys, _small, mtp=True))
