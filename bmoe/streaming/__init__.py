"""Expert streaming: demand reads (`streamer`), the orders in flight (`orders`), reads ahead
(`readahead`), the I/O lanes (`lanes`, `lane_stats`), the expert cache and its policies
(`expert_cache`, `cache_policy`), the spec-gate (`speculation`, `routers`), lossy routing, the warm
start (`warm_fill`, `usage_profile`) and route traces. The slab's OS objects are bmoe.shm_cache and
the worker processes bmoe.workers, beside this package (their paths are fixed by the design).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bmoe.base.surface import lazy

if TYPE_CHECKING:
    from bmoe.streaming.cache_policy import POLICIES
    from bmoe.streaming.route_trace import Trace, TraceWriter
    from bmoe.streaming.streamer import Streamer

__getattr__, __all__ = lazy(
    __name__,
    {
        "bmoe.streaming.streamer": ["Streamer"],
        "bmoe.streaming.cache_policy": ["POLICIES"],
        "bmoe.streaming.route_trace": ["Trace", "TraceWriter"],
    },
)
