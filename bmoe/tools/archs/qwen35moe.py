"""qwen35moe (src/models/qwen35moe.cpp): Gated DeltaNet layers and every full_every-th a gated full
attention with interleaved M-RoPE, routed experts and a gated shared expert in every layer."""

from __future__ import annotations

from gguf import GGUFWriter

from bmoe.tools.synth_parts import Arch, Table, gdn_hybrid, gdn_hybrid_keys, gdn_hybrid_small, register, rope_sections
from bmoe.tools.synth_shape import Shape


def _table(s: Shape, tb: Table) -> None:
    gdn_hybrid(s, tb, fused_ba=False)


def _keys(w: GGUFWriter, s: Shape, a: str) -> None:
    gdn_hybrid_keys(w, s, a)
    w.add_array(f"{a}.rope.dimension_sections", rope_sections(s.rope_dims))


register(Arch("qwen35moe", 6, _table, _keys, gdn_hybrid_small, fused=True, mtp=True))
