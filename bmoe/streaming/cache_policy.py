"""Eviction policies of the expert cache: which resident expert goes first when room is needed.

`ExpertCache` owns residency, bytes and pinning; a policy owns only the *order* in which
resident experts are given up. The live cache and the trace simulator (`bmoe-bench policies`)
run the same policy objects, so what the simulator says is what the cache does.

A key is an expert, `(layer, expert)`: the cache reads, holds and evicts an expert whole (its
gate, up and down slices together). The interface, all on the decode thread:

- `begin(layer)`: the decode reached this MoE layer's routing (once per `plan`). Policies that
  count tokens or need the position in the layer cycle take it from here.
- `touch(key)`: a demand use of a resident expert at the current layer (a hit).
- `admit(key, speculative=False)`: an expert became resident. A demand insert (`speculative=False`)
  is a use, like `touch`. A speculative read (prefetch, spec-gate) is admitted *at the cold end*:
  it is the first candidate to go until a real demand `touch` promotes it.
- `forget(key)`: the expert is no longer resident (evicted).
- `victims(layer)`: resident keys in eviction order while the current layer is `layer`. The
  caller skips keys it pins (the current layer's routed experts) and `forget`s each key it evicts
  before asking for the next one; it stops as soon as it has room, and once it has called
  anything else it never resumes that walk (the policies keep their orders across walks).
- `predict(keys)`: optional hints, the experts expected within the next few layers (spec-gate or
  temporal prefetcher). Prediction-aware policies keep them; others ignore the call.

Policies here (`POLICIES`): `next-use` (the default: evict the expert whose next use is expected
furthest away over all layers, from the layer cycle and each expert's decayed routing frequency),
`lru` (global least-recently-used: the cache's historical behaviour, exactly), `cycle` (evict
from the layer whose next use in the 0..N-1 layer cycle is furthest ahead of the current layer;
least recently used first within it), `cycle-lfu` (the same layer order, least frequently used
first within the layer, with decaying counts), `quota` (equal per-layer shares: evict from the
layer holding most experts) and `predict` (`cycle-lfu` that never gives up a predicted expert while
another candidate is left). The bounds that need the future (Belady's MIN, a next-token oracle)
live with the simulator, in bmoe.replay.bounds.

Cost: a policy keeps its order as it goes, so `touch`, `admit` and `forget` cost O(1) or O(log n)
and each key a walk yields O(log n), amortized; nothing passes over every expert per eviction or per
token (`next-use` re-ranks each layer's first candidate once a token, O(layers); `predict` drops
expired predictions by scanning the live ones, a window of a few layers).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice

Key = tuple[int, int, int]  # a slice: (layer, region index, expert), what a read fills
ExpertKey = tuple[int, int]  # an expert: (layer, expert), what the policies rank
Rank = tuple[float, int, ExpertKey]  # (weight, tick of last use, key): an expert's rank in its layer

_UNUSED = (0.0, -1)  # an expert never used: no count, no token


def _drain(od: OrderedDict[ExpertKey, None]) -> Iterator[ExpertKey]:
    """`od`'s keys oldest first while the caller forgets them; a key it keeps (pinned) is passed over.

    Keys are copied in chunks that double, each from just after the keys passed over so far (the
    caller forgets only the key it was given, so the rest of a chunk stays valid): no walk copies
    the whole order, and keys passed over are skipped once per chunk, not once per eviction.
    """
    kept, size = 0, 8
    while kept < len(od):
        for key in list(islice(od, kept, kept + size)):
            yield key
            if key in od:
                kept += 1
        size *= 2


class _Heads:
    """One entry per layer in a heap, lowest rank first, kept between eviction walks.

    A layer whose rank changed is pushed again; its older entries go stale and are skipped when they
    surface (lazy invalidation), and the heap is compacted once stale entries outnumber the layers
    a few times over: a push or a look at the top costs O(log layers), amortized.
    """

    def __init__(self, layers: Sequence[int]) -> None:
        self.heap: list[tuple[float, int, int, int]] = []  # (rank, tie, version, layer)
        self.version = dict.fromkeys(layers, 0)

    def push(self, layer: int, rank: float | None = None, tie: int = 0) -> None:
        """The layer's rank from now on (None: it has no candidate); equal ranks go to the lower `tie`."""
        v = self.version[layer] = self.version[layer] + 1
        if rank is not None:
            heapq.heappush(self.heap, (rank, tie, v, layer))
            if len(self.heap) > 4 * len(self.version) + 16:
                self.heap[:] = [e for e in self.heap if e[2] == self.version[e[3]]]
                heapq.heapify(self.heap)

    def clear(self) -> None:
        """Forget every entry (the caller pushes every layer again)."""
        self.heap.clear()

    def top(self) -> int | None:
        """The layer ranked first (None: no layer has a candidate)."""
        heap = self.heap
        while heap:
            _, _, v, layer = heap[0]
            if v == self.version[layer]:
                return layer
            heapq.heappop(heap)
        return None


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

    def touch(self, key: ExpertKey) -> None:
        raise NotImplementedError

    def admit(self, key: ExpertKey, speculative: bool = False) -> None:
        raise NotImplementedError

    def forget(self, key: ExpertKey) -> None:
        raise NotImplementedError

    def victims(self, layer: int | None) -> Iterator[ExpertKey]:
        raise NotImplementedError

    def predict(self, keys: Iterable[ExpertKey]) -> None:
        """Policies that do not use predictions ignore them."""

    def prior(self, frequencies: dict[tuple[int, int], float], tokens: int) -> None:
        """Start from a past run's routing: each (layer, expert)'s share of its layer's routings, seen
        over `tokens` tokens (bmoe.streaming.usage_profile). Policies that do not count uses ignore it."""

    def furthest_first(self, layer: int | None) -> Iterator[int]:
        """Layers by next use in the cycle, furthest first: `layer` itself (next token), then the ones behind it."""
        i = self.pos.get(layer, 0) if layer is not None else 0  # None: nothing routed yet
        n = len(self.layers)
        for k in range(n):
            yield self.layers[(i - k) % n]


