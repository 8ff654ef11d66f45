"""The memory a run may use: the limits that apply to the process and the room each leaves
(`probe`), the cache budget they allow (`budget`), and the dense weights kept mapped (`dense`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bmoe.base.surface import lazy

if TYPE_CHECKING:
    from bmoe.memory.budget import Adaptive, decide
    from bmoe.memory.probe import MemoryProbe

__getattr__, __all__ = lazy(
    __name__,
    {
        "bmoe.memory.budget": ["Adaptive", "decide"],
        "bmoe.memory.probe": ["MemoryProbe"],
    },
)
