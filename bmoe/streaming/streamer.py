"""The Streamer: one loaded model's slab, expert cache and I/O lanes, and what holds them together.

It owns the slab and the slot pools llama.cpp's expert tensors are bound to (at every slot, ids
remapped; or, for a layer resident for good, at its experts in order), the ExpertCache and its
budget (an adaptive budget's watch included), the lanes and the waits on them (a completed read is
committed to the cache here), the reads ahead (bmoe.streaming.readahead, the spec-gate attached to
it), the per-token counters, and the lifecycle: settle between requests, preload, close. What happens
at the graph's stops while a decode runs (the demand reads of a layer's routing, the remap, the down
matmul's wait) is bmoe.streaming.graph_stops'; both send through bmoe.streaming.orders. The lanes'
busy time is bmoe.streaming.lane_stats'.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from bmoe import seam
from bmoe.base.errors import ModelError
from bmoe.base.model_files import ModelFiles, dio_alignment
from bmoe.base.settings import DEFAULT_POLICY, StreamSettings
from bmoe.shm_cache import Slab
from bmoe.streaming.expert_cache import ExpertCache, Region, layout
from bmoe.streaming.file_view import FileView
from bmoe.streaming.lane_stats import LaneLoad, LaneStats
from bmoe.streaming.lanes import CANCELLED, LanePool
from bmoe.streaming.orders import Order, OrdersInFlight
from bmoe.streaming.readahead import ReadAhead, ReadAheadCounts
from bmoe.streaming.speculation import SpecGate

ABANDON_REAP_S = 2.0  # a killed worker is waited for this long (one in uninterruptible I/O may take longer)

WATCH_STEP = 64 * 2**20  # an adaptive budget is checked again once the cache has taken this much more
ON_FILE = (-1, -1)  # Streamer.direct's entry for a layer bound to llama.cpp's own mapping of the file


@dataclass
class Counters:
    """Nanoseconds, bytes and cache lookups since the last `take_counters`: one token's share."""

    io_ns: int = 0  # serial: waiting for reads; overlap: the lanes' busy time reading the device
    mgmt_ns: int = 0  # cache bookkeeping, the remap, giving pages back
    stall_ns: int = 0  # overlap: compute waiting for reads
    read_bytes: int = 0  # from the device (flash)
    hits: int = 0
    lookups: int = 0
    # copied from the page cache instead (a lane's read the page cache held whole), and the lanes' busy
    # time doing it: memory's rate, kept out of read_bytes and overlap's io_ns
    page_cache_bytes: int = 0
    page_cache_ns: int = 0


def regions_of(files: ModelFiles, tensors: list[seam.ExpertTensor]) -> list[Region]:
    """llama.cpp's expert tensors as cache regions, checked against the GGUF table and laid out for the
    files' direct-I/O alignment (the slot sizes the budget rules need; the Streamer lays them out again
    with the spare slot lossy routing wants)."""
    regions = []
    for t in sorted(tensors, key=lambda t: t.name):
        ext = files.extents.get(t.name)
        if ext is None or ext.nbytes != t.nbytes:
            raise ModelError(f"expert tensor {t.name} in llama.cpp does not match the GGUF table; "
                             "the file changed while loading, reload it")
        regions.append(Region(t.name, t.layer, t.kind, ext.file_index, ext.offset, t.n_expert, t.expert_bytes))
    layout(regions, align=dio_alignment(files.paths))
    return regions


