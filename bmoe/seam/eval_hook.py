"""The eval hook: llama.cpp's eval and abort callbacks while bmoe streams (`EvalHook`), and a plain
tap of chosen activations (`NodeTap`).

In capture mode the hook hands every node to the warm-up `Capture`; while streaming it stops the
graph where its listener (`StopListener`, bmoe.streaming.graph_stops) acts: each MoE layer's
routing, the router input, the waits of overlapped reads. Exceptions raised inside a callback
(a signal's included) are parked and raised once llama_decode returns (`run`, `deliver`): ctypes
would otherwise swallow them and let llama.cpp compute on. The compiled filter (bmoe.seam.eval_filter)
answers the calls whose answer is known, in C.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from typing import Protocol

import llama_cpp
import numpy as np

from bmoe.seam import eval_filter
from bmoe.seam.capture import DOWN_INPUT_PREFIX, WEIGHTS_NAME, Capture
from bmoe.seam.ggml_mirror import NAME_OFFSET, f32_rows, ids_view, tensor_at

WEIGHTS_PREFIX = b"ffn_moe_weigh"  # ffn_moe_weights-L (and its _softmax/_sum/_norm/_scaled nodes)
LOGITS_PREFIX = b"ffn_moe_logi"  # ffn_moe_logits-L: the router matmul; its src[1] is the router input
_LOGITS_NAME = re.compile(r"^ffn_moe_logits-(\d+)$")
ABORTED = 2  # llama_decode's return code when the abort callback stopped the graph


def _layer_of(cache: dict[bytes, int | None], name: bytes, rx: re.Pattern[str]) -> int | None:
    if name not in cache:
        m = rx.match(name.decode(errors="replace"))
        cache[name] = int(m.group(1)) if m else None
    return cache[name]


_decoding: EvalHook | None = None


def deliver(exc: BaseException) -> None:
    """Raise `exc` from a signal handler without losing it inside llama.cpp.

    A Python signal handler runs at whatever Python frame comes next — during a
    decode that is one of the ctypes callbacks, where ctypes would print and
    swallow the exception. So while a decode runs the exception is parked on the
    hook, the abort callback stops the graph, and `_decode` raises it.
    """
    if _decoding is not None:
        _decoding.error = exc
    else:
        raise exc


class StopListener(Protocol):
    """What the eval hook calls at the nodes where it stops the graph (bmoe.streaming.graph_stops implements it).

    `wait_nodes` maps the node names where overlapped reads are awaited to their wait key
    (Capture.wait_nodes: a layer's gate matmul for its up slices, its down matmul's input for its down
    slices; empty: no stop there); `router_input` says whether to stop at each layer's router input
    (`ffn_moe_logits-L`).
    """

    wait_nodes: dict[bytes, int]
    router_input: bool

    def skip_route(self, layer: int) -> bool: ...

    def reroute(self, layer: int, ids: np.ndarray, node: int) -> None: ...

    def on_route(self, layer: int, ids: np.ndarray) -> None: ...

    def slot_ids(self, layer: int, ids: np.ndarray) -> np.ndarray: ...

    def on_router_input(self, layer: int, node: int) -> None: ...

    def wait_pending(self, key: int) -> bool: ...

    def on_wait(self, key: int) -> None: ...

    def fast_layers(self) -> list[eval_filter.FastTables]: ...

    def answers_in_c(self) -> bool: ...

    def replay_hit(self, layer: int, ids: np.ndarray, slots: np.ndarray) -> None: ...


class EvalHook:
    """The cb_eval trampoline.

    In capture mode it records expert tensors; in stream mode (`stops` set) it asks for each MoE
    layer's `ffn_moe_weights-L` node (the router weights gathered with the real expert ids) and,
    in its ask=False call, before any expert matmul reads the ids, calls `stops.reroute(layer, ids,
    node)` (lossy routing may change the ids and the weights at the node, bmoe.streaming.lossy), then
    `stops.on_route(layer, ids)` and overwrites the routed ids in place with
    `stops.slot_ids(layer, ids)`; a layer
    for which `stops.skip_route(layer)` is True runs without stopping (its tensors then read the
    experts by their own ids). With `stops.router_input` it also hands over each layer's router
    input; at a node of `stops.wait_nodes` whose `wait_pending(key)` is true it stops and calls
    `on_wait(key)` once the node is computed, before the next matmul runs (under --overlap a layer's
    up slices are awaited after its gate matmul, its down slices at the down matmul's input).
    Exceptions (including KeyboardInterrupt from a signal) are kept and the
    graph aborted: ctypes would otherwise swallow them and let llama.cpp compute on.
    """

    def __init__(self) -> None:
        self._capture: Capture | None = None
        self._stops: StopListener | None = None
        self._error: BaseException | None = None
        self._layers: dict[bytes, int | None] = {}
        self._fast_keep: list[object] = []  # what the filter's fast path reads (its tables' ctypes views)
        self.py_callback = llama_cpp.ggml_backend_sched_eval_callback(self._callback)
        self.py_abort = llama_cpp.ggml_abort_callback(self._abort)
        # llama.cpp calls these on every node: the compiled filter (bmoe.seam.eval_filter) answers those
        # whose answer is known and hands the rest to the two above; without it, they are called directly
        self.filter_lib = eval_filter.compiled()
        self.filter: eval_filter.EvalFilter | None = None
        self.c_callback: object = self.py_callback
        self.c_abort: object = self.py_abort
        self.user_data: int | None = None
        if self.filter_lib is not None:
            f = self.filter = eval_filter.EvalFilter.wired(self.py_callback, self.py_abort)
            self.c_callback = ctypes.cast(self.filter_lib.bmoe_eval_filter, llama_cpp.ggml_backend_sched_eval_callback)
            self.c_abort = ctypes.cast(self.filter_lib.bmoe_abort_filter, llama_cpp.ggml_abort_callback)
            self.user_data = ctypes.addressof(f)

    # what the filter needs to know, kept in step with the hook's own state

    @property
    def error(self) -> BaseException | None:
        """An exception parked during a decode (raised by `run` once llama_decode returns); while one
        is parked, every callback answers so that the graph stops."""
        return self._error

    @error.setter
    def error(self, exc: BaseException | None) -> None:
        self._error = exc
        if self.filter is not None:
            self.filter.stop = exc is not None

    @property
    def capture(self) -> Capture | None:
        """The warm-up capture under way: every node is visited (a dry one stops at the first computed)."""
        return self._capture

    @capture.setter
    def capture(self, cap: Capture | None) -> None:
        self._capture = cap
        if self.filter is not None:
            self.filter.every = cap is not None
            self.filter.halt = cap is not None and cap.dry

    @property
    def stops(self) -> StopListener | None:
        """The streaming run's listener at the graph's stops (None: nothing stops)."""
        return self._stops

    @stops.setter
    def stops(self, stops: StopListener | None) -> None:
        self._stops = stops
        if self.filter is not None:
            self.filter.routing = stops is not None
            self.filter.router_input = stops is not None and stops.router_input
            self.filter.set_stems(sorted({name.rsplit(b"-", 1)[0] for name in stops.wait_nodes}) if stops else [])
            self._fast_keep = self.filter.set_layers(stops.fast_layers() if stops else [])

    def _replay_logged(self) -> None:
        """Keep the books of the routings the filter answered, in order, before Python decides anything."""
        if self.filter is not None and self.filter.log_len and self._stops is not None:
            for layer, ids, slots in self.filter.logged():
                self._stops.replay_hit(layer, ids, slots)

    def _allow_fast(self) -> None:
        """Tell the filter whether it may answer the next all-resident routings (the listener's say, now)."""
        if self.filter is not None:
            self.filter.fast = self._stops is not None and self.error is None and self._stops.answers_in_c()

    def _callback(self, t: int, ask: bool, _user: int) -> bool:
        try:
            if self.error is not None:
                return False
            if self.capture is not None:
                if ask:
                    self.capture.visit(t)
                return False
            stops = self.stops
            if stops is None:
                return False
            if self.filter is None:
                return self._stop(stops, t, ask)
            self._replay_logged()
            answer = self._stop(stops, t, ask)
            self._allow_fast()
            return answer
        except BaseException as e:  # noqa: BLE001 - re-raised after llama_decode returns
            self.error = e
            return False

    def _stop(self, stops: StopListener, t: int, ask: bool) -> bool:
        """The listener's answer at a node the filter handed over (or every node, without the filter)."""
        prefix = ctypes.string_at(t + NAME_OFFSET, 13)
        if prefix == WEIGHTS_PREFIX:
            layer = _layer_of(self._layers, ctypes.string_at(t + NAME_OFFSET), WEIGHTS_NAME)
            if ask:
                # no need to stop the graph for a layer whose experts are all resident for good
                return layer is not None and not stops.skip_route(layer)
            if layer is not None:
                view = ids_view(tensor_at(t).src[1])  # ffn_moe_topk-L's (Capture checked)
                ids = view.copy()
                stops.reroute(layer, ids, t)
                stops.on_route(layer, ids)
                view[...] = stops.slot_ids(layer, ids)
            return True
        if stops.router_input and prefix[:12] == LOGITS_PREFIX:
            if ask:
                return True
            layer = _layer_of(self._layers, ctypes.string_at(t + NAME_OFFSET), _LOGITS_NAME)
            if layer is not None:
                stops.on_router_input(layer, t)
            if self.filter is not None:
                self.filter.router_input = stops.router_input  # (the recall governor may have turned it off)
            return True
        if stops.wait_nodes and prefix[:8] == DOWN_INPUT_PREFIX:
            key = stops.wait_nodes.get(ctypes.string_at(t + NAME_OFFSET))
            if key is None:
                return False
            if ask:
                return stops.wait_pending(key)
            stops.on_wait(key)
            return True
        return False

    def _abort(self, _user: int) -> bool:
        return self.error is not None or (self.capture is not None and self.capture.dry)

    def take_error(self) -> BaseException | None:
        err, self.error = self.error, None
        return err

    def run(self, decode: Callable[[], tuple[int, list[int]]], aborts: bool = False) -> list[int]:
        """Run one llama_decode (`decode`, returning its code and rows) under this hook: an exception
        parked during it is raised, and so is a failing return code (ABORTED is expected with `aborts`)."""
        with self:
            self._allow_fast()
            try:
                rc, rows = decode()
            finally:
                if self.filter is not None:
                    self.filter.fast = 0
                try:
                    self._replay_logged()
                except BaseException as e:  # noqa: BLE001 - the decode's own error first
                    self.error = self.error or e
        err = self.take_error()
        if err is not None:
            raise err
        if rc != 0 and not (aborts and rc == ABORTED):
            raise RuntimeError(f"llama_decode failed with code {rc}")
        return rows

    def __enter__(self) -> EvalHook:
        global _decoding
        _decoding = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _decoding
        _decoding = None


class NodeTap:
    """A cb_eval callback that copies chosen activations of a plain decode, layer by layer.

    Each node named `NAME-L` for a NAME in `names` (the whole name: views such as
    "ffn_norm-3 (reshaped)" are not it) is asked for, and once computed its F32 rows go to
    `on_rows(NAME, L, rows)` as a copy. Tools that read a model's activations use it (the demo's
    calibration reads `ffn_norm-L`, the router input of the llama graph); streaming uses
    `EvalHook`. An exception in the callback is kept in `error` (ctypes would swallow it) and
    nothing more is copied; the caller raises it once `llama_decode` returns.
    """

    def __init__(self, names: tuple[str, ...], on_rows: Callable[[str, int, np.ndarray], None]) -> None:
        self.on_rows = on_rows
        self.error: BaseException | None = None
        self._rx = re.compile(r"^(" + "|".join(map(re.escape, names)) + r")-(\d+)$")
        self._nodes: dict[bytes, tuple[str, int] | None] = {}
        self.c_callback = llama_cpp.ggml_backend_sched_eval_callback(self._callback)

    def _node(self, name: bytes) -> tuple[str, int] | None:
        if name not in self._nodes:
            m = self._rx.match(name.decode(errors="replace"))
            self._nodes[name] = (m.group(1), int(m.group(2))) if m else None
        return self._nodes[name]

    def _callback(self, t: int, ask: bool, _user: int) -> bool:
        try:
            if self.error is not None:
                return False
            node = self._node(ctypes.string_at(t + NAME_OFFSET))
            if node is None:
                return False
            if not ask:
                self.on_rows(node[0], node[1], f32_rows(t))
            return True
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller after llama_decode returns
            self.error = e
            return False
