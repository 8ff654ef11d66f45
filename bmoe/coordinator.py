"""The coordinator: the process that runs decode in llama.cpp and owns every piece of cache state.

`Engine` is the composition root. It loads the model with llama.cpp's own mmap load, finds the
expert tensors in one warm-up graph, visited but not computed (bmoe.seam), sizes the cache
(bmoe.memory.budget), builds the Streamer (slab, slot pools, cache and I/O lanes:
bmoe.streaming.streamer) and the spec-gate (bmoe.streaming.speculation), hooks them into llama.cpp's
eval callback and runs prefill and decode: `begin` prefills one KV sequence, `step` decodes one
token for each of several sequences in one llama.cpp batch (`--parallel`), `end` frees one. Requests
reach these only through the one generation loop, bmoe.engine.driver.

Per MoE layer and step, llama.cpp computes up to the router weights `ffn_moe_weights-L`; the
hook hands the routed ids (every token's in the batch) to the Streamer, which sends the missing
reads at once, rewrites the ids to slot indices, and waits for what the next matmul reads: every
slice serially, or with `overlap` the gate/up slices there and the down slices at the down
matmul's input node, while reads ahead (prefetch, spec-gate) fill idle lanes. Output is computed
from exactly the bytes plain llama.cpp would use.

The edges (bmoe.cli, bmoe.edges.session, bmoe.api, bmoe.engine.driver, bmoe.server.scheduler, bmoe.server.app) use only
the Engine's public methods and properties, never its parts (tests/test_layout.py checks that no
product module reads another's private attributes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bmoe import seam
from bmoe.base.errors import Cancelled, ConfigError, ContextTooLong, ModelError
from bmoe.base.model_files import open_model
from bmoe.base.settings import FLAGS, Naming, SamplerSettings, Settings
from bmoe.base.telemetry import TokenStat
from bmoe.base.units import MiB
from bmoe.engine.graph_stops import StreamingStops
from bmoe.memory.budget import Adaptive, decide
from bmoe.memory.dense import DenseReadAhead, advise_normal, dense_ranges, pin
from bmoe.memory.probe import MemoryProbe, Room
from bmoe.seam import llama
from bmoe.seam.llama import Vocab, init_backend, load_model, make_sampler, new_context
from bmoe.shm_cache import sweep_stale_segments
from bmoe.streaming.expert_cache import working_sets
from bmoe.streaming.lossy import Lossy
from bmoe.streaming.readahead import ReadAheadCounts
from bmoe.streaming.route_replay import ReplayError, RouteReplay
from bmoe.streaming.route_trace import Trace, TraceError, TraceWriter
from bmoe.streaming.speculation import SpecGate
from bmoe.streaming.streamer import Streamer, regions_of
from bmoe.streaming.usage_profile import default_dir
from bmoe.streaming.warm_fill import WarmStart

if TYPE_CHECKING:
    from bmoe.chat.grammar import Grammar

__all__ = ["Engine", "EngineSequence", "EngineStats"]


@dataclass
class EngineSequence:
    """One generation's state in the engine (Engine.begin/step/end): its KV sequence and sampler."""

    seq: int
    sampler: llama.Sampler | None
    next: int = -1  # the token sampled from its last logits, decoded at its next step
    prefill_s: float = 0.0
    lossless: bool = False  # no lossy routing for this sequence's tokens (bmoe.streaming.lossy)
    forced: list[int] = field(default_factory=list)  # tokens decoded next instead of sampled (teacher forcing)
    keep_logits: bool = False
    logits: np.ndarray | None = None  # with keep_logits: the distribution `next` was chosen from


@dataclass(frozen=True)
class EngineStats:
    """The load and the cache now (Engine.stats): every figure an edge prints about them."""

    arch: str
    n_ctx: int
    load_s: float
    llama_load_s: float  # of load_s, llama.cpp's own load (model, then context)
    streaming: bool
    lossy: bool  # generations change routing unless they ask for lossless (bmoe.streaming.lossy)
    top_k: int  # experts the model's router picks per token and layer
    experts_per_token: int  # experts a lossy generation's tokens use per layer
    budget_bytes: int  # the expert cache's budget now (0 without streaming or without a cache)
    resident_bytes: int  # expert bytes in memory now
    holds_every_expert: bool  # plain llama.cpp's mapping, or a cache budget that holds them all
    spec_gate: tuple[float, float | None] | None  # (recall %, the floor that switched it off) of the spec-gate
    lanes: tuple[str, ...]  # the lanes' busy time and queue depth so far (--profile)
    workers: tuple[tuple[str, int], ...]  # (role, pid) of every worker process
    full_bytes: int  # a budget that holds every expert's slot (0 without streaming)
    memory: Room  # the tightest memory limit now and the room it leaves (bmoe.memory.probe)
    # per MoE layer (layer, one character per expert: '1' resident, '0' not); empty without streaming
    residency: tuple[tuple[int, str], ...] = field(default=(), repr=False)


