"""The expert cache: a sparse POSIX shared-memory slab and the LRU that decides what stays.

The slab holds every expert tensor's byte range, each region placed so that
`slab_offset ≡ file_offset (mod 4096)`. An O_DIRECT read of an expert slice's
4 KiB-aligned superset then lands in place: the extra bytes at either end are
the neighbours' own bytes at their own places. Pages cost RAM only once a lane
writes them, and eviction gives them back (MADV_REMOVE), so the segment's
allocated blocks *are* the cache and are measured from the segment itself.
"""

from __future__ import annotations

import mmap
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import posix_ipc

from bmoe.cache_policy import DEFAULT_POLICY, Policy, make_policy
from bmoe.model_files import EXPERT_TENSOR, ModelFiles

PAGE = 4096
SHM_PREFIX = "bmoe-"
SHM_DIR = Path("/dev/shm")

ABSENT, LOADING, RESIDENT = 0, 1, 2


def _down(x: int) -> int:
    return x - x % PAGE


def _up(x: int) -> int:
    return -(-x // PAGE) * PAGE


@dataclass
class Region:
    """One expert tensor's place in the file and in the slab."""

    name: str
    layer: int
    kind: str
    file_index: int
    file_offset: int
    n_expert: int
    expert_bytes: int
    slab_offset: int = 0

    @property
    def nbytes(self) -> int:
        return self.n_expert * self.expert_bytes

    def slice_bounds(self, e: int) -> tuple[int, int]:
        """Slab bytes [start, end) of expert e."""
        start = self.slab_offset + e * self.expert_bytes
        return start, start + self.expert_bytes

    def page_span(self, e: int) -> tuple[int, int]:
        s, t = self.slice_bounds(e)
        return _down(s), _up(t)

    def read_order(self, e: int) -> tuple[int, int, int, int, int]:
        """(file index, file offset, length, slab offset, needed) of the aligned superset read.

        `needed` is how many of those bytes must exist in the file: the superset
        may run past end of file, the slice itself may not.
        """
        p0, p1 = self.page_span(e)
        return self.file_index, self.file_offset + (p0 - self.slab_offset), p1 - p0, p0, self.slice_bounds(e)[1] - p0

    def experts_on_page(self, page: int) -> range:
        lo = max(0, (page - self.slab_offset) // self.expert_bytes)
        hi = min(self.n_expert - 1, (page + PAGE - 1 - self.slab_offset) // self.expert_bytes)
        return range(lo, hi + 1)


def layout(regions: list[Region]) -> int:
    """Assign congruent slab offsets; returns the slab size."""
    cursor = 0
    for r in sorted(regions, key=lambda r: (r.file_index, r.file_offset)):
        r.slab_offset = cursor + r.file_offset % PAGE
        cursor = _up(r.slab_offset + r.nbytes)
    return max(cursor, PAGE)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments() -> list[str]:
    """Remove segments whose owning process is dead (left by a SIGKILLed run)."""
    removed = []
    if not SHM_DIR.is_dir():
        return removed
    for p in SHM_DIR.glob(f"{SHM_PREFIX}*"):
        parts = p.name.split("-")
        if len(parts) < 3 or not parts[1].isdigit() or _pid_alive(int(parts[1])):
            continue
        try:
            posix_ipc.unlink_shared_memory("/" + p.name)
            removed.append(p.name)
        except posix_ipc.ExistentialError:
            pass
    return removed


class Slab:
    """The shared segment: created by the coordinator, mapped by every lane.

    A POSIX shared-memory object when /dev/shm exists; otherwise (Android) an
    anonymous memfd that lanes open through /proc/<pid>/fd/<n>. `name` is what a
    lane passes to `open_segment`.
    """

    def __init__(self, size: int, backend: str = "auto") -> None:
        self.size = size
        if backend == "auto":
            backend = "posix" if SHM_DIR.is_dir() else "memfd"
        self.backend = backend
        self._shm: posix_ipc.SharedMemory | None = None
        if backend == "memfd":
            self.fd = os.memfd_create(f"{SHM_PREFIX}{os.getpid()}", 0)
            os.ftruncate(self.fd, size)
            self.name = f"/proc/{os.getpid()}/fd/{self.fd}"
        else:
            self.name = f"/{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            try:
                self._shm = posix_ipc.SharedMemory(self.name, posix_ipc.O_CREX, size=size)
            except (posix_ipc.Error, OSError) as e:
                raise OSError(
                    f"cannot create shared memory {self.name} of {size} bytes ({e}); check that /dev/shm "
                    "is mounted and has room, or use --shm memfd"
                ) from e
            self.fd = self._shm.fd
        self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.base = _address_of(self.mm)
        self._open = True

    def resident_bytes(self) -> int:
        return os.fstat(self.fd).st_blocks * 512

    def release(self, start: int, end: int) -> None:
        if end > start:
            self.mm.madvise(mmap.MADV_REMOVE, start, end - start)

    def close(self) -> None:
        """Unmap and unlink; safe to call twice and from a signal path."""
        if not self._open:
            return
        self._open = False
        try:
            self.mm.close()
        except BufferError:
            pass  # a ctypes view still exported; the mapping goes with the process
        if self._shm is None:
            os.close(self.fd)
            return
        try:
            self._shm.close_fd()
        except posix_ipc.Error:
            pass
        try:
            self._shm.unlink()
        except posix_ipc.ExistentialError:
            pass


def open_segment(name: str) -> mmap.mmap:
    """A lane's mapping of the slab, by the name the coordinator passed it."""
    if name.startswith("/proc/"):
        fd = os.open(name, os.O_RDWR)
    else:
        fd = posix_ipc.SharedMemory(name).fd
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _address_of(mm: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


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

    A slice is charged the whole pages it spans from the moment its read is
    planned (LOADING) until it is evicted, so the budget bounds the segment's
    real allocated bytes even with reads in flight. The slices the current layer
    is about to use are pinned: they may push residency past the budget by at
    most one layer's routed set, never get evicted under the matmul that needs
    them. A LOADING slice is never evicted: a lane is writing its pages.

    Slices read on a prediction (`admit_speculative`) enter the policy's order at
    the cold end; a real hit promotes them. Until their layer next routes they are
    "expected" and evicted only when nothing else can go; a prediction the layer
    did not route is then left cold, so mispredictions are the first to leave.
    """

    def __init__(self, slab: Slab, regions: list[Region], budget: int, policy: str | Policy = DEFAULT_POLICY) -> None:
        self.slab = slab
        self.regions = regions
        self.budget = budget
        self.by_layer: dict[int, list[int]] = {}
        for i, r in enumerate(regions):
            self.by_layer.setdefault(r.layer, []).append(i)
        self.state = [bytearray(r.n_expert) for r in regions]
        self.policy = make_policy(policy, sorted(self.by_layer)) if isinstance(policy, str) else policy
        self.used = 0
        self.stats = CacheStats()
        self.resident_in_layer = {layer: 0 for layer in self.by_layer}
        self.slices_in_layer = {layer: sum(regions[i].n_expert for i in idxs) for layer, idxs in self.by_layer.items()}
        self.holds_everything = budget >= sum(self.charge(ri, e) for ri, r in enumerate(regions)
                                              for e in range(r.n_expert))
        self.defer_release = False
        self.unreleased: dict[tuple[int, int, int], None] = {}
        self.pinned: set[tuple[int, int, int]] = set()
        self.speculative: set[tuple[int, int, int]] = set()  # LOADING on a prediction
        self.expected: dict[int, set[tuple[int, int, int]]] = {layer: set() for layer in self.by_layer}

    def layer_complete(self, layer: int) -> bool:
        """Every expert of the layer is resident and, with a budget that holds all, stays so."""
        return self.holds_everything and self.resident_in_layer[layer] == self.slices_in_layer[layer]

    def count_hits(self, layer: int, n_experts: int) -> None:
        """Account a routing that was not looked at because the whole layer is resident."""
        n = n_experts * len(self.by_layer[layer])
        self.stats.hits += n

    def charge(self, ri: int, e: int) -> int:
        p0, p1 = self.regions[ri].page_span(e)
        return p1 - p0

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

    def _reserve(self, keys: list[tuple[int, int, int]]) -> None:
        need = sum(self.charge(ri, e) for _, ri, e in keys)
        if not self._make_room(need, protect_expected=True):
            self._make_room(need, protect_expected=False)  # demand may go over by the pinned set
        for _, ri, e in keys:
            self.state[ri][e] = LOADING
        self.used += need

    def abandon(self, slices: list[tuple[int, int, int]]) -> None:
        """Reads of these LOADING slices were cancelled before they started: absent again."""
        for key in slices:
            _, ri, e = key
            self.state[ri][e] = ABSENT
            self.used -= self.charge(ri, e)
            self.speculative.discard(key)

    def commit(self, slices: list[tuple[int, int, int]]) -> None:
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
        if self.defer_release:
            self.unreleased[key] = None
        else:
            self._release(ri, e)

    def release_evicted(self) -> int:
        """Give evicted slices' pages back now; returns how many slices were released.

        With `defer_release` the coordinator calls this while lanes read, so freeing
        pages (the costliest part of eviction) overlaps with I/O. Edge pages are
        judged by the neighbours' state now, not at eviction: a neighbour being read
        since then keeps its page. A slice planned again in between keeps its pages,
        which its new read rewrites.
        """
        n = 0
        for _, ri, e in self.unreleased:
            if self.state[ri][e] == ABSENT:
                self._release(ri, e)
                n += 1
        self.unreleased.clear()
        return n

    def _release(self, ri: int, e: int) -> None:
        r = self.regions[ri]
        p0, p1 = r.page_span(e)
        if self._page_shared(ri, e, p0):
            p0 += PAGE
        if p1 > p0 and self._page_shared(ri, e, p1 - PAGE):
            p1 -= PAGE
        self.slab.release(p0, p1)

    def _page_shared(self, ri: int, e: int, page: int) -> bool:
        st = self.state[ri]
        return any(st[o] != ABSENT for o in self.regions[ri].experts_on_page(page) if o != e)

    def layer_working_set(self, top_k: int) -> int:
        """Bytes of the largest layer's routed set for one token: below it a layer cannot run."""
        return max(working_sets(self.regions, top_k).values())

    def token_working_set(self, top_k: int) -> int:
        """Bytes one decode token routes through: every MoE layer's set together (see working_sets)."""
        return sum(working_sets(self.regions, top_k).values())


def working_sets(regions: list[Region], top_k: int) -> dict[int, int]:
    """Per MoE layer, the bytes its `top_k` costliest experts are charged (whole pages, as the
    cache charges them).

    A decode token visits the layers in a fixed cycle, so a budget below their sum evicts,
    somewhere in the cycle, slices the next token needs again: the cache only thrashes.
    """
    need: dict[int, int] = {}
    for r in regions:
        spans = sorted((p1 - p0 for p0, p1 in map(r.page_span, range(r.n_expert))), reverse=True)
        need[r.layer] = need.get(r.layer, 0) + sum(spans[:top_k])
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
