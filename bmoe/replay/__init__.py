"""Recorded routes replayed offline: statistics of a trace (`stats`), every cache policy and
Belady's optimum over it (`policies`, `bounds`). `bmoe-bench routes` and `policies` print these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bmoe.base.surface import lazy

if TYPE_CHECKING:
    from bmoe.replay.policies import simulate, table
    from bmoe.replay.stats import Budget, report

__getattr__, __all__ = lazy(
    __name__,
    {
        "bmoe.replay.stats": ["Budget", "report"],
        "bmoe.replay.policies": ["simulate", "table"],
    },
)