class Engine:
    """A loaded model and context; streaming experts unless `settings.streaming.enabled` is off."""

    def __init__(self, settings: Settings, notice: Callable[[str], None] = lambda s: None,
                 words: Naming = FLAGS) -> None:
        """Load `settings.model` as `settings` ask (validated by the edge: bmoe.edges.flags,
        bmoe.base.settings.from_keywords); `notice` hears what the user should know, errors name
        settings in `words` (the edge's)."""
        self.settings = settings
        self.notice = notice
        self.words = words
        self.streamer: Streamer | None = None
        self.trace: TraceWriter | None = None
        self.model: llama.Model | None = None
        self.ctx: llama.Context | None = None
        self.memory = MemoryProbe()
        self.adaptive: Adaptive | None = None
        self.lossy: Lossy | None = None  # lossy routing while streaming (the hook's)
        self.replay: RouteReplay | None = None  # --replay-routes: every routing is a trace's (the hook's)
        self.stops: StreamingStops | None = None
        self.fixed_k = 0  # --no-stream --experts-per-token: llama.cpp's own expert count, set at load
        self.dense_ahead: DenseReadAhead | None = None  # the dense weights read while the start-up runs
        self.warm: WarmStart | None = None  # the usage profile: a background fill now, saved at close
        t0 = time.perf_counter()
        self.files = open_model(settings.model)
        init_backend(settings.verbose)
        self.hook = seam.EvalHook()
        moe = self.files.n_expert > 1
        if settings.streaming.enabled and not moe:
            notice(f"{Path(settings.model).name} is not a Mixture-of-Experts model; running it plain")
        streaming = settings.streaming.enabled and moe
        if streaming:
            removed = sweep_stale_segments()
            if removed:
                notice(f"removed {len(removed)} shared-memory segment(s) left by dead runs")
        try:
            self._check_lossy(moe, streaming)
            replay = self._read_replay(moe)
            self._load(streaming)
            assert self.model is not None  # _load raised otherwise
            self.vocab: Vocab = Vocab(self.model)
            if streaming:
                self._start_streaming(replay)
        except BaseException:
            self.close()
            raise
        self.load_s: float = time.perf_counter() - t0

    @property
    def context(self) -> llama.Context:
        """llama.cpp's context, while the engine is loaded."""
        assert self.ctx is not None, "the engine is closed"
        return self.ctx

    @property
    def llama_model(self) -> llama.Model:
        assert self.model is not None, "the engine is closed"
        return self.model

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- loading and wiring --------------------------------------------------------------------

    def _check_lossy(self, moe: bool, streaming: bool) -> None:
        """The lossy settings against the model: K within its top-k; without streaming K is llama.cpp's
        own expert count, overridden at load (`fixed_k`)."""
        lo, top_k = self.settings.lossy, self.files.n_expert_used
        if not lo.on:
            return
        if not moe:
            self.notice("the lossy routing settings change nothing on a model without experts")
            return
        k = lo.experts_per_token
        if k > top_k:
            raise ConfigError(f"{self.words.value('experts_per_token', k)}: {Path(self.settings.model).name} routes "
                              f"each token to {top_k} experts; give at most {top_k}")
        if not streaming and 0 < k < top_k:
            self.fixed_k = k

    def _read_replay(self, moe: bool) -> Trace | None:
        """--replay-routes' trace, read before the model loads: an unreadable one fails at once."""
        path = self.settings.replay_routes
        if not path:
            return None
        if not moe:
            self.notice(f"{self.words.name('replay_routes')} changes nothing on a model without experts")
            return None
        try:
            return Trace.read(path)
        except OSError as e:
            raise ConfigError(f"{self.words.value('replay_routes', path)}: cannot read it ({e.strerror}); "
                              "give a trace written by bmoe-cli --route-trace, or route_trace v1 CSV") from None
        except (TraceError, ValueError, KeyError) as e:
            raise ConfigError(f"{self.words.value('replay_routes', path)}: {e}") from None

    def _load(self, streaming: bool) -> None:
        """llama.cpp's own load (model, then context), timed apart as `llama_load_s`, so that
        `load_s - llama_load_s` is what bmoe adds to a plain llama.cpp load."""
        t0 = time.perf_counter()
        ints = {f"{self.files.arch}.expert_used_count": self.fixed_k} if self.fixed_k else None
        with seam.no_populate() if streaming else nullcontext("not streaming") as why:
            if streaming and why is not None:
                self.notice(f"loading the whole model file, as llama.cpp does ({why}): a slower start, the same output")
            self.model = load_model(self.settings.model, ints)
        if why is None:  # llama.cpp mapped the file without reading it: the dense weights are read here
            self.dense_ahead = DenseReadAhead(self.files).start()
        if not self.model:
            raise ModelError(f"llama.cpp could not load {self.settings.model}; run with --verbose to see why")
        self.ctx = new_context(self.model, self.settings.n_ctx, self.settings.threads,
                               self.hook.c_callback if streaming else None, n_seq=self.settings.parallel)
        self.llama_load_s = time.perf_counter() - t0
        llama.set_abort(self.ctx, self.hook.c_abort)
        self.n_ctx: int = min(llama.context_size(self.ctx), self.settings.n_ctx)

    def _start_streaming(self, replay: Trace | None = None) -> None:
        """A warm-up graph, visited but not computed, finds the expert tensors; then they are
        rebound into the slab's pools. `replay`: the trace --replay-routes runs on."""
        cap = self._capture(dry=True)
        if not cap.bad and not self.files.expert_names() <= {t.name for t in cap.tensors.values()}:
            cap = self._capture(dry=False)  # a graph in several splits: its later ones were not visited
        if cap.bad:
            raise ModelError("cannot stream this model's expert layout: " + "; ".join(cap.bad[:3])
                             + "; run it with --no-stream")
        if not cap.tensors:
            raise ModelError("llama.cpp computed no expert matmul (MUL_MAT_ID) for this model; run it with --no-stream")
        s = self.settings
        tensors = list(cap.tensors.values())
        regions = regions_of(self.files, tensors)
        # a token reads its routed experts: under --replay-routes, the trace's top-k where it is smaller
        routed = min(self.files.n_expert_used, int(replay.header.get("top_k") or 0) or self.files.n_expert_used) \
            if replay is not None else self.files.n_expert_used
        need = working_sets(regions, max(1, routed))
        # before the expert tensors are rebound: their data pointers find the mapping
        dense = dense_ranges(self.files, tensors)
        self.memory.kept = 0 if s.streaming.pin_dense else sum(n for _, n in dense)  # (pinned, they are in the charge)
        if s.streaming.pin_dense:
            self._dense_read(dense)
            t0 = time.perf_counter()
            n = pin(dense)
            self.notice(f"pinned {n / MiB:.0f} MiB of dense weights in memory in {time.perf_counter() - t0:.1f} s")
        # the lanes and pinned weights are there before the budget is decided: they are in the charge
        st = self.streamer = Streamer(self.files, regions, tensors, 0, s.streaming, s.cache.policy,
                                      s.speculation.prefetch, list(cap.biases.values()),
                                      spare=s.lossy.on or replay is not None)
        if replay is not None:
            try:
                self.replay = RouteReplay(replay, str(s.replay_routes), st.layers, self.files.n_expert,
                                          self.files.n_expert_used, cap.norms)
            except ReplayError as e:
                raise ConfigError(str(e)) from None
            self.notice(self.replay.describe())
        self._size_cache(st.full_bytes, max(need.values()), sum(need.values()))
        if s.speculation.gate:
            gate = SpecGate(self.files, st.layers, llama.n_embd(self.llama_model), s.speculation,
                            s.streaming.shm_backend, self.notice)
            if gate.active:
                st.attach_gate(gate)
            else:
                gate.close()  # it said why (e.g. a quantized router); the run goes on without it
        if s.route_trace:
            self.trace = TraceWriter(Path(s.route_trace), {
                "model": str(Path(s.model).resolve()), "arch": self.files.arch, "n_expert": self.files.n_expert,
                "top_k": self.files.n_expert_used, "layers": st.layers, "n_layer": llama.n_layer(self.llama_model),
                "n_embd": llama.n_embd(self.llama_model),
                # one whole expert per MoE layer (its slices summed): what v1 readers charge per read
                "expert_bytes": {layer: sum(r.expert_bytes for r in regions if r.layer == layer)
                                 for layer in st.layers}})
        if s.lossy.on:
            self.lossy = Lossy(s.lossy, self.files.n_expert_used, cap.norms, st.cache)
        self.hook.stops = self.stops = StreamingStops(st, cap.down_inputs if s.streaming.overlap else {}, self.trace,
                                                      self.lossy, self.replay, cap.norms)
        self._dense_read(dense)
        if s.streaming.preload:
            if not st.holds_everything:
                self.notice("--preload ignored: the cache budget does not hold every expert")
            else:
                t0 = time.perf_counter()
                n = st.preload()
                self.notice(f"preloaded {n / MiB:.0f} MiB of experts in {time.perf_counter() - t0:.1f} s")
        if s.cache.warm_start:
            self.warm = WarmStart(Path(s.cache.usage_dir) if s.cache.usage_dir else default_dir(), self.files, st,
                                  self.notice)

    def _dense_read(self, ranges: list[tuple[int, int]]) -> None:
        """Wait for the dense read-ahead (once) and give those ranges normal read-around again."""
        if self.dense_ahead is not None:
            self.dense_ahead.join()
            self.dense_ahead = None
            advise_normal(ranges)

    def _capture(self, dry: bool) -> seam.Capture:
        """Visit the graph of a one-token decode; `dry` aborts it at the first computed node, so no
        expert is read from the file before streaming starts (the visits come before the compute
        of a graph in one split)."""
        cap = self.hook.capture = seam.Capture(dry=dry)
        try:
            self._decode([(0, [self.vocab.warmup_token()], 0)], aborts=dry)
        finally:
            self.hook.capture = None
        self.clear_kv()
        return cap

    def _size_cache(self, expert_bytes: int, layer_need: int, token_need: int) -> None:
        """Decide the budget from the room the limits leave now, and make it adaptive when asked.

        `expert_bytes` is what holding every expert takes in the cache (its slots, page-rounded),
        so an auto budget with room to spare holds them all (and --preload can fill it)."""
        s, st = self.settings, self.streamer
        assert st is not None  # sized while streaming starts
        decided = decide(s.cache, s.reads_ahead, expert_bytes, layer_need, token_need, self.memory.rooms(), self.words)
        if decided.notice:
            self.notice(decided.notice)
        st.set_budget(decided.bytes)
        if s.cache.adaptive:
            most_mb = s.cache.mb if s.cache.mb is not None else s.cache.ceil_mb
            ceiling = st.full_bytes if most_mb is None else min(st.full_bytes, int(most_mb * MiB))
            self.adaptive = Adaptive(decided.floor, token_need, ceiling, margin=min(128 * MiB, token_need // 2))
            st.watch = self._adapt  # the Streamer runs it once per token (Engine.step) and as the cache grows

    # ---- what the edges may ask ----------------------------------------------------------------

    @property
    def streaming(self) -> bool:
        return self.streamer is not None

    @property
    def holds_every_expert(self) -> bool:
        """Every expert is in memory for good: plain llama.cpp's mapping, or a cache budget that holds them all."""
        return self.streamer is None or self.streamer.holds_everything

    @property
    def cache_active(self) -> bool:
        """A cache is in use now (an adaptive budget may take it to 0 and back)."""
        return self.streamer is not None and self.streamer.budget > 0

    def follow_memory(self) -> None:
        """Between generations: an adaptive budget follows the room as it does each token, so an
        idle session or server gives memory back when another program needs it; a warm start's
        fill reads on."""
        if self.streamer is not None:
            self.streamer.follow()
        if self.warm is not None and self.streamer is not None:
            self.warm.idle()

    def _adapt(self) -> None:
        """Once per token, and whenever the cache took another WATCH_STEP: follow the room the
        memory limits leave (Adaptive)."""
        st = self.streamer
        assert st is not None and self.adaptive is not None  # the Streamer watches only with an adaptive budget
        change = self.adaptive.step(st.budget, st.resident_bytes(), self.memory.least(), self.memory.pressure())
        if change is not None:
            old = st.budget
            st.set_budget(change[0])
            self.notice(f"cache budget {old / MiB:.0f} -> {change[0] / MiB:.0f} MiB: {change[1]}")

    def stats(self) -> EngineStats:
        """What the engine is and holds now, in one object: what every edge prints about the load."""
        st = self.streamer
        return EngineStats(
            arch=self.arch, n_ctx=self.n_ctx, load_s=self.load_s, llama_load_s=self.llama_load_s,
            streaming=st is not None, lossy=self.is_lossy, top_k=self.top_k, experts_per_token=self.experts_per_token,
            budget_bytes=st.budget if st else 0, resident_bytes=st.resident_bytes() if st else 0,
            holds_every_expert=self.holds_every_expert, spec_gate=st.gate_recall() if st else None,
            lanes=tuple(st.lane_load().lines()) if st else (), workers=tuple(st.worker_pids()) if st else (),
            full_bytes=st.full_bytes if st else 0, memory=self.memory.least(),
            residency=tuple(st.residency()) if st else ())

    def chat_template(self) -> bytes | None:
        """The chat template: --chat-template-file's, else the one stored in the GGUF, if any."""
        if self.settings.chat_template_file:
            return Path(self.settings.chat_template_file).read_bytes()
        return llama.chat_template(self.llama_model)

    @property
    def arch(self) -> str:
        return self.files.arch

    @property
    def is_lossy(self) -> bool:
        """Whether generations change routing (the load's lossy settings) unless they ask for lossless."""
        return self.lossy is not None or self.fixed_k > 0

    @property
    def top_k(self) -> int:
        """Experts the model's router picks per token and layer (its `expert_used_count`)."""
        return self.files.n_expert_used

    @property
    def experts_per_token(self) -> int:
        """Experts a lossy generation's tokens use per layer (the model's top-k when the setting is off)."""
        return self.fixed_k or (self.lossy.k if self.lossy else self.files.n_expert_used)

    def check_lossless(self, fix: str) -> None:
        """ConfigError when a lossless generation cannot run: llama.cpp was loaded with its own expert
        count lowered (--no-stream --experts-per-token), which no request can raise again."""
        if self.fixed_k:
            raise ConfigError(f"this model was loaded with {self.words.value('experts_per_token', self.fixed_k)} "
                              f"and {self.words.value('stream', False)}: llama.cpp itself routes to "
                              f"{self.fixed_k} experts, and no request can have the model's "
                              f"{self.files.n_expert_used} back; {fix}")
        if self.replay is not None:
            raise ConfigError(f"this model was loaded with {self.words.value('replay_routes', self.replay.name)}: "
                              f"every token takes the trace's routing, and no request can have the model's own "
                              f"back; {fix}")

    def tokenize(self, text: str) -> list[int]:
        """Text as the model's tokens, with the special tokens (BOS) the vocab asks for."""
        return self.vocab.tokenize(text, add_special=True)

    def check_model_unchanged(self, fix: str) -> None:
        """ModelError when a model file changed since the load (the offsets bmoe reads describe the old one)."""
        self.files.check_unchanged(fix)

    def check_fits(self, n_tokens: int, n_predict: int, fix: str) -> None:
        """The one prompt check: `n_tokens` in the KV after prefill, plus `n_predict`, must fit the context."""
        if n_tokens <= 0:
            raise ConfigError("the prompt is empty (no tokens); give it some text")
        if n_tokens + n_predict > self.n_ctx:
            raise ContextTooLong(f"the prompt ({n_tokens} tokens) plus {n_predict} tokens to generate exceeds "
                                 f"the context of {self.n_ctx} tokens; {fix}", n_tokens + n_predict, self.n_ctx)

    # ---- KV and cancel (a Slot's tokens are the KV sequence's: bmoe.engine.generation) ----------------

    def clear_kv(self, seq: int = -1) -> None:
        """Empty sequence `seq`'s KV (-1: every sequence's)."""
        llama.kv_clear(self.context, seq)

    def kv_len(self, seq: int = 0) -> int:
        """Tokens in sequence `seq`'s KV: the next position to decode there."""
        return llama.kv_len(self.context, seq)

    def kv_keep(self, n: int, seq: int = 0) -> int:
        """Keep the first `n` positions of sequence `seq` and drop the rest; returns how many were kept.

        A memory that cannot drop a partial sequence (e.g. sliding-window or recurrent) is
        cleared instead, and 0 is returned: the caller then re-prefills everything.
        """
        if n <= 0 or not llama.kv_cut(self.context, seq, n):
            self.clear_kv(seq)
            return 0
        return n

    def interrupt(self) -> None:
        """Stop the llama_decode in flight with Cancelled; safe to call from another thread.

        Like a signal (seam.deliver), the Cancelled is parked on the hook: the eval and abort
        callbacks stop the running graph and `_decode` raises it. An error already parked (a lane
        failure, a signal) is left in place, so it is not mistaken for a cancel. Only the
        generation driver (bmoe.engine.driver) calls it, when every generation in the decode is cancelled.
        """
        if self.hook.error is None:
            self.hook.error = Cancelled()

    def clear_interrupt(self) -> None:
        """Forget an interrupt that came after its decode ended."""
        if isinstance(self.hook.error, Cancelled):
            self.hook.error = None

    # ---- decoding ------------------------------------------------------------------------------

    def prefill(self, seq: int, tokens: list[int]) -> float:
        """Decode `tokens` after what sequence `seq`'s KV holds, sampling nothing (a prompt decoded in
        parts: bmoe.engine.prompt_cache); the seconds it took. Cancelled when interrupted. No lossy routing:
        the KV kept from it serves lossless and lossy requests alike."""
        st = self.streamer
        t0 = time.perf_counter()
        if self.lossy:
            self.lossy.begin([False] * len(tokens))
        if self.trace:
            self.trace.prompting = True
        try:
            self._decode([(seq, tokens, self.kv_len(seq))])
            if st:
                st.settle()
        finally:
            if self.trace:
                self.trace.prompting = False
            if st:  # a prefill's reads are not the decode's
                st.take_counters()
                st.take_speculation()
        return time.perf_counter() - t0

    def begin(self, seq: int, tokens: list[int], n_predict: int, sampler: SamplerSettings,
              fix: str = "raise -c or shorten the prompt", grammar: Grammar | None = None, *,
              lossless: bool = False, forced: Iterable[int] = (), keep_logits: bool = False) -> EngineSequence:
        """Prefill `tokens` after what sequence `seq`'s KV holds and sample its first token; `step`
        then decodes it. `lossless`: no lossy routing for this sequence. `forced`: the tokens its
        steps decode, in order, instead of sampled ones (teacher forcing). `keep_logits`: each
        step keeps the distribution it chose from (`EngineSequence.logits`).

        Raises ContextTooLong when it does not fit the context (`fix` ends the message), Cancelled
        when interrupted mid-prefill. Every EngineSequence begun must be ended (`end`), also after an error.
        """
        pos = self.kv_len(seq)
        self.check_fits(pos + len(tokens), n_predict, fix)
        if lossless:
            self.check_lossless("load it without one of them for lossless requests")
        st = self.streamer
        s = EngineSequence(seq, make_sampler(sampler, self.vocab, grammar.gbnf if grammar else None), lossless=lossless,
                     forced=list(forced), keep_logits=keep_logits)
        try:
            t0 = time.perf_counter()
            if self.lossy:
                self.lossy.begin([not lossless] * len(tokens))
            if self.trace:
                self.trace.prompting = True
            try:
                row = self._decode([(seq, tokens, pos)])[0]
            finally:
                if self.trace:
                    self.trace.prompting = False
            if st:  # the prefill's reads ahead land (or are dropped) in the prefill, not in the first token
                st.settle()
            s.prefill_s = time.perf_counter() - t0
            self._choose(s, row)
        except BaseException:
            self.end(s)
            raise
        finally:
            if st:  # the prefill's reads (and reads ahead) are not the decode's
                st.take_counters()
                st.take_speculation()
        if self.trace:
            self.trace.active = True
        return s

    def step(self, seqs: list[EngineSequence]) -> list[tuple[int, TokenStat] | None]:
        """Decode, for each of `seqs` together in one llama.cpp batch, the token it sampled after
        its last decode; returns per sequence that token and its TokenStat, or None for one that
        had sampled end-of-generation (nothing decoded: it is done).

        llama.cpp keeps only the last decode's logits, so every sequence samples its next token
        right after the decode. Each token's TokenStat is the step's wall time and an even share
        of the step's reads, waits and hits (the shares add up to the step's).
        """
        c0 = time.perf_counter_ns()
        going = [s for s in seqs if not self.vocab.is_eog(s.next)]
        if not going:
            return [None] * len(seqs)
        toks = {id(s): s.next for s in going}
        if self.lossy:
            self.lossy.begin([not s.lossless for s in going])
        rows = self._decode([(s.seq, [s.next], self.kv_len(s.seq)) for s in going])
        for s, row in zip(going, rows):
            self._choose(s, row)
        if self.streamer is not None:
            self.streamer.follow()
        wall, st, k = time.perf_counter_ns() - c0, self.streamer, len(going)
        if st:
            c = st.take_counters(step=True)
            counts = (c.io_ns, c.mgmt_ns, c.read_bytes, c.hits, c.lookups, c.stall_ns)
            shares = []
            for i in range(k):  # token i's share of each count: the shares add up to the count
                io, mgmt, read, hits, lookups, stall = (x * (i + 1) // k - x * i // k for x in counts)
                shares.append(TokenStat(wall, io, mgmt, read, hits, lookups, stall, st.budget))
        else:
            shares = [TokenStat(wall, 0, 0, 0, 0, 0) for _ in range(k)]
        if self.lossy:
            assert st is not None  # lossy routing runs only while streaming
            layers = len(st.layers)
            for stat, rc in zip(shares, self.lossy.take()):
                stat.dropped, stat.substituted = rc.dropped, rc.substituted
                stat.weight_changed_pct = 100.0 * rc.moved / layers
        if self.trace:
            self.trace.end_step(toks[id(going[0])])
        by_id = {id(s): st_ for s, st_ in zip(going, shares)}
        return [(toks[id(s)], by_id[id(s)]) if id(s) in toks else None for s in seqs]

    def _choose(self, s: EngineSequence, row: int) -> None:
        """The token sequence `s` decodes next, from its logits at batch row `row`: its next forced
        token, else its sampler's choice (kept with the distribution when asked)."""
        if s.keep_logits:
            s.logits = llama.logits(self.context, self.vocab, row)
        if s.forced:
            s.next = s.forced.pop(0)
        else:
            assert s.sampler is not None, "an EngineSequence is sampled only between begin and end"
            s.next = llama.sample(s.sampler, self.context, row)

    def end(self, s: EngineSequence) -> ReadAheadCounts:
        """Free an EngineSequence's sampler and settle the reads it left; returns what its reads ahead did."""
        if s.sampler is None:
            return ReadAheadCounts()
        llama.free_sampler(s.sampler)
        s.sampler = None
        ahead = ReadAheadCounts()
        if self.streamer:
            ahead = self.streamer.take_speculation()
            self.streamer.settle()
        if self.trace:
            self.trace.active = False
            self.trace.write()
        return ahead

    def _decode(self, parts: list[tuple[int, list[int], int]], aborts: bool = False) -> list[int]:
        """One llama_decode of (sequence, tokens, first position) parts; logits for each part's last
        token, whose batch rows are returned. With `aborts`, the hook's abort is expected."""
        if self.streamer is not None:
            self.streamer.begin_batch(sum(len(toks) for _, toks, _ in parts))
        if self.stops is not None and not aborts:
            self.stops.begin_batch(sum(len(toks) for _, toks, _ in parts))
        with self.hook:
            rc, rows = llama.decode(self.context, parts)
        err = self.hook.take_error()
        if err is not None:
            raise err
        if rc != 0 and not (aborts and rc == llama.ABORTED):
            raise RuntimeError(f"llama_decode failed with code {rc}")
        return rows

    def close(self) -> None:
        """Free llama.cpp objects, then release workers and shared memory; idempotent."""
        if self.warm is not None and self.streamer is not None:
            self.warm.save()
        st, self.streamer = self.streamer, None
        self.hook.stops = None
        try:
            if self.ctx:
                llama.free_context(self.ctx)
                self.ctx = None
            if self.model:
                llama.free_model(self.model)
                self.model = None
        finally:
            if st:
                st.close()
