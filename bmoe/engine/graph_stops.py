"""What happens at each node where llama.cpp's graph stops for bmoe while streaming: the routing
(the Streamer's demand reads and remap, and the route trace), each layer's router input (the
spec-gate's prediction and the trace) and the down matmul's input (overlap's wait).

`StreamingStops` is the eval hook's one listener (a bmoe.seam.StopListener); the Engine builds it once the
Streamer, the spec-gate and the trace exist.
"""

from __future__ import annotations

import numpy as np

from bmoe import seam
from bmoe.streaming.lossy import DROPPED, Lossy
from bmoe.streaming.route_trace import TraceWriter
from bmoe.streaming.streamer import Streamer


class StreamingStops:
    """The streaming run's answers at the graph's stops."""

    def __init__(self, streamer: Streamer, down_nodes: dict[bytes, int], trace: TraceWriter | None,
                 lossy: Lossy | None = None) -> None:
        self.st = streamer
        self.trace = trace
        self.lossy = lossy
        self.down_nodes = down_nodes  # empty without --overlap: every read is awaited at the routing node
        self.router_input = streamer.gate_running or trace is not None

    def skip_route(self, layer: int) -> bool:
        """A layer whose experts are all resident for good runs through (a trace sees every layer),
        unless lossy routing changes every layer's routing in this decode."""
        if self.lossy is not None and self.lossy.cuts and self.lossy.active:
            self.st.unbind(layer)
            return False
        return self.trace is None and self.st.skip(layer)

    def reroute(self, layer: int, ids: np.ndarray, node: int) -> None:
        """Lossy routing (bmoe.streaming.lossy), when the run has it, changes the ids and weights first."""
        if self.lossy is not None:
            self.lossy.reroute(layer, ids, node)

    def on_route(self, layer: int, ids: np.ndarray) -> None:
        if self.lossy is not None:
            ids = _read(ids)
        if self.trace is not None:
            self.trace.on_route(layer, ids, self.st.predicted_for(layer))
        self.st.on_route(layer, ids)

    def slot_ids(self, layer: int, ids: np.ndarray) -> np.ndarray:
        if self.lossy is None:
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


def _read(ids: np.ndarray) -> np.ndarray:
    """The routed ids as experts to read: a dropped position as its row's best expert, which the row
    reads anyway (its slot is the spare's: StreamingStops.slot_ids)."""
    dropped = ids == DROPPED
    return np.where(dropped, ids[:, :1], ids) if dropped.any() else ids
