"""A model's load, and the streaming parts wired around it: everything `Engine` is handed.

`load_engine` opens the GGUF, loads it with llama.cpp's own mmap load (mapped without being read while
streaming: bmoe.seam.no_populate), finds the expert tensors in one warm-up graph visited but not
computed (bmoe.seam.Capture), sizes the cache (bmoe.memory.budget), builds the Streamer (slab, slot
pools, cache, I/O lanes), the spec-gate, the route trace, lossy routing and a replayed trace, and
hooks them into llama.cpp's eval callback through `StreamingStops`. A new streaming mode is wired
here, in `_stream`; what it does at the graph's stops lives in bmoe.streaming.graph_stops.

Before llama.cpp loads anything it reads a replayed trace and makes and checks `--prompt-cache`'s
folder (bmoe.base.private_files), so a setting that cannot work fails at once. What a load made is
released by `Loaded.close`, also when the load fails half-way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from bmoe import seam
from bmoe.base.errors import ConfigError, ModelError
from bmoe.base.model_files import ModelFiles, read_model_files
from bmoe.base.private_files import private_folder
from bmoe.base.settings import Naming, Settings
from bmoe.base.units import MiB
from bmoe.engine import prompt_calls
from bmoe.engine.drafts import DraftReads
from bmoe.memory.budget import Adaptive, BudgetWatch, decide
from bmoe.memory.dense import DenseReadAhead, advise_normal, dense_ranges, pin
from bmoe.memory.probe import MemoryProbe
from bmoe.seam import llama
from bmoe.shm_cache import sweep_stale_segments
from bmoe.streaming.expert_cache import Region, working_sets
from bmoe.streaming.gating import Gating, lossy_refusal, read_gating, spec_gate_refusal
from bmoe.streaming.graph_stops import StreamingStops
from bmoe.streaming.lossy import Lossy
from bmoe.streaming.route_replay import ReplayError, RouteReplay
from bmoe.streaming.route_trace import Trace, TraceError, TraceWriter
from bmoe.streaming.speculation import SpecGate
from bmoe.streaming.streamer import Streamer, regions_of
from bmoe.streaming.usage_profile import default_dir
from bmoe.streaming.warm_fill import WarmStart, fill_rest
from bmoe.workers.routers import ROUTER_NORM


@dataclass
class Loaded:
    """One load's llama.cpp objects and streaming parts (the last are None without streaming)."""

    settings: Settings
    notice: Callable[[str], None]
    words: Naming
    files: ModelFiles
    hook: seam.EvalHook
    memory: MemoryProbe = field(default_factory=MemoryProbe)
    model: llama.LlamaModel | None = None
    ctx: llama.Context | None = None
    mtp_ctx: llama.Context | None = None  # --draft mtp: the context that runs the model's MTP layer (bmoe.engine.mtp)
    vocab: llama.Vocab | None = None
    n_ctx: int = 0
    load_s: float = 0.0
    llama_load_s: float = 0.0  # of load_s, llama.cpp's own load (model, then context)
    fixed_k: int = 0  # --no-stream --experts-per-token: llama.cpp's own expert count, set at load
    pooling: str | None = None  # --embedding: how the context pools them (llama.cpp's, by --pooling's names)
    streamer: Streamer | None = None
    stops: StreamingStops | None = None
    trace: TraceWriter | None = None
    lossy: Lossy | None = None  # lossy routing while streaming (the stops')
    replay: RouteReplay | None = None  # --replay-routes: every routing is a trace's (the stops')
    adaptive: Adaptive | None = None
    warm: WarmStart | None = None  # the usage profile: a background fill now, saved at close
    dense_ahead: DenseReadAhead | None = None  # the dense weights read while the start-up runs
    gating: Gating | None = None  # how the model routes (read from the warm-up graph while streaming)
    scratch: seam.Scratch | None = None  # llama.cpp's compute buffer (from the warm-up graph while streaming)
    draft_reads: DraftReads | None = None  # --draft while streaming: the extra reads of verify groups (the stops')
    mtp_layers: frozenset[int] = frozenset()  # --draft mtp: the MTP block's layers, run by the MTP context alone
    abandoned: bool = False  # closed while a decode may have been running: llama.cpp's objects are left alone

    @property
    def mtp_blind(self) -> frozenset[int]:
        """With one MTP block, its layer: the experts an MTP decode without outputs does not need (bmoe.engine.mtp)."""
        return self.mtp_layers if len(self.mtp_layers) == 1 else frozenset()

    def close(self, in_use: bool = False) -> None:
        """Free llama.cpp's objects, then release workers and shared memory; idempotent.

        `in_use`: a decode may still be running in llama.cpp on another thread. Then the workers
        are killed and the shared segments unlinked (Streamer.abandon), but llama.cpp's objects and
        the slab's mapping, which that decode reads, are left for the process's exit to take: freeing
        them under it would crash it. A close after that one does nothing more.

        The streamer stays reachable until its own close has ended, so an `in_use` close from another
        thread (a shutdown past its bound) while this one waits on the workers still frees the
        shared memory's names."""
        if self.abandoned:
            return
        if in_use:
            self.abandoned = True
            if self.streamer is not None:
                self.streamer.abandon()
            return
        if self.warm is not None and self.streamer is not None:
            self.warm.save()
        self.hook.stops = None
        try:
            if self.mtp_ctx:
                llama.free_context(self.mtp_ctx)
                self.mtp_ctx = None
            if self.ctx:
                llama.free_context(self.ctx)
                self.ctx = None
            if self.model:
                llama.free_model(self.model)
                self.model = None
        finally:
            if self.streamer is not None:
                try:
                    self.streamer.close()
                finally:
                    self.streamer = None


