"""llama4 (src/models/llama4.cpp): every moe_every-th layer MoE (sigmoid of the chosen logits, applied
to the input before the experts) with a shared expert, the others dense."""

from __future__ import annotations

from dataclasses import replace

from gguf import GGUFWriter

from bmoe.tools.synth_parts import Arch, Table, ffn_or_experts, head, heads, qkvo, register
from bmoe.tools.synth_shape import Shape


def _table(s: Shape, tb: Table) -> None:
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        qkvo(t, s)
        t("ffn_norm.weight", (e,), fill="ones")
        ffn_or_experts(t, s, i, shared="plain")
    head(s, tb)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.interleave_moe_layer_step", s.moe_every)
    heads(w, s, a)


def _small(s: Shape) -> Shape:
    return replace(s, shared_ff=s.ff, moe_every=2, dense_ff=2 * s.ff)


register(Arch("llama4", 13, _table, _keys, _small))