class LRU(Policy):
    """Global least-recently-used, as the cache always did (OrderedDict, oldest first)."""

    name = "lru"

    def __init__(self, layers: Sequence[int]) -> None:
        super().__init__(layers)
        self.order: OrderedDict[ExpertKey, None] = OrderedDict()

    def touch(self, key: ExpertKey) -> None:
        self.order.move_to_end(key)

    def admit(self, key: ExpertKey, speculative: bool = False) -> None:
        self.order[key] = None
        if speculative:
            self.order.move_to_end(key, last=False)

    def forget(self, key: ExpertKey) -> None:
        del self.order[key]

    def victims(self, layer: int | None) -> Iterator[ExpertKey]:
        return _drain(self.order)


class Cycle(Policy):
    """Evict from the layer needed furthest ahead in the layer cycle; LRU inside a layer.

    A decode step visits the MoE layers 0..N-1 in turn, so the expert global LRU gives up (the
    oldest) belongs to the layer that comes next: the cyclic worst case. Here the current layer's
    unpinned experts go first (its next use is a whole token away), then the layer just behind it.
    """

    name = "cycle"

    def __init__(self, layers: Sequence[int]) -> None:
        super().__init__(layers)
        self.by_layer: dict[int, OrderedDict[ExpertKey, None]] = {layer: OrderedDict() for layer in self.layers}

    def touch(self, key: ExpertKey) -> None:
        self.by_layer[key[0]].move_to_end(key)

    def admit(self, key: ExpertKey, speculative: bool = False) -> None:
        od = self.by_layer[key[0]]
        od[key] = None
        if speculative:
            od.move_to_end(key, last=False)

    def forget(self, key: ExpertKey) -> None:
        del self.by_layer[key[0]][key]

    def in_layer(self, layer: int) -> Iterator[ExpertKey]:
        """One layer's resident keys, first to go first."""
        return _drain(self.by_layer[layer])

    def victims(self, layer: int | None) -> Iterator[ExpertKey]:
        for lay in self.furthest_first(layer):
            if self.by_layer[lay]:
                yield from self.in_layer(lay)