def load_engine(settings: Settings, notice: Callable[[str], None], words: Naming) -> Loaded:
    """Load `settings.model` as `settings` ask (validated by the edge); `notice` hears what the user
    should know; errors name settings in `words` (the edge's)."""
    t0 = time.perf_counter()
    files = read_model_files(settings.model)
    mtp_layers = files.mtp_layers
    if settings.draft.mode == "mtp":
        files = _with_mtp(files, settings, words)
    llama.init_backend(settings.verbose)
    parts = Loaded(settings, notice, words, files, seam.EvalHook())
    if settings.draft.mode == "mtp":
        parts.mtp_layers = mtp_layers
    moe = files.n_expert > 1
    if settings.streaming.enabled and not moe:
        notice(f"{Path(settings.model).name} is not a Mixture-of-Experts model; running it plain")
    streaming = settings.streaming.enabled and moe
    if streaming:
        removed = sweep_stale_segments()
        if removed:
            notice(f"removed {len(removed)} shared-memory segment(s) left by dead runs")
    try:
        parts.fixed_k = _fixed_k(parts, moe, streaming)
        replay = _read_replay(parts, moe)
        _prompt_cache_folder(parts)
        _load_llama(parts, streaming)
        _check_drafts(parts)
        if streaming:
            _stream(parts, replay)
    except BaseException:
        parts.close()
        raise
    parts.load_s = time.perf_counter() - t0
    return parts


def _with_mtp(files: ModelFiles, s: Settings, words: Naming) -> ModelFiles:
    """--draft mtp: the model's MTP layers are loaded and decoded (their experts streamed like the rest), or a
    model without one is refused before llama.cpp loads it."""
    if not files.mtp_layers:
        raise ConfigError(f"{words.value('draft', 'mtp')}: {Path(s.model).name} has no multi-token-prediction "
                          f"layer ({files.arch}.nextn_predict_layers); use {words.value('draft', 'ngram')} or a "
                          "model file converted with its MTP layer")
    return replace(files, mtp_layers=frozenset())


