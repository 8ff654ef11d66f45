"""qwen3next (src/models/qwen3next.cpp): qwen35moe's layers with the DeltaNet's beta and alpha fused
into one matrix and plain RoPE."""

from __future__ import annotations

from bmoe.tools.synth_parts import Arch, Table, gdn_hybrid, gdn_hybrid_keys, gdn_hybrid_small, register
from bmoe.tools.synth_shape import Shape


def _table(s: Shape, tb: Table) -> None:
    gdn_hybrid(s, tb, fused_ba=True)


register(Arch("qwen3next", 12, _table, gdn_hybrid_keys, gdn_hybrid_small, fused=True, mtp=True))
