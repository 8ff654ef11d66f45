"""Expert streaming: what runs at the graph's stops (`graph_stops`: demand reads, the remap), the
slab, cache, lanes and budget of a model (`streamer`), the orders in flight (`orders`), reads ahead
(`readahead`), the I/O lanes (`lanes`, `lane_stats`), the expert cache and its policies
(`expert_cache`, `cache_policy`), the spec-gate's coordinator side (`speculation`), lossy routing, the warm
start (`warm_fill`, `usage_profile`) and route traces. The slab's OS objects are bmoe.shm_cache and
the worker processes bmoe.workers, beside this package (their paths are fixed by the design).
"""

from bmoe.streaming.route_trace import Trace