class Streamer:
    """Cache, slab and lanes for one loaded model; `on_route` is the per-layer entry point."""

    def __init__(self, files: ModelFiles, regions: list[Region], tensors: list[seam.ExpertTensor], budget: int,
                 streaming: StreamSettings, policy: str = DEFAULT_POLICY, prefetch: int = 0,
                 biases: Sequence[seam.ExpertBias | seam.ExpertScale] = (), spare: bool = False,
                 guess: float = 0.0, mtp_layers: frozenset[int] = frozenset()) -> None:
        """`prefetch`, `guess`: the reads ahead of bmoe.streaming.readahead (--prefetch, --guess); `mtp_layers`: the
        MTP block's (--draft mtp), streamed like the rest and read ahead in no token's cycle."""
        self.files = files
        self.n_expert = max(r.n_expert for r in regions)
        self.slab = Slab(layout(regions, spare, regions[0].align), streaming.shm_backend)
        self.pool: LanePool | None = None
        try:  # a signal may land anywhere in here: what exists so far is released
            self.cache = ExpertCache(self.slab, regions, budget, policy, spare)
            self.pool = LanePool(streaming.io_threads, self.slab.name, [str(p) for p in files.paths],
                                 streaming.odirect, timeout=streaming.lane_timeout)
        except BaseException:
            self._release_memory()
            raise
        self.tensors = {t.name: t for t in tensors}  # llama.cpp's expert tensors, pointing into the slab
        self.layer_tensors: dict[int, list[tuple[seam.ExpertTensor, Region]]] = {}
        for r in regions:
            self.layer_tensors.setdefault(r.layer, []).append((self.tensors[r.name], r))
        # per layer: its expert biases and scales, each with the file's rows and the pool they follow the slots in
        self.biases: dict[int, list[tuple[seam.ExpertBias | seam.ExpertScale, np.ndarray, np.ndarray]]] = {}
        bias_pools: dict[tuple[str, int], np.ndarray] = {}  # (kind, row bytes) -> rows by slot index
        for b in biases:
            pool = bias_pools.get((b.kind, b.row_bytes))
            if pool is None:
                pool = bias_pools[(b.kind, b.row_bytes)] = np.zeros((self.cache.capacity, b.row_bytes // 4),
                                                                     dtype=np.float32)
            self.biases.setdefault(b.layer, []).append((b, b.rows(), pool))
        if self.biases:
            self.cache.on_assign = self._bias_rows
        # layers whose rows a graph fixes when it is built (expert scales): never bound direct
        self.slot_bound = {layer for layer, bs in self.biases.items() if any(b.graph_fixed for b, _, _ in bs)}
        self.direct: dict[int, tuple[int, int]] = {}  # layer -> (base, cache.moved) while bound direct, or ON_FILE
        # per layer: slots its expert tensors show ggml while bound to the pools, 0 otherwise; the compiled
        # filter narrows them too when it answers a routing (bmoe.seam.eval_filter)
        self.seen = np.zeros(max(self.layer_tensors) + 1, dtype=np.int32)
        # lanes that read buffered drop what they read from the page cache: a layer read there would fault
        self.view = FileView({layer: [t for t, _ in ts] for layer, ts in self.layer_tensors.items()}) \
            if streaming.odirect else None
        for layer in self.layer_tensors:
            self._bind(layer, None)
        self.overlap = streaming.overlap
        self.cache.defer_release = True  # pages given back while lanes read: see wait
        self.down_kind = {ri for ri, r in enumerate(regions) if r.kind == "ffn_down_exps"}
        self.up_kind = {ri for ri, r in enumerate(regions) if r.kind == "ffn_up_exps"}
        self.orders = OrdersInFlight(self.pool, self.cache)
        self.replaced: dict[int, list[int]] = {}  # cancelled order -> demand orders re-reading what it held
        self.counters = Counters()
        self.looked = (0, 0)  # the cache's (hits, lookups) at the last take_counters
        self.commit_ns = 0  # committing arrived slices, ever (for wait's split)
        self.ahead = ReadAhead(self.orders, self.cache, self.n_expert, files.n_expert_used, prefetch, guess,
                               mtp_layers)
        self.lane_stats = LaneStats(streaming.io_threads)
        self.watch: Callable[[], None] | None = None  # the adaptive budget's step (bmoe.memory.budget.BudgetWatch)
        self.watched_at = 0  # cache bytes at the last check

    def _bind(self, layer: int, base: int | None) -> None:
        """Point the layer's expert tensors (and bias rows) at their pools: at every slot (`base` None,
        ids remapped to slot indices), or at the n_expert slots from `base` on, which then hold
        experts 0..n-1 in order (ids read as they are)."""
        if self.direct.get(layer) == ON_FILE and self.view is not None:
            self.view.read_around(layer, False)
        for t, r in self.layer_tensors[layer]:
            at = self.slab.base + r.data_offset
            if base is None:
                t.rebind(at, r.stride, r.capacity)
            else:
                t.rebind(at + base * r.stride, r.stride, r.n_expert)
        if base is None:
            self.seen[layer] = self.cache.capacity
        else:
            self.seen[layer] = 0
        for b, _, pool in self.biases.get(layer, ()):
            at = pool.ctypes.data
            if base is None:
                b.rebind(at, len(pool))
            else:
                b.rebind(at + base * b.row_bytes, b.n_expert)

    def narrow(self, layer: int, n_slots: int) -> None:
        """Show the layer's matmuls (bound to the pools) only the pools' first `n_slots` slots, which hold
        every slot its remapped ids read in this decode. ggml's CPU mul_mat_id does work for each of
        the tensor's ne[2] experts on every call (it clears a row count and resets a chunk counter, on
        a cache line of its own, for each: ggml_compute_forward_mul_mat_id), so a tensor that showed
        the whole pool (every layer's experts: 6145 slots on the Qwen3-30B-A3B shape) cost more than
        its matmul (24 ms a token there, bench/reports/2026-12-05-speed/); the CPU backend plans each
        graph piece afresh, and the piece after the routing's stop holds the layer's matmuls."""
        if self.seen[layer] == n_slots:
            return
        for t, r in self.layer_tensors[layer]:
            t.rebind(self.slab.base + r.data_offset, r.stride, n_slots)
        self.seen[layer] = n_slots

    def _bind_file(self, layer: int) -> None:
        """Point the layer's expert tensors (and bias rows) at llama.cpp's own mapping of the file."""
        assert self.view is not None
        self.view.read_around(layer, True)
        for t, _ in self.layer_tensors[layer]:
            t.bind_file()
        self.seen[layer] = 0
        for b, _, _ in self.biases.get(layer, ()):
            b.rebind(b.data, b.n_expert)

    def fast_layers(self) -> list[seam.FastTables]:
        """What the compiled filter reads to answer a routing whose experts are all resident, per layer
        streamed: the cache's slot table and resident flags, the slots shown, the expert tensors and their
        strides (it narrows them as `narrow` does)."""
        c = self.cache
        return [seam.FastTables(layer, c.table[layer], c.resident[layer], self.seen,
                                [(t.addr, r.stride) for t, r in ts]) for layer, ts in self.layer_tensors.items()]

    def _bias_rows(self, layer: int, e: int, index: int) -> None:
        """Expert e of the layer took slot `index`: its bias rows follow it."""
        for _, rows, pool in self.biases.get(layer, ()):
            pool[index] = rows[e]

    # ---- what the engine may ask ---------------------------------------------------------------

    @property
    def layers(self) -> list[int]:
        """Every streamed layer, in order (an MTP block's too)."""
        return sorted(self.cache.by_layer)

    @property
    def holds_everything(self) -> bool:
        return self.cache.holds_everything

    @property
    def budget(self) -> int:
        return self.cache.budget

    @property
    def full_bytes(self) -> int:
        """What a budget that holds every expert's slot needs."""
        return self.cache.total

    def set_budget(self, budget: int) -> None:
        """The cache shrinks to `budget` at once (pages given back), or may grow to it."""
        t0 = time.perf_counter_ns()
        self.cache.set_budget(budget)
        self.counters.mgmt_ns += time.perf_counter_ns() - t0

    def resident_bytes(self) -> int:
        return self.slab.resident_bytes()

    def residency(self) -> list[tuple[int, str]]:
        """Which experts of each layer are resident (ExpertCache.residency)."""
        return self.cache.residency()

    @property
    def lanes(self) -> LanePool:
        """The I/O lanes (there from the end of __init__ until close)."""
        assert self.pool is not None
        return self.pool

    def worker_pids(self) -> list[tuple[str, int]]:
        pids = [(f"io_lane {lane.index}", lane.pid) for lane in self.lanes.lanes]
        gate = self.ahead.gate
        if gate is not None and gate.proc is not None:
            pids.append(("spec_gate", gate.pid))
        return pids

    def attach_gate(self, gate: SpecGate) -> None:
        self.ahead.gate = gate

    @property
    def gate_running(self) -> bool:
        return self.ahead.listening

    def gate_recall(self) -> tuple[float, float | None] | None:
        gate = self.ahead.gate
        return None if gate is None else (gate.recall_pct, gate.disabled_below)

    def lane_load(self) -> LaneLoad:
        return self.lane_stats.load()

    def take_speculation(self) -> ReadAheadCounts:
        return self.ahead.take_counts()

    def follow(self) -> None:
        """Run the adaptive budget's check now (once per token, and when the cache grew by WATCH_STEP)."""
        if self.watch is not None:
            self.watched_at = self.cache.used
            self.watch()

    def run_through(self, layer: int) -> bool:
        """Under a budget that holds every expert a layer needs no stop (its lookups count as hits).
        While the page cache holds the layer's expert bytes whole, its tensors are bound to llama.cpp's
        own mapping of the file (bmoe.streaming.file_view): plain llama.cpp's bytes, in the page cache's
        2 MiB pages where the kernel maps them so (the slab's are 4 KiB: bench/reports/2026-12-04-resident/).
        Otherwise, once its experts are all resident at slots in expert order, they are bound to read
        them by their own ids. A layer that stops again is bound back to the whole pool first. A layer
        with an expert scale always stops (its scale's pool is fixed in the graph)."""
        c = self.cache
        bound = self.direct.get(layer)
        if c.holds_everything and layer not in self.slot_bound:
            if self.view is not None and self.view.cached(layer):
                if bound != ON_FILE:
                    self._bind_file(layer)
                    bound = self.direct[layer] = ON_FILE
                c.count_hits(layer, self.files.n_expert_used)
                return True
            if c.layer_complete(layer):
                if bound is None or bound[1] != c.moved[layer]:
                    base = c.direct_base(layer)
                    if base is not None:
                        self._bind(layer, base)
                        bound = self.direct[layer] = (base, c.moved[layer])
                if bound is not None and bound[1] == c.moved[layer]:
                    c.count_hits(layer, self.files.n_expert_used)
                    return True
        if bound is not None:
            self._bind(layer, None)
            del self.direct[layer]
        return False

    def unbind(self, layer: int) -> None:
        """The graph stops at a layer `run_through` would let run through (lossy routing changes every
        layer, a replay every routing): it reads through the remapped ids again."""
        if layer in self.direct:
            self._bind(layer, None)
            del self.direct[layer]

    # ---- reads: sending, collecting, waiting ---------------------------------------------------

    def begin_batch(self, n_tokens: int, trunk: bool = True) -> None:
        """A llama_decode of n_tokens is about to run (`trunk` False: an MTP context's, which runs none of the
        trunk's layers, so none of them is read ahead for it). While layers read a warm file's mapping, their
        page-cache answers are dropped after a decode that faulted (FileView.after_faults), and a
        background fill waits for idle time: its copies into fresh slab pages are CPU work that slows
        the decode's threads several times their own cost (bench/reports/2026-12-04-resident/), and
        those layers already run at plain llama.cpp's speed."""
        t0 = time.perf_counter_ns()
        with self.lanes.batched():
            self.ahead.begin_batch(n_tokens, trunk)
            if ON_FILE in self.direct.values():
                assert self.view is not None
                self.view.after_faults()
                if self.ahead.warm is not None:
                    self.ahead.warm.pause()
        self.counters.mgmt_ns += time.perf_counter_ns() - t0

    def tick(self) -> None:
        """Collect what finished and keep idle lanes busy, without blocking."""
        if self.orders.inflight or self.ahead.listening:
            self.lanes.poll(0, self.ahead.handlers())
            self._collect()
            self.ahead.pump()

    def wait(self, orders: list[int]) -> int:
        """Block until these orders completed; returns the wall time blocked (ns).

        Pages of free slots to give back are given back here first, while the lanes read; that
        time, and committing the slices that arrive, is cache management, not waiting. With nothing
        live there is nothing to wait for: 0, without timing (the stall of a token whose experts
        were all resident is 0).
        """
        if not any(self.live(o) for o in orders):
            return 0
        t0 = time.perf_counter_ns()
        committed = self.commit_ns
        spent = 0
        while any(self.live(o) for o in orders):
            if self.cache.pending_release:
                r0 = time.perf_counter_ns()
                self.cache.release_evicted()
                spent += time.perf_counter_ns() - r0
            self.lanes.poll(0.5, self.ahead.handlers())
            self._collect()
            self.ahead.pump()
        spent += self.commit_ns - committed
        self.counters.mgmt_ns += spent
        return time.perf_counter_ns() - t0 - spent

    def _collect(self) -> None:
        for oid in self.orders.done():
            answer = self.lanes.take(oid)
            order = self.orders.pop(oid)
            self.ahead.on_done(oid, order, answer.device_bytes)
            if answer.nbytes == CANCELLED:
                self._abandon(oid, order)
                continue
            c0 = time.perf_counter_ns()
            self.cache.commit(order.keys)
            self.commit_ns += time.perf_counter_ns() - c0
            c = self.counters
            c.read_bytes += answer.device_bytes
            c.page_cache_bytes += answer.copied
            c.page_cache_ns += answer.copy_ns
            self.lane_stats.answered(order.lane, answer.busy_ns)

    def _abandon(self, oid: int, order: Order) -> None:
        """A cancelled order read nothing: its slices are absent again. Should a layer have come to
        need one meanwhile (its routing saw it loading), it is read now, and waits that were on
        the cancelled order follow the new one."""
        pinned = self.cache.pinned
        needed = [k for k in order.keys if (k[0], k[2]) in pinned]
        self.cache.abandon([k for k in order.keys if (k[0], k[2]) not in pinned])
        if needed:
            self.replaced[oid] = self.orders.spread(needed)

    def live(self, oid: int) -> bool:
        """An order still to wait for: in flight, or cancelled and replaced by orders in flight."""
        return oid in self.orders.inflight or any(self.live(o) for o in self.replaced.get(oid, ()))

    def settle(self) -> None:
        """Finish every read in flight and drop queued ones: the cache is consistent again."""
        self.ahead.settle()
        self.wait(list(self.orders.inflight))
        self.replaced.clear()

    # ---- whole-cache operations ----------------------------------------------------------------

    def preload(self) -> int:
        """Read every expert now (only when the budget holds them all); returns the bytes the cache took
        in (from the device or the page cache)."""
        c = self.cache
        if not c.holds_everything:
            return 0
        for layer in sorted(c.by_layer):
            experts = list(range(c.n_expert(layer)))
            self.wait(self.orders.spread(c.plan(layer, experts)))
        c.reset_stats()
        took = self.take_counters()
        return took.read_bytes + took.page_cache_bytes

    def idle_fill(self) -> None:
        """Between requests: collect a background fill's reads and let it queue deeper."""
        if self.ahead.warm is not None:
            self.tick()
            self.ahead.warm.idle()

    def take_counters(self, step: bool = False) -> Counters:
        """The counters since the last call; under overlap, io is the lanes' busy time less their copies
        from the page cache (a decode `step` also records the lanes' busy share: LaneStats). Serial io is
        the wall time blocked on reads, copies' included: the lanes copy in parallel, so their copy time
        is not a part of it that can be taken out."""
        out, self.counters = self.counters, Counters()
        busy = self.lane_stats.take(step)
        if self.overlap:
            out.io_ns = busy - out.page_cache_ns
        looked = self.cache.stats.snapshot()
        out.hits, out.lookups = looked[0] - self.looked[0], looked[1] - self.looked[1]
        self.looked = looked
        return out

    def abandon(self) -> None:
        """Release what can go while a decode may still run (Loaded.close in_use): every worker killed
        and reaped, the slab's and the spec-gate ring's names unlinked. The mappings stay: the
        decode reads them until the process exits."""
        procs = [lane.proc for lane in self.pool.lanes] if self.pool is not None else []
        gate = self.ahead.gate
        if gate is not None:
            if gate.proc is not None:
                procs.append(gate.proc)
            gate.ring.unlink()
        self.slab.unlink()
        for p in procs:
            p.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(ABANDON_REAP_S)

    def close(self) -> None:
        try:
            self.ahead.close()
        finally:
            self._release_memory()

    def _release_memory(self) -> None:
        try:
            if self.pool is not None:
                self.pool.close()
        finally:
            self.slab.close()
