"""The expert cache: which experts are resident, in which slot, under a byte budget.

llama.cpp reads expert i of a tensor at `data + i * nb[2]`, with i taken from the layer's routed
ids (`ffn_moe_topk-L`, int32). bmoe points every expert tensor at a pool of slots in the slab
(bmoe.shm_cache) and, once the router's weights are gathered, overwrites the routed ids in place
with slot indices (bmoe.streaming.graph_stops), so ggml reads slot s where the model asked for
expert e. Filling a slot is a read and a few integer writes; there is no mapping to change.

Layout. One pool per kind of expert tensor (gate, up, down, gate_up, ...), shared by every MoE
layer: a slot index names one slot in each kind's pool (a layer's gate, up and down matmuls read
one ids tensor, so an expert holds one index for all its slices), and any expert of any layer
may take any free index. A pool's stride holds the kind's largest slice and two blocks of the
device's direct-I/O alignment (`align`: statx's, often 512 bytes; else a page), rounded to a page
so that no two slots share a page. A slice is read as the aligned superset of its bytes into the
start of its slot; it lands where its layer's tensor reads it when its offset within an aligned
block is the tensor's (every expert of a tensor whose slices are a multiple of `align`), and the
lane that read it moves it there otherwise (`Region.read_order`). So the cache evicts in its
policy's order alone, on every file.

Memory. An expert is charged one index (a slot of every kind) from the moment its read is planned
until it is evicted; evicting takes all its slices, and a freed index keeps its pages for the
next expert (`warm`). Pages are given back (MADV_REMOVE) only when slices in use plus kept pages
would pass the budget (it shrinks, or it was never filled), so the slab's allocated blocks stay
within the budget while steady decode neither frees nor faults in memory. The eviction order
comes from bmoe.streaming.cache_policy, which ranks experts (`(layer, expert)`). With no slab
(trace replays) the same decisions run with no memory.

Safety. `slot_ids` translates through a per-layer table that holds an index only while that
layer's expert holds it: a routed expert without an index raises (the graph is aborted) instead
of computing with whatever a free or reused slot holds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np

from bmoe.base.model_files import EXPERT_TENSOR, ModelFiles, dio_alignment
from bmoe.base.settings import DEFAULT_POLICY
from bmoe.shm_cache import PAGE, Slab
from bmoe.streaming.cache_policy import ExpertKey, Key, Policy, make_policy
from bmoe.streaming.lanes import ReadOrder

ABSENT, LOADING, RESIDENT = 0, 1, 2
# A prompt's last tokens, whose experts the first decode tokens reuse: the prompt's other experts are
# admitted at the cold end (bench/reports/2026-12-03-real-shape-baseline/bytes: the bytes it saves)
WARM_PROMPT_ROWS = 2
SMALL = 64  # up to this many ids (a decode's), Python's set, min and max cost less than numpy's calls


def _up(x: int, to: int) -> int:
    return -(-x // to) * to


@dataclass
class Region:
    """One expert tensor's place in the file and in its kind's pool (set by `layout`)."""

    name: str
    layer: int
    kind: str
    file_index: int
    file_offset: int
    n_expert: int
    expert_bytes: int
    pool_offset: int = 0  # slab offset of its kind's pool
    stride: int = 0  # its kind's slot stride
    align: int = PAGE  # the direct-I/O alignment reads keep
    capacity: int = 1  # slot indices

    @property
    def nbytes(self) -> int:
        return self.n_expert * self.expert_bytes

    @property
    def data_offset(self) -> int:
        """Slab offset of slot 0's expert bytes: the pool plus the offset of the tensor's first expert
        within an aligned block of the file."""
        return self.pool_offset + self.file_offset % self.align

    def slot_pages(self, index: int) -> tuple[int, int]:
        """Slab bytes [start, end) of slot `index` (whole pages, shared with no other slot)."""
        at = self.pool_offset + index * self.stride
        return at, at + self.stride

    def read_order(self, e: int, index: int) -> ReadOrder:
        """Expert e's aligned superset read into the start of slot `index`, and the move that puts its
        bytes where the tensor reads them when its offset within an aligned block is not the tensor's.

        The superset may run past end of file; `needed` (the fifth field) says how much of it must exist."""
        fo = self.file_offset + e * self.expert_bytes
        head = fo % self.align
        at = self.pool_offset + index * self.stride
        want = head + self.expert_bytes
        data = at + self.file_offset % self.align
        move = (at + head, data, self.expert_bytes) if head != self.file_offset % self.align else (0, 0, 0)
        return (self.file_index, fo - head, _up(want, self.align), at, want, *move)

    @property
    def footprint(self) -> int:
        """Slab bytes an expert of this tensor touches in its slot (whole pages): its aligned read
        and its move's destination both end within the slice and two blocks of the slot's start."""
        return min(self.stride, _up(self.expert_bytes + 2 * self.align, PAGE))

    def read_bytes(self, e: int) -> int:
        """What reading expert e's slice costs: its aligned superset."""
        head = (self.file_offset + e * self.expert_bytes) % self.align
        return _up(head + self.expert_bytes, self.align)


