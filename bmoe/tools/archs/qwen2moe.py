"""qwen2moe (src/models/qwen2moe.cpp): attention with q/k/v biases, routed experts and a shared expert
of their width behind its own sigmoid gate."""

from __future__ import annotations

from gguf import GGUFWriter

from bmoe.tools.synth_parts import Arch, Table, experts, ffn, head, heads, qkvo, register
from bmoe.tools.synth_shape import Shape


def _table(s: Shape, tb: Table) -> None:
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        qkvo(t, s, biased=True)
        t("ffn_norm.weight", (e,), fill="ones")
        experts(t, s)
        t("ffn_gate_inp_shexp.weight", (e,), std=e**-0.5)
        ffn(t, e, s.ff, "_shexp")
    head(s, tb)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", s.ff)
    heads(w, s, a)


register(Arch("qwen2moe", 1, _table, _keys, kept_bytes=True, shared_down=True))
