"""gpt-oss (src/models/openai-moe.cpp): attention with biases and sinks, every other layer
sliding-window; routed experts with biases, softmax over the chosen logits."""

from __future__ import annotations

from gguf import GGUFWriter

from bmoe.tools.synth_parts import Arch, Table, experts, head, heads, qkvo, register
from bmoe.tools.synth_shape import Shape


def _table(s: Shape, tb: Table) -> None:
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        qkvo(t, s, biased=True)
        t("attn_output.bias", (e,), std=0.02)
        t("attn_sinks.weight", (s.n_head,), std=1.0)
        t("post_attention_norm.weight", (e,), fill="ones")
        experts(t, s)
        t("ffn_gate_inp.bias", (s.experts,), std=0.1)
        t("ffn_gate_exps.bias", (s.experts, s.ff), std=0.02)
        t("ffn_up_exps.bias", (s.experts, s.ff), std=0.02)
        t("ffn_down_exps.bias", (s.experts, e), std=0.02)
    head(s, tb)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.attention.sliding_window", s.sliding_window)
    heads(w, s, a)


register(Arch("gpt-oss", 4, _table, _keys, kept_bytes=True))
