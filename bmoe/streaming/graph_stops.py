"""What runs inside ggml's eval callback while streaming: the graph's stops and the demand reads.

At each MoE layer's routing (`ffn_moe_weights-L`, the router's weights gathered with the routed
ids) a replayed trace or lossy routing may rewrite the routing first; then the layer's routed
experts are looked up in the cache, which pins them and makes room, the missing slices go to the
lanes at once (gate, up, down, largest read first onto the least-loaded lane) and the ids are
rewritten to slot indices. Serial (`overlap` off): the stop returns once every read landed. Overlap:
once the gate slices landed (and the up slices, where the graph has no separate gate matmul first);
the up slices are awaited after the gate matmul and the down slices at the down matmul's input
node, so those reads run while the matmuls before them compute. At each layer's router input the spec-gate and
the route trace get their rows. A layer resident for good runs through without a stop.

`StreamingStops` is the eval hook's one listener (a bmoe.seam.StopListener); bmoe.engine.load builds
it once the Streamer (bmoe.streaming.streamer: the cache, lanes, waits, binding and counters), the
spec-gate and the trace exist.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from bmoe import seam
from bmoe.streaming.expert_cache import SMALL, WARM_PROMPT_ROWS, highest
from bmoe.streaming.lossy import DROPPED, Lossy
from bmoe.streaming.orders import Key
from bmoe.streaming.route_replay import RouteReplay
from bmoe.streaming.route_trace import TraceWriter
from bmoe.streaming.streamer import WATCH_STEP, Streamer


class BatchRows:
    """Which tokens of a llama_decode a layer's routed rows are. llama.cpp splits one sequence's
    decode into ubatches in order and routes every row of a ubatch at the first MoE layer; a layer
    with fewer rows (the last, which computes only the rows whose logits are asked for: one
    sequence's last token) has the ubatch's last ones."""

    def __init__(self, first_layer: int) -> None:
        self.first = first_layer
        self.start = 0  # the ubatch's first token, within the decode
        self.n = 0  # the ubatch's tokens

    def begin(self) -> None:
        self.start, self.n = 0, 0

    def at(self, layer: int, n: int) -> np.ndarray:
        if layer == self.first:
            self.start += self.n
            self.n = n
        return self.start + np.arange(n) + max(self.n - n, 0)


class StreamingStops:
    """The streaming run's answers at the graph's stops."""

    def __init__(self, streamer: Streamer, wait_nodes: dict[bytes, int], trace: TraceWriter | None,
                 lossy: Lossy | None = None, replay: RouteReplay | None = None,
                 norms: dict[int, str] | None = None) -> None:
        """`norms`: each layer's normalisation of its top-k weights (bmoe.seam.Capture.norms), for the
        shares the trace records."""
        self.st = streamer
        self.trace = trace
        self.lossy = lossy
        self.replay = replay
        self.norms = norms or {}
        self.rewrites = lossy is not None or replay is not None  # ids may hold DROPPED
        self.tells_rows = self.rewrites or trace is not None  # `reroute` has something to do (BatchRows' rows)
        self.rows = BatchRows(streamer.layers[0])
        # node name -> wait key (bmoe.seam.Capture.wait_nodes); empty without --overlap: every read is
        # awaited at the routing node
        self.wait_nodes = wait_nodes
        self.up_split = {key // 2 for key in wait_nodes.values() if key % 2 == 0}  # up slices awaited after gate
        self.router_input = streamer.gate_running or trace is not None
        self.waits: dict[int, list[int]] = {}  # wait key -> orders awaited at its node (overlap)
        self._at = np.zeros(0, dtype=np.int64)  # the tokens of the rows at the routing node under way
        self.prompting = False  # the decode under way reads a prompt (some sequence sends several tokens)
        self.blind: frozenset[int] = frozenset()  # layers of the decode under way whose experts no row needs
        # bmoe.engine.drafts.DraftReads' hook: each layer's routed ids and the slices it reads now
        self.on_plan: Callable[[int, np.ndarray, list[Key]], None] | None = None

    def begin_batch(self, n_tokens: int, prompt: bool = False, blind: frozenset[int] = frozenset()) -> None:
        """A llama_decode of `n_tokens` tokens starts (not the warm-up capture's); `prompt`: some
        sequence sends several tokens, so the experts only its earlier tokens route enter the cache cold;
        `blind`: layers whose expert outputs nothing reads in this decode (an MTP block's, decoded for its KV
        alone: bmoe.engine.mtp), which read none of their experts and compute on the spare slot's zeros."""
        self.rows.begin()
        self.prompting = prompt
        self.blind = blind
        self.waits.clear()  # (settled since: none is live)
        if self.replay is not None:
            self.replay.begin(n_tokens)
        if self.trace is not None:
            self.trace.begin_batch(n_tokens)

    def skip_route(self, layer: int) -> bool:
        """A layer whose experts are all resident for good runs through (a trace sees every layer),
        unless lossy routing changes every layer's routing in this decode or a replay every routing."""
        if self.replay is not None or (self.lossy is not None and self.lossy.cuts and self.lossy.active):
            self.st.unbind(layer)
            return False
        return self.trace is None and self.st.run_through(layer)

    def reroute(self, layer: int, ids: np.ndarray, node: int) -> None:
        """A replayed trace (bmoe.streaming.route_replay) sets the ids and weights, or lossy routing
        (bmoe.streaming.lossy) changes them, before anything reads them; the trace records the weights."""
        if not self.tells_rows or layer in self.blind:
            return
        self._at = self.rows.at(layer, ids.shape[0])
        if self.replay is not None:
            self.replay.reroute(layer, ids, node, self._at)
        if self.lossy is not None:
            self.lossy.reroute(layer, ids, node)
        if self.trace is not None and ids.shape[0]:
            self.trace.on_weights(layer, shares(seam.moe_weights(node), self.norms.get(layer, seam.NORM_NONE)),
                                  self._at)

    def fast_layers(self) -> list[seam.FastTables]:
        return self.st.fast_layers()

    def answers_in_c(self) -> bool:
        """Whether the compiled filter may answer the next routing whose experts are all resident
        (bmoe.seam.eval_filter), as `on_route` and `slot_ids` would: such a stop only keeps the cache's books,
        which `replay_hit` keeps afterwards, in order, before Python decides anything else. Not while a read is
        in flight (the tables would change under C), nor where a stop does more: a prompt's (cold admission,
        whole-layer reads), a blind layer's, reads ahead, a trace, a replay or lossy routing, the router input,
        drafts' reads, a budget holding everything (layers run through, some bound direct)."""
        st = self.st
        return not (self.prompting or self.blind or self.tells_rows or self.router_input or self.on_plan is not None
                    or st.orders.inflight or st.ahead.reads_ahead or st.direct or st.cache.holds_everything)

    def replay_hit(self, layer: int, ids: np.ndarray, slots: np.ndarray) -> None:
        """A routing the compiled filter answered (`slots` what it wrote over `ids`): the stop's bookkeeping now,
        as `on_route` would have kept it then, and its slots checked against the cache's own."""
        misses = self.st.cache.stats.misses
        self.on_route(layer, ids)
        if self.st.cache.stats.misses != misses:
            raise RuntimeError(f"layer {layer}: the compiled filter answered a routing to experts {ids.tolist()} "
                               "that the cache does not hold")
        if not np.array_equal(self.slot_ids(layer, ids), slots):
            raise RuntimeError(f"layer {layer}: the compiled filter read slots {slots.tolist()} for experts "
                               f"{ids.tolist()}, the cache holds them at {self.st.cache.slot_ids(layer, ids).tolist()}")

    def on_route(self, layer: int, ids: np.ndarray) -> None:
        if layer in self.blind:
            return
        if self.trace is not None:  # before DROPPED is read as the row's best expert: the trace leaves it out
            self.trace.on_route(layer, ids, self.st.ahead.predictions.get(layer), self._at)
        if self.rewrites:
            ids = _read(ids)
        self._demand(layer, ids)

    def _demand(self, layer: int, ids: np.ndarray) -> None:
        """The layer's routed experts: hits counted and pinned, room made, the missing slices sent to
        the lanes at once; then wait for what the next matmul reads (all of it serially; under overlap
        the gate slices, the up ones after the gate matmul, the down ones at the down input)."""
        st = self.st
        t0 = time.perf_counter_ns()
        st.tick()
        # a token's few ids as a Python set; a prompt's many through numpy
        wanted = sorted(set(ids.ravel().tolist())) if ids.size <= SMALL else np.unique(ids).tolist()
        if wanted and (wanted[0] < 0 or wanted[-1] >= st.n_expert):
            raise RuntimeError(f"layer {layer} routed to expert ids {wanted} outside 0..{st.n_expert - 1}")
        if st.cache.used - st.watched_at >= WATCH_STEP:
            st.follow()  # a prefill fills the cache within one token: look before it takes more
        st.ahead.on_route(layer, ids, wanted)
        cold: set[int] = set()
        if self.prompting and len(ids) > WARM_PROMPT_ROWS:
            cold = set(wanted).difference(ids[-WARM_PROMPT_ROWS:].ravel().tolist())
        missing = st.cache.plan(layer, wanted, cold)
        if self.on_plan is not None:
            self.on_plan(layer, ids, missing)
        busy = bool(st.orders.order_of)  # reads under way before this layer's (speculative, or a cancel's)
        st.lanes.hold()
        try:
            now, at_gate, later = self._send(layer, wanted, missing, busy)
            st.ahead.after_demand(layer, len(ids), wanted)
        finally:
            t1 = time.perf_counter_ns()
            wrote = st.lanes.flush()  # the reads start: the lanes woken may take this CPU first
            handed = time.perf_counter_ns() - t1 if wrote else 0
        st.lane_stats.sample_depth(len(st.orders.inflight))
        c = st.counters
        c.mgmt_ns += t1 - t0
        if st.overlap:
            self.waits[2 * layer] = at_gate
            self.waits[2 * layer + 1] = later
            c.stall_ns += handed + st.wait(now)
        else:
            c.io_ns += handed + st.wait(now + at_gate + later)
        if st.cache.pending_release:  # nothing to wait for: do it now
            t2 = time.perf_counter_ns()
            st.cache.release_evicted()
            c.mgmt_ns += time.perf_counter_ns() - t2

    def _send(self, layer: int, wanted: list[int], missing: list[Key],
              busy: bool) -> tuple[list[int], list[int], list[int]]:
        """Send the layer's missing reads in the order the matmuls read them; returns the orders to
        await now (the gate slices, and all the others unless under overlap), after the gate matmul
        (the up slices, where the graph computes gate first) and at the down input (the down slices).
        `busy`: reads were under way before these, and may hold some of the layer's slices."""
        if not missing and not busy:
            return [], [], []
        st = self.st
        split_down = st.overlap and any(ri in st.down_kind for ri in st.cache.by_layer[layer])
        split_up = layer in self.up_split

        def stage(ri: int) -> int:
            return 2 if split_down and ri in st.down_kind else 1 if split_up and ri in st.up_kind else 0

        groups: list[list[Key]] = [[], [], []]
        for k in missing:
            groups[stage(k[1])].append(k)
        staged = st.orders.staged(groups)
        if busy:
            for key in st.cache.layer_slices(layer, wanted):
                oid = st.orders.order_of.get(key)  # a read already under way (speculative) covers this slice
                target = staged[stage(key[1])]
                if oid is not None and oid not in target:
                    target.append(oid)
        return staged[0], staged[1], staged[2]

    def slot_ids(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """What the layer's expert matmuls read instead of the routed ids: each expert's slot index (a
        position lossy routing dropped reads the pool's spare slot, all zeros)."""
        st = self.st
        if layer in st.direct:  # bound to read its experts by their own ids (a caller stopped where the hook would not)
            return ids
        t0 = time.perf_counter_ns()
        if layer in self.blind:
            slots = np.full_like(ids, st.cache.spare_slot(layer))
        else:
            slots = st.cache.slot_ids(layer, _read(ids) if self.rewrites else ids)
        if self.rewrites:
            slots[ids == DROPPED] = st.cache.spare_slot(layer)
        if slots.size:
            st.narrow(layer, highest(slots) + 1)
        st.counters.mgmt_ns += time.perf_counter_ns() - t0
        return slots

    def on_router_input(self, layer: int, node: int) -> None:
        """Hand a layer's router input to the trace and the spec-gate; no more stops there once
        neither wants it (the recall governor switched the gate off)."""
        if self.trace is not None:
            self.trace.on_router_input(layer, seam.router_input(node))
        st = self.st
        if st.gate_running:
            st.ahead.on_router_input(layer, node)
            t0 = time.perf_counter_ns()
            st.tick()  # collect what finished (cache management time)
            st.counters.mgmt_ns += time.perf_counter_ns() - t0
        elif self.trace is None:
            self.router_input = False

    def wait_pending(self, key: int) -> bool:
        """Whether the slices awaited at this node are still being read (the graph must stop there then)."""
        orders = self.waits.get(key)
        if orders and any(self.st.live(o) for o in orders):
            return True
        self.waits.pop(key, None)
        return False

    def on_wait(self, key: int) -> None:
        self.st.counters.stall_ns += self.st.wait(self.waits.pop(key, []))


def shares(w: np.ndarray, norm: str) -> np.ndarray:
    """Each routed expert's share of its token's top-k weight, from the weights node ([n_tokens, top_k]),
    as the layer normalises them: a softmax for NORM_SOFTMAX (the node holds logits), else w / sum
    (bmoe.streaming.lossy computes its `full` so)."""
    v = np.exp(w - w.max(axis=1, keepdims=True)) if norm == seam.NORM_SOFTMAX else w.astype(np.float64)
    return v / np.maximum(v.sum(axis=1, keepdims=True), 1e-30)


def _read(ids: np.ndarray) -> np.ndarray:
    """The routed ids as experts to read: a dropped position as its row's best expert, which the row
    reads anyway (its slot is the spare's: StreamingStops.slot_ids)."""
    dropped = ids == DROPPED
    return np.where(dropped, ids[:, :1], ids) if dropped.any() else ids