def _fixed_k(p: Loaded, moe: bool, streaming: bool) -> int:
    """The lossy settings against the model: K within its top-k; without streaming K is llama.cpp's
    own expert count, overridden at load (the returned `fixed_k`, else 0)."""
    lo, top_k = p.settings.lossy, p.files.n_expert_used
    if not lo.on:
        return 0
    if not moe:
        p.notice("the lossy routing settings change nothing on a model without experts")
        return 0
    k = lo.experts_per_token
    if k > top_k:
        raise ConfigError(f"{p.words.value('experts_per_token', k)}: {Path(p.settings.model).name} routes "
                          f"each token to {top_k} experts; give at most {top_k}")
    return k if not streaming and 0 < k < top_k else 0


def _read_replay(p: Loaded, moe: bool) -> Trace | None:
    """--replay-routes' trace, read before the model loads: an unreadable one fails at once."""
    path = p.settings.replay_routes
    if not path:
        return None
    if not moe:
        p.notice(f"{p.words.name('replay_routes')} changes nothing on a model without experts")
        return None
    try:
        return Trace.read(path)
    except OSError as e:
        raise ConfigError(f"{p.words.value('replay_routes', path)}: cannot read it ({e.strerror}); "
                          "give a trace written by bmoe-cli --route-trace, or route_trace v1 CSV") from None
    except (TraceError, ValueError, KeyError) as e:
        raise ConfigError(f"{p.words.value('replay_routes', path)}: {e}") from None


def _prompt_cache_folder(p: Loaded) -> None:
    """--prompt-cache's folder, made and checked before the model loads: its entries go to llama.cpp's
    state loader, so no other user may be able to change them (bmoe.base.private_files)."""
    folder = p.settings.prompt_cache
    if not folder:
        return
    try:
        why = private_folder(Path(folder))
    except OSError as e:
        why = f"cannot create it ({e.strerror}); choose a folder you can write to"
    if why:
        raise ConfigError(f"{p.words.value('prompt_cache', folder)}: {why}")


def _load_llama(p: Loaded, streaming: bool) -> None:
    """llama.cpp's own load (model, then context), timed apart as `llama_load_s`, so that
    `load_s - llama_load_s` is what bmoe adds to a plain llama.cpp load."""
    s = p.settings
    t0 = time.perf_counter()
    ints = {f"{p.files.arch}.expert_used_count": p.fixed_k} if p.fixed_k else None
    with seam.no_populate() if streaming else nullcontext("not streaming") as why:
        if streaming and why is not None:
            p.notice(f"loading the whole model file, as llama.cpp does ({why}): a slower start, the same output")
        p.model = llama.load_model(s.model, ints, mtp=s.draft.mode == "mtp")
    if why is None:  # llama.cpp mapped the file without reading it: the dense weights are read here
        p.dense_ahead = DenseReadAhead(p.files).start()
    if not p.model:
        raise ModelError(f"llama.cpp could not load {s.model}; run with --verbose to see why")
    cb = p.hook.c_callback if streaming else None
    rollback = s.draft.most if s.draft.mode != "none" else 0  # a recurrent state's snapshots (llama.cpp's n_rs_seq)
    p.ctx = llama.new_context(p.model, s.n_ctx, s.threads, cb, n_ubatch=prompt_calls.width(s.n_ctx), n_seq=s.parallel,
                              eval_user=p.hook.user_data, embeddings=s.embedding, pooling=s.pooling, rollback=rollback)
    if s.draft.mode == "mtp":  # as llama.cpp's common_speculative_init_result makes it
        if llama.n_layer_nextn(p.model) < 1:
            raise ModelError(f"llama.cpp loaded no MTP layer of {Path(s.model).name}; run it without "
                             f"{p.words.value('draft', 'mtp')}")
        # ubatches of 512, llama.cpp's default: a prompt's width would reserve (and touch) a compute buffer of
        # that many rows of logits (2 GB at 2048 on a 248k vocabulary) for a layer that decodes a token at a time
        p.mtp_ctx = llama.new_context(p.model, s.n_ctx, s.threads, cb, n_seq=s.parallel, eval_user=p.hook.user_data,
                                      mtp_of=p.ctx)
        llama.set_embeddings_nextn(p.ctx, masked=False)
        llama.set_embeddings_nextn(p.mtp_ctx, masked=True)
        llama.set_abort(p.mtp_ctx, p.hook.c_abort, p.hook.user_data)
    if s.embedding:  # made computing them (its buffer reserved for it); generation decodes without
        llama.set_embeddings(p.ctx, False)
        p.pooling = llama.pooling_name(p.ctx)
        if p.pooling is None:
            raise ModelError(f"{Path(s.model).name} pools its embeddings in a way bmoe does not serve (a reranker's); "
                             f"give {p.words.name('pooling')} none, mean, cls or last")
    p.llama_load_s = time.perf_counter() - t0
    llama.set_abort(p.ctx, p.hook.c_abort, p.hook.user_data)
    p.n_ctx = min(llama.context_size(p.ctx), s.n_ctx)
    p.vocab = llama.Vocab(p.model)


