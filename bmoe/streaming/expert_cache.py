"""The expert cache: which expert slices are resident, in which slot, under a byte budget.

llama.cpp reads expert i of a tensor at `data + i * nb[2]`, with i taken from the layer's routed
ids (`ffn_moe_topk-L`, int32). bmoe points every expert tensor at a pool of slots in the slab
(bmoe.shm_cache) and, once the router's weights are gathered, overwrites the routed ids in place
with slot indices (bmoe.seam), so ggml reads slot s where the model asked for expert e. Filling a
slot is a read and a few integer writes; there is no mapping to change.

Layout. Layers whose expert tensors have the same kinds and sizes form a group; the group's
slot indices are shared by its layers, so a slot given up by one layer is reused by another
without a system call. One index names one slot in each kind's pool (the gate, up and down
matmuls of a layer read the same ids tensor, so an expert has one index for all its slices).
A pool's stride is the expert's size plus two pages, and a tensor looks at its pool from the
offset its first expert has within a page of the file: an O_DIRECT read of an expert's
4 KiB-aligned superset then lands with its bytes where ggml reads them, and the supersets of
neighbouring slots never share a page. When an expert's size is not a multiple of a page its
experts start at different offsets within a page; an expert may then only take an index of its
own class (index ≡ expert mod the group's `period`), which keeps those offsets. The class of a
4 KiB-multiple expert (real K-quant models) is the one class there is.

Memory. A slice is charged its slot from the moment its read is planned (LOADING) until it is
evicted; eviction takes the expert's other resident slices with it, and an index freed keeps its
pages for the next read of its class (`warm`). A read whose class has no free index evicts an
expert of its class (the policy's first) rather than give another class's pages back, so steady
decode neither frees nor faults in memory. Pages are given back (MADV_REMOVE) only when no expert
of the class can go (the mix of groups shifts, the budget shrinks), so the slab's allocated blocks
stay within the budget. The eviction order comes from bmoe.streaming.cache_policy. With
no slab (trace replays) the same decisions run with no memory.

Safety. `slot_ids` translates through a per-layer table that holds an index only while that
layer's expert holds it: a routed expert without an index raises (the graph is aborted) instead
of computing with whatever a free or reused slot holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import gcd

import numpy as np

from bmoe.base.model_files import EXPERT_TENSOR, ModelFiles
from bmoe.base.settings import DEFAULT_POLICY
from bmoe.shm_cache import PAGE, Slab
from bmoe.streaming.cache_policy import Key, Policy, make_policy

ABSENT, LOADING, RESIDENT = 0, 1, 2


def _down(x: int) -> int:
    return x - x % PAGE


def _up(x: int) -> int:
    return -(-x // PAGE) * PAGE


@dataclass
class Region:
    """One expert tensor's place in the file and in its group's pool (set by `layout`)."""

    name: str
    layer: int
    kind: str
    file_index: int
    file_offset: int
    n_expert: int
    expert_bytes: int
    group: int = 0
    pool_offset: int = 0  # slab offset of the pool this tensor's kind has in its group
    period: int = 1  # the group's: index s may hold expert e only when s % period == e % period
    capacity: int = 1  # the group's slot indices

    @property
    def nbytes(self) -> int:
        return self.n_expert * self.expert_bytes

    @property
    def slot_bytes(self) -> int:
        """Pool stride: the expert and two pages, so that whatever in-page offset the group's tensors
        of this kind start at, the aligned supersets of neighbouring slots never share a page."""
        return self.expert_bytes + 2 * PAGE

    @property
    def data_offset(self) -> int:
        """Slab offset of slot 0's expert bytes: the pool plus the in-page offset of the file's expert 0."""
        return self.pool_offset + self.file_offset % PAGE

    def slot_pages(self, index: int) -> tuple[int, int]:
        """Slab bytes [start, end) that reads into slot `index` of this pool can touch, whichever tensor."""
        at = self.pool_offset + index * self.slot_bytes
        return _down(at), _up(at + self.expert_bytes + PAGE)

    def read_order(self, e: int, at: int) -> tuple[int, int, int, int, int]:
        """(file index, file offset, length, slab offset, needed) of expert e's aligned superset, read
        so that its bytes land at slab offset `at`.

        `needed` is how many of those bytes must exist in the file: the superset
        may run past end of file, the slice itself may not.
        """
        fo = self.file_offset + e * self.expert_bytes
        head = fo % PAGE
        if at % PAGE != head:
            raise RuntimeError(f"{self.name} expert {e}: slot at {at} is not at the file's in-page offset {head}")
        return self.file_index, fo - head, _up(head + self.expert_bytes), at - head, head + self.expert_bytes


def layout(regions: list[Region], spare: bool = False) -> int:
    """Group the layers by their tensors' kinds and sizes and give each kind of each group a pool in
    the slab, room for every (layer, expert) of the group at once; returns the slab size (sparse:
    only the pages reads fill cost memory).

    With `spare`, each pool has one slot more, its last (`capacity - 1`): no expert ever takes it
    (indices are handed out per class below it), so it stays all zeros, what a position lossy
    routing dropped reads (bmoe.streaming.lossy)."""
    by_layer: dict[int, list[Region]] = {}
    for r in regions:
        by_layer.setdefault(r.layer, []).append(r)
    groups: dict[tuple, list[int]] = {}
    for layer, regs in sorted(by_layer.items()):
        sig = (regs[0].n_expert, *sorted((r.kind, r.expert_bytes) for r in regs))
        groups.setdefault(sig, []).append(layer)
    cursor = 0
    for g, (group_sig, layers) in enumerate(groups.items()):
        n_expert, kinds = group_sig[0], group_sig[1:]
        period = max(PAGE // gcd(size, PAGE) for _, size in kinds)
        capacity = len(layers) * period * -(-n_expert // period) + int(spare)
        pools: dict[str, int] = {}
        for kind, size in kinds:
            pools[kind] = cursor
            cursor = _up(cursor + capacity * (size + 2 * PAGE) + PAGE)
        for layer in layers:
            for r in by_layer[layer]:
                r.group, r.pool_offset, r.period, r.capacity = g, pools[r.kind], period, capacity
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
    """(layer, tensor, expert) slices under a byte budget; a policy (bmoe.streaming.cache_policy) picks what goes.

    A slice is charged its slot from the moment its read is planned (LOADING)
    until it is evicted. An expert holds one slot index (`index_of`, and the
    layer's `table` the remap reads) while any of its slices is not ABSENT; a freed
    index keeps its pages for the next read of its class, and the slab's pages
    (slices charged + free indices kept) stay within the budget, even with reads
    in flight. The slices the current layer is about to use are pinned: they may
    push residency past the budget by at most one layer's routed set, never get
    evicted under the matmul that needs them. A LOADING slice is never evicted: a
    lane is writing its slot. Evicting a slice evicts its expert's other resident,
    unpinned slices too: an index is freed only when the whole expert is gone.

    Slices read on a prediction (`admit_speculative`) enter the policy's order at
    the cold end; a real hit promotes them. Until their layer next routes they are
    "expected" and evicted only when nothing else can go; a prediction the layer
    did not route is then left cold, so mispredictions are the first to leave.

    `slab` is None in trace replays: the same decisions, no memory behind them.
    """

    def __init__(self, slab: Slab | None, regions: list[Region], budget: int,
                 policy: str | Policy = DEFAULT_POLICY) -> None:
        self.slab = slab
        self.regions = regions
        self.budget = budget
        self.slot_size = [r.slot_bytes for r in regions]
        self.by_layer: dict[int, list[int]] = {}
        for i, r in enumerate(regions):
            self.by_layer.setdefault(r.layer, []).append(i)
        first = {layer: regions[idxs[0]] for layer, idxs in self.by_layer.items()}
        self.group_of = {layer: r.group for layer, r in first.items()}
        self.period = {r.group: r.period for r in regions}
        # group -> one region per kind (any layer's: the pool geometry is the kind's)
        self.pools: dict[int, list[Region]] = {}
        self.index_bytes: dict[int, int] = {}  # group -> what a full slot index holds: one slot in each kind's pool
        for layer, idxs in self.by_layer.items():
            g = self.group_of[layer]
            if g not in self.pools:
                self.pools[g] = [regions[i] for i in idxs]
                self.index_bytes[g] = sum(self.slot_size[i] for i in idxs)
        self.state = [bytearray(r.n_expert) for r in regions]
        self.policy = make_policy(policy, sorted(self.by_layer)) if isinstance(policy, str) else policy
        self.used = 0
        self.stats = CacheStats()
        self.resident_in_layer = {layer: 0 for layer in self.by_layer}
        self.slices_in_layer = {layer: sum(regions[i].n_expert for i in idxs) for layer, idxs in self.by_layer.items()}
        self.total = sum(self.slot_size[ri] * r.n_expert for ri, r in enumerate(regions))
        self.defer_release = False
        self.pinned: set[Key] = set()
        self.speculative: set[Key] = set()  # LOADING on a prediction
        self.expected: dict[int, set[Key]] = {layer: set() for layer in self.by_layer}
        self.index_of: dict[tuple[int, int], int] = {}  # (layer, expert) -> slot index in its group
        self.held: dict[tuple[int, int], int] = {}  # (layer, expert) -> its slices not ABSENT
        self.table = {layer: np.full(r.n_expert, -1, dtype=np.int32) for layer, r in first.items()}
        self.moved = dict.fromkeys(self.by_layer, 0)  # per layer: indices freed so far (direct binding's check)
        self.warm: dict[tuple[int, int], list[int]] = {}  # (group, class) -> free indices whose pages are kept
        self.warm_bytes = 0
        self.cold: dict[tuple[int, int], list[int]] = {}  # (group, class) -> free indices whose pages were given back
        self.fresh: dict[tuple[int, int], int] = {}  # (group, class) -> indices of the class handed out so far
        self.giving_back: list[tuple[int, int]] = []  # (group, index): free, pages to give back
        self.top = 0  # slab bytes handed out as slot indices so far
        self.on_assign: Callable[[int, int, int], None] | None = None  # (layer, expert, index): bias rows
        self.routed = {layer: np.zeros(r.n_expert, dtype=np.int64) for layer, r in first.items()}  # the usage profile:
        self.routings = dict.fromkeys(self.by_layer, 0)  # times each expert was routed, of its layer's routings

    @property
    def holds_everything(self) -> bool:
        return self.budget >= self.total

    def set_budget(self, budget: int) -> None:
        """A new budget, in force at once: evict in the policy's order (never a pinned or loading
        slice) and give back the pages of free indices until slices in use and kept fit it."""
        self.budget = budget
        self._make_room(0, protect_expected=False)
        while self.warm_bytes and self.used + self.warm_bytes > self.budget:
            self._give_back_one()
        self.release_evicted()

    def reset_stats(self) -> None:
        """Start counting afresh (after a preload or a replay's prefill pass, which are not decode)."""
        self.stats = CacheStats()
        for c in self.routed.values():
            c[:] = 0
        self.routings = dict.fromkeys(self.routings, 0)

    def residency(self) -> list[tuple[int, str]]:
        """Per layer, in order, one character per expert: '1' when every slice of it is resident, '0'
        otherwise (what a live view draws as a heat map; read between steps, or racing one harmlessly)."""
        out = []
        for layer, idxs in sorted(self.by_layer.items()):
            whole = np.logical_and.reduce([np.frombuffer(bytes(self.state[ri]), np.uint8) == RESIDENT for ri in idxs])
            out.append((layer, (whole.astype(np.uint8) + ord("0")).tobytes().decode()))
        return out

    def layer_complete(self, layer: int) -> bool:
        """Every expert of the layer is resident and, with a budget that holds all, stays so."""
        return self.holds_everything and self.resident_in_layer[layer] == self.slices_in_layer[layer]

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
        n = n_experts * len(self.by_layer[layer])
        self.stats.hits += n

    def charge(self, ri: int, e: int) -> int:
        return self.slot_size[ri]

    def layer_slices(self, layer: int, experts: list[int]) -> list[Key]:
        return [(layer, ri, e) for ri in self.by_layer.get(layer, ()) for e in experts]

    def slot_ids(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """The slot index of every routed expert id, same shape: what ggml must read instead."""
        slots = self.table[layer][ids]
        if slots.size and slots.min() < 0:
            bad = sorted({int(e) for e in ids[slots < 0]})
            raise RuntimeError(f"layer {layer} routed to experts {bad} that hold no slot")
        return slots

    def spare_slot(self, layer: int) -> int:
        """The layer's pools' spare slot (laid out with `spare`): all zeros, never an expert's."""
        return self.regions[self.by_layer[layer][0]].capacity - 1

    def slice_offset(self, ri: int, e: int) -> int:
        """Slab offset of expert e's bytes of region ri, in the slot its expert holds."""
        r = self.regions[ri]
        return r.data_offset + self.index_of[(r.layer, e)] * r.slot_bytes

    def plan(self, layer: int, experts: list[int]) -> list[Key]:
        """Count hits, pin the layer's slices, make room; returns the slices that must be read now.

        A wanted slice already LOADING (a speculative read in flight) is counted as
        a miss but not returned: the caller waits for the read that is under way.
        """
        want = self.layer_slices(layer, experts)
        self.routed[layer][experts] += 1
        self.routings[layer] += 1
        self.pinned = set(want)
        self.expected[layer].clear()
        missing = []
        self.policy.begin(layer)
        for key in want:
            st = self.state[key[1]][key[2]]
            if st == RESIDENT:
                self.stats.hits += 1
                self.policy.touch(key)
            else:
                self.stats.misses += 1
                if st == ABSENT:
                    missing.append(key)
                else:
                    self.speculative.discard(key)  # demanded now: commit makes it hot
        self._reserve(missing)
        return missing

    def fits(self, layer: int, expert: int) -> bool:
        """The expert's absent slices fit the budget without evicting anything."""
        need = sum(self.charge(ri, expert) for ri in self.by_layer[layer] if self.state[ri][expert] == ABSENT)
        return self.used + need <= self.budget

    def admit_speculative(self, layer: int, experts: list[int]) -> list[Key]:
        """Reserve room for a predicted read of the experts' absent slices; returns what to read.

        All of an expert's slices or none: room is made only from slices nobody
        expects or pins, so a prediction never pushes out demand or another prediction.
        """
        self.predict(layer, experts)
        out: list[Key] = []
        for e in experts:
            keys = [k for k in self.layer_slices(layer, [e]) if self.state[k[1]][k[2]] == ABSENT]
            need = sum(self.charge(ri, x) for _, ri, x in keys)
            if not keys or not self._make_room(need, protect_expected=True):
                continue
            self._reserve(keys)
            self.speculative.update(keys)
            out += keys
        return out

    def read_order(self, key: Key) -> tuple[int, int, int, int, int]:
        """The read that fills a LOADING slice's slot."""
        return self.regions[key[1]].read_order(key[2], self.slice_offset(key[1], key[2]))

    def _reserve(self, keys: list[Key]) -> None:
        need = sum(self.charge(ri, e) for _, ri, e in keys)
        if not self._make_room(need, protect_expected=True):
            self._make_room(need, protect_expected=False)  # demand may go over by the pinned set
        self.used += need
        for layer, ri, e in keys:
            self.state[ri][e] = LOADING
            self._hold(layer, e)

    def _hold(self, layer: int, e: int) -> None:
        """One more slice of the expert is not ABSENT: the first one takes a slot index."""
        held = self.held.get((layer, e), 0)
        self.held[(layer, e)] = held + 1
        if held:
            return
        index = self._take(self.group_of[layer], e % self.period[self.group_of[layer]])
        self.index_of[(layer, e)] = index
        self.table[layer][e] = index
        if self.on_assign is not None:
            self.on_assign(layer, e, index)

    def _unhold(self, layer: int, e: int) -> None:
        """One slice of the expert became ABSENT: the last one frees its index, pages kept."""
        held = self.held.pop((layer, e)) - 1
        if held:
            self.held[(layer, e)] = held
            return
        g = self.group_of[layer]
        index = self.index_of.pop((layer, e))
        self.table[layer][e] = -1
        self.moved[layer] += 1
        self.warm.setdefault((g, index % self.period[g]), []).append(index)
        self.warm_bytes += self.index_bytes[g]

    def _take(self, g: int, cls: int) -> int:
        """A free index of the class: one that kept its pages if any, else new pages, after giving back
        kept pages of other classes so that slices in use + kept stay within the budget."""
        key = (g, cls)
        size = self.index_bytes[g]
        if not self.warm.get(key) and self.warm_bytes and self.used + self.warm_bytes > self.budget:
            self._evict_for(g, cls)  # rather than give back another class's pages and fault in new ones
        if self.warm.get(key):
            self.warm_bytes -= size
            return self.warm[key].pop()
        while self.used + self.warm_bytes > self.budget and self.warm_bytes:
            self._give_back_one()
        if not self.defer_release or (not self.cold.get(key) and key in {(gb, s % self.period[gb])
                                                                          for gb, s in self.giving_back}):
            self.release_evicted()  # (an index of this class still on its way back: use it, the slab stays bounded)
        if self.cold.get(key):
            return self.cold[key].pop()
        j = self.fresh.get(key, 0)
        self.fresh[key] = j + 1
        index = cls + j * self.period[g]
        if index >= self.pools[g][0].capacity:
            raise RuntimeError(f"slot indices of group {g} exhausted ({index})")
        self.top += size
        return index

    def _evict_for(self, g: int, cls: int) -> None:
        """Evict, in the policy's order, the first whole expert whose index is of this class: a free
        index of another class then stays warm for the next read of its class, where giving its
        pages back would cost a system call now and page faults in the lane later (the cache holds
        one expert fewer until that read). Nothing pinned or expected is taken."""
        for key in self.policy.victims(self.policy.layer):
            layer, ri, e = key
            if self.group_of[layer] != g or e % self.period[g] != cls or key in self.pinned \
                    or key in self.expected[layer] or self.state[ri][e] != RESIDENT:
                continue
            self._evict(key, protect_expected=True)
            if (layer, e) not in self.index_of:
                return

    def _give_back_one(self) -> None:
        key = next(k for k, free in self.warm.items() if free)
        self.warm_bytes -= self.index_bytes[key[0]]
        self.giving_back.append((key[0], self.warm[key].pop()))

    def abandon(self, slices: list[Key]) -> None:
        """Reads of these LOADING slices were cancelled before they started: absent again."""
        for key in slices:
            layer, ri, e = key
            self.state[ri][e] = ABSENT
            self.used -= self.charge(ri, e)
            self.speculative.discard(key)
            self._unhold(layer, e)

    def commit(self, slices: list[Key]) -> None:
        """The reads of these LOADING slices completed: they are resident now."""
        for key in slices:
            layer, ri, e = key
            self.state[ri][e] = RESIDENT
            self.policy.admit(key, speculative=key in self.speculative)
            self.resident_in_layer[layer] += 1
            if key in self.speculative:
                self.speculative.discard(key)
                self.expected[layer].add(key)

    def predict(self, layer: int, experts: list[int]) -> None:
        """Tell the policy which experts a predictor expects at `layer` soon (prediction-aware policies keep them)."""
        self.policy.predict(self.layer_slices(layer, experts))

    def _make_room(self, need: int, protect_expected: bool) -> bool:
        """Evict in the policy's order until `need` more bytes fit; False if it cannot."""
        if self.used + need <= self.budget:
            return True
        for key in self.policy.victims(self.policy.layer):
            if self.used + need <= self.budget:
                break
            if key in self.pinned or (protect_expected and key in self.expected[key[0]]) \
                    or self.state[key[1]][key[2]] != RESIDENT:  # (an expert's slice evicted with another)
                continue
            self._evict(key, protect_expected)
        return self.used + need <= self.budget

    def _evict(self, key: Key, protect_expected: bool = False) -> None:
        """Evict the slice and its expert's other resident slices (unless pinned or, protecting,
        expected): an expert's index is reused only once the whole expert is gone."""
        layer, _, e = key
        for ri in self.by_layer[layer]:
            k = (layer, ri, e)
            if k == key or (self.state[ri][e] == RESIDENT and k not in self.pinned
                            and not (protect_expected and k in self.expected[layer])):
                self._drop(k)

    def _drop(self, key: Key) -> None:
        layer, ri, e = key
        self.used -= self.charge(ri, e)
        self.policy.forget(key)
        self.expected[layer].discard(key)
        self.state[ri][e] = ABSENT
        self.resident_in_layer[layer] -= 1
        self.stats.evictions += 1
        self._unhold(layer, e)
        if not self.defer_release:
            self.release_evicted()

    @property
    def pending_release(self) -> bool:
        return bool(self.giving_back)

    def release_evicted(self) -> None:
        """Give back the pages of the free indices `_give_back_one` queued (when `_take` or `set_budget`
        had to bring the kept pages within the budget): MADV_REMOVE on every pool's slot.

        With `defer_release` the coordinator calls this while lanes read, so the system calls
        overlap with I/O.
        """
        for g, index in self.giving_back:
            if self.slab is not None:
                for r in self.pools[g]:
                    self.slab.release(*r.slot_pages(index))
            self.cold.setdefault((g, index % self.period[g]), []).append(index)
        self.giving_back.clear()


def working_sets(regions: list[Region], top_k: int) -> dict[int, int]:
    """Per MoE layer, the bytes its `top_k` experts are charged (whole slots, as the cache charges them).

    A decode token visits the layers in a fixed cycle, so a budget below their sum evicts,
    somewhere in the cycle, slices the next token needs again: the cache only thrashes.
    """
    need: dict[int, int] = {}
    for r in regions:
        need[r.layer] = need.get(r.layer, 0) + min(top_k, r.n_expert) * r.slot_bytes
    return need


def file_regions(files: ModelFiles) -> list[Region]:
    """The expert regions of a model read from its GGUF table alone (no llama.cpp load), laid out as
    a running cache lays them out."""
    regions = []
    for name, ext in sorted(files.extents.items()):
        m = EXPERT_TENSOR.match(name)
        if m and files.n_expert > 1:
            layer, kind = int(name.split(".")[1]), name.split(".")[2]
            regions.append(Region(name, layer, kind, ext.file_index, ext.offset, files.n_expert,
                                  ext.nbytes // files.n_expert))
    layout(regions)
    return regions
