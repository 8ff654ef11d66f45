"""The coordinator: runs decode in llama.cpp and owns all expert-cache state.

Flow per MoE layer and step: llama.cpp computes up to the layer's routing node
`ffn_moe_topk-L`; the eval hook hands the routed ids here; the cache pins the
layer's slices, evicts to stay within budget, and the lanes read the misses
into slots of the slab, which the cache maps into the window the expert weight
tensors point into (shm_cache). Only then does the hook return and llama.cpp run
the expert matmuls. Output is therefore
computed from exactly the bytes plain llama.cpp would use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import psutil
import llama_cpp

from bmoe import seam
from bmoe.lanes import LanePool, ReadOrder, merge_keyed
from bmoe.llama import SamplerSettings, TextStream, Vocab, init_backend, load_model, make_sampler
from bmoe.model_files import ModelError, ModelFiles, open_model
from bmoe.route_trace import TraceWriter
from bmoe.cache_policy import DEFAULT_POLICY
from bmoe.shm_cache import ABSENT, ExpertCache, Region, Slab, Window, layout, slab_size, sweep_stale_segments
from bmoe.speculation import SpecGate
from bmoe.workers.io_lane import CANCELLED
from bmoe.units import MiB

MAX_MERGED_READ = 4 * MiB
SPEC_PRECISION_PCT = 70.0  # --spec-precision default: see bench/reports/
SPEC_QUEUE_PER_LANE = 4  # speculative orders queued in one lane at a time (each holds room in the cache)
DEFAULT_FLOOR_MB = 1536.0


def _mib_up(nbytes: int) -> str:
    """MiB rounded up to 0.1, so a number printed as "use --cache-mb N" is enough."""
    return f"{-(-nbytes * 10 // MiB) / 10:g}"


class ConfigError(ValueError):
    """A setting that cannot work with this model; the message names the fix."""


class Cancelled(Exception):
    """A cancel request (Engine.cancel) stopped the generation; the Engine stays usable."""


@dataclass
class Settings:
    model: str
    n_ctx: int = 2048
    threads: int = 0
    stream: bool = True
    cache_mb: float | None = None  # None: sized from available memory (auto_cache_bytes)
    cache_floor_mb: float = DEFAULT_FLOOR_MB
    cache_ceil_mb: float | None = None  # caps the auto size; None: no cap
    force: bool = False  # accept a budget below one token's working set
    io_threads: int = 2
    odirect: bool = True
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    verbose: bool = False
    route_trace: str | None = None
    preload: bool = False
    lane_timeout: float = 30.0
    shm_backend: str = "auto"
    overlap: bool = False
    prefetch: int = 0
    spec_gate: bool = False
    spec_warmup: int = 512
    spec_recall_min: float = 75.0
    spec_precision: float = SPEC_PRECISION_PCT
    cache_policy: str = DEFAULT_POLICY


@dataclass
class TokenStat:
    """One decode step (sample a token, then decode it), in nanoseconds and bytes."""

    wall_ns: int
    io_ns: int
    mgmt_ns: int
    read_bytes: int
    hits: int
    lookups: int
    stall_ns: int = 0


@dataclass
class Speculation:
    """What the speculative reads did in one generation: the moe-prefetch / moe-spec-gate numbers."""

    bytes: int = 0
    prefetched: int = 0
    useful: int = 0
    cancelled: int = 0  # speculative orders dropped unread (mispredictions caught in time)


@dataclass
class Result:
    ids: list[int]
    text: str
    n_prompt: int
    prefill_s: float
    steps: list[TokenStat]
    max_resident: int = 0
    speculation: Speculation = field(default_factory=Speculation)

    def hit_pct(self, upto: int | None = None) -> float:
        """Cumulative decode hit rate over the first `upto` steps (all by default)."""
        steps = self.steps[:upto]
        looks = sum(s.lookups for s in steps)
        return 100.0 * sum(s.hits for s in steps) / looks if looks else 0.0


Key = tuple[int, int, int]  # (layer, region index, expert)


@dataclass
class Order:
    """Reads sent to one lane: the slices they fill and, if speculative, the experts read ahead."""

    keys: list[Key]
    lane: int
    ahead: list[tuple[int, int]] = field(default_factory=list)


class Streamer:
    """Cache, slab and lanes for one loaded model; `on_route` is the per-layer entry point.

    Serial: a layer's missing slices are read and awaited at its routing node.
    Overlap: reads go out at the routing node, gate/up slices are awaited there and
    down slices only at the down matmul's input node (`on_down`). Speculative reads
    (temporal prefetch of the previous token's routing, spec-gate predictions) wait
    in a coordinator-side queue and go to lanes with nothing in flight, so a lane
    holds at most one of them when a demand batch arrives; the queue is dropped at
    every demand batch and refilled from the new position in the layer cycle.
    """

    def __init__(self, files: ModelFiles, tensors: list[seam.ExpertTensor], budget: int,
                 io_threads: int, odirect: bool, lane_timeout: float = 30.0, shm_backend: str = "auto",
                 overlap: bool = False, prefetch: int = 0,
                 cache_policy: str = DEFAULT_POLICY) -> None:
        self.files = files
        regions = []
        for t in sorted(tensors, key=lambda t: t.name):
            ext = files.extents.get(t.name)
            if ext is None or ext.nbytes != t.nbytes:
                raise ModelError(f"expert tensor {t.name} in llama.cpp does not match the GGUF table; "
                                 "the file changed while loading, reload it")
            regions.append(Region(t.name, t.layer, t.kind, ext.file_index, ext.offset,
                                  t.n_expert, t.expert_bytes))
        self.n_expert = max(r.n_expert for r in regions)
        window_size = layout(regions)
        self.slab = Slab(slab_size(regions), shm_backend)
        self.window: Window | None = None
        self.pool: LanePool | None = None
        try:  # a signal may land anywhere in here: what exists so far is released
            self.window = Window(window_size, self.slab)
            self.cache = ExpertCache(self.window, regions, budget, cache_policy)
            self.pool = LanePool(io_threads, self.slab.name, [str(p) for p in files.paths], odirect,
                                 timeout=lane_timeout)
            self.tensors = {t.name: t for t in tensors}  # llama.cpp's expert tensors, pointing into the window
            for r in regions:
                self.tensors[r.name].rebind(self.window.base + r.window_offset, r.stride)
        except BaseException:
            self._release_memory()
            raise
        self.overlap = overlap
        self.prefetch = prefetch
        self.spec: SpecGate | None = None
        self.layers = sorted(self.cache.by_layer)
        self.cycle_pos = {layer: i for i, layer in enumerate(self.layers)}
        self.inflight: dict[int, Order] = {}
        self.cancelled: set[int] = set()  # speculative orders asked to be dropped, not yet answered
        self.replaced: dict[int, list[int]] = {}  # cancelled order -> demand orders re-reading what it held
        self.order_of: dict[Key, int] = {}
        self.wishes: list[tuple[int, int]] = []
        self.down_orders: dict[int, list[int]] = {}
        self.last_routes: dict[int, list[int]] = {}
        self.predictions: dict[int, set[int]] = {}
        self.guesses: dict[int, list[tuple[int, int]]] = {}  # layer -> (confidence band, expert) absent when predicted
        self.read_ahead: set[tuple[int, int]] = set()  # finished reads ahead not yet routed
        self.used_in_flight: set[int] = set()  # orders read ahead that their layer routed before they finished
        self.speculation = Speculation()
        self.cache.defer_release = True  # unmapped and given back while lanes read: see _wait
        self.route_seq = 0
        self.routed_at: dict[int, int] = {}
        self.io_ns = self.mgmt_ns = self.stall_ns = self.read_bytes = self.busy_ns = 0
        self.commit_ns = 0  # mapping arrived slots into the window, ever (for _wait's split)

    # ---- the hook's entry points ---------------------------------------------------------------

    def on_route(self, layer: int, ids: np.ndarray) -> None:
        t0 = time.perf_counter_ns()
        self._tick()
        experts = np.unique(ids)
        if experts.size and (experts[0] < 0 or experts[-1] >= self.n_expert):
            raise RuntimeError(f"layer {layer} routed to expert ids {experts.tolist()} outside 0..{self.n_expert - 1}")
        wanted = experts.tolist()
        self.route_seq += 1
        self.routed_at[layer] = self.route_seq
        self.last_routes[layer] = [int(x) for x in ids[-1]] if len(ids) else []
        predicted = self.predictions.pop(layer, None)
        if predicted is not None and self.spec is not None:
            self.spec.score(predicted, set(self.last_routes[layer]))
            for band, e in self.guesses.pop(layer, ()):
                self.spec.confidence.score(band, e in self.last_routes[layer])
        self._count_useful(layer, wanted)
        self.wishes.clear()  # demand first: speculative reads not yet sent are dropped,
        self._cancel_speculation(layer, wanted)  # and those for this layer still queued are mispredictions
        missing = self.cache.plan(layer, wanted)
        now, later = self._send_demand(layer, wanted, missing)
        self._plan_speculation(layer)
        t1 = time.perf_counter_ns()
        self.mgmt_ns += t1 - t0
        if self.overlap:
            self.down_orders[layer] = later
            self.stall_ns += self._wait(now)
        else:
            self.io_ns += self._wait(now + later)
        if self.cache.pending_release:  # nothing to wait for: do it now
            t2 = time.perf_counter_ns()
            self.cache.release_evicted()
            self.mgmt_ns += time.perf_counter_ns() - t2

    def down_pending(self, layer: int) -> bool:
        orders = self.down_orders.get(layer)
        if orders and any(self._live(o) for o in orders):
            return True
        self.down_orders.pop(layer, None)
        return False

    def on_down(self, layer: int) -> None:
        self.stall_ns += self._wait(self.down_orders.pop(layer, []))

    def on_router_input(self, layer: int, node: int) -> None:
        if self.spec is None or not self.spec.active:
            return
        addr, n_embd, n_tokens = seam.last_router_input(node)
        if n_tokens == 1 and n_embd == self.spec.n_embd:  # decode: prefill routes nearly every expert anyway
            self.spec.send(layer, addr, self.route_seq)
        t0 = time.perf_counter_ns()
        self._tick()
        self.mgmt_ns += time.perf_counter_ns() - t0

    def skip(self, layer: int) -> bool:
        """A layer whose every expert is resident under a budget that holds them all needs no stop."""
        if self.cache.layer_complete(layer):
            self.cache.count_hits(layer, self.files.n_expert_used)
            return True
        return False

    # ---- demand and speculative reads ----------------------------------------------------------

    def _send_demand(self, layer: int, wanted: list[int], missing: list[Key]) -> tuple[list[int], list[int]]:
        """Send the layer's missing reads (gate/up before down); returns (await now, await at down)."""
        down = {ri for ri in self.cache.by_layer[layer] if self.cache.regions[ri].kind == "ffn_down_exps"}
        split = self.overlap and bool(down)
        now = self._spread([k for k in missing if not (split and k[1] in down)])
        later = self._spread([k for k in missing if split and k[1] in down])
        for key in self.cache.layer_slices(layer, wanted):
            oid = self.order_of.get(key)  # a read already under way (speculative) covers this slice
            target = later if split and key[1] in down else now
            if oid is not None and oid not in target:
                target.append(oid)
        return now, later

    def _spread(self, keys: list[Key]) -> list[int]:
        """Demand reads over all lanes, largest first onto the least-loaded one; returns order ids."""
        if not keys:
            return []
        merged = self._merged(keys)
        load = [lane.pending_bytes() for lane in self.pool.lanes]
        shares: list[list[tuple[ReadOrder, list[Key]]]] = [[] for _ in load]
        for item in sorted(merged, key=lambda x: -x[0][2]):
            i = load.index(min(load))
            shares[i].append(item)
            load[i] += item[0][2]
        return [self._send(i, share) for i, share in enumerate(shares) if share]

    def _send(self, lane: int, share: list[tuple[ReadOrder, list[Key]]],
              ahead: list[tuple[int, int]] | None = None) -> int:
        oid = self.pool.send(lane, [r for r, _ in share], speculative=bool(ahead))
        keys = [k for _, ks in share for k in ks]
        self.inflight[oid] = Order(keys, lane, ahead or [])
        for k in keys:
            self.order_of[k] = oid
        return oid

    def _plan_speculation(self, layer: int) -> None:
        """Queue the previous token's experts of the next `prefetch` layers, nearest first."""
        if self.prefetch:
            pos = self.cycle_pos[layer]
            for j in range(1, self.prefetch + 1):
                nxt = self.layers[(pos + j) % len(self.layers)]
                self._wish(nxt, self.last_routes.get(nxt, ()))
        self._pump()

    def _wish(self, layer: int, experts) -> None:
        for e in experts:
            if (layer, e) not in self.wishes and self._absent(layer, e):
                self.wishes.append((layer, e))

    def _absent(self, layer: int, expert: int) -> bool:
        st = self.cache.state
        return any(st[ri][expert] == ABSENT for ri in self.cache.by_layer[layer])

    def _pump(self) -> None:
        """Queue wished-for speculative reads in the lanes, one expert per order, up to
        SPEC_QUEUE_PER_LANE per lane; the lanes serve them only when no demand order waits."""
        queued = [0] * len(self.pool.lanes)
        for order in self.inflight.values():
            if order.ahead:
                queued[order.lane] += 1
        while self.wishes and min(queued) < SPEC_QUEUE_PER_LANE:
            layer, e = self.wishes.pop(0)
            keys = self.cache.admit_speculative(layer, [e])
            if keys:
                lane = queued.index(min(queued))
                self._send(lane, self._merged(keys), ahead=[(layer, e)])
                queued[lane] += 1

    def _cancel_speculation(self, layer: int | None, routed: list[int] = ()) -> None:
        """Ask the lanes to drop the speculative orders for `layer` (None: all layers) that they have
        not started, except those for experts the layer routed to."""
        by_lane: dict[int, list[int]] = {}
        for oid, order in self.inflight.items():
            if not order.ahead or oid in self.cancelled:
                continue
            at, e = order.ahead[0]
            if layer is None or (at == layer and e not in routed):
                by_lane.setdefault(order.lane, []).append(oid)
                self.cancelled.add(oid)
        for lane, oids in by_lane.items():
            self.pool.lanes[lane].cancel(oids)

    def _on_predictions(self) -> None:
        conf = self.spec.confidence
        for seq, layer, ids, probs in self.spec.receive():
            if self.routed_at.get(layer, 0) > seq:
                continue  # the layer routed before the prediction arrived: too late to use
            self.predictions[layer] = set(ids)
            guesses = [(conf.band(p), e) for e, p in zip(ids, probs) if self._absent(layer, e)]
            self.guesses[layer] = guesses
            before = len(self.wishes)
            self._wish(layer, [e for band, e in guesses if conf.worth(band)])
            self.wishes[:] = self.wishes[before:] + self.wishes[:before]  # the next layer comes first
        self._pump()

    def _count_useful(self, layer: int, wanted: list[int]) -> None:
        """A read ahead is useful when its layer routes the expert: counted now if it finished, else
        when it does (the demand waits for it instead of reading again)."""
        for e in wanted:
            if (layer, e) in self.read_ahead:
                self.read_ahead.discard((layer, e))
                if not self._absent(layer, e):  # not evicted before its layer routed
                    self.speculation.useful += 1
        for oid, order in self.inflight.items():
            if order.ahead and order.ahead[0][0] == layer and order.ahead[0][1] in wanted:
                self.used_in_flight.add(oid)

    # ---- completions ---------------------------------------------------------------------------

    def _extra(self) -> dict:
        return {self.spec.fd: self._on_predictions} if self.spec is not None and self.spec.active else {}

    def _tick(self) -> None:
        """Collect what finished and keep idle lanes busy, without blocking."""
        if self.inflight or (self.spec is not None and self.spec.active):
            self.pool.poll(0, self._extra())
            self._collect()
            self._pump()

    def _wait(self, orders: list[int]) -> int:
        """Block until these orders completed; returns the wall time blocked (ns).

        Evicted slices' window ranges are unmapped here first, while the lanes read (and
        pages to give back are given back); that time, and mapping the slots that arrive,
        is cache management, not waiting.
        """
        t0 = time.perf_counter_ns()
        committed = self.commit_ns
        spent = 0
        while any(self._live(o) for o in orders):
            if self.cache.pending_release:
                r0 = time.perf_counter_ns()
                self.cache.release_evicted()
                spent += time.perf_counter_ns() - r0
            self.pool.poll(0.5, self._extra())
            self._collect()
            self._pump()
        spent += self.commit_ns - committed
        self.mgmt_ns += spent
        return time.perf_counter_ns() - t0 - spent

    def _collect(self) -> None:
        for oid in [o for o in self.pool.done if o in self.inflight]:
            nbytes, busy = self.pool.take(oid)
            order = self.inflight.pop(oid)
            self.cancelled.discard(oid)
            used = oid in self.used_in_flight
            self.used_in_flight.discard(oid)
            for k in order.keys:
                del self.order_of[k]
            if nbytes == CANCELLED:
                self._abandon(oid, order)
                continue
            c0 = time.perf_counter_ns()
            self.cache.commit(order.keys)
            self.commit_ns += time.perf_counter_ns() - c0
            self.read_bytes += nbytes
            self.busy_ns += busy
            if order.ahead:
                self.speculation.bytes += nbytes
                self.speculation.prefetched += len(order.ahead)
                if used:
                    self.speculation.useful += len(order.ahead)
                else:
                    self.read_ahead.update(order.ahead)

    def _abandon(self, oid: int, order: Order) -> None:
        """A cancelled order read nothing: its slices are absent again. Should a layer have come to
        need one meanwhile (its routing saw it loading), it is read now, and waits that were on
        the cancelled order follow the new one."""
        self.speculation.cancelled += 1
        needed = [k for k in order.keys if k in self.cache.pinned]
        self.cache.abandon([k for k in order.keys if k not in self.cache.pinned])
        if needed:
            self.replaced[oid] = self._spread(needed)

    def _live(self, oid: int) -> bool:
        """An order still to wait for: in flight, or cancelled and replaced by orders in flight."""
        return oid in self.inflight or any(self._live(o) for o in self.replaced.get(oid, ()))

    def settle(self) -> None:
        """Finish every read in flight and drop queued ones: the cache is consistent again."""
        self.wishes.clear()
        self.down_orders.clear()
        self.predictions.clear()
        self.guesses.clear()
        self._cancel_speculation(None)
        self._wait(list(self.inflight))
        self.replaced.clear()

    # ---- whole-cache operations ----------------------------------------------------------------

    def preload(self) -> int:
        """Read every expert now (only when the budget holds them all); returns bytes read."""
        c = self.cache
        if not c.holds_everything:
            return 0
        total = 0
        for layer in sorted(c.by_layer):
            experts = list(range(max(c.regions[i].n_expert for i in c.by_layer[layer])))
            missing = c.plan(layer, experts)
            if missing:
                total += self.pool.wait(self.pool.submit([r for r, _ in self._merged(missing)]))
            c.commit(missing)
        c.stats = type(c.stats)()
        return total

    def _merged(self, keys: list[Key]) -> list[tuple[ReadOrder, list[Key]]]:
        """The slices' reads, adjacent ones merged, each with the slices it fills."""
        return merge_keyed([(self.cache.read_order(k), k) for k in keys], MAX_MERGED_READ)

    def take_counters(self) -> tuple[int, int, int, int]:
        """(io, mgmt, stall ns, bytes read) since the last call; io is lane busy time under overlap."""
        io = self.busy_ns if self.overlap else self.io_ns
        out = (io, self.mgmt_ns, self.stall_ns, self.read_bytes)
        self.io_ns = self.mgmt_ns = self.stall_ns = self.read_bytes = self.busy_ns = 0
        return out

    def close(self) -> None:
        try:
            if self.spec is not None:
                self.spec.close()
        finally:
            self._release_memory()

    def _release_memory(self) -> None:
        try:
            if self.pool is not None:
                self.pool.close()
        finally:
            try:
                if self.window is not None:
                    self.window.close()
            finally:
                self.slab.close()


def auto_cache_bytes(expert_bytes: int, floor_mb: float, ceil_mb: float | None = None) -> tuple[int, str]:
    """The `--cache-mb auto` budget: the least of available memory minus the floor, the ceiling and
    every expert's bytes; with the terms it compared, for the notice that reports it."""
    avail = psutil.virtual_memory().available
    terms = [(max(0, avail - int(floor_mb * MiB)),
              f"available {avail / MiB:.0f} MiB minus --cache-floor-mb {floor_mb:g}"),
             (expert_bytes, f"experts total {expert_bytes / MiB:.0f} MiB")]
    if ceil_mb is not None:
        terms.append((int(ceil_mb * MiB), f"--cache-ceil-mb {ceil_mb:g}"))
    budget = min(b for b, _ in terms)
    why = "; ".join(f"{'=> ' if b == budget else ''}{what}" for b, what in terms)
    return budget, why


class Engine:
    """A loaded model and context; streaming experts unless `settings.stream` is off."""

    def __init__(self, settings: Settings, notice: Callable[[str], None] = lambda s: None) -> None:
        self.settings = settings
        self.streamer: Streamer | None = None
        self.trace: TraceWriter | None = None
        self.model = self.ctx = None
        self.budget = 0
        t0 = time.perf_counter()
        self.files = open_model(settings.model)
        init_backend(settings.verbose)
        self.hook = seam.EvalHook()
        self.moe = self.files.n_expert > 1
        if settings.stream and not self.moe:
            notice(f"{Path(settings.model).name} is not a Mixture-of-Experts model; running it plain")
        streaming = settings.stream and self.moe
        if streaming:
            removed = sweep_stale_segments()
            if removed:
                notice(f"removed {len(removed)} shared-memory segment(s) left by dead runs")
        try:
            self._load(streaming)
            self.vocab = Vocab(self.model)
            if streaming:
                self._start_streaming(notice)
        except BaseException:
            self.close()
            raise
        self.load_s = time.perf_counter() - t0

    def _load(self, streaming: bool) -> None:
        self.model = load_model(self.settings.model)
        if not self.model:
            raise ModelError(f"llama.cpp could not load {self.settings.model}; run with --verbose to see why")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = self.settings.n_ctx
        cp.n_batch = self.settings.n_ctx
        cp.n_ubatch = min(512, self.settings.n_ctx)
        threads = self.settings.threads or psutil.cpu_count(logical=True) or 1
        cp.n_threads = cp.n_threads_batch = threads
        if streaming:
            cp.cb_eval = self.hook.c_callback
            cp.cb_eval_user_data = None
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise ModelError(f"llama.cpp could not create a context of {self.settings.n_ctx} tokens; lower -c")
        llama_cpp.llama_set_abort_callback(self.ctx, self.hook.c_abort, None)
        self.n_ctx = llama_cpp.llama_n_ctx(self.ctx)

    def _start_streaming(self, notice: Callable[[str], None]) -> None:
        """One warm-up decode finds the expert tensors; then they are rebound into the window."""
        cap = self.hook.capture = seam.Capture()
        try:
            self._decode([self.vocab.warmup_token()])
        finally:
            self.hook.capture = None
        self.clear_kv()
        if cap.bad:
            raise ModelError("cannot stream this model's expert layout: " + "; ".join(cap.bad[:3])
                             + "; run it with --no-stream")
        if not cap.tensors:
            raise ModelError("llama.cpp computed no expert matmul (MUL_MAT_ID) for this model; run it with --no-stream")
        tensors = list(cap.tensors.values())
        s = self.settings
        if s.cache_mb is not None:
            self.budget = int(s.cache_mb * MiB)
        else:
            self.budget, why = auto_cache_bytes(sum(t.nbytes for t in tensors), s.cache_floor_mb, s.cache_ceil_mb)
            auto_notice = f"cache budget {self.budget / MiB:.1f} MiB (auto, the least of: {why})"
        if (s.prefetch or s.spec_gate) and self.budget <= 0 and s.cache_mb is not None:
            raise ConfigError("--prefetch and --spec-gate read experts ahead into the cache, and this run has "
                              "none; give it a budget with --cache-mb (or drop those flags)")
        self.streamer = Streamer(self.files, tensors, self.budget, s.io_threads, s.odirect, s.lane_timeout,
                                 s.shm_backend, s.overlap, s.prefetch, s.cache_policy)
        top_k = max(1, self.files.n_expert_used)
        layer_need = self.streamer.cache.layer_working_set(top_k)
        token_need = self.streamer.cache.token_working_set(top_k)
        if s.cache_mb is None:
            if 0 < self.budget < token_need and not s.force:
                auto_notice += (f"; that is below one token's working set ({token_need / MiB:.1f} MiB), where a "
                                "cache thrashes, so this run has none (as --cache-mb 0); --force keeps it")
                self.budget = self.streamer.cache.budget = 0
            notice(auto_notice)
            if (s.prefetch or s.spec_gate) and self.budget <= 0:
                raise ConfigError("--prefetch and --spec-gate read experts ahead into the cache, and --cache-mb "
                                  "auto found no room for one; free memory, lower --cache-floor-mb, or drop "
                                  "those flags")
        what = "--cache-mb " + (f"{s.cache_mb:g}" if s.cache_mb is not None else f"auto ({self.budget / MiB:.1f})")
        if 0 < self.budget < layer_need:
            raise ConfigError(f"{what} is below one layer's working set ({layer_need / MiB:.1f} MiB), which even "
                              f"--force cannot run; use --cache-mb {_mib_up(token_need)} (one token's working set) "
                              "or more, or 0 for no cache")
        if 0 < self.budget < token_need and not s.force:
            raise ConfigError(f"{what} is below one token's working set ({token_need / MiB:.1f} MiB): the cache "
                              "would thrash, each token evicting experts the next one needs again; use --cache-mb "
                              f"{_mib_up(token_need)} or more, 0 for no cache, or --force to run with it anyway")
        st = self.streamer
        self.hook.on_route = st.on_route
        if s.overlap:
            self.hook.down_nodes = cap.down_inputs
            self.hook.down_pending, self.hook.on_down = st.down_pending, st.on_down
        if s.spec_gate:
            gate = SpecGate([str(p) for p in self.files.paths], self.files.arch, st.layers,
                            self.files.n_expert_used, llama_cpp.llama_model_n_embd(self.model),
                            s.shm_backend, s.spec_warmup, s.spec_recall_min, notice,
                            self.files.n_expert, s.spec_precision)
            if gate.active:
                st.spec = gate
                self.hook.on_router_input = self._router_input
            else:
                gate.close()  # it said why (e.g. a quantized router); the run goes on without it
        if s.route_trace:
            self._start_trace(Path(s.route_trace))
        else:
            self.hook.skip_route = st.skip
        if s.preload:
            if not self.streamer.cache.holds_everything:
                notice("--preload ignored: the cache budget does not hold every expert")
            else:
                t0 = time.perf_counter()
                n = self.streamer.preload()
                notice(f"preloaded {n / MiB:.0f} MiB of experts in {time.perf_counter() - t0:.1f} s")

    def _start_trace(self, path: Path) -> None:
        layers = sorted(self.streamer.cache.by_layer)
        self.trace = TraceWriter(path, {
            "model": str(Path(self.settings.model).resolve()), "arch": self.files.arch,
            "n_expert": self.files.n_expert, "top_k": self.files.n_expert_used, "layers": layers,
            "n_embd": llama_cpp.llama_model_n_embd(self.model)})
        stream = self.streamer.on_route

        def on_route(layer: int, ids: np.ndarray) -> None:
            self.trace.on_route(layer, ids, self.streamer.predictions.get(layer))
            stream(layer, ids)

        self.hook.on_route = on_route
        self.hook.on_router_input = self._router_input

    def _router_input(self, layer: int, node: int) -> None:
        """Hand a layer's router input to the trace and the spec-gate; off once neither wants it."""
        st = self.streamer
        if self.trace:
            self.trace.on_router_input(layer, seam.router_input(node))
        if st.spec is not None and st.spec.active:
            st.on_router_input(layer, node)
        elif not self.trace:
            self.hook.on_router_input = None  # the governor fired: no more stops at the router

    @property
    def cache_active(self) -> bool:
        return self.streamer is not None and self.budget > 0

    def clear_kv(self) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)

    # ---- session support: KV prefix reuse and cancel (bmoe.session) -------------------------

    cancel_requested = False

    def cancel(self) -> None:
        """Stop the generation in flight; safe to call from another thread.

        Like a signal (seam.deliver), a Cancelled is parked on the hook: the eval and abort
        callbacks stop the running graph and `_decode` raises it. An error already parked
        (a lane failure, a signal) is left in place, so it is not mistaken for a cancel. The
        flag covers the time between decodes; `generate_after` checks it after each token.
        """
        self.cancel_requested = True
        if self.hook.error is None:
            self.hook.error = Cancelled()

    def reset_cancel(self) -> None:
        """Forget a cancel that arrived after its generation ended."""
        self.cancel_requested = False
        if isinstance(self.hook.error, Cancelled):
            self.hook.error = None

    def kv_len(self) -> int:
        """Tokens in the KV (sequence 0): the next position to decode."""
        return llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(self.ctx), 0) + 1

    def kv_keep(self, n: int) -> int:
        """Keep the KV's first `n` positions and drop the rest; returns how many were kept.

        A memory that cannot drop a partial sequence (e.g. sliding-window or recurrent) is
        cleared instead, and 0 is returned: the caller then re-prefills everything.
        """
        mem = llama_cpp.llama_get_memory(self.ctx)
        if n <= 0 or not llama_cpp.llama_memory_seq_rm(mem, 0, n, -1):
            self.clear_kv()
            return 0
        return n

    def generate_after(self, suffix: list[int], n_predict: int,
                       on_piece: Callable[[int, str, TokenStat], None] = lambda i, s, st: None) -> Result:
        """Like `generate`, but continues the KV as it stands: prefill only `suffix`, then decode.

        The KV afterwards holds the old tokens, `suffix` and every token in `Result.ids` (each
        sampled token is decoded before the next one is sampled; an end-of-generation token is
        not). Raises Cancelled when `cancel` is called mid-prefill or mid-decode.
        """
        if not suffix:
            raise ConfigError("nothing to prefill: the prompt is empty")
        n_ctx = min(self.n_ctx, self.settings.n_ctx)
        n_past = self.kv_len()
        if n_past + len(suffix) + n_predict > n_ctx:
            raise ConfigError(f"the context ({n_past} tokens kept + {len(suffix)} new) plus n_predict "
                              f"{n_predict} exceeds the context of {n_ctx} tokens")

        def piece(i: int, text: str, stat: TokenStat) -> None:
            on_piece(i, text, stat)
            if self.cancel_requested:
                raise Cancelled()

        if self.cancel_requested:
            raise Cancelled()
        sampler = make_sampler(self.settings.sampler)
        try:
            return self._generate(sampler, suffix, n_predict, piece)
        finally:
            llama_cpp.llama_sampler_free(sampler)
            if self.trace:
                self.trace.active = False

    def _decode(self, tokens: list[int]) -> None:
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        with self.hook:
            rc = llama_cpp.llama_decode(self.ctx, llama_cpp.llama_batch_get_one(arr, len(tokens)))
        err = self.hook.take_error()
        if err is not None:
            raise err
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")

    def prompt_tokens(self, prompt: str, chat: bool) -> list[int]:
        text = self.vocab.chat_prompt(prompt) if chat else prompt
        return self.vocab.tokenize(text, add_special=True)

    def generate(self, tokens: list[int], n_predict: int,
                 on_piece: Callable[[int, str, TokenStat], None] = lambda i, s, st: None) -> Result:
        if not tokens:
            raise ConfigError("the prompt is empty; pass text with -p or -f")
        n_ctx = min(self.n_ctx, self.settings.n_ctx)
        if len(tokens) + n_predict > n_ctx:
            raise ConfigError(f"the prompt ({len(tokens)} tokens) plus -n {n_predict} exceeds the context "
                              f"of {n_ctx} tokens; raise -c or shorten the prompt")
        sampler = make_sampler(self.settings.sampler)
        try:
            return self._generate(sampler, tokens, n_predict, on_piece)
        finally:
            llama_cpp.llama_sampler_free(sampler)

    def _generate(self, sampler: llama_cpp.llama_sampler_p, tokens: list[int], n_predict: int,
                  on_piece: Callable[[int, str, TokenStat], None]) -> Result:
        st = self.streamer
        try:
            return self._run(sampler, tokens, n_predict, on_piece)
        finally:
            if st:
                st.settle()

    def _run(self, sampler: llama_cpp.llama_sampler_p, tokens: list[int], n_predict: int,
             on_piece: Callable[[int, str, TokenStat], None]) -> Result:
        st = self.streamer
        if st:
            st.speculation = Speculation()
        t0 = time.perf_counter()
        self._decode(tokens)
        if st:
            st.take_counters()
        prefill_s = time.perf_counter() - t0
        if self.trace:
            self.trace.active = True
        out = TextStream()
        res = Result([], "", len(tokens), prefill_s, [])
        for i in range(n_predict):
            c0 = time.perf_counter_ns()
            tok = llama_cpp.llama_sampler_sample(sampler, self.ctx, -1)
            if self.vocab.is_eog(tok):
                break
            res.ids.append(tok)
            new = out.push(self.vocab.piece(tok))
            before = st.cache.stats.snapshot() if st else (0, 0)
            self._decode([tok])
            wall = time.perf_counter_ns() - c0
            io, mgmt, stall, nbytes = st.take_counters() if st else (0, 0, 0, 0)
            after = st.cache.stats.snapshot() if st else (0, 0)
            stat = TokenStat(wall, io, mgmt, nbytes, after[0] - before[0], after[1] - before[1], stall)
            res.steps.append(stat)
            if self.trace:
                self.trace.end_step(tok)
            if st:
                res.max_resident = max(res.max_resident, st.slab.resident_bytes())
            on_piece(i, new, stat)
        out.finish()
        res.text = out.text
        if st:
            res.speculation = st.speculation
        if self.trace:
            self.trace.active = False
            self.trace.write()
        return res

    def resident_bytes(self) -> int:
        return self.streamer.slab.resident_bytes() if self.streamer else 0

    def close(self) -> None:
        """Free llama.cpp objects, then release workers and shared memory; idempotent."""
        st, self.streamer = self.streamer, None
        self.hook.on_route = self.hook.on_router_input = self.hook.skip_route = None
        self.hook.down_pending = self.hook.on_down = None
        try:
            if self.ctx:
                llama_cpp.llama_free(self.ctx)
                self.ctx = None
            if self.model:
                llama_cpp.llama_model_free(self.model)
                self.model = None
        finally:
            if st:
                st.close()