def _check_drafts(p: Loaded) -> None:
    """--draft needs a memory that can drop the positions of rejected drafts: a KV cache can, and a recurrent or
    hybrid model's state where llama.cpp keeps a snapshot per drafted position (n_rs_seq: qwen35moe, deepseek4,
    bailingmoe3, lfm2moe, ...); for the others (qwen3next) llama-server restores whole checkpoints of the state,
    which bmoe does not."""
    assert p.model is not None and p.ctx is not None  # loaded
    d = p.settings.draft
    if d.mode != "none" and not llama.can_rewind(p.model) and llama.rollback_room(p.ctx) < d.most:
        raise ConfigError(f"{p.words.value('draft', d.mode)}: {Path(p.settings.model).name} ({p.files.arch}) keeps a "
                          "recurrent state that llama.cpp cannot roll back by position for it (it keeps no per-token "
                          "snapshots of this architecture's state), so rejected drafts could not be dropped; run it "
                          "without drafts")


def _stream(p: Loaded, replay: Trace | None) -> None:
    """A warm-up graph, visited but not computed, finds the expert tensors; they are rebound into the
    slab's pools, and every part the settings ask for is built and hooked in. `replay`: the trace
    --replay-routes runs on."""
    s, files = p.settings, p.files
    cap = _captured(p)
    p.scratch = cap.scratch()
    gating = p.gating = read_gating(files, cap.gating)
    _refuse_what_cannot_follow(p, gating)
    tensors = list(cap.tensors.values())
    regions = regions_of(files, tensors)
    dense = dense_ranges(files, tensors)  # before the expert tensors are rebound: their data pointers find the mapping
    _charge_dense(p, dense)
    # the lanes and pinned weights are there before the budget is decided: they are in the charge
    st = p.streamer = Streamer(files, regions, tensors, 0, s.streaming, s.cache.policy, s.speculation.prefetch,
                               [*cap.biases.values(), *cap.scales.values()],
                               spare=s.lossy.on or replay is not None or bool(p.mtp_blind),
                               guess=s.speculation.guess, mtp_layers=p.mtp_layers)
    if cap.scales:  # their graphs' REPEATs were sized for n_expert rows: build them for the pools
        assert p.ctx is not None and p.model is not None  # loaded
        llama.rebuild_graphs(p.ctx, p.model)
    if replay is not None:
        p.replay = _replayed(p, replay, st, cap.norms)
    need = working_sets(regions, max(1, _routed(files.n_expert_used, replay)))
    _size_cache(p, st, max(need.values()), sum(need.values()))
    if s.speculation.gate:
        _attach_gate(p, st, gating)
    if s.route_trace:
        p.trace = _trace_writer(p, s.route_trace, st, regions)
    if s.lossy.on:
        p.lossy = Lossy(s.lossy, files.n_expert_used, cap.norms, st.cache)
    p.hook.stops = p.stops = StreamingStops(st, cap.wait_nodes() if s.streaming.overlap else {}, p.trace, p.lossy,
                                            p.replay, cap.norms)
    if s.draft.mode != "none":
        p.draft_reads = DraftReads(lambda ri: st.cache.regions[ri].expert_bytes)
        p.stops.on_plan = p.draft_reads.on_plan
    _dense_read(p, dense)
    _fill(p, st)


