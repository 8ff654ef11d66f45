"""lfm2moe (src/models/lfm2moe.cpp): short-convolution layers and every full_every-th attention,
leading dense layers, sigmoid routing with a selection bias; the output is tied, its norm is named
token_embd_norm."""

from __future__ import annotations

from dataclasses import replace

from gguf import GGUFWriter

from bmoe.tools.synth_parts import SIGMOID, Arch, Table, ffn, head, heads, qkvo, register, routing
from bmoe.tools.synth_shape import Recurrent, Shape


def _table(s: Shape, tb: Table) -> None:
    e, r = s.embd, s.recurrent
    assert r is not None
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.layers):
        t = tb.block(i)
        t("ffn_norm.weight", (e,), fill="ones")
        if s.is_moe(i):
            t("ffn_gate_inp.weight", (s.experts, e), "router", std=2.0 * e**-0.5)
            t("ffn_gate_exps.weight", (s.experts, s.ff, e), "exps_gate", std=e**-0.5)
            t("ffn_down_exps.weight", (s.experts, e, s.ff), "exps_down", std=s.ff**-0.5)
            t("ffn_up_exps.weight", (s.experts, s.ff, e), "exps_up", std=e**-0.5)
            t("exp_probs_b.bias", (s.experts,), std=0.1)
        else:
            ffn(t, e, s.dense_ff)
        t("attn_norm.weight", (e,), fill="ones")
        if s.is_full(i):
            t("attn_q_norm.weight", (s.head_dim,), fill="ones")
            t("attn_k_norm.weight", (s.head_dim,), fill="ones")
            qkvo(t, s, q_dim=e)
        else:
            t("shortconv.conv.weight", (e, r.conv), std=0.5)
            t("shortconv.in_proj.weight", (3 * e, e), "matrix", std=e**-0.5)
            t("shortconv.out_proj.weight", (e, e), "matrix", std=e**-0.5)
    head(s, tb, norm="token_embd_norm.weight")


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    r = s.recurrent
    assert r is not None
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.leading_dense_block_count", s.dense_lead)
    routing(w, a, SIGMOID)
    w.add_uint32(f"{a}.shortconv.l_cache", r.conv)
    heads(w, s, a, kv=[s.n_head_kv if s.is_full(i) else 0 for i in range(s.layers)])


def _small(s: Shape) -> Shape:
    return replace(s, dense_lead=1, dense_ff=2 * s.ff, full_every=2, recurrent=Recurrent(conv=3))


register(Arch("lfm2moe", 14, _table, _keys, _small))
