"""Eviction policies of the expert cache: which resident slice goes first when room is needed.

`ExpertCache` owns residency, bytes and pinning; a policy owns only the *order* in which
resident slices are given up. The live cache and the trace simulator (`bmoe-bench policies`)
run the same policy objects, so what the simulator says is what the cache does.

A key is a slice `(layer, region index, expert)`. The interface, all on the decode thread:

- `begin(layer)`: the decode reached this MoE layer's routing (once per `plan`). Policies that
  count tokens or need the position in the layer cycle take it from here.
- `touch(key)`: a demand use of a resident slice at the current layer (a hit).
- `admit(key, speculative=False)`: a slice became resident. A demand insert (`speculative=False`)
  is a use, like `touch`. A speculative read (prefetch, spec-gate) is admitted *at the cold end*:
  it is the first candidate to go until a real demand `touch` promotes it.
- `forget(key)`: the slice is no longer resident (evicted, or a speculative read cancelled).
- `victims(layer)`: resident keys in eviction order while the current layer is `layer`. The
  caller skips keys it pins (the current layer's routed slices) and `forget`s each key it evicts
  before asking for the next one; it stops as soon as it has room.
- `predict(keys)`: optional hints, the slices expected within the next few layers (spec-gate or
  temporal prefetcher). Prediction-aware policies keep them; others ignore the call.

Policies here (`POLICIES`): `next-use` (the default: evict the slice whose next use is expected
furthest away over all layers, from the layer cycle and each expert's decayed routing frequency),
`lru` (global least-recently-used: the cache's historical behaviour, exactly), `cycle` (evict
from the layer whose next use in the 0..N-1 layer cycle is furthest ahead of the current layer;
least recently used first within it), `cycle-lfu` (the same layer order, least frequently used
first within the layer, with decaying counts), `quota` (equal per-layer shares: evict from the
layer holding most slices) and `predict` (`cycle-lfu` that never gives up a predicted slice while
another candidate is left). The bounds that need the future (Belady's MIN, a next-token oracle)
live with the simulator, in bmoe.tools.policy_bounds.
"""

from __future__ import annotations

import heapq

from collections import OrderedDict
from itertools import islice
from typing import Iterable, Iterator, Sequence

Key = tuple[int, int, int]

DEFAULT_POLICY = "next-use"


def _drain(od: OrderedDict[Key, None]) -> Iterator[Key]:
    """`od`'s keys oldest first while the caller forgets them; a key it keeps (pinned) is passed over.

    No copy of the whole order per eviction: the next candidate is the first key not passed over.
    """
    kept = 0
    while kept < len(od):
        key = next(islice(od, kept, None))
        yield key
        if key in od:
            kept += 1


class Policy:
    """Base: the layer cycle and a token clock; subclasses keep their own order."""

    name = ""
    wants_predictions = False

    def __init__(self, layers: Sequence[int]) -> None:
        self.layers = list(layers)
        self.pos = {layer: i for i, layer in enumerate(self.layers)}
        self.layer: int | None = None
        self.token = 0

    def begin(self, layer: int) -> None:
        """A new token starts when the cycle wraps (or the same layer comes again)."""
        if self.layer is None or self.pos[layer] <= self.pos[self.layer]:
            self.token += 1
        self.layer = layer

    def touch(self, key: Key) -> None:
        raise NotImplementedError

    def admit(self, key: Key, speculative: bool = False) -> None:
        raise NotImplementedError

    def forget(self, key: Key) -> None:
        raise NotImplementedError

    def victims(self, layer: int | None) -> Iterator[Key]:
        raise NotImplementedError

    def predict(self, keys: Iterable[Key]) -> None:
        """Policies that do not use predictions ignore them."""

    def furthest_first(self, layer: int | None) -> Iterator[int]:
        """Layers by next use in the cycle, furthest first: `layer` itself (next token), then the ones behind it."""
        i = self.pos.get(layer, 0)  # None: nothing routed yet
        n = len(self.layers)
        for k in range(n):
            yield self.layers[(i - k) % n]


