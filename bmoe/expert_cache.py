"""The expert cache: which expert slices are resident, in which slot, under a byte budget.

llama.cpp reads expert e of a tensor at `data + e * nb[2]`. bmoe points every expert tensor into
the window (bmoe.shm_cache) with a stride of a page more than an expert, placed so that each
expert starts at the same offset within its page as in the file: an O_DIRECT read of its 4
KiB-aligned superset then fills whole pages that are the expert's alone, a slot of the slab.
Committing a read maps the slot under the expert; evicting makes the range inaccessible and
frees the slot for the next read without giving its pages back, so steady-state decode neither
frees nor faults in memory (both cost more CPU than the read itself). Slots are given back
(MADV_REMOVE) only when pages of one slot size must make room for another, so the slab's
allocated blocks, measured from the segment, stay within the budget. The eviction order comes
from bmoe.cache_policy. With no window (trace replays) the same decisions run with no memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from bmoe.cache_policy import DEFAULT_POLICY, Policy, make_policy
from bmoe.model_files import EXPERT_TENSOR, ModelFiles
from bmoe.shm_cache import PAGE, Window

ABSENT, LOADING, RESIDENT = 0, 1, 2


def _down(x: int) -> int:
    return x - x % PAGE


def _up(x: int) -> int:
    return -(-x // PAGE) * PAGE


@dataclass
class Region:
    """One expert tensor's place in the file and in the window."""

    name: str
    layer: int
    kind: str
    file_index: int
    file_offset: int
    n_expert: int
    expert_bytes: int
    window_offset: int = 0

    @property
    def nbytes(self) -> int:
        return self.n_expert * self.expert_bytes

    @property
    def stride(self) -> int:
        """Window bytes from one expert to the next: a page more than an expert, so no two share a
        page and each keeps its in-page offset from the file."""
        return self.expert_bytes + PAGE

    @property
    def slot_bytes(self) -> int:
        """Slab bytes one of this tensor's experts takes (its aligned superset; the largest one)."""
        return max(_up((self.file_offset + e * self.expert_bytes) % PAGE + self.expert_bytes)
                   for e in range(self.n_expert))

    def slice_bounds(self, e: int) -> tuple[int, int]:
        """Window bytes [start, end) of expert e."""
        start = self.window_offset + e * self.stride
        return start, start + self.expert_bytes

    def page_span(self, e: int) -> tuple[int, int]:
        s, t = self.slice_bounds(e)
        return _down(s), _up(t)

    def read_order(self, e: int, slot: int) -> tuple[int, int, int, int, int]:
        """(file index, file offset, length, slab offset, needed) of the aligned superset read into `slot`.

        `needed` is how many of those bytes must exist in the file: the superset
        may run past end of file, the slice itself may not.
        """
        p0, p1 = self.page_span(e)
        s, t = self.slice_bounds(e)
        return self.file_index, self.file_offset + e * self.expert_bytes - (s - p0), p1 - p0, slot, t - p0


def layout(regions: list[Region]) -> int:
    """Assign window offsets congruent to the file's (mod PAGE); returns the window size."""
    cursor = 0
    for r in sorted(regions, key=lambda r: (r.file_index, r.file_offset)):
        r.window_offset = cursor + r.file_offset % PAGE
        cursor = _up(r.window_offset + r.n_expert * r.stride)
    return max(cursor, PAGE)


