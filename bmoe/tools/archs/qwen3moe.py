"""qwen3moe (src/models/qwen3moe.cpp): attention with per-head q/k norms, routed experts."""

from __future__ import annotations

from collections.abc import Callable

from gguf import GGUFWriter

from bmoe.tools.synth_parts import Arch, Table, experts, head, heads, qkvo, register
from bmoe.tools.synth_shape import Shape


def qwen3moe_block(t: Callable[..., None], s: Shape) -> None:
    """One layer's tensors (grovemoe's layers have them too)."""
    t("attn_norm.weight", (s.embd,), fill="ones")
    qkvo(t, s)
    t("attn_q_norm.weight", (s.head_dim,), fill="ones")
    t("attn_k_norm.weight", (s.head_dim,), fill="ones")
    t("ffn_norm.weight", (s.embd,), fill="ones")
    experts(t, s)


def _table(s: Shape, tb: Table) -> None:
    tb.add("token_embd.weight", (s.n_vocab, s.embd), "token_embd", std=1.0)
    for i in range(s.layers):
        qwen3moe_block(tb.block(i), s)
    head(s, tb)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    heads(w, s, a)


register(Arch("qwen3moe", 0, _table, _keys, kept_bytes=True))