class CycleLFU(Policy):
    """`cycle`'s layer order; inside a layer the least frequently routed expert goes first.

    An expert's count decays by DECAY per token, so experts popular long ago fade; ties (and
    speculative experts, which have no count) go least recently used first.

    Each layer's experts wait in a heap ranked by (count, last use), with lazy deletion: a use pushes
    the expert's new entry and leaves the old one to be dropped when it surfaces, a forget only drops
    the key; each victim costs O(log n), amortized. A count is stored as its weight, count / `unit`,
    where `unit` (what one use at the current token adds) grows by 1/DECAY per token: decay then
    changes no stored number and no order. A power-of-two rescale every ~17 k tokens (exact) keeps
    the numbers finite.
    """

    name = "cycle-lfu"
    DECAY = 0.98
    RESCALE = 512  # bits `unit` may grow before every weight is scaled by 2**-RESCALE

    def __init__(self, layers: Sequence[int]) -> None:
        super().__init__(layers)
        self.count: dict[ExpertKey, tuple[float, int]] = {}  # expert -> (weight, token of last use)
        self.shift = 0  # weights are scaled by 2**-shift
        self.unit = 1.0
        self.clock = 0  # order of last use: a use takes the next tick, a speculative admit the lowest
        self.cold = 0
        self.swept = 0  # clock - cold when the heaps were last cleared of stale entries
        self.entry: dict[ExpertKey, Rank] = {}  # resident key -> its live entry (any other entry is stale)
        self.heap: dict[int, list[Rank]] = {layer: [] for layer in self.layers}
        self.held: list[Rank] = []  # live entries the last walk passed over (kept by the caller), off their heap
        self.moved: set[int] = set()  # layers whose first candidate may have changed since the last walk

    def begin(self, layer: int) -> None:
        token = self.token
        super().begin(layer)
        if self.token != token:
            self.unit = 2.0 ** (self.token * -math.log2(self.DECAY) - self.shift)
            if self.unit > 2.0 ** self.RESCALE:
                self._rescale()
        if self.clock - self.cold - self.swept > len(self.entry) + 1024:  # no walk for a long while (every
            self._sweep()  # expert fits): each use pushed an entry, and nothing else would drop the old ones

    def prior(self, frequencies: dict[tuple[int, int], float], tokens: int) -> None:
        """Each expert's decayed count as if it had been routed at that share over `tokens` tokens."""
        seen = (1 - self.DECAY ** max(1, tokens)) / (1 - self.DECAY)
        for ek, p in frequencies.items():
            if ek not in self.count:
                self.count[ek] = (p * seen * self.unit, -1)

    def _rescale(self) -> None:
        """Scale every weight by 2**-RESCALE: exact, so every order stays as it was."""
        self.shift += self.RESCALE
        self.unit = math.ldexp(self.unit, -self.RESCALE)
        self.count = {ek: (math.ldexp(w, -self.RESCALE), t) for ek, (w, t) in self.count.items()}
        self.entry = {key: (math.ldexp(w, -self.RESCALE), tick, key) for key, (w, tick, _) in self.entry.items()}
        self.held.clear()
        self._sweep()

    def _sweep(self) -> None:
        """Heaps of the live entries only: after about as many pushes as there are keys (amortized O(1))."""
        heaps = self.heap = {layer: [] for layer in self.layers}
        for e in self.entry.values():
            heaps[e[2][0]].append(e)
        for heap in heaps.values():
            heapq.heapify(heap)
        self.swept = self.clock - self.cold
        self.moved.update(self.layers)

    def _push(self, e: Rank) -> None:
        self.entry[e[2]] = e
        heapq.heappush(self.heap[e[2][0]], e)
        self.moved.add(e[2][0])

    def score(self, layer: int, expert: int) -> float:
        """The expert's decayed count at the current token."""
        return self.count.get((layer, expert), _UNUSED)[0] / self.unit

    def touch(self, key: ExpertKey) -> None:
        w, t = self.count.get(key, _UNUSED)
        if t != self.token:  # (used again in the same token: the same use)
            w += self.unit
            self.count[key] = (w, self.token)
        self.clock += 1
        e = self.entry[key] = (w, self.clock, key)
        heapq.heappush(self.heap[key[0]], e)
        self.moved.add(key[0])

    def admit(self, key: ExpertKey, speculative: bool = False) -> None:
        if speculative:
            self.cold -= 1
            self._push((self.count.get(key, _UNUSED)[0], self.cold, key))
        else:
            self.touch(key)

    def forget(self, key: ExpertKey) -> None:
        del self.entry[key]
        self.moved.add(key[0])

    def _settle(self) -> None:
        """Before a walk: put back what the last walk passed over, and sweep stale entries when due."""
        for e in self.held:
            if self.entry.get(e[2]) is e:
                self._push(e)
        self.held.clear()
        if self.clock - self.cold - self.swept > len(self.entry) + 1024:
            self._sweep()

    def victims(self, layer: int | None) -> Iterator[ExpertKey]:
        self._settle()
        for lay in self.furthest_first(layer):
            yield from self.in_layer(lay)

    def in_layer(self, layer: int) -> Iterator[ExpertKey]:
        """One layer's resident keys, first to go first; a key the caller keeps is passed over."""
        heap, entry = self.heap[layer], self.entry
        while heap:
            e = heap[0]
            if entry.get(e[2]) is e:
                yield e[2]
                if entry.get(e[2]) is not e:
                    continue
                self.held.append(e)  # kept by the caller: off the heap for the rest of the walk
            heapq.heappop(heap)

    def _first(self, layer: int) -> Rank | None:
        """The layer's live entry ranked first (stale ones on top are dropped)."""
        heap = self.heap[layer]
        while heap:
            e = heap[0]
            if self.entry.get(e[2]) is e:
                return e
            heapq.heappop(heap)
        return None