def _captured(p: Loaded) -> seam.Capture:
    """The warm-up's capture, every expert tensor found (computed after all where a visit missed some: a
    graph in several splits), or the ModelError that says why bmoe cannot stream the model."""
    files = p.files
    cap = _capture(p, dry=True)
    if not cap.bad and not files.expert_names() <= {t.name for t in cap.tensors.values()}:
        cap = _capture(p, dry=False)  # a graph in several splits: its later ones were not visited
    if cap.bad:
        raise ModelError(f"bmoe cannot stream {files.arch or 'this model'}: {cap.bad[0]}; run it with --no-stream")
    if not cap.tensors:
        raise ModelError(f"bmoe cannot stream {files.arch or 'this model'}: llama.cpp computed no expert matmul "
                         "(MUL_MAT_ID) for it; run it with --no-stream")
    return cap


def _charge_dense(p: Loaded, dense: list[tuple[int, int]]) -> None:
    """The dense weights in the memory charge the budget is decided against: kept in the page cache, or
    pinned (--pin-dense: read first, then locked)."""
    pin_dense = p.settings.streaming.pin_dense
    p.memory.kept = 0 if pin_dense else sum(n for _, n in dense)  # (pinned, they are in the charge)
    if pin_dense:
        _dense_read(p, dense)
        t0 = time.perf_counter()
        n = pin(dense)
        p.notice(f"pinned {n / MiB:.0f} MiB of dense weights in memory in {time.perf_counter() - t0:.1f} s")


def _replayed(p: Loaded, replay: Trace, st: Streamer, norms: dict[int, str]) -> RouteReplay:
    """--replay-routes' trace laid out for this model's layers (a trace that does not fit is a ConfigError)."""
    files = p.files
    try:
        rr = RouteReplay(replay, str(p.settings.replay_routes), st.layers, files.n_expert, files.n_expert_used,
                         norms)
    except ReplayError as e:
        raise ConfigError(str(e)) from None
    p.notice(rr.describe())
    return rr


def _routed(top_k: int, replay: Trace | None) -> int:
    """The experts a token reads per layer: the model's top-k, or under --replay-routes the trace's where
    it is smaller."""
    return min(top_k, int(replay.header.get("top_k") or 0) or top_k) if replay is not None else top_k


def _attach_gate(p: Loaded, st: Streamer, gating: Gating) -> None:
    """The spec-gate's process, attached to the Streamer; one that cannot predict (e.g. a quantized
    router) has said why and is closed, and the run goes on without it."""
    assert p.model is not None  # loaded
    s = p.settings
    gate = SpecGate(p.files, st.layers, llama.n_embd(p.model), s.speculation, s.streaming.shm_backend, p.notice,
                    gating)
    if gate.active:
        st.attach_gate(gate)
    else:
        gate.close()


def _trace_writer(p: Loaded, path: str, st: Streamer, regions: list[Region]) -> TraceWriter:
    """--route-trace's writer (to `path`), its header the model's facts."""
    assert p.model is not None  # loaded
    files = p.files
    return TraceWriter(Path(path), {
        "model": str(Path(p.settings.model).resolve()), "arch": files.arch, "n_expert": files.n_expert,
        "top_k": files.n_expert_used, "layers": st.layers, "n_layer": llama.n_layer(p.model),
        "n_embd": llama.n_embd(p.model),
        # one whole expert per MoE layer (its slices summed): what v1 readers charge per read
        "expert_bytes": {layer: sum(r.expert_bytes for r in regions if r.layer == layer) for layer in st.layers}})


