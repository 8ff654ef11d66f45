"""grovemoe (src/models/grovemoe.cpp): qwen3moe's layers with chunk experts, one per GROVE_GROUP routed
experts. llama.cpp routes them by the expert ids divided by the group size, which the slot remap
cannot serve: bmoe refuses to stream it, and the model is written so that the refusal is tested on
a real graph."""

from __future__ import annotations

from gguf import GGUFWriter

from bmoe.tools.archs.qwen3moe import qwen3moe_block
from bmoe.tools.synth_parts import Arch, Table, head, heads, register
from bmoe.tools.synth_shape import Shape

GROVE_GROUP, GROVE_CHUNK_FF = 2, 64  # routed experts per chunk expert; a chunk expert's width


def _table(s: Shape, tb: Table) -> None:
    e = s.embd
    tb.add("token_embd.weight", (s.n_vocab, e), "token_embd", std=1.0)
    for i in range(s.layers):
        t = tb.block(i)
        qwen3moe_block(t, s)
        ch = s.experts // GROVE_GROUP
        t("ffn_gate_chexps.weight", (ch, GROVE_CHUNK_FF, e), "exps_gate", std=e**-0.5)
        t("ffn_up_chexps.weight", (ch, GROVE_CHUNK_FF, e), "exps_up", std=e**-0.5)
        t("ffn_down_chexps.weight", (ch, e, GROVE_CHUNK_FF), "exps_down", std=GROVE_CHUNK_FF**-0.5)
    head(s, tb)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    w.add_uint32(f"{a}.expert_feed_forward_length", s.ff)
    w.add_uint32(f"{a}.expert_chunk_feed_forward_length", GROVE_CHUNK_FF)
    w.add_float32(f"{a}.expert_group_scale", 0.5)
    w.add_uint32(f"{a}.experts_per_group", GROVE_GROUP)
    heads(w, s, a)


def _check(s: Shape) -> None:
    if s.experts % GROVE_GROUP:
        raise ValueError(f"grovemoe's experts come in groups of {GROVE_GROUP}: give an even --experts")


register(Arch("grovemoe", 18, _table, _keys, streamed=False, kept_bytes=True, check=_check))
