"""What happens at each node where llama.cpp's graph stops for bmoe while streaming: the routing
(a replayed trace's or lossy routing's rewrite, the Streamer's demand reads and remap, and the route
trace), each layer's router input (the spec-gate's prediction and the trace) and the down matmul's
input (overlap's wait).

`StreamingStops` is the eval hook's one listener (a bmoe.seam.StopListener); the Engine builds it once the
Streamer, the spec-gate and the trace exist.
"""

from __future__ import annotations

import numpy as np

from bmoe import seam
from bmoe.streaming.lossy import DROPPED, Lossy
from bmoe.streaming.route_replay import RouteReplay
from bmoe.streaming.route_trace import TraceWriter
from bmoe.streaming.streamer import Streamer


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

    def __init__(self, streamer: Streamer, down_nodes: dict[bytes, int], trace: TraceWriter | None,
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
        self.rows = BatchRows(streamer.layers[0])
        self.down_nodes = down_nodes  # empty without --overlap: every read is awaited at the routing node
        self.router_input = streamer.gate_running or trace is not None
        self._at = np.zeros(0, dtype=np.int64)  # the tokens of the rows at the routing node under way

    def begin_batch(self, n_tokens: int) -> None:
        """A llama_decode of `n_tokens` tokens starts (not the warm-up capture's)."""
        self.rows.begin()
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
        return self.trace is None and self.st.skip(layer)

    def reroute(self, layer: int, ids: np.ndarray, node: int) -> None:
        """A replayed trace (bmoe.streaming.route_replay) sets the ids and weights, or lossy routing
        (bmoe.streaming.lossy) changes them, before anything reads them; the trace records the weights."""
        self._at = self.rows.at(layer, ids.shape[0])
        if self.replay is not None:
            self.replay.reroute(layer, ids, node, self._at)
        if self.lossy is not None:
            self.lossy.reroute(layer, ids, node)
        if self.trace is not None and ids.shape[0]:
            self.trace.on_weights(layer, shares(seam.moe_weights(node), self.norms.get(layer, seam.NORM_NONE)),
                                  self._at)

    def on_route(self, layer: int, ids: np.ndarray) -> None:
        if self.trace is not None:  # before DROPPED is read as the row's best expert: the trace leaves it out
            self.trace.on_route(layer, ids, self.st.predicted_for(layer), self._at)
        if self.rewrites:
            ids = _read(ids)
        self.st.on_route(layer, ids)

    def slot_ids(self, layer: int, ids: np.ndarray) -> np.ndarray:
        if not self.rewrites:
            return self.st.slot_ids(layer, ids)
        slots = self.st.slot_ids(layer, _read(ids))
        slots[ids == DROPPED] = self.st.spare_slot(layer)
        return slots

    def on_router_input(self, layer: int, node: int) -> None:
        """Hand a layer's router input to the trace and the spec-gate; no more stops there once
        neither wants it (the recall governor switched the gate off)."""
        if self.trace is not None:
            self.trace.on_router_input(layer, seam.router_input(node))
        if self.st.gate_running:
            self.st.on_router_input(layer, node)
        elif self.trace is None:
            self.router_input = False

    def down_pending(self, layer: int) -> bool:
        return self.st.down_pending(layer)

    def on_down(self, layer: int) -> None:
        self.st.on_down(layer)


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