class LRU(Policy):
    """Global least-recently-used, as the cache always did (OrderedDict, oldest first)."""

    name = "lru"

    def __init__(self, layers: Sequence[int]) -> None:
        super().__init__(layers)
        self.order: OrderedDict[Key, None] = OrderedDict()

    def touch(self, key: Key) -> None:
        self.order.move_to_end(key)

    def admit(self, key: Key, speculative: bool = False) -> None:
        self.order[key] = None
        if speculative:
            self.order.move_to_end(key, last=False)

    def forget(self, key: Key) -> None:
        del self.order[key]

    def victims(self, layer: int | None) -> Iterator[Key]:
        return _drain(self.order)


class Cycle(Policy):
    """Evict from the layer needed furthest ahead in the layer cycle; LRU inside a layer.

    A decode step visits the MoE layers 0..N-1 in turn, so the slice global LRU gives up (the
    oldest) belongs to the layer that comes next: the cyclic worst case. Here the current layer's
    unpinned slices go first (its next use is a whole token away), then the layer just behind it.
    """

    name = "cycle"

    def __init__(self, layers: Sequence[int]) -> None:
        super().__init__(layers)
        self.by_layer: dict[int, OrderedDict[Key, None]] = {layer: OrderedDict() for layer in self.layers}

    def touch(self, key: Key) -> None:
        self.by_layer[key[0]].move_to_end(key)

    def admit(self, key: Key, speculative: bool = False) -> None:
        od = self.by_layer[key[0]]
        od[key] = None
        if speculative:
            od.move_to_end(key, last=False)

    def forget(self, key: Key) -> None:
        del self.by_layer[key[0]][key]

    def in_layer(self, layer: int) -> Iterator[Key]:
        """One layer's resident keys, first to go first."""
        return _drain(self.by_layer[layer])

    def victims(self, layer: int | None) -> Iterator[Key]:
        for lay in self.furthest_first(layer):
            if self.by_layer[lay]:
                yield from self.in_layer(lay)


class CycleLFU(Cycle):
    """`cycle`'s layer order; inside a layer the least frequently routed expert goes first.

    An expert's count decays by DECAY per token, so experts popular long ago fade; ties (and
    speculative slices, which have no count) go least recently used first.
    """

    name = "cycle-lfu"
    DECAY = 0.98

    def __init__(self, layers: Sequence[int]) -> None:
        super().__init__(layers)
        self.count: dict[tuple[int, int], tuple[float, int]] = {}  # (layer, expert) -> (count, token)

    def _use(self, key: Key) -> None:
        ek = (key[0], key[2])
        c, t = self.count.get(ek, (0.0, self.token))
        if t == self.token and c:  # another slice of the same expert, same token: one use
            return
        self.count[ek] = (c * self.DECAY ** (self.token - t) + 1.0, self.token)

    def score(self, layer: int, expert: int) -> float:
        c, t = self.count.get((layer, expert), (0.0, self.token))
        return c * self.DECAY ** (self.token - t)

    def touch(self, key: Key) -> None:
        super().touch(key)
        self._use(key)

    def admit(self, key: Key, speculative: bool = False) -> None:
        super().admit(key, speculative)
        if not speculative:
            self._use(key)

    def in_layer(self, layer: int) -> Iterator[Key]:
        keys = list(self.by_layer[layer])  # LRU order, kept by the stable sort for ties
        return iter(sorted(keys, key=lambda k: self.score(k[0], k[2])))


