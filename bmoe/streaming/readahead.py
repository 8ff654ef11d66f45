"""Reads ahead of demand: whole layers in a prefill, the previous token's experts (`--prefetch K`),
the experts the routing seen so far says follow this layer's (`--guess P`, bmoe.streaming.route_guess)
and the spec-gate's predictions.

A prefill batch routes nearly every expert of every layer, so the next layer's routing is known
before it happens: when a batch routes WHOLE_LAYER of a layer's experts, every absent expert of the
next layer (after the last layer, of the first, when more of the prompt is to come) goes to the
lanes at once, and a long prompt's first layer goes out before its decode starts. Those reads run
while this layer computes; otherwise the flash idles while a layer computes and the compute waits
while the next layer is read.

Wished-for experts wait in a list on the coordinator and go to the lanes one expert per order,
up to QUEUE_PER_LANE orders per lane; a lane serves them only when no demand order waits, so a
demand read waits for at most the one read under way. When a layer routes, its orders for
experts it did not pick (mispredictions) are cancelled if the lane has not started them, and the
wish list is rebuilt from the new position in the layer cycle. A read ahead is useful when its
layer routes the expert; one still in flight then counts when it lands (the demand waits for it).
The cache admits these slices at the cold end and protects them until their layer routes.

Guesses are wishes too, with one more rule: they go only to a lane with nothing in flight, so they
take only the flash's idle time (a layer's compute after its reads landed) and a demand read never
waits behind more than one guess.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from bmoe import seam
from bmoe.streaming.expert_cache import ABSENT, ExpertCache
from bmoe.streaming.lanes import CANCELLED
from bmoe.streaming.orders import Order, OrdersInFlight
from bmoe.streaming.route_guess import RouteGuess
from bmoe.streaming.speculation import SpecGate


class BackgroundFill(Protocol):
    """Reads that ride behind the reads ahead (bmoe.streaming.warm_fill.WarmFill): told when a decode starts
    and settles, given the lanes after the wish list, and shown every answered order."""

    def owns(self, oid: int) -> bool: ...

    @property
    def filling(self) -> bool: ...

    def busy(self) -> None: ...

    def pause(self) -> None: ...

    def pump(self) -> None: ...

    def on_done(self, oid: int, order: Order, nbytes: int) -> None: ...

    def idle(self) -> None: ...

    def extend(self, experts: list[tuple[int, int]]) -> None: ...

QUEUE_PER_LANE = 4  # speculative orders queued in one lane at a time (each holds room in the cache)
WHOLE_LAYER = 7 / 8  # a batch routing this share of a layer's experts is taken to route all of the next


@dataclass
class ReadAheadCounts:
    """What the reads ahead did in one generation (counts): the moe-prefetch / moe-spec-gate numbers."""

    bytes: int = 0
    prefetched: int = 0
    useful: int = 0
    cancelled: int = 0  # orders dropped unread (mispredictions caught in time)


class ReadAhead:
    """The wish list, the spec-gate's predictions and how they fared; it sends and cancels its
    orders through `orders` (bmoe.streaming.orders), beside the Streamer's demand reads."""

    def __init__(self, orders: OrdersInFlight, cache: ExpertCache, n_expert: int, top_k: int, prefetch: int,
                 guess: float = 0.0, mtp_layers: frozenset[int] = frozenset()) -> None:
        """`mtp_layers`: layers of the model's MTP block (--draft mtp), which run in the MTP context's own decodes,
        not in a token's cycle of layers."""
        self.orders = orders
        self.cache = cache
        self.n_expert, self.top_k = n_expert, max(1, top_k)
        self.prefetch = prefetch
        self.gate: SpecGate | None = None
        self.layers = sorted(set(self.cache.by_layer) - mtp_layers)  # a token's layers, in the order it runs them
        self.cycle_pos = {layer: i for i, layer in enumerate(self.layers)}
        self.wishes: list[tuple[int, int]] = []
        self.guess = RouteGuess(self.layers, n_expert, guess) if guess > 0 else None
        self.guessed: list[tuple[int, int]] = []  # wishes that are guesses: idle lanes only
        self.cancelled: set[int] = set()  # orders asked to be dropped, not yet answered
        self.last_routes: dict[int, list[int]] = {}
        self.predictions: dict[int, set[int]] = {}
        self.guesses: dict[int, list[tuple[int, int]]] = {}  # layer -> (confidence band, expert) absent when predicted
        self.read_ahead: set[tuple[int, int]] = set()  # finished reads ahead not yet routed
        self.used_in_flight: set[int] = set()  # orders whose layer routed their expert before they finished
        self.counts = ReadAheadCounts()
        self.route_seq = 0
        self.routed_at: dict[int, int] = {}
        self.batch_left = 0  # tokens of the decode under way whose last layer has not routed yet
        self.ubatch = 0  # tokens the first layer routed in this ubatch
        self.last_routes_all = False  # the last layer routed every token of the last ubatch of several
        self.warm: BackgroundFill | None = None  # a warm start's fill (bmoe.streaming.warm_fill), after these reads

    @property
    def reads_ahead(self) -> bool:
        """Reads ahead of demand may go out at a routing's stop: --prefetch, --guess, a running spec-gate, a warm
        start's fill with experts left to read."""
        return bool(self.prefetch) or self.guess is not None or self.listening \
            or (self.warm is not None and self.warm.filling)

    @property
    def listening(self) -> bool:
        """A running spec-gate may have predictions to pick up."""
        return self.gate is not None and self.gate.active

    def handlers(self) -> dict[int, Callable[[], None]]:
        """File descriptors to watch beside the lanes' (LanePool.poll's `extra`)."""
        if not self.listening:
            return {}
        assert self.gate is not None  # listening
        return {self.gate.fd: self._on_predictions}

    # ---- per layer -----------------------------------------------------------------------------

    def on_route(self, layer: int, ids: np.ndarray, wanted: list[int]) -> None:
        """The layer routed: score what was predicted for it, count reads ahead that it used, and
        drop wishes (demand goes first) and its queued mispredictions."""
        self.route_seq += 1
        self.routed_at[layer] = self.route_seq
        self.last_routes[layer] = ids[-1].tolist() if len(ids) else []
        if self.guess is not None and len(ids) and layer in self.cycle_pos:
            self.guess.observe(layer, ids)
        predicted = self.predictions.pop(layer, None)
        if predicted is not None and self.gate is not None:
            self.gate.score(predicted, set(self.last_routes[layer]))
            for band, e in self.guesses.pop(layer, ()):
                self.gate.confidence.score(band, e in self.last_routes[layer])
        self.wishes.clear()
        self.guessed.clear()
        if self.read_ahead or self.orders.ahead_ids:
            self._count_useful(layer, wanted)
            self.cancel(layer, wanted)

    def begin_batch(self, n_tokens: int, trunk: bool = True) -> None:
        """A llama_decode of `n_tokens` starts: a prompt long enough to route nearly every expert
        reads its first layer whole now (`trunk` False: an MTP context's decode, which runs no trunk layer)."""
        if self.warm:
            self.warm.busy()
        self.batch_left = n_tokens if trunk else 0
        if trunk and self._routes_nearly_all(n_tokens):
            self._read_whole(self.layers[0])

    def _routes_nearly_all(self, n_tokens: int) -> bool:
        """Whether n_tokens tokens, each routed to k distinct of n experts at random, are expected
        to cover WHOLE_LAYER of them."""
        n, k = self.n_expert, self.top_k
        return n_tokens > 1 and 1 - (1 - k / n) ** n_tokens >= WHOLE_LAYER

    def after_demand(self, layer: int, n_tokens: int, wanted: list[int]) -> None:
        """A batch that routed nearly all of the layer reads the next layer whole; then wish for
        the previous token's experts of the next `prefetch` layers, nearest first.

        In most architectures llama.cpp's last layer computes only the rows whose logits are
        wanted (one per sequence), so it routes a few experts, not the batch's: it is read whole
        ahead only once a ubatch has shown that it routes them all. When it has routed, the
        ubatch (its size known from the first layer) is through. An MTP layer is in no token's cycle: nothing."""
        pos, last = self.cycle_pos.get(layer), len(self.layers) - 1
        if pos is None:
            return
        if pos == 0:
            self.ubatch = n_tokens
        if pos < last - 1 or (pos == last - 1 and self.last_routes_all):
            if n_tokens > 1 and len(wanted) >= WHOLE_LAYER * self.n_expert:
                self._read_whole(self.layers[pos + 1])
        if pos == last:
            if self.ubatch > 1:
                self.last_routes_all = n_tokens == self.ubatch
            self.batch_left -= self.ubatch
            if self._routes_nearly_all(min(self.batch_left, self.ubatch)):
                self._read_whole(self.layers[0])
        if self.guess is not None and n_tokens == 1:
            nxt = self.layers[(pos + 1) % len(self.layers)]
            self.guessed = [(nxt, e) for e, _ in self.guess.guess(layer) if self.absent(nxt, e)]
        if self.prefetch:
            for j in range(1, self.prefetch + 1):
                nxt = self.layers[(pos + j) % len(self.layers)]
                self._wish(nxt, self.last_routes.get(nxt, ()))
        if self.wishes or self.guessed or self.warm:
            self.pump()

    def on_router_input(self, layer: int, node: int) -> None:
        if not self.listening:
            return
        assert self.gate is not None  # listening
        addr, n_embd, n_tokens = seam.last_router_input(node)
        if n_tokens == 1 and n_embd == self.gate.n_embd:  # decode: prefill routes nearly every expert anyway
            self.gate.send(layer, addr, self.route_seq)

    # ---- the wish list and the lanes -----------------------------------------------------------

    def _wish(self, layer: int, experts) -> None:
        for e in experts:
            if (layer, e) not in self.wishes and self.absent(layer, e):
                self.wishes.append((layer, e))

    def absent(self, layer: int, expert: int) -> bool:
        st = self.cache.state
        return any(st[ri][expert] == ABSENT for ri in self.cache.by_layer[layer])

    def pump(self) -> None:
        """Queue wished-for reads in the lanes, one expert per order, up to QUEUE_PER_LANE per lane."""
        queued = [0] * self.orders.lanes
        for oid, order in self.orders.ahead():
            if not (self.warm and self.warm.owns(oid)):
                queued[order.lane] += 1
        while self.wishes and min(queued) < QUEUE_PER_LANE:
            layer, e = self.wishes.pop(0)
            keys = self.cache.admit_speculative(layer, [e])
            if keys:
                lane = queued.index(min(queued))
                self.orders.send(lane, self.orders.reads_for(keys), ahead=[(layer, e)])
                queued[lane] += 1
        if self.guessed:
            idle = [i for i, b in enumerate(self.orders.pending_bytes()) if b == 0]
            while self.guessed and idle:
                layer, e = self.guessed.pop(0)
                keys = self.cache.admit_speculative(layer, [e]) if self.absent(layer, e) else []
                if keys:
                    self.orders.send(idle.pop(0), self.orders.reads_for(keys), ahead=[(layer, e)])
        if self.warm:
            self.warm.pump()

    def _read_whole(self, layer: int) -> None:
        """Every absent expert of the layer the cache makes room for, one order per expert, spread
        by bytes over the lanes (they serve it after any demand, in order)."""
        load = self.orders.pending_bytes()
        for e in range(self.cache.n_expert(layer)):
            keys = self.cache.admit_speculative(layer, [e])
            if keys:
                reads = self.orders.reads_for(keys)
                lane = load.index(min(load))
                self.orders.send(lane, reads, [(layer, e)])
                load[lane] += sum(r[2] for r, _ in reads)

    def cancel(self, layer: int | None, routed: Collection[int] = ()) -> None:
        """Ask the lanes to drop the orders for `layer` (None: all layers) they have not started,
        except those for experts the layer routed to."""
        by_lane: dict[int, list[int]] = {}
        for oid, order in self.orders.ahead():
            if oid in self.cancelled or (layer is not None and self.warm and self.warm.owns(oid)):
                continue
            at, e = order.ahead[0]
            if layer is None or (at == layer and e not in routed):
                by_lane.setdefault(order.lane, []).append(oid)
                self.cancelled.add(oid)
        self.orders.cancel(by_lane)

    def _on_predictions(self) -> None:
        assert self.gate is not None  # a handler only while listening
        conf = self.gate.confidence
        for seq, layer, ids, probs in self.gate.receive():
            if self.routed_at.get(layer, 0) > seq:
                continue  # the layer routed before the prediction arrived: too late to use
            self.predictions[layer] = set(ids)
            guesses = [(conf.band(p), e) for e, p in zip(ids, probs) if self.absent(layer, e)]
            self.guesses[layer] = guesses
            before = len(self.wishes)
            self._wish(layer, [e for band, e in guesses if conf.worth(band)])
            self.wishes[:] = self.wishes[before:] + self.wishes[:before]  # the next layer comes first
        self.pump()

    # ---- accounting ----------------------------------------------------------------------------

    def _count_useful(self, layer: int, wanted: list[int]) -> None:
        for e in wanted:
            if (layer, e) in self.read_ahead:
                self.read_ahead.discard((layer, e))
                if not self.absent(layer, e):  # not evicted before its layer routed
                    self.counts.useful += 1
        for oid, order in self.orders.ahead():
            if order.ahead[0][0] == layer and order.ahead[0][1] in wanted:
                self.used_in_flight.add(oid)

    def on_done(self, oid: int, order: Order, nbytes: int) -> None:
        """An order came back (read, or CANCELLED unread); `nbytes` are the device's (the page cache's
        copies are no flash read: moe-prefetch's MiB is a subset of moe-stream's)."""
        self.cancelled.discard(oid)
        if self.warm:
            self.warm.on_done(oid, order, nbytes)
        used = oid in self.used_in_flight
        self.used_in_flight.discard(oid)
        if nbytes == CANCELLED:
            self.counts.cancelled += 1
        elif order.ahead:
            self.counts.bytes += nbytes
            self.counts.prefetched += len(order.ahead)
            if used:
                self.counts.useful += len(order.ahead)
            else:
                self.read_ahead.update(order.ahead)

    def take_counts(self) -> ReadAheadCounts:
        out, self.counts = self.counts, ReadAheadCounts()
        return out

    def settle(self) -> None:
        """Drop every wish and prediction and cancel what the lanes have not started (a warm fill pauses)."""
        if self.warm:
            self.warm.pause()
        self.wishes.clear()
        self.guessed.clear()
        self.predictions.clear()
        self.guesses.clear()
        self.cancel(None)

    def close(self) -> None:
        if self.gate is not None:
            self.gate.close()