def _fill(p: Loaded, st: Streamer) -> None:
    """The cache's start: --preload reads every expert now (when the budget holds them all), a warm start
    reads its profile's in the background, and a budget that holds every expert has the rest read in the
    background too (then every layer runs through; docs/architecture.md)."""
    s = p.settings
    if s.streaming.preload:
        if not st.holds_everything:
            p.notice("--preload ignored: the cache budget does not hold every expert")
        else:
            t0 = time.perf_counter()
            n = st.preload()
            p.notice(f"preloaded {n / MiB:.0f} MiB of experts in {time.perf_counter() - t0:.1f} s")
    if s.cache.warm_start:
        p.warm = WarmStart(Path(s.cache.usage_dir) if s.cache.usage_dir else default_dir(), p.files, st, p.notice)
    if st.holds_everything and not s.streaming.preload:
        fill_rest(st)


def _refuse_what_cannot_follow(p: Loaded, gating: Gating) -> None:
    """The spec-gate and the lossy modes where the model's gating is one they cannot follow: refused with the
    reason (bmoe.streaming.gating), before the slab and the workers exist."""
    s = p.settings
    lossy = {k: p.words.name(k) for k in ("experts_per_token", "drop_cold", "cache_routing")
             if getattr(s.lossy, k)}
    why = lossy_refusal(gating, lossy)
    if why is None and s.speculation.gate:
        why = spec_gate_refusal(gating, p.files.arch in ROUTER_NORM)
        if why is not None:
            why += f"; run without {p.words.name('spec_gate')}"
    if why is not None:
        raise ConfigError(why)


def _dense_read(p: Loaded, ranges: list[tuple[int, int]]) -> None:
    """Wait for the dense read-ahead (once) and give those ranges normal read-around again."""
    if p.dense_ahead is not None:
        p.dense_ahead.join()
        p.dense_ahead = None
        advise_normal(ranges)


def _capture(p: Loaded, dry: bool) -> seam.Capture:
    """Visit the graph of a one-token decode; `dry` aborts it at the first computed node, so no
    expert is read from the file before streaming starts (the visits come before the compute
    of a graph in one split)."""
    assert p.ctx is not None and p.vocab is not None and p.model is not None  # loaded
    cap = p.hook.capture = seam.Capture(dry=dry)
    ctx, mtp, token = p.ctx, p.mtp_ctx, p.vocab.warmup_token()
    try:
        p.hook.run(lambda: llama.decode(ctx, [(0, [token], 0)]), aborts=dry)
        if mtp is not None:  # the MTP layer's graph, in the same capture: its experts are streamed too
            state = np.zeros((1, llama.n_embd_out(p.model)), dtype=np.float32)
            p.hook.run(lambda: llama.decode_mtp(mtp, [(0, [token], 0, state)], outputs=True), aborts=dry)
    finally:
        p.hook.capture = None
    llama.kv_clear(p.ctx, -1)
    if mtp is not None:
        llama.kv_clear(mtp, -1)
    return cap


def _size_cache(p: Loaded, st: Streamer, layer_need: int, token_need: int) -> None:
    """Decide the budget from the room the limits leave now, and make it adaptive when asked.

    What holding every expert takes in the cache (its slots, page-rounded) is the ceiling, so an
    auto budget with room to spare holds them all (and --preload can fill it)."""
    s = p.settings
    decided = decide(s.cache, s.reads_ahead, st.full_bytes, layer_need, token_need, p.memory.rooms(), p.words)
    if decided.notice:
        p.notice(decided.notice)
    st.set_budget(decided.bytes)
    if s.cache.adaptive:
        most_mb = s.cache.mb if s.cache.mb is not None else s.cache.ceil_mb
        ceiling = st.full_bytes if most_mb is None else min(st.full_bytes, int(most_mb * MiB))
        p.adaptive = Adaptive(decided.floor, token_need, ceiling, margin=min(128 * MiB, token_need // 2))
        st.watch = BudgetWatch(p.adaptive, st, p.memory, p.notice)  # once per token and as the cache grows