class NextUse(CycleLFU):
    """Evict the expert whose next use is expected furthest away, over all layers.

    Expected next use, in layer steps = layers until its layer comes again in the cycle (the
    current layer: a whole token) + N × the tokens it is expected to wait for its expert, 1/p − 1,
    with p the expert's routing frequency per token (its decayed count over the decayed token
    count). `cycle` and `cycle-lfu` order layers by position alone, so a prefill that read every
    expert of a few layers locks them in (cycle-lfu then hit less than LRU live: docs/cache-policies.md). Here a
    rarely routed expert of a near layer goes before a hot one of a far layer.

    Within a layer the order is `cycle-lfu`'s (least frequent first); across layers each layer's
    first candidate waits in a heap kept between evictions (`_Heads`), the longest wait on top, a
    tie to the lower layer. Within a token a candidate's wait changes only when its layer's first
    candidate does (a use, an eviction) or when the current layer passes its layer (its distance
    jumps by N; all others shift alike, which keeps their order): only those layers are pushed
    again. A new token changes every frequency: the heap is rebuilt, once a token, O(layers).
    """

    name = "next-use"
    # Faster than cycle-lfu's, chosen on one real model's trace and checked on another it was not tuned to
    # (bench/reports/2026-12-02-real-routing has both; `bmoe-bench policies` replays them)
    DECAY = 0.95

    def __init__(self, layers: Sequence[int]) -> None:
        super().__init__(layers)
        self.start: int | None = None
        self.heads = _Heads(self.layers)
        self.frame: tuple[int, int] | None = None  # (token, current position) the heads are ranked for
        self.seen = 1.0  # the decayed token count in that frame

    def begin(self, layer: int) -> None:
        super().begin(layer)
        if self.start is None:
            self.start = self.token - 1

    def prior(self, frequencies: dict[tuple[int, int], float], tokens: int) -> None:
        """The counts, and a token count that makes them frequencies over `tokens` tokens."""
        super().prior(frequencies, tokens)
        if self.start is None:
            self.start = self.token - max(1, tokens)

    def frequency(self, layer: int, expert: int) -> float:
        """The expert's routing frequency per token (decayed count over decayed token count), clamped."""
        tokens = max(1, self.token - (self.start or 0))
        seen = (1 - self.DECAY ** tokens) / (1 - self.DECAY)
        return min(1.0, max(1e-3, self.score(layer, expert) / seen))

    def _head(self, lay: int) -> None:
        """Rank the layer's first candidate in the current frame by its wait (+ the current position,
        the same for all)."""
        e = self._first(lay)
        if e is None:
            self.heads.push(lay)
            return
        n = len(self.layers)
        p = self.pos[lay]
        assert self.frame is not None  # _refresh set the frame before ranking
        f = min(1.0, max(1e-3, e[0] / self.unit / self.seen))
        wait = (p + n if p <= self.frame[1] else p) + n * (1 / f - 1)
        self.heads.push(lay, -wait, lay)

    def _refresh(self, layer: int | None) -> None:
        """Bring the heads up to the current token and layer."""
        self._settle()
        cur = self.pos.get(layer, 0) if layer is not None else 0  # None: nothing routed yet
        if self.frame is None or self.frame[0] != self.token:
            tokens = max(1, self.token - (self.start or 0))
            self.seen = (1 - self.DECAY ** tokens) / (1 - self.DECAY)
            self.heads.clear()
            self.moved.update(self.layers)
        else:
            lo, hi = sorted((cur, self.frame[1]))
            self.moved.update(self.layers[lo + 1:hi + 1])  # passed by the current layer (or back)
        self.frame = (self.token, cur)
        for lay in self.moved:
            self._head(lay)
        self.moved.clear()

    def victims(self, layer: int | None) -> Iterator[ExpertKey]:
        self._refresh(layer)
        while (lay := self.heads.top()) is not None:
            e = self._first(lay)
            assert e is not None  # a layer is ranked only with a live first entry (_head)
            yield e[2]
            if self.entry.get(e[2]) is e:  # kept by the caller: off the heap for the rest of the walk
                heapq.heappop(self.heap[lay])
                self.held.append(e)
            after = self._first(lay)
            if after is None or after[0] != e[0]:  # (the same count: the same wait, the entry holds)
                self._head(lay)


