"""The coordinator: the process that runs decode in llama.cpp and owns every piece of cache state.

`Engine` is the composition root. It loads the model with llama.cpp's own mmap load, finds the
expert tensors in one warm-up graph, visited but not computed (bmoe.seam), sizes the cache
(bmoe.budget), builds the Streamer (slab, slot pools, cache and I/O lanes: bmoe.streamer) and the spec-gate
(bmoe.speculation), hooks them into llama.cpp's eval callback and runs prefill and decode:
`begin` prefills one KV sequence, `step` decodes one token for each of several sequences in one
llama.cpp batch (`--parallel`), `end` frees one; `generate` is one sequence through all three.

Per MoE layer and step, llama.cpp computes up to the router weights `ffn_moe_weights-L`; the
hook hands the routed ids (every token's in the batch) to the Streamer, which sends the missing
reads at once, rewrites the ids to slot indices, and waits for what the next matmul reads: every
slice serially, or with `overlap` the gate/up slices there and the down slices at the down
matmul's input node, while reads ahead (prefetch, spec-gate) fill idle lanes. Output is computed
from exactly the bytes plain llama.cpp would use.

The edges (bmoe.cli, bmoe.session, bmoe.api, bmoe.scheduler) use only the Engine's public methods.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import llama_cpp
import numpy as np

from bmoe import seam
from bmoe.budget import Adaptive, decide
from bmoe.chat import Renderer
from bmoe.dense import DenseReadAhead, advise_normal, dense_ranges, pin
from bmoe.expert_cache import working_sets
from bmoe.memory import MemoryProbe
from bmoe.llama import TextStream, Vocab, init_backend, load_model, make_sampler, new_context
from bmoe.model_files import ModelError, open_model
from bmoe.readahead import Speculation
from bmoe.route_trace import TraceWriter
from bmoe.settings import ConfigError, SamplerSettings, Settings, validate
from bmoe.shm_cache import sweep_stale_segments
from bmoe.speculation import SpecGate
from bmoe.streamer import Streamer, regions_of
from bmoe.telemetry import TokenStat
from bmoe.units import MiB
from bmoe.usage_profile import default_dir
from bmoe.warm_fill import WarmStart

__all__ = ["Cancelled", "ConfigError", "Engine", "Result", "Sequence"]

OnPiece = Callable[[int, str, TokenStat], None]
ABORTED = 2  # llama_decode: the abort callback stopped the graph


class Cancelled(Exception):
    """A cancel request (Engine.cancel) stopped the generation; the Engine stays usable."""


@dataclass
class Result:
    ids: list[int]
    text: str
    n_prompt: int
    prefill_s: float
    steps: list[TokenStat]
    max_resident: int = 0
    speculation: Speculation = field(default_factory=Speculation)


@dataclass
class Sequence:
    """One generation in the engine (Engine.begin/step/end): its KV sequence, sampler and result."""

    seq: int
    sampler: llama_cpp.llama_sampler_p | None
    n_predict: int
    on_piece: OnPiece
    result: Result
    out: TextStream = field(default_factory=TextStream)
    next: int = -1  # the token sampled from its last logits, decoded at its next step
    done: bool = False
    error: BaseException | None = None  # what ended it early (raised by its on_piece)


class Engine:
    """A loaded model and context; streaming experts unless `settings.streaming.enabled` is off."""

    def __init__(self, settings: Settings, notice: Callable[[str], None] = lambda s: None) -> None:
        validate(settings)
        self.settings = settings
        self.notice = notice
        self.streamer: Streamer | None = None
        self.trace: TraceWriter | None = None
        self.model = self.ctx = None
        self.memory = MemoryProbe()
        self.adaptive: Adaptive | None = None
        self.dense_ahead: DenseReadAhead | None = None  # the dense weights read while the start-up runs
        self.warm: WarmStart | None = None  # the usage profile: a background fill now, saved at close
        self.cancel_requested = False
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
            self._load(streaming)
            self.vocab = Vocab(self.model)
            if streaming:
                self._start_streaming()
        except BaseException:
            self.close()
            raise
        self.load_s = time.perf_counter() - t0

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- loading and wiring --------------------------------------------------------------------

    def _load(self, streaming: bool) -> None:
        """llama.cpp's own load (model, then context), timed apart as `llama_load_s`, so that
        `load_s - llama_load_s` is what bmoe adds to a plain llama.cpp load."""
        t0 = time.perf_counter()
        with seam.no_populate() if streaming else nullcontext("not streaming") as why:
            if streaming and why is not None:
                self.notice(f"loading the whole model file, as llama.cpp does ({why}): a slower start, the same output")
            self.model = load_model(self.settings.model)
        if why is None:  # llama.cpp mapped the file without reading it: the dense weights are read here
            self.dense_ahead = DenseReadAhead(self.files).start()
        if not self.model:
            raise ModelError(f"llama.cpp could not load {self.settings.model}; run with --verbose to see why")
        self.ctx = new_context(self.model, self.settings.n_ctx, self.settings.threads,
                               self.hook.c_callback if streaming else None, n_seq=self.settings.parallel)
        self.llama_load_s = time.perf_counter() - t0
        llama_cpp.llama_set_abort_callback(self.ctx, self.hook.c_abort, None)
        self.n_ctx = min(llama_cpp.llama_n_ctx(self.ctx), self.settings.n_ctx)

    def _start_streaming(self) -> None:
        """A warm-up graph, visited but not computed, finds the expert tensors; then they are
        rebound into the slab's pools."""
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
        need = working_sets(regions, max(1, self.files.n_expert_used))
        dense = dense_ranges(self.files, tensors)  # before the expert tensors are rebound: their data pointers find the mapping
        self.memory.kept = 0 if s.pin_dense else sum(n for _, n in dense)  # (pinned, they are in the charge)
        if s.pin_dense:
            self._dense_read(dense)
            t0 = time.perf_counter()
            n = pin(dense)
            self.notice(f"pinned {n / MiB:.0f} MiB of dense weights in memory in {time.perf_counter() - t0:.1f} s")
        # the lanes and pinned weights are there before the budget is decided: they are in the charge
        st = self.streamer = Streamer(self.files, regions, tensors, 0, s.streaming, s.cache.policy,
                                      s.speculation.prefetch, list(cap.biases.values()))
        self._size_cache(st.full_bytes, max(need.values()), sum(need.values()))
        self.hook.on_route, self.hook.slot_ids = st.on_route, st.slot_ids
        if s.streaming.overlap:
            self.hook.down_nodes = cap.down_inputs
            self.hook.down_pending, self.hook.on_down = st.down_pending, st.on_down
        if s.speculation.gate:
            gate = SpecGate(self.files, st.layers, llama_cpp.llama_model_n_embd(self.model), s.speculation,
                            s.streaming.shm_backend, self.notice)
            if gate.active:
                st.attach_gate(gate)
                self.hook.on_router_input = self._router_input
            else:
                gate.close()  # it said why (e.g. a quantized router); the run goes on without it
        if s.route_trace:
            self._start_trace(Path(s.route_trace))
        else:
            self.hook.skip_route = st.skip
        self._dense_read(dense)
        if s.cache.preload:
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
        decided = decide(s.cache, s.reads_ahead, expert_bytes, layer_need, token_need, self.memory.rooms())
        if decided.notice:
            self.notice(decided.notice)
        st.set_budget(decided.bytes)
        if s.cache.adaptive:
            most_mb = s.cache.mb if s.cache.mb is not None else s.cache.ceil_mb
            ceiling = st.full_bytes if most_mb is None else min(st.full_bytes, int(most_mb * MiB))
            self.adaptive = Adaptive(decided.floor, token_need, ceiling, margin=min(128 * MiB, token_need // 2))
            st.watch = self._adapt

    def _start_trace(self, path: Path) -> None:
        st = self.streamer
        self.trace = TraceWriter(path, {
            "model": str(Path(self.settings.model).resolve()), "arch": self.files.arch,
            "n_expert": self.files.n_expert, "top_k": self.files.n_expert_used, "layers": st.layers,
            "n_embd": llama_cpp.llama_model_n_embd(self.model)})

        def on_route(layer: int, ids: np.ndarray) -> None:
            self.trace.on_route(layer, ids, st.predicted_for(layer))
            st.on_route(layer, ids)

        self.hook.on_route = on_route
        self.hook.on_router_input = self._router_input

    def _router_input(self, layer: int, node: int) -> None:
        """Hand a layer's router input to the trace and the spec-gate; off once neither wants it."""
        st = self.streamer
        if self.trace:
            self.trace.on_router_input(layer, seam.router_input(node))
        if st.gate_running:
            st.on_router_input(layer, node)
        elif not self.trace:
            self.hook.on_router_input = None  # the governor fired: no more stops at the router

    # ---- what the edges may ask ----------------------------------------------------------------

    @property
    def streaming(self) -> bool:
        return self.streamer is not None

    @property
    def budget(self) -> int:
        """The expert cache's budget in bytes now (0 without streaming or without a cache)."""
        return self.streamer.budget if self.streamer else 0

    @property
    def cache_active(self) -> bool:
        """A cache is in use now (an adaptive budget may take it to 0 and back)."""
        return self.streamer is not None and self.budget > 0

    def follow_memory(self) -> None:
        """Between generations: an adaptive budget follows the room as it does each token, so an
        idle session or server gives memory back when another program needs it; a warm start's
        fill reads on."""
        if self.adaptive is not None and self.streamer is not None:
            self._adapt()
        if self.warm is not None and self.streamer is not None:
            self.warm.idle()

    def _adapt(self) -> None:
        """Once per token, and whenever the cache took another WATCH_STEP: follow the room the
        memory limits leave (Adaptive)."""
        st = self.streamer
        st.watched_at = st.cached_bytes
        change = self.adaptive.step(st.budget, st.resident_bytes(), self.memory.least(), self.memory.pressure())
        if change is not None:
            old = st.budget
            st.set_budget(change[0])
            self.notice(f"cache budget {old / MiB:.0f} -> {change[0] / MiB:.0f} MiB: {change[1]}")

    def resident_bytes(self) -> int:
        return self.streamer.resident_bytes() if self.streamer else 0

    def worker_pids(self) -> list[tuple[str, int]]:
        """(role, pid) of every worker process, for the per-process profile."""
        return self.streamer.worker_pids() if self.streamer else []

    def lane_lines(self) -> list[str]:
        """The lanes' busy time and queue depth so far, for the --profile table (none without streaming)."""
        return self.streamer.lane_load().lines() if self.streamer else []

    def spec_gate_recall(self) -> tuple[float, float | None] | None:
        """(recall %, the floor that switched it off or None) of this run's spec-gate; None without one."""
        return self.streamer.gate_recall() if self.streamer else None

    def chat_template(self) -> bytes | None:
        """The chat template stored in the GGUF, if any."""
        return llama_cpp.llama_model_chat_template(self.model, None) or None

    @property
    def arch(self) -> str:
        return self.files.arch

    def prompt_tokens(self, prompt: str, chat: bool) -> list[int]:
        """The prompt's tokens, with `chat` as one user turn in the model's chat template (bmoe.chat)."""
        if chat:
            prompt = Renderer(self.vocab, self.chat_template()).render([{"role": "user", "content": prompt}], think=True)
        return self.tokenize(prompt)

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
            raise ConfigError(f"the prompt ({n_tokens} tokens) plus {n_predict} tokens to generate exceeds "
                              f"the context of {self.n_ctx} tokens; {fix}")

    # ---- KV and cancel (the session keeps a conversation in the KV) ---------------------------

    def clear_kv(self, seq: int = -1) -> None:
        """Empty sequence `seq`'s KV (-1: every sequence's)."""
        mem = llama_cpp.llama_get_memory(self.ctx)
        if seq < 0:
            llama_cpp.llama_memory_clear(mem, True)
        else:
            llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)

    def kv_len(self, seq: int = 0) -> int:
        """Tokens in sequence `seq`'s KV: the next position to decode there."""
        return llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(self.ctx), seq) + 1

    def kv_keep(self, n: int, seq: int = 0) -> int:
        """Keep the first `n` positions of sequence `seq` and drop the rest; returns how many were kept.

        A memory that cannot drop a partial sequence (e.g. sliding-window or recurrent) is
        cleared instead, and 0 is returned: the caller then re-prefills everything.
        """
        mem = llama_cpp.llama_get_memory(self.ctx)
        if n <= 0 or not llama_cpp.llama_memory_seq_rm(mem, seq, n, -1):
            self.clear_kv(seq)
            return 0
        return n

    def cancel(self) -> None:
        """Stop the decode in flight; safe to call from another thread.

        Like a signal (seam.deliver), a Cancelled is parked on the hook: the eval and abort
        callbacks stop the running graph and `_decode` raises it. An error already parked
        (a lane failure, a signal) is left in place, so it is not mistaken for a cancel. The
        flag covers the time between decodes; `generate` checks it after each token. A cancel
        stops every sequence of a batched step: a scheduler of several drops one between steps.
        """
        self.cancel_requested = True
        if self.hook.error is None:
            self.hook.error = Cancelled()

    def reset_cancel(self) -> None:
        """Forget a cancel that arrived after its generation ended."""
        self.cancel_requested = False
        if isinstance(self.hook.error, Cancelled):
            self.hook.error = None

    # ---- generation ----------------------------------------------------------------------------

    def generate(self, tokens: list[int], n_predict: int, on_piece: OnPiece = lambda i, s, st: None,
                 fix: str = "raise -c or shorten the prompt", sampler: SamplerSettings | None = None) -> Result:
        """Prefill `tokens` after what sequence 0's KV holds, then decode up to `n_predict` tokens.

        The KV afterwards holds the old tokens, `tokens` and every token in `Result.ids` (each
        sampled token is decoded before the next one is sampled; an end-of-generation token is
        not). `fix` ends the message when the context is too small. `sampler` overrides the
        settings' sampler for this call (a server's requests each bring their own). Raises
        Cancelled when `cancel` is called mid-prefill or mid-decode.
        """
        def piece(i: int, text: str, stat: TokenStat) -> None:
            on_piece(i, text, stat)
            if self.cancel_requested:
                raise Cancelled()

        if self.cancel_requested:
            raise Cancelled()
        seq = self.begin(0, tokens, n_predict, piece, fix, sampler)
        try:
            while not seq.done:
                self.step([seq])
            if seq.error is not None:
                raise seq.error
            return seq.result
        finally:
            self.end(seq)

    def begin(self, seq: int, tokens: list[int], n_predict: int, on_piece: OnPiece,
              fix: str = "raise -c or shorten the prompt", sampler: SamplerSettings | None = None) -> Sequence:
        """Prefill `tokens` after what sequence `seq`'s KV holds; `step` then decodes it.

        Raises ConfigError when it does not fit the context, Cancelled when cancelled mid-prefill.
        Every Sequence begun must be ended (`end`), also after an error.
        """
        pos = self.kv_len(seq)
        self.check_fits(pos + len(tokens), n_predict, fix)
        st = self.streamer
        chain = make_sampler(sampler or self.settings.sampler)
        s = Sequence(seq, chain, n_predict, on_piece, Result([], "", len(tokens), 0.0, []))
        try:
            t0 = time.perf_counter()
            row = self._decode([(seq, tokens, pos)])[0]
            if st:  # the prefill's reads ahead land (or are dropped) in the prefill, not in the first token
                st.settle()
            s.result.prefill_s = time.perf_counter() - t0
            s.next = llama_cpp.llama_sampler_sample(chain, self.ctx, row)
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

    def step(self, seqs: list[Sequence]) -> None:
        """Decode one token for each of `seqs` together, in one llama.cpp batch.

        Each decodes the token it sampled after its last decode (llama.cpp keeps only the last
        decode's logits, so every sequence samples at once); one that sampled end-of-generation is
        done without a decode. Each token's TokenStat is the step's wall time and an even share
        of the step's reads, waits and hits (the shares add up to the step's). An exception from
        a sequence's `on_piece` ends that sequence (kept in `.error`), not the step; one from the
        decode ends the step.
        """
        c0 = time.perf_counter_ns()
        going = []
        for s in seqs:
            tok = s.next
            if self.vocab.is_eog(tok):
                s.done = True
            else:
                s.result.ids.append(tok)
                going.append((s, tok))
        if not going:
            return
        rows = self._decode([(s.seq, [tok], self.kv_len(s.seq)) for s, tok in going])
        for (s, _tok), row in zip(going, rows):
            s.next = llama_cpp.llama_sampler_sample(s.sampler, self.ctx, row)
        if self.adaptive is not None:
            self._adapt()
        wall, st, k = time.perf_counter_ns() - c0, self.streamer, len(going)
        if st:
            c = st.take_counters(step=True)
            counts = (c.io_ns, c.mgmt_ns, c.read_bytes, c.hits, c.lookups, c.stall_ns)
            stats = [TokenStat(wall, *(x * (i + 1) // k - x * i // k for x in counts), st.budget) for i in range(k)]
            resident = st.resident_bytes()
        else:
            stats, resident = [TokenStat(wall, 0, 0, 0, 0, 0)] * k, 0
        if self.trace:
            self.trace.end_step(going[0][1])
        for (s, tok), stat in zip(going, stats):
            res = s.result
            res.steps.append(stat)
            res.max_resident = max(res.max_resident, resident)
            try:
                s.on_piece(len(res.ids) - 1, s.out.push(self.vocab.piece(tok)), stat)
            except Exception as e:  # noqa: BLE001 - this sequence's own end (a stop string, a cancel)
                s.error, s.done = e, True
            if len(res.ids) >= s.n_predict:
                s.done = True

    def end(self, s: Sequence) -> None:
        """Free a Sequence's sampler and settle the reads it left; its text is final (`result`)."""
        if s.sampler is None:
            return
        s.out.finish()
        s.result.text = s.out.text
        llama_cpp.llama_sampler_free(s.sampler)
        s.sampler = None
        if self.streamer:
            s.result.speculation = self.streamer.take_speculation()
            self.streamer.settle()
        if self.trace:
            self.trace.active = False
            self.trace.write()

    def _decode(self, parts: list[tuple[int, list[int], int]], aborts: bool = False) -> list[int]:
        """One llama_decode of (sequence, tokens, first position) parts; logits for each part's last
        token, whose batch rows are returned. With `aborts`, the hook's abort (code 2) is expected."""
        n = sum(len(toks) for _, toks, _ in parts)
        batch = llama_cpp.llama_batch_init(n, 0, 1)
        rows, i = [], 0
        try:
            for seq, toks, pos in parts:
                for j, tok in enumerate(toks):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos + j, 1
                    batch.seq_id[i][0] = seq
                    batch.logits[i] = j == len(toks) - 1
                    i += 1
                rows.append(i - 1)
            batch.n_tokens = n
            if self.streamer is not None:
                self.streamer.begin_batch(n)
            with self.hook:
                rc = llama_cpp.llama_decode(self.ctx, batch)
        finally:
            llama_cpp.llama_batch_free(batch)
        err = self.hook.take_error()
        if err is not None:
            raise err
        if rc != 0 and not (aborts and rc == ABORTED):
            raise RuntimeError(f"llama_decode failed with code {rc}")
        return rows

    def close(self) -> None:
        """Free llama.cpp objects, then release workers and shared memory; idempotent."""
        if self.warm is not None and self.streamer is not None:
            self.warm.save()
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
