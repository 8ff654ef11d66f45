"""The engine: `Engine` (bmoe.coordinator: load, KV sequences, decode), the one generation loop
(`driver`), one request's life on a KV sequence (`generation`), the prompt cache, and what happens at
the graph's stops while streaming (`graph_stops`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bmoe.base.surface import lazy

if TYPE_CHECKING:
    from bmoe.coordinator import Engine, EngineStats
    from bmoe.engine.driver import Driver
    from bmoe.engine.generation import Chunk, Completion, Generation, GenerationStats, Request, Slot, StopText

__getattr__, __all__ = lazy(
    __name__,
    {
        "bmoe.coordinator": ["Engine", "EngineStats"],
        "bmoe.engine.driver": ["Driver"],
        "bmoe.engine.generation": [
            "Chunk",
            "Completion",
            "Generation",
            "GenerationStats",
            "Request",
            "Slot",
            "StopText",
        ],
    },
)