class NextUse(CycleLFU):
    """Evict the slice whose next use is expected furthest away, over all layers.

    Expected next use, in layer steps = layers until its layer comes again in the cycle (the
    current layer: a whole token) + N × the tokens it is expected to wait for its expert, 1/p − 1,
    with p the expert's routing frequency per token (its decayed count over the decayed token
    count). `cycle` and `cycle-lfu` order layers by position alone, so a prefill that read every
    expert of a few layers locks them in: measured live, cycle-lfu then hit less than LRU. Here a
    rarely routed expert of a near layer goes before a hot one of a far layer. Each eviction
    compares one candidate per layer (its least frequent slice), so it stays cheap.
    """

    name = "next-use"

    def __init__(self, layers: Sequence[int]) -> None:
        super().__init__(layers)
        self.start: int | None = None
        # Each layer's keys least frequent first. Decay scales every count alike, so the order
        # changes only when one of the layer's experts is used: it is kept until then.
        self.order: dict[int, list[Key]] = {}

    def begin(self, layer: int) -> None:
        super().begin(layer)
        if self.start is None:
            self.start = self.token - 1

    def touch(self, key: Key) -> None:
        super().touch(key)
        self.order.pop(key[0], None)

    def admit(self, key: Key, speculative: bool = False) -> None:
        super().admit(key, speculative)
        self.order.pop(key[0], None)

    def in_layer(self, layer: int) -> Iterator[Key]:
        if layer not in self.order:
            self.order[layer] = list(super().in_layer(layer))
        return iter(self.order[layer])  # keys evicted since are skipped by _push

    def frequency(self, layer: int, expert: int) -> float:
        tokens = max(1, self.token - (self.start or 0))
        seen = (1 - self.DECAY ** tokens) / (1 - self.DECAY)
        return min(1.0, max(1e-3, self.score(layer, expert) / seen))

    def victims(self, layer: int | None) -> Iterator[Key]:
        n = len(self.layers)
        cur = self.pos.get(layer, 0)
        heap: list[tuple[float, int, Key]] = []
        orders: dict[int, tuple[int, Iterator[Key]]] = {}
        for lay in self.layers:
            if self.by_layer[lay]:
                orders[lay] = ((self.pos[lay] - cur) % n or n, self.in_layer(lay))
                self._push(heap, lay, orders[lay])
        while heap:
            _, lay, key = heapq.heappop(heap)
            yield key
            self._push(heap, lay, orders[lay])

    def _push(self, heap: list[tuple[float, int, Key]], lay: int, order: tuple[int, Iterator[Key]]) -> None:
        """The layer's next candidate still resident (the caller may have kept a pinned one)."""
        distance, keys = order
        for key in keys:
            if key in self.by_layer[lay]:
                wait = distance + len(self.layers) * (1 / self.frequency(lay, key[2]) - 1)
                heapq.heappush(heap, (-wait, lay, key))
                return


class Quota(Policy):
    """Equal per-layer shares: evict from the layer holding the most slices, LRU inside it."""

    name = "quota"

    def __init__(self, layers: Sequence[int]) -> None:
        super().__init__(layers)
        self.by_layer: dict[int, OrderedDict[Key, None]] = {layer: OrderedDict() for layer in self.layers}

    touch = Cycle.touch
    admit = Cycle.admit
    forget = Cycle.forget

    def victims(self, layer: int | None) -> Iterator[Key]:
        kept = dict.fromkeys(self.layers, 0)  # pinned keys passed over, at the front of each layer's order
        while True:
            best = max(self.layers, key=lambda lay: len(self.by_layer[lay]) - kept[lay])
            od = self.by_layer[best]
            if len(od) <= kept[best]:
                return
            key = next(islice(od, kept[best], None))
            yield key
            if key in od:
                kept[best] += 1


class Predictive(CycleLFU):
    """`cycle-lfu`, but a slice predicted for the next layers goes only after every other candidate.

    Predictions expire when their layer has passed; a speculative slice that was not used by then
    (a misprediction) sits at its layer's cold end and goes first.
    """

    name = "predict"
    wants_predictions = True

    def __init__(self, layers: Sequence[int]) -> None:
        super().__init__(layers)
        self.predicted: dict[Key, int] = {}  # key -> token of the prediction

    def predict(self, keys: Iterable[Key]) -> None:
        for k in keys:
            self.predicted[k] = self.token

    def begin(self, layer: int) -> None:
        super().begin(layer)
        stale = [k for k, t in self.predicted.items() if k[0] == layer or t < self.token - 1]
        for k in stale:
            del self.predicted[k]

    def victims(self, layer: int | None) -> Iterator[Key]:
        kept = []
        for key in super().victims(layer):
            if key in self.predicted:
                kept.append(key)
            else:
                yield key
        yield from kept


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (LRU, Cycle, CycleLFU, NextUse, Quota, Predictive)
}


def make_policy(name: str, layers: Sequence[int]) -> Policy:
    """A policy by name; an unknown name is a ValueError that lists the valid ones."""
    try:
        return POLICIES[name](layers)
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}") from None