def layout(regions: list[Region], spare: bool = False, align: int = PAGE) -> int:
    """Give each kind of expert tensor a pool in the slab, room for every (layer, expert) at once;
    returns the slab size (sparse: only the pages reads fill cost memory).

    With `spare`, each pool has one slot more, its first (index 0): no expert ever takes it, so it
    stays all zeros, what a position lossy routing dropped reads (bmoe.streaming.lossy). It is the
    first so that a layer's matmuls, which see the pool only up to the highest slot they read
    (`Streamer.narrow`), do not see all of it for a dropped position."""
    experts: dict[int, int] = {}
    largest: dict[str, int] = {}
    for r in regions:
        experts[r.layer] = max(experts.get(r.layer, 0), r.n_expert)
        largest[r.kind] = max(largest.get(r.kind, 0), r.expert_bytes)
    capacity = sum(experts.values()) + int(spare)
    pools: dict[str, tuple[int, int]] = {}  # kind -> (offset, stride)
    cursor = 0
    for kind in sorted(largest):
        stride = _up(largest[kind] + 2 * align, PAGE)
        pools[kind] = (cursor, stride)
        cursor += capacity * stride
    for r in regions:
        r.pool_offset, r.stride = pools[r.kind]
        r.align, r.capacity = align, capacity
    return max(cursor, PAGE)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    def snapshot(self) -> tuple[int, int]:
        """(hits, lookups) so far, for per-token differences."""
        return self.hits, self.hits + self.misses

    @property
    def hit_pct(self) -> float:
        total = self.hits + self.misses
        return 100.0 * self.hits / total if total else 0.0


