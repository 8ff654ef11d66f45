"""deepseek2 (src/models/deepseek2.cpp, DeepSeek-V3's layout): MLA, leading dense layers, experts
with a selection bias, DeepSeek-V3's group-limited routing (the experts of the best groups only) and
shared experts."""

from __future__ import annotations

from gguf import GGUFWriter

from bmoe.tools.synth_parts import Arch, Table, ffn_or_experts, head, mla, mla_moe_keys, mla_moe_small, nextn, register
from bmoe.tools.synth_shape import Shape


def _table(s: Shape, tb: Table) -> None:
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.all_layers):
        t = tb.block(i)
        t("attn_norm.weight", (e,), fill="ones")
        mla(t, s)
        t("ffn_norm.weight", (e,), fill="ones")
        ffn_or_experts(t, s, i, probs_bias=True, shared="plain")
        if i >= s.layers:
            nextn(t, s)
    head(s, tb)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    mla_moe_keys(w, s, a, groups=4, groups_used=2)


register(Arch("deepseek2", 10, _table, _keys, mla_moe_small, fused=True, mtp=True))