def slab_size(regions: list[Region]) -> int:
    """Slab bytes for every expert at once (the segment is sparse: only written slots cost RAM)."""
    return max(sum(r.n_expert * r.slot_bytes for r in regions), PAGE)


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
    """(layer, tensor, expert) slices under a byte budget; a policy (bmoe.cache_policy) picks what goes.

    A slice is charged its slot from the moment its read is planned (LOADING)
    until it is evicted. Freed slots keep their pages for the next read of the
    same size; the slab's pages (slots in use + free slots kept) stay within the
    budget, even with reads in flight. The slices the current layer is about to
    use are pinned: they may push residency past the budget by at most one
    layer's routed set, never get evicted under the matmul that needs them. A
    LOADING slice is never evicted: a lane is writing its slot.

    Slices read on a prediction (`admit_speculative`) enter the policy's order at
    the cold end; a real hit promotes them. Until their layer next routes they are
    "expected" and evicted only when nothing else can go; a prediction the layer
    did not route is then left cold, so mispredictions are the first to leave.

    `window` is None in trace replays: the same decisions, no memory behind them.
    """

    def __init__(self, window: Window | None, regions: list[Region], budget: int,
                 policy: str | Policy = DEFAULT_POLICY) -> None:
        self.window = window
        self.regions = regions
        self.budget = budget
        self.slot_size = [r.slot_bytes for r in regions]
        self.by_layer: dict[int, list[int]] = {}
        for i, r in enumerate(regions):
            self.by_layer.setdefault(r.layer, []).append(i)
        self.state = [bytearray(r.n_expert) for r in regions]
        self.policy = make_policy(policy, sorted(self.by_layer)) if isinstance(policy, str) else policy
        self.used = 0
        self.stats = CacheStats()
        self.resident_in_layer = {layer: 0 for layer in self.by_layer}
        self.slices_in_layer = {layer: sum(regions[i].n_expert for i in idxs) for layer, idxs in self.by_layer.items()}
        self.total = sum(self.slot_size[ri] * r.n_expert for ri, r in enumerate(regions))
        self.defer_release = False
        self.unreleased: dict[tuple[int, int, int], None] = {}  # evicted, window range not yet unmapped
        self.pinned: set[tuple[int, int, int]] = set()
        self.speculative: set[tuple[int, int, int]] = set()  # LOADING on a prediction
        self.expected: dict[int, set[tuple[int, int, int]]] = {layer: set() for layer in self.by_layer}
        self.slot_of: dict[tuple[int, int, int], int] = {}
        self.warm: dict[int, list[int]] = {}  # slot size -> free slots whose pages are kept
        self.warm_bytes = 0
        self.cold: dict[int, list[int]] = {}  # slot size -> free slots whose pages were given back
        self.giving_back: list[tuple[int, int]] = []  # (slab offset, size): free, pages to give back
        self.top = 0  # slab bytes handed out as slots so far

    @property
    def holds_everything(self) -> bool:
        return self.budget >= self.total

    def set_budget(self, budget: int) -> None:
        """A new budget, in force at once: evict in the policy's order (never a pinned or loading
        slice) and give back the pages of free slots until slots in use and kept fit it."""
        self.budget = budget
        self._make_room(0, protect_expected=False)
        while self.warm_bytes and self.used + self.warm_bytes > self.budget:
            size = next(sz for sz, slots in self.warm.items() if slots)
            self.warm_bytes -= size
            self.giving_back.append((self.warm[size].pop(), size))
        self.release_evicted()

    def reset_stats(self) -> None:
        """Start counting afresh (after a preload or a replay's prefill pass, which are not decode)."""
        self.stats = CacheStats()

    def layer_complete(self, layer: int) -> bool:
        """Every expert of the layer is resident and, with a budget that holds all, stays so."""
        return self.holds_everything and self.resident_in_layer[layer] == self.slices_in_layer[layer]

    def count_hits(self, layer: int, n_experts: int) -> None:
        """Account a routing that was not looked at because the whole layer is resident."""
        n = n_experts * len(self.by_layer[layer])
        self.stats.hits += n

    def charge(self, ri: int, e: int) -> int:
        return self.slot_size[ri]

    def layer_slices(self, layer: int, experts: list[int]) -> list[tuple[int, int, int]]:
        return [(layer, ri, e) for ri in self.by_layer.get(layer, ()) for e in experts]

    def plan(self, layer: int, experts: list[int]) -> list[tuple[int, int, int]]:
        """Count hits, pin the layer's slices, make room; returns the slices that must be read now.

        A wanted slice already LOADING (a speculative read in flight) is counted as
        a miss but not returned: the caller waits for the read that is under way.
        """
        want = self.layer_slices(layer, experts)
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

    def admit_speculative(self, layer: int, experts: list[int]) -> list[tuple[int, int, int]]:
        """Reserve room for a predicted read of the experts' absent slices; returns what to read.

        All of an expert's slices or none: room is made only from slices nobody
        expects or pins, so a prediction never pushes out demand or another prediction.
        """
        self.predict(layer, experts)
        out: list[tuple[int, int, int]] = []
        for e in experts:
            keys = [k for k in self.layer_slices(layer, [e]) if self.state[k[1]][k[2]] == ABSENT]
            need = sum(self.charge(ri, x) for _, ri, x in keys)
            if not keys or not self._make_room(need, protect_expected=True):
                continue
            self._reserve(keys)
            self.speculative.update(keys)
            out += keys
        return out

    def read_order(self, key: tuple[int, int, int]) -> tuple[int, int, int, int, int]:
        """The read that fills a LOADING slice's slot."""
        return self.regions[key[1]].read_order(key[2], self.slot_of[key])

    def _reserve(self, keys: list[tuple[int, int, int]]) -> None:
        need = sum(self.charge(ri, e) for _, ri, e in keys)
        if not self._make_room(need, protect_expected=True):
            self._make_room(need, protect_expected=False)  # demand may go over by the pinned set
        self.used += need
        for key in keys:
            _, ri, e = key
            self.state[ri][e] = LOADING
            self.slot_of[key] = self._take(self.slot_size[ri])

    def _take(self, size: int) -> int:
        """A free slot of `size`: one that kept its pages if any, else new pages, after giving back
        kept pages of other sizes so that slots in use + kept stay within the budget."""
        if self.warm.get(size):
            self.warm_bytes -= size
            return self.warm[size].pop()
        while self.used + self.warm_bytes > self.budget and self.warm_bytes:
            other = next(sz for sz, slots in self.warm.items() if slots)
            self.warm_bytes -= other
            self.giving_back.append((self.warm[other].pop(), other))
        if not self.defer_release or (not self.cold.get(size) and any(sz == size for _, sz in self.giving_back)):
            self.release_evicted()  # (a slot of this size still on its way back: use it, the slab stays bounded)
        if self.cold.get(size):
            return self.cold[size].pop()
        self.top += size
        if self.window is not None and self.top > self.window.slab.size:
            raise RuntimeError(f"expert slab exhausted ({self.top} > {self.window.slab.size} bytes)")
        return self.top - size

    def _free(self, key: tuple[int, int, int]) -> None:
        size = self.slot_size[key[1]]
        self.warm.setdefault(size, []).append(self.slot_of.pop(key))
        self.warm_bytes += size

    def abandon(self, slices: list[tuple[int, int, int]]) -> None:
        """Reads of these LOADING slices were cancelled before they started: absent again."""
        for key in slices:
            _, ri, e = key
            self.state[ri][e] = ABSENT
            self.used -= self.charge(ri, e)
            self.speculative.discard(key)
            self._free(key)

    def commit(self, slices: list[tuple[int, int, int]]) -> None:
        """The reads of these LOADING slices completed: they are resident now, in the window too."""
        for key in slices:
            layer, ri, e = key
            if self.window is not None:
                p0, p1 = self.regions[ri].page_span(e)
                self.window.map(p0, p1 - p0, self.slot_of[key])
            self.state[ri][e] = RESIDENT
            self.unreleased.pop(key, None)
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
            if key in self.pinned or (protect_expected and key in self.expected[key[0]]):
                continue
            self._evict(key)
        return self.used + need <= self.budget

    def _evict(self, key: tuple[int, int, int]) -> None:
        _, ri, e = key
        self.used -= self.charge(ri, e)
        self.policy.forget(key)
        self.expected[key[0]].discard(key)
        self.state[ri][e] = ABSENT
        self.resident_in_layer[key[0]] -= 1
        self.stats.evictions += 1
        self._free(key)  # its old window range is nobody's to read: a new read may fill the slot now
        self.unreleased[key] = None
        if not self.defer_release:
            self.release_evicted()

    @property
    def pending_release(self) -> bool:
        return bool(self.unreleased or self.giving_back)

    def release_evicted(self) -> int:
        """Make evicted slices' window ranges inaccessible and give back the pages queued by `_take`;
        returns how many window ranges were unmapped.

        With `defer_release` the coordinator calls this while lanes read, so the system calls
        overlap with I/O. A slice planned again in between keeps its range, which its commit maps.
        """
        n = 0
        if self.window is not None:
            for _, ri, e in self.unreleased:
                if self.state[ri][e] == ABSENT:
                    p0, p1 = self.regions[ri].page_span(e)
                    self.window.unmap(p0, p1 - p0)
                    n += 1
            for offset, size in self.giving_back:
                self.window.slab.release(offset, offset + size)
        self.unreleased.clear()
        for offset, size in self.giving_back:
            self.cold.setdefault(size, []).append(offset)
        self.giving_back.clear()
        return n


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
    """The expert regions of a model read from its GGUF table alone (no llama.cpp load), placed as
    `layout` places them, so page-rounded sizes match what a running cache charges."""
    regions = []
    for name, ext in sorted(files.extents.items()):
        m = EXPERT_TENSOR.match(name)
        if m and files.n_expert > 1:
            layer, kind = int(name.split(".")[1]), name.split(".")[2]
            regions.append(Region(name, layer, kind, ext.file_index, ext.offset, files.n_expert,
                                  ext.nbytes // files.n_expert))
    layout(regions)
    return regions