class ExpertCache:
    """Experts (their slices) under a byte budget; a policy (bmoe.streaming.cache_policy) picks what goes.

    An expert holds one slot index from the moment its read is planned until it is evicted, and is
    charged the pages its slices touch there (`charge`: its layer's, not the largest layer's); it is
    RESIDENT once every slice has landed. A free index keeps its pages for the next expert; one taken
    by an expert that touches fewer gives the rest back, so pages held and kept stay what is charged.
    The experts the current layer is about to use are pinned: they may push residency past the
    budget by at most one layer's routed set, never get evicted under the matmul that needs them.
    An expert with a slice loading is never evicted: a lane is writing its slot. Hits and misses
    are counted per routed expert.

    Experts read on a prediction (`admit_speculative`) enter the policy's order at the cold end;
    a real hit promotes them. Until their layer next routes they are "expected" and evicted only
    when nothing else can go; a prediction the layer did not route is then left cold, so
    mispredictions are the first to leave. A prompt's experts that its last WARM_PROMPT_ROWS tokens
    did not route (`plan`'s `cold`) enter at the cold end too: decode evicts them first.

    `slab` is None in trace replays: the same decisions, no memory behind them.
    """

    def __init__(self, slab: Slab | None, regions: list[Region], budget: int,
                 policy: str | Policy = DEFAULT_POLICY, spare: bool = False) -> None:
        """`spare`: the regions were laid out with the spare slot (index 0), which no expert takes."""
        self.slab = slab
        self.regions = regions
        self.budget = budget
        self.by_layer: dict[int, list[int]] = {}
        for i, r in enumerate(regions):
            self.by_layer.setdefault(r.layer, []).append(i)
        first = {layer: regions[idxs[0]] for layer, idxs in self.by_layer.items()}
        self.pools = list({r.kind: r for r in regions}.values())  # one slot of each kind: what an index holds
        # per layer: the pages each kind's slice touches, and what an expert is charged
        self.pages = {layer: {regions[i].kind: regions[i].footprint for i in idxs}
                      for layer, idxs in self.by_layer.items()}
        self.charge = expert_charges(regions)
        self.capacity = regions[0].capacity if regions else 1
        self.state = [bytearray(r.n_expert) for r in regions]  # per slice: ABSENT, LOADING or RESIDENT
        self.policy = make_policy(policy, sorted(self.by_layer)) if isinstance(policy, str) else policy
        self.used = 0
        self.stats = CacheStats()
        self.resident = {layer: bytearray(r.n_expert) for layer, r in first.items()}  # 1: every slice landed
        self.resident_in_layer = dict.fromkeys(self.by_layer, 0)  # experts resident
        self.total = sum(len(t) * self.charge[layer] for layer, t in self.resident.items())
        self.defer_release = False
        self.pinned: set[ExpertKey] = set()
        self.speculative: set[ExpertKey] = set()  # loading on a prediction
        self.prompt_only: set[ExpertKey] = set()  # loading for a prompt whose last tokens did not route it
        self.expected: dict[int, set[ExpertKey]] = {layer: set() for layer in self.by_layer}
        self.doomed: set[ExpertKey] = set()  # a cancelled read left it part-read: dropped once nothing is loading
        self.index_of: dict[ExpertKey, int] = {}  # expert -> slot index
        self.table = {layer: np.full(r.n_expert, -1, dtype=np.int32) for layer, r in first.items()}
        self.moved = dict.fromkeys(self.by_layer, 0)  # per layer: indices freed so far (direct binding's check)
        self.warm: list[int] = []  # free indices whose pages are kept
        self.warm_bytes = 0  # their pages
        self.kept_for: dict[int, int] = {}  # index -> the layer whose expert's pages it holds (held or kept)
        self.cold: list[int] = []  # free indices whose pages were given back
        self.spare = spare
        self.fresh = int(spare)  # indices below it were all handed out at least once (or are the spare)
        self.ever = bytearray(self.capacity)  # 1: the index was handed out (it is held, or on a free list)
        if spare:
            self.ever[0] = 1
        # each expert's own index (home[layer] + e), which it takes while the budget holds every expert and
        # no other expert holds it: a layer complete at its own indices is read by its own ids
        self.home: dict[int, int] = {}
        at = int(spare)
        for layer in sorted(first):
            self.home[layer], at = at, at + first[layer].n_expert
        self.giving_back: list[int] = []  # free indices whose pages are to be given back
        self.on_assign: Callable[[int, int, int], None] | None = None  # (layer, expert, index): bias rows
        # the usage profile: times each expert was routed, of its layer's routings (Python ints: a routing
        # stop adds a few, where a numpy update costs more than the rest of a hit's bookkeeping)
        self.routed = {layer: [0] * r.n_expert for layer, r in first.items()}
        self.routings = dict.fromkeys(self.by_layer, 0)

    @property
    def holds_everything(self) -> bool:
        return self.budget >= self.total

    def set_budget(self, budget: int) -> None:
        """A new budget, in force at once: evict in the policy's order (never a pinned or loading
        expert) and give back the pages of free indices until experts held and pages kept fit it."""
        self.budget = budget
        self._make_room(0, protect_expected=False)
        self._fit_kept()
        self.release_evicted()

    def reset_stats(self) -> None:
        """Start counting afresh (after a preload or a replay's prefill pass, which are not decode)."""
        self.stats = CacheStats()
        for c in self.routed.values():
            c[:] = [0] * len(c)
        self.routings = dict.fromkeys(self.routings, 0)

    def residency(self) -> list[tuple[int, str]]:
        """Per layer, in order, one character per expert: '1' when it is resident, '0' otherwise (what a
        live view draws as a heat map; read between steps, or racing one harmlessly)."""
        return [(layer, (np.frombuffer(bytes(res), np.uint8) + ord("0")).tobytes().decode())
                for layer, res in sorted(self.resident.items())]

    def layer_complete(self, layer: int) -> bool:
        """Every expert of the layer is resident and, with a budget that holds all, stays so."""
        return self.holds_everything and self.resident_in_layer[layer] == len(self.resident[layer])

    def direct_base(self, layer: int) -> int | None:
        """b when expert e of the layer sits at index b + e for every e: ggml may then read the
        layer's experts by their own ids from the pool shifted by b slots, with no remap."""
        idx = self.table[layer]
        shift = idx - np.arange(len(idx), dtype=np.int32)
        return int(shift[0]) if idx.min() >= 0 and (shift == shift[0]).all() else None

    def n_expert(self, layer: int) -> int:
        """The experts the layer routes among (its table has an entry for each)."""
        return len(self.table[layer])

    def count_hits(self, layer: int, n_experts: int) -> None:
        """Account a routing that was not looked at because the whole layer is resident."""
        self.stats.hits += n_experts

    def layer_slices(self, layer: int, experts: list[int]) -> list[Key]:
        return [(layer, ri, e) for ri in self.by_layer.get(layer, ()) for e in experts]

    def slot_ids(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """The slot index of every routed expert id, same shape: what ggml must read instead."""
        slots = self.table[layer][ids]
        if slots.size and lowest(slots) < 0:
            bad = sorted({int(e) for e in ids[slots < 0]})
            raise RuntimeError(f"layer {layer} routed to experts {bad} that hold no slot")
        return slots

    def spare_slot(self, layer: int) -> int:
        """The pools' spare slot (laid out with `spare`): all zeros, never an expert's."""
        assert self.spare, "the pools were laid out without a spare slot"
        return 0

    def slice_offset(self, ri: int, e: int) -> int:
        """Slab offset of expert e's bytes of region ri, in the slot its expert holds."""
        r = self.regions[ri]
        return r.data_offset + self.index_of[(r.layer, e)] * r.stride

    def read_order(self, key: Key) -> ReadOrder:
        """The read that fills a LOADING slice's slot."""
        layer, ri, e = key
        return self.regions[ri].read_order(e, self.index_of[(layer, e)])

    def read_bytes(self, key: Key) -> int:
        """Bytes the read of a slice moves from flash."""
        return self.regions[key[1]].read_bytes(key[2])

    def plan(self, layer: int, experts: list[int], cold: Collection[int] = ()) -> list[Key]:
        """Count hits, pin the layer's experts, make room; returns the slices that must be read now.

        A wanted expert already loading (a speculative read in flight) is counted as a miss and
        its slices not returned: the caller waits for the reads under way. Those of `cold` read now
        enter the policy's order at the cold end (a prompt's experts its last tokens did not route)."""
        counts = self.routed[layer]
        for e in experts:
            counts[e] += 1
        self.routings[layer] += 1
        self.pinned = {(layer, e) for e in experts}
        self.expected[layer].clear()
        self.policy.begin(layer)
        resident, touch = self.resident[layer], self.policy.touch
        hits = 0
        new: list[int] = []
        missing: list[Key] = []
        for e in experts:
            if resident[e]:
                hits += 1
                touch((layer, e))
                continue
            key = (layer, e)
            self.speculative.discard(key)  # demanded now: commit makes it hot
            self.prompt_only.discard(key)
            self.doomed.discard(key)
            if key in self.index_of:  # loading, or part-read after a cancel: read what is absent
                missing += [k for k in self.layer_slices(layer, [e]) if self.state[k[1]][e] == ABSENT]
            else:
                new.append(e)
        self.stats.hits += hits
        self.stats.misses += len(experts) - hits
        if new:
            self._reserve(layer, new)
            missing += self.layer_slices(layer, new)
            if cold:
                self.prompt_only.update((layer, e) for e in new if e in cold)
        for _, ri, e in missing:
            self._loading(ri, e)
        return missing

    def fits(self, layer: int, expert: int) -> bool:
        """The expert can be read without evicting anything (it holds an index already, or one fits)."""
        return (layer, expert) in self.index_of or self.used + self.charge[layer] <= self.budget

    def admit_speculative(self, layer: int, experts: list[int]) -> list[Key]:
        """Reserve room for a predicted read of the experts that hold no index; returns what to read.

        Room is made only from experts nobody expects or pins, so a prediction never pushes out
        demand or another prediction."""
        self.predict(layer, experts)
        out: list[Key] = []
        for e in experts:
            key = (layer, e)
            if key in self.index_of or not self._make_room(self.charge[layer], protect_expected=True):
                continue
            self._reserve(layer, [e])
            self.speculative.add(key)
            keys = self.layer_slices(layer, [e])
            for _, ri, x in keys:
                self._loading(ri, x)
            out += keys
        return out

    def _loading(self, ri: int, e: int) -> None:
        self.state[ri][e] = LOADING

    def _reserve(self, layer: int, experts: list[int]) -> None:
        """Indices for these experts (which hold none), room made first: demand may go over by the pinned set."""
        need = self.charge[layer] * len(experts)
        if not self._make_room(need, protect_expected=True):
            self._make_room(need, protect_expected=False)
        self.used += need
        for e in experts:
            index = self._own_index(layer, e)
            if index is None:
                index = self._take(layer)
            self.index_of[(layer, e)] = index
            self.table[layer][e] = index
            if self.on_assign is not None:
                self.on_assign(layer, e, index)

    def _own_index(self, layer: int, e: int) -> int | None:
        """The expert's own index while the budget holds every expert, unless another expert holds it
        (None then): never handed out, or taken off the free list it waits on."""
        index = self.home[layer] + e
        if not self.holds_everything:
            return None
        if not self.ever[index]:
            self.ever[index] = 1
        elif index in self.warm:
            self.warm.remove(index)
            return self._reuse(index, layer)
        elif index in self.cold:
            self.cold.remove(index)
        elif index in self.giving_back:
            self.giving_back.remove(index)
        else:
            return None
        self.kept_for[index] = layer
        return index

    def _take(self, layer: int) -> int:
        """A free index for an expert of `layer`: one that kept its pages if any (the pages beyond
        what this expert touches given back), else one given back, else a new one (pages kept by
        others are given back first when held and kept would pass the budget)."""
        if self.warm:
            return self._reuse(self.warm.pop(), layer)
        index = self._cold_index()
        self.kept_for[index] = layer
        return index

    def _reuse(self, index: int, layer: int) -> int:
        """A free index that kept its pages, for an expert of `layer`: the pages beyond what it touches
        are given back."""
        before = self.kept_for[index]
        self.warm_bytes -= self.charge[before]
        self.kept_for[index] = layer
        if self.slab is not None and before != layer:
            had, fits = self.pages[before], self.pages[layer]
            for r in self.pools:
                start, _ = r.slot_pages(index)
                if had.get(r.kind, 0) > fits.get(r.kind, 0):
                    self.slab.release(start + fits.get(r.kind, 0), start + had[r.kind])
        return index

    def _cold_index(self) -> int:
        """A free index holding no pages."""
        self._fit_kept()
        if not self.defer_release:
            self.release_evicted()
        if self.cold:
            return self.cold.pop()
        if self.giving_back:  # (an index still on its way back: use it, the slab stays bounded)
            return self.giving_back.pop()
        # (never more indices than experts are held at once, all of them at most: the spare, index 0,
        # lossy routing's zeros, is marked handed out from the start and never is)
        while self.fresh < self.capacity and self.ever[self.fresh]:  # (taken as some expert's own)
            self.fresh += 1
        index = self.fresh
        if index >= self.capacity:
            raise RuntimeError(f"slot indices exhausted ({index} of {self.capacity})")
        self.fresh += 1
        self.ever[index] = 1
        return index

    def _fit_kept(self) -> None:
        """Give back kept pages (the most recently freed last) until held and kept fit the budget."""
        while self.warm and self.used + self.warm_bytes > self.budget:
            index = self.warm.pop(0)
            self.warm_bytes -= self.charge[self.kept_for.pop(index)]
            self.giving_back.append(index)

    def _make_room(self, need: int, protect_expected: bool) -> bool:
        """Evict in the policy's order until `need` more bytes fit; False if it cannot."""
        if self.used + need <= self.budget:
            return True
        for key in self.policy.victims(self.policy.layer):
            if self.used + need <= self.budget:
                break
            if key in self.pinned or (protect_expected and key in self.expected[key[0]]) \
                    or not self.resident[key[0]][key[1]]:
                continue
            self._evict(key)
        return self.used + need <= self.budget

    def _evict(self, key: ExpertKey) -> None:
        layer, e = key
        self.policy.forget(key)
        self.expected[layer].discard(key)
        self.resident[layer][e] = 0
        self.resident_in_layer[layer] -= 1
        self.stats.evictions += 1
        for ri in self.by_layer[layer]:
            self.state[ri][e] = ABSENT
        self._free(key)

    def _free(self, key: ExpertKey) -> None:
        """The expert holds nothing any more: its index is free, pages kept."""
        layer, e = key
        index = self.index_of.pop(key)
        self.table[layer][e] = -1
        self.moved[layer] += 1
        self.used -= self.charge[layer]
        self.warm.append(index)
        self.warm_bytes += self.charge[layer]

    def abandon(self, slices: list[Key]) -> None:
        """Reads of these LOADING slices were cancelled before they started: absent again. An expert
        with nothing landed or loading any more gives its index back; one part-read waits (`doomed`)
        for its other reads, or for a routing that reads the rest."""
        for layer, ri, e in slices:
            key = (layer, e)
            self.state[ri][e] = ABSENT
            self.doomed.add(key)
            self._drop_if_doomed(key)

    def commit(self, slices: list[Key]) -> None:
        """The reads of these LOADING slices completed: an expert whose every slice has landed is resident."""
        for layer, ri, e in slices:
            self.state[ri][e] = RESIDENT
            key = (layer, e)
            if key in self.doomed:
                self._drop_if_doomed(key)
                continue
            if all(self.state[i][e] == RESIDENT for i in self.by_layer[layer]):
                self.resident[layer][e] = 1
                self.resident_in_layer[layer] += 1
                spec = key in self.speculative
                self.policy.admit(key, speculative=spec or key in self.prompt_only)
                self.prompt_only.discard(key)
                if spec:
                    self.speculative.discard(key)
                    self.expected[layer].add(key)

    def _drop_if_doomed(self, key: ExpertKey) -> None:
        """A part-read expert nobody demands is dropped once none of its reads is in flight."""
        layer, e = key
        if any(self.state[ri][e] == LOADING for ri in self.by_layer[layer]):
            return
        for ri in self.by_layer[layer]:
            self.state[ri][e] = ABSENT
        self.doomed.discard(key)
        self.speculative.discard(key)
        self.prompt_only.discard(key)
        self._free(key)

    def predict(self, layer: int, experts: list[int]) -> None:
        """Tell the policy which experts a predictor expects at `layer` soon (prediction-aware policies keep them)."""
        self.policy.predict([(layer, e) for e in experts])

    @property
    def pending_release(self) -> bool:
        return bool(self.giving_back)

    def release_evicted(self) -> None:
        """Give back the pages of the free indices `_fit_kept` queued: MADV_REMOVE on every pool's slot.

        With `defer_release` the coordinator calls this while lanes read, so the system calls
        overlap with I/O."""
        for index in self.giving_back:
            if self.slab is not None:
                for r in self.pools:
                    self.slab.release(*r.slot_pages(index))
            self.cold.append(index)
        self.giving_back.clear()


def lowest(a: np.ndarray) -> int:
    """a.min(), for a routing's few ids or a prompt's many."""
    return min(a.ravel().tolist()) if a.size <= SMALL else int(a.min())


def highest(a: np.ndarray) -> int:
    """a.max(), for a routing's few ids or a prompt's many."""
    return max(a.ravel().tolist()) if a.size <= SMALL else int(a.max())


def expert_charges(regions: list[Region]) -> dict[int, int]:
    """Per MoE layer, what one of its experts is charged: the pages its slices touch in their slots."""
    charge: dict[int, int] = {}
    for r in regions:
        charge[r.layer] = charge.get(r.layer, 0) + r.footprint
    return charge


def working_sets(regions: list[Region], top_k: int) -> dict[int, int]:
    """Per MoE layer, the bytes its `top_k` experts are charged (the pages their slices touch in their
    slots, as the cache charges them).

    A decode token visits the layers in a fixed cycle, so a budget below their sum evicts,
    somewhere in the cycle, experts the next token needs again: the cache only thrashes.
    """
    n_expert: dict[int, int] = {}
    for r in regions:
        n_expert[r.layer] = max(n_expert.get(r.layer, 0), r.n_expert)
    charge = expert_charges(regions)
    return {layer: min(top_k, n) * charge[layer] for layer, n in n_expert.items()}


def file_regions(files: ModelFiles) -> list[Region]:
    """The expert regions of a model read from its GGUF table alone (no llama.cpp load), laid out as
    a running cache lays them out (for the files' direct-I/O alignment)."""
    regions = []
    for name, ext in sorted(files.extents.items()):
        m = EXPERT_TENSOR.match(name)
        if m and files.n_expert > 1:
            layer, kind = int(name.split(".")[1]), name.split(".")[2]
            regions.append(Region(name, layer, kind, ext.file_index, ext.offset, files.n_expert,
                                  ext.nbytes // files.n_expert))
    layout(regions, align=dio_alignment(files.paths))
    return regions
