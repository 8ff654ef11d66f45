"""The coordinator: the process that runs decode in llama.cpp and owns every piece of cache state.

`Engine` runs what bmoe.engine.load loaded (the model, its context and the streaming parts wired
around them): `begin` prefills one KV sequence and samples its first token, `step` decodes one token
for each of several sequences in one llama.cpp batch (`--parallel`; a lone sequence with `--draft`
decodes its drafts with it and keeps those its sampler agrees with: bmoe.engine.drafts), `end` frees one; it keeps the
KV, stops a decode on request, and holds the facts every edge prints about the load (`stats`).
Requests reach `begin`/`step`/`end` only through the one generation loop, bmoe.generation.driver.

While a decode runs, llama.cpp's graph stops at each MoE layer's routing for
bmoe.streaming.graph_stops, which has the routed experts read into the cache and the ids
rewritten to their slots: output is computed from exactly the bytes plain llama.cpp would use.

Its users (bmoe.api.model, bmoe.generation.driver, bmoe.generation.request_life, bmoe.generation.prompt_cache)
use only the Engine's public methods and properties (tests/test_layout.py checks that no product
module reads another's private attributes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bmoe import seam
from bmoe.base.errors import Cancelled, ConfigError, ContextTooLong, ModelError
from bmoe.base.model_files import ModelFiles
from bmoe.base.settings import Naming, SamplerSettings, Settings
from bmoe.base.telemetry import TokenStat
from bmoe.engine import prompt_calls
from bmoe.engine.drafts import Drafter, DraftTally, verify
from bmoe.engine.engine_stats import EmbeddingFacts, EngineStats, token_shares
from bmoe.engine.load import Loaded
from bmoe.engine.mtp import MtpDrafts
from bmoe.engine.sequence import EngineSequence
from bmoe.memory.budget import Adaptive
from bmoe.memory.probe import MemoryProbe
from bmoe.seam import llama
from bmoe.streaming.gating import Gating
from bmoe.streaming.lossy import Lossy
from bmoe.streaming.readahead import ReadAheadCounts
from bmoe.streaming.streamer import Streamer
from bmoe.streaming.warm_fill import WarmStart

if TYPE_CHECKING:
    from bmoe.chat.grammar import Grammar

class Engine:
    """A loaded model and context (bmoe.engine.load), streaming experts unless the settings turned it off:
    prefill and decode of KV sequences, the KV itself, and the facts edges print about the load."""

    def __init__(self, parts: Loaded) -> None:
        """Take over what `bmoe.engine.load.load_engine` made (closed with the engine); each of its parts
        is reached through the engine's property of that name, and only the engine reads `_parts`."""
        self._parts = parts
        self._mtp = None if parts.mtp_ctx is None else MtpDrafts(parts.mtp_ctx, self.model, self.vocab, self._run_mtp)

    # ---- the load's parts ----------------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        return self._parts.settings

    @property
    def notice(self) -> Callable[[str], None]:
        """Where what the user should know goes (the edge's)."""
        return self._parts.notice

    @property
    def words(self) -> Naming:
        """How errors name settings (the edge's flags or keywords)."""
        return self._parts.words

    @property
    def files(self) -> ModelFiles:
        return self._parts.files

    @property
    def hook(self) -> seam.EvalHook:
        return self._parts.hook

    @property
    def vocab(self) -> llama.Vocab:
        assert self._parts.vocab is not None  # a load that returned made it
        return self._parts.vocab

    @property
    def model(self) -> llama.LlamaModel:
        """llama.cpp's model, while the engine is loaded."""
        assert self._parts.model is not None, "the engine is closed"
        return self._parts.model

    @property
    def context(self) -> llama.Context:
        """llama.cpp's context, while the engine is loaded."""
        assert self._parts.ctx is not None, "the engine is closed"
        return self._parts.ctx

    @property
    def streamer(self) -> Streamer | None:
        """The Streamer while streaming (None without, and once closed)."""
        return self._parts.streamer

    @property
    def scratch(self) -> seam.Scratch | None:
        """llama.cpp's compute buffer and the part a decode uses (streaming only: read off the warm-up graph)."""
        return self._parts.scratch

    @property
    def lossy(self) -> Lossy | None:
        """Lossy routing while streaming with a lossy setting on."""
        return self._parts.lossy

    @property
    def gating(self) -> Gating | None:
        """How the model routes, read from the warm-up graph (None without streaming)."""
        return self._parts.gating

    @property
    def warm(self) -> WarmStart | None:
        """The warm start's usage profile (--warm-start)."""
        return self._parts.warm

    @property
    def memory(self) -> MemoryProbe:
        """The limits that apply to the process (an adaptive budget reads them too)."""
        return self._parts.memory

    @property
    def adaptive(self) -> Adaptive | None:
        """The adaptive budget (--adapt)."""
        return self._parts.adaptive

    @property
    def fixed_k(self) -> int:
        """llama.cpp's own expert count, set at load (--no-stream --experts-per-token), else 0."""
        return self._parts.fixed_k

    @property
    def n_ctx(self) -> int:
        return self._parts.n_ctx

    def embedding_facts(self) -> EmbeddingFacts | None:
        """How this load computes embeddings (None: loaded without --embedding)."""
        pooling = self._parts.pooling
        return EmbeddingFacts(pooling, llama.n_embd_out(self.model), self.call_width) if pooling else None

    @property
    def load_s(self) -> float:
        return self._parts.load_s

    @property
    def llama_load_s(self) -> float:
        """Of load_s, llama.cpp's own load (model, then context)."""
        return self._parts.llama_load_s

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        idle session or server gives memory back when another program needs it; a background
        fill (a warm start's, or the rest of a cache that holds every expert) reads on."""
        if self.streamer is not None:
            self.streamer.follow()
            self.streamer.idle_fill()
            if self.warm is not None:
                self.warm.idle()

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
        """The chat template: --chat-template-file's, --chat-template's name of a llama.cpp built-in, else the
        one stored in the GGUF, if any."""
        if self.settings.chat_template_file:
            return Path(self.settings.chat_template_file).read_bytes()
        if self.settings.chat_template:
            return self.settings.chat_template.encode()
        return llama.chat_template(self.model)

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
        words, replay = self._parts.words, self._parts.replay
        if self.fixed_k:
            raise ConfigError(f"this model was loaded with {words.value('experts_per_token', self.fixed_k)} "
                              f"and {words.value('stream', False)}: llama.cpp itself routes to "
                              f"{self.fixed_k} experts, and no request can have the model's "
                              f"{self.files.n_expert_used} back; {fix}")
        if replay is not None:
            raise ConfigError(f"this model was loaded with {words.value('replay_routes', replay.name)}: "
                              f"every token takes the trace's routing, and no request can have the model's own "
                              f"back; {fix}")

    def tokenize(self, text: str) -> list[int]:
        """Text as the model's tokens, with the special tokens (BOS) the vocab asks for."""
        return self.vocab.tokenize(text, add_special=True)

    def check_unchanged(self, fix: str) -> None:
        """ModelError when a model file changed since the load (the offsets bmoe reads describe the old one)."""
        self.files.check_unchanged(fix)

    def check_fits(self, n_tokens: int, n_predict: int, fix: str) -> None:
        """The one prompt check: `n_tokens` in the KV after prefill, plus `n_predict`, must fit the context."""
        if n_tokens <= 0:
            raise ConfigError("the prompt is empty (no tokens); give it some text")
        if n_tokens + n_predict > self.n_ctx:
            raise ContextTooLong(f"the prompt ({n_tokens} tokens) plus {n_predict} tokens to generate exceeds "
                                 f"the context of {self.n_ctx} tokens; {fix}", n_tokens, self.n_ctx)

    # ---- KV and cancel (a Slot's tokens are the KV sequence's: bmoe.generation.request_life) ----------------

    def clear_kv(self, seq: int = -1) -> None:
        """Empty sequence `seq`'s KV (-1: every sequence's), and the MTP context's with it."""
        llama.kv_clear(self.context, seq)
        if self._mtp is not None:
            self._mtp.clear(seq)

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
        if self._mtp is not None:  # its carried state stays the last decode's, as llama-server's does
            self._mtp.cut(seq, n)
        return n

    def interrupt(self) -> None:
        """Stop the llama_decode in flight with Cancelled; safe to call from another thread.

        Like a signal (seam.deliver), the Cancelled is parked on the hook: the eval and abort
        callbacks stop the running graph and `_decode` raises it. An error already parked (a lane
        failure, a signal) is left in place, so it is not mistaken for a cancel. Only the
        generation driver (bmoe.generation.driver) calls it, when every generation in the decode is cancelled.
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
        parts: bmoe.generation.prompt_cache); the seconds it took. Cancelled when interrupted. No lossy routing:
        the KV kept from it serves lossless and lossy requests alike."""
        st = self.streamer
        t0 = time.perf_counter()
        if self.lossy:
            self.lossy.begin([False] * len(tokens))
        if self._parts.trace:
            self._parts.trace.prompting = True
        try:
            self._decode([(seq, tokens, self.kv_len(seq))])
            if st:
                st.settle()
        finally:
            if self._parts.trace:
                self._parts.trace.prompting = False
            if st:  # a prefill's reads are not the decode's
                st.take_counters()
                st.take_speculation()
        return time.perf_counter() - t0

    def begin(self, seq: int, tokens: list[int], n_predict: int, sampler: SamplerSettings,
              fix: str = "raise -c or shorten the prompt", grammar: Grammar | None = None, *,
              lossless: bool = False, forced: Iterable[int] = (), keep_logits: bool = False, kept: bool = False,
              on_call: Callable[[int, float], None] | None = None, held: Sequence[int] = ()) -> EngineSequence:
        """Prefill `tokens` after what sequence `seq`'s KV holds and sample its first token; `step`
        then decodes it. `lossless`: no lossy routing for this sequence. `forced`: the tokens its
        steps decode, in order, instead of sampled ones (teacher forcing). `keep_logits`: each
        step keeps the distribution it chose from (`EngineSequence.logits`); `kept`: the sampler chain's
        probabilities after its last sampler instead (seam.llama.sample_kept: the same token). `on_call` hears,
        after each llama_decode call the prompt is cut into, the prompt's tokens decoded so far and the seconds
        taken. `held`: the prompt's tokens before `tokens`, which the KV holds already (drafts look them up too).

        Raises ContextTooLong when it does not fit the context (`fix` ends the message), Cancelled
        when interrupted mid-prefill. Every EngineSequence begun must be ended (`end`), also after an error.
        """
        pos = self.kv_len(seq)
        self.check_fits(pos + len(tokens), n_predict, fix)
        if lossless:
            self.check_lossless("load it without one of them for lossless requests")
        st = self.streamer
        s = EngineSequence(seq, llama.make_sampler(sampler, self.vocab, grammar.gbnf if grammar else None),
                           lossless=lossless, forced=list(forced), keep_logits=keep_logits or kept, kept=kept,
                           left=n_predict)
        d = self.settings.draft
        if d.mode != "none" and not s.forced and not s.keep_logits:  # those need each token's step alone
            s.drafter = Drafter([*held, *tokens] if d.mode == "ngram" else None, d.most, d.gate, self.notice)
        try:
            t0 = time.perf_counter()
            if self.lossy:
                self.lossy.begin([not lossless] * len(tokens))
            if self._parts.trace:
                self._parts.trace.prompting = True
            try:
                after = None if on_call is None else (lambda n: on_call(n, time.perf_counter() - t0))
                row = self._decode([(seq, tokens, pos)], after)[0]
            finally:
                if self._parts.trace:
                    self._parts.trace.prompting = False
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
        if self._parts.trace:
            self._parts.trace.active = True
        return s

    def step(self, seqs: list[EngineSequence]) -> list[list[tuple[int, TokenStat]] | None]:
        """Decode, for each of `seqs` together in one llama.cpp batch, the token it sampled after
        its last decode; returns per sequence the tokens this step generated with their TokenStats
        (one; more when a lone sequence's drafts were accepted), or None for one that had sampled
        end-of-generation (nothing decoded: it is done).

        llama.cpp keeps only the last decode's logits, so every sequence samples its next token
        right after the decode. Each token's TokenStat is its sequence's share of the step's wall time
        (a batch's sequences each the whole step; a verify step's tokens an even share) and an even share
        of the step's reads, waits and hits (the shares add up to the step's); the drafts' figures
        are on a verify step's first token.
        """
        c0 = time.perf_counter_ns()
        going = [s for s in seqs if not self.vocab.is_eog(s.next)]
        if not going:
            return [None] * len(seqs)
        toks = {id(s): [s.next] for s in going}
        if self.lossy:
            self.lossy.begin([not s.lossless for s in going])
        lone = going[0].drafter if len(going) == 1 else None  # several sequences: one token each, as before
        drafts, drafting_bytes = self._propose(going[0], lone) if lone is not None else ([], 0)
        guessed = bool(drafts) and lone is not None and lone.guessing
        tally = DraftTally()
        if drafts and not guessed:
            toks[id(going[0])], tally = self._verify(going[0], drafts)
            tally.extra_bytes += drafting_bytes
        else:
            rows = self._decode([(s.seq, [s.next], self.kv_len(s.seq)) for s in going])
            for s, row in zip(going, rows):
                self._choose(s, row)
            if guessed:  # the gate's guess, checked against the token chosen
                tally = DraftTally(extra_bytes=drafting_bytes, guesses=1, right=int(drafts[0] == going[0].next))
        if self.streamer is not None:
            self.streamer.follow()
        made = [(s, t) for s in going for t in toks[id(s)]]
        wall, st, k = time.perf_counter_ns() - c0, self.streamer, len(made)
        for s in going:
            s.left -= len(toks[id(s)])
            if s.drafter is not None:
                s.drafter.settle(tally, len(toks[id(s)]), wall / 1e9)
        # each sequence's tokens share its wall time (a batch's sequences each took the whole step)
        walls = [wall * (i + 1) // k - wall * i // k for i in range(k)] if drafts else [wall] * k
        shares = token_shares(walls, st.take_counters(step=True) if st else None, st.budget if st else 0)
        if drafts:
            first = shares[0]
            first.drafted, first.accepted, first.draft_extra_bytes = tally.drafted, tally.accepted, tally.extra_bytes
        if self.lossy:
            assert st is not None  # lossy routing runs only while streaming
            layers = len(st.layers)
            for stat, rc in zip(shares, self.lossy.take()):
                stat.dropped, stat.substituted = rc.dropped, rc.substituted
                stat.weight_changed_pct = 100.0 * rc.moved / layers
        if self._parts.trace:
            self._parts.trace.end_step(toks[id(going[0])][0])
        out: dict[int, list[tuple[int, TokenStat]]] = {}
        for (s, t), stat in zip(made, shares):
            out.setdefault(id(s), []).append((t, stat))
        return [out.get(id(s)) for s in seqs]

    def _propose(self, s: EngineSequence, drafter: Drafter) -> tuple[list[int], int]:
        """A lone sequence's drafts after its chosen token: the n-gram lookup's, or the MTP layer's; with the bytes
        the MTP layer's drafting decodes read (DraftReads: extra, as the drafted rows' are)."""
        most = drafter.room(s.left - 1)
        if drafter.lookup is not None or not most:
            return drafter.propose(most), 0
        assert self._mtp is not None  # --draft mtp loaded its context
        reads = self._parts.draft_reads
        if reads is not None:
            reads.begin(False, drafting=True)
        try:
            drafts = self._mtp.draft(s.seq, s.next, self.kv_len(s.seq), most)
        finally:
            made = reads.take() if reads is not None else 0
        return drafts, made

    def _verify(self, s: EngineSequence, drafts: list[int]) -> tuple[list[int], DraftTally]:
        """Decode `s`'s chosen token and `drafts` in one llama_decode, every row's logits kept, and sample the rows
        in order while they agree with the drafts (bmoe.engine.drafts.verify); the KV is cut after the last
        token kept. Returns the tokens generated (the chosen one, then the drafts accepted) and the step's figures."""
        group = [s.next, *drafts]
        pos = self.kv_len(s.seq)
        reads = self._parts.draft_reads
        if reads is not None:
            reads.begin(True)
        try:
            last = self._decode_call([(s.seq, group, pos)], every_logit=True, prompt=False)[0]
        finally:
            extra = reads.take() if reads is not None else 0

        def choose(i: int) -> int:
            self._choose(s, last - len(drafts) + i)
            return s.next

        out = verify(group, choose, self.vocab.is_eog)
        if not llama.kv_cut(self.context, s.seq, pos + len(out)):
            raise ModelError("llama.cpp could not drop the drafts it rejected from the KV")
        if self._mtp is not None:
            self._mtp.accept(s.seq, len(out), pos)
        return group[:len(out)], DraftTally(1, len(drafts), len(out) - 1, extra)

    def embed(self, seq: int, tokens: list[int]) -> np.ndarray:
        """`tokens`' embeddings as llama.cpp computes them from an empty sequence `seq` in one llama_decode
        (one ubatch: `call_width` tokens at most), the experts streamed as a prefill's: pooled, one vector;
        pooling none, one per token. The KV of `seq` is empty again after it. Cancelled when interrupted."""
        pooling = self._parts.pooling
        assert pooling is not None, "loaded without --embedding"
        assert 0 < len(tokens) <= self.call_width, "one ubatch"
        st, ctx = self.streamer, self.context
        self.clear_kv(seq)
        llama.set_embeddings(ctx, True)
        if self.lossy:
            self.lossy.begin([False] * len(tokens))
        try:
            self._decode_call([(seq, tokens, 0)], every_logit=True, follow=False)
            if pooling == "none":
                return llama.token_embeddings(ctx, self.model, len(tokens))
            return llama.seq_embedding(ctx, self.model, seq)
        finally:
            llama.set_embeddings(ctx, False)
            self.clear_kv(seq)
            if st:  # its reads are no generation's
                st.settle()
                st.take_counters()
                st.take_speculation()
            prompt_calls.return_scratch(self.scratch, len(tokens), self._parts.adaptive is not None)

    def _choose(self, s: EngineSequence, row: int) -> None:
        """The token sequence `s` decodes next, from its logits at batch row `row`: its next forced
        token, else its sampler's choice (kept with the distribution when asked)."""
        if s.keep_logits and not s.kept:
            s.logits = llama.logits(self.context, self.vocab, row)
        if s.forced:
            s.next = s.forced.pop(0)
        else:
            assert s.sampler is not None, "an EngineSequence is sampled only between begin and end"
            if s.kept:
                s.next, s.logits = llama.sample_kept(s.sampler, self.context, self.vocab, row)
            else:
                s.next = llama.sample(s.sampler, self.context, row)
        if s.drafter is not None and s.drafter.lookup is not None:
            s.drafter.lookup.add([s.next])

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
        if self._parts.trace:
            self._parts.trace.active = False
            self._parts.trace.write()
        return ahead

    def _decode(self, parts: list[tuple[int, list[int], int]],
                after: Callable[[int], None] | None = None) -> list[int]:
        """Decode (sequence, tokens, first position) parts; logits for each part's last token, whose
        batch rows are returned. One part of several tokens (a prompt) goes in the calls
        bmoe.engine.prompt_calls cuts it into, each part of lossy routing's rows following its call
        (`after` hears the tokens decoded so far after each call); anything else in one llama_decode."""
        if len(parts) != 1 or len(parts[0][1]) <= 1:
            one = self._decode_call(parts)
            if after is not None:
                after(sum(len(toks) for _, toks, _ in parts))
            return one
        seq, toks, pos = parts[0]
        rows: list[int] = []
        mask = self.lossy.mask.tolist() if self.lossy else []
        at = 0
        calls = prompt_calls.calls(len(toks), self.call_width)
        for k in calls:
            if self.lossy:
                self.lossy.begin(mask[at:at + k])
            at += k
            rows = self._decode_call([(seq, toks[at - k:at], pos + at - k)], no_logit=at < len(toks))
            if after is not None:
                after(at)
        prompt_calls.return_scratch(self.scratch, max(calls), self._parts.adaptive is not None)
        return rows

    @property
    def call_width(self) -> int:
        """The widest llama_decode a prompt is decoded in: the context's ubatch."""
        return llama.ubatch_size(self.context)

    def _decode_call(self, parts: list[tuple[int, list[int], int]], no_logit: bool = False,
                     every_logit: bool = False, prompt: bool = True, follow: bool = True) -> list[int]:
        """One llama_decode of (sequence, tokens, first position) parts (`no_logit`: a prompt's call
        before its last, whose logits nobody reads; `every_logit`: every token an output, as embeddings and
        drafts ask; `prompt` False: several tokens of a part are no prompt's, but a verify group's); with
        --draft mtp the MTP context then decodes them too (`follow` False: an embedding's, which no KV keeps)."""
        n = sum(len(toks) for _, toks, _ in parts)
        prompt = prompt and any(len(toks) > 1 for _, toks, _ in parts)
        ctx = self.context
        rows = self._run(lambda: llama.decode(ctx, parts, every_logit=every_logit, no_logit=no_logit), n, prompt)
        if self._mtp is not None and follow:
            self._mtp.follow(ctx, parts, prompt)
        return rows

    def _run(self, decode: Callable[[], tuple[int, list[int]]], n: int, prompt: bool,
             blind: frozenset[int] | None = None) -> list[int]:
        """One decode of `n` tokens under the eval hook, the streaming parts told a batch starts (`prompt`: a prompt's,
        whose experts only its earlier tokens route enter cold; `blind`: the MTP context's, those layers' unread)."""
        if self.streamer is not None:
            self.streamer.begin_batch(n, trunk=blind is None)
        if self._parts.stops is not None:
            self._parts.stops.begin_batch(n, prompt=prompt, blind=blind or frozenset())
        return self.hook.run(decode)

    def _run_mtp(self, decode: Callable[[], tuple[int, list[int]]], n: int, prompt: bool, outputs: bool) -> list[int]:
        """An MTP context's decode; one without outputs is for its KV alone: no expert read (bmoe.engine.mtp)."""
        return self._run(decode, n, prompt, frozenset() if outputs else self._parts.mtp_blind)

    def close(self, in_use: bool = False) -> None:
        """Free llama.cpp objects, then release workers and shared memory; idempotent. `in_use`: a
        decode may still be running (a close that could not wait for it, a process ending at once):
        only the workers and the shared memory's names go (Loaded.close)."""
        self._parts.close(in_use)