class Quota(Cycle):
    """Equal per-layer shares: evict from the layer holding the most experts, LRU inside it.

    The layers wait in a heap (`_Heads`) by expert count, the lower position first on a tie: a
    layer is pushed again when its count changed, and an eviction costs O(log layers).
    """

    name = "quota"

    def __init__(self, layers: Sequence[int]) -> None:
        super().__init__(layers)
        self.heads = _Heads(self.layers)
        self.moved: set[int] = set()  # layers whose count changed since the last walk

    def admit(self, key: ExpertKey, speculative: bool = False) -> None:
        super().admit(key, speculative)
        self.moved.add(key[0])

    def forget(self, key: ExpertKey) -> None:
        super().forget(key)
        self.moved.add(key[0])

    def _rank(self, lay: int, left: int) -> None:
        self.heads.push(lay, -left if left else None, self.pos[lay])

    def victims(self, layer: int | None) -> Iterator[ExpertKey]:
        for moved in self.moved:
            self._rank(moved, len(self.by_layer[moved]))
        self.moved.clear()
        walks: dict[int, Iterator[ExpertKey]] = {}
        passed: dict[int, int] = {}  # a layer's experts passed over (kept) in this walk
        while (lay := self.heads.top()) is not None:
            if lay not in walks:
                walks[lay] = _drain(self.by_layer[lay])
            key = next(walks[lay])
            yield key
            if key in self.by_layer[lay]:
                passed[lay] = passed.get(lay, 0) + 1
            self._rank(lay, len(self.by_layer[lay]) - passed.get(lay, 0))  # (the caller may forget several)
            self.moved.add(lay)  # its true count goes back in before the next walk


class Predictive(CycleLFU):
    """`cycle-lfu`, but a expert predicted for the next layers goes only after every other candidate.

    Predictions expire when their layer has passed; a speculative expert that was not used by then
    (a misprediction) sits at its layer's cold end and goes first.
    """

    name = "predict"
    wants_predictions = True

    def __init__(self, layers: Sequence[int]) -> None:
        super().__init__(layers)
        self.predicted: dict[ExpertKey, int] = {}  # key -> token of the prediction

    def predict(self, keys: Iterable[ExpertKey]) -> None:
        for k in keys:
            self.predicted[k] = self.token

    def begin(self, layer: int) -> None:
        super().begin(layer)
        stale = [k for k, t in self.predicted.items() if k[0] == layer or t < self.token - 1]
        for k in stale:
            del self.predicted[k]

    def victims(self, layer: int | None) -> Iterator[ExpertKey]:
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
