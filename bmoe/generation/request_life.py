"""One request's life on a KV sequence (Generation on a Slot), and what it gives back.

A Generation is one request from prefill to its last chunk: the KV prefix it can reuse, its
tokens as text (UTF-8 held back until whole, stop strings cut), its telemetry, its finish reason
and the KV it leaves. bmoe.generation.driver's Driver, the one loop, decides when: it calls a
Generation's `begin` (which keeps the reusable KV prefix and prefills the rest through Engine.begin),
decodes its tokens with others in one Engine.step, and calls its `finish` (Engine.end, the KV kept),
for every caller.
"""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from bmoe.base import telemetry
from bmoe.base.errors import Cancelled
from bmoe.base.settings import SamplerSettings
from bmoe.generation.logprobs import TokenLogprob, TokenSpans

if TYPE_CHECKING:
    from bmoe.chat.grammar import Grammar
    from bmoe.chat.output import Reading
    from bmoe.coordinator import Engine, EngineSequence
    from bmoe.generation.prompt_cache import PromptKV
    from bmoe.streaming.readahead import ReadAheadCounts

Turn = dict[str, str]  # one message of a conversation as the engine keeps it (role, content)


@dataclass(frozen=True)
class GenerationStats:
    """One generation in numbers; per-token figures are over its decode tokens (the contract's)."""

    finish_reason: str  # "stop" (end of generation or a stop string), "length" (max_tokens) or "cancelled"
    prompt_tokens: int  # the prompt as rendered (for a chat, all of the conversation)
    prefill_tokens: int  # those decoded: the prompt less the KV prefix reused from the previous call
    completion_tokens: int
    kv_tokens: int  # in the KV afterwards (the session's n_past)
    prefill_s: float
    tok_s: float
    read_mib: float
    mib_per_token: float
    cache_hit_pct: float  # cumulative over the decode tokens; -1 without a cache
    stall_s_per_token: float
    mgmt_s_per_token: float
    io_s_per_token: float
    speculative_mib: float = 0.0  # read ahead of demand (--prefetch, --spec-gate)
    prefetched_experts: int = 0
    useful_experts: int = 0  # of those, the ones their layer then routed
    lossy: bool = False  # lossy routing changed this generation (the load's settings; it did not ask lossless)
    experts_per_token: int = 0  # experts per layer its tokens used (the model's top-k when not lossy)
    dropped_per_token: float = 0.0  # lossy routing: experts dropped (--drop-cold), over every layer
    substituted_per_token: float = 0.0  # experts taken from the cache instead (--cache-routing)
    weight_changed_pct: float = 0.0  # mean share of a layer's routing weight not computed as routed
    page_cache_mib: float = 0.0  # copied from the page cache by the lanes instead of read from flash (not in read_mib)


@dataclass(frozen=True)
class Chunk:
    """A piece of the answer: one per generated token, then a last one with the outcome.

    `text` may be empty while a UTF-8 sequence or a possible stop string is held back.
    `token` is that token's telemetry in the contract's units (telemetry.TokenLine: wall_ms,
    io_ms, compute_ms, mgmt_ms, stall_ms, read_mb, cache_hit_pct); the last chunk has none
    and carries `finish_reason` and `stats` instead.
    """

    text: str
    token: telemetry.TokenLine | None = None
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    logits: np.ndarray | None = None  # with Request.logits: the distribution this token was chosen from
    stop: str | None = None  # the last chunk's: the stop string that ended the answer, if one did
    logprobs: tuple[TokenLogprob, ...] = ()  # with Request.logprobs: the tokens whose text this chunk completes


@dataclass(frozen=True)
class Completion:
    """A finished generation: its text, stats, and the tokens it generated with each one's telemetry."""

    text: str
    stats: GenerationStats
    ids: tuple[int, ...] = ()  # the generated tokens (an end-of-generation token is not one)
    tokens: tuple[telemetry.TokenLine, ...] = ()  # each generated token's telemetry, in order
    logprobs: tuple[TokenLogprob, ...] = ()  # with Request.logprobs: the text's tokens (bmoe.generation.logprobs)

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


@dataclass(frozen=True)
class Request:
    """A generation ready to run: the prompt as tokens, checked against the context (Model.prepare)."""

    tokens: tuple[int, ...]
    max_tokens: int
    sampler: SamplerSettings
    stop: tuple[str, ...] = ()
    messages: tuple[Turn, ...] | None = None  # a chat's conversation; None: a plain prompt
    grammar: Grammar | None = None  # holds sampling to a JSON schema or a tool call (bmoe.chat.grammar)
    specials: frozenset[int] = frozenset()  # tokens written as their special text (a chat syntax's markers)
    reading: Reading | None = None  # how a chat's answer splits into reasoning, content, tool calls
    cache_prefix: int = 0  # the prompt's first tokens worth keeping in a prompt cache (bmoe.generation.prompt_cache)
    lossless: bool = False  # no lossy routing, whatever the load's settings (bmoe.streaming.lossy)
    forced: tuple[int, ...] = ()  # teacher forcing: the tokens generated, in order, instead of sampled ones
    logits: bool = False  # each Chunk carries the distribution its token was chosen from
    logprobs: int | None = None  # each Chunk carries its tokens' log-probabilities and this many alternatives


class _Stopped(Exception):
    """A stop string appeared, or the answer's tool calls end here (bmoe.chat.output.CallEnd)."""


class _StopMatcher:
    """One stop string, matched a character at a time (Knuth-Morris-Pratt): `state` is the length
    of the longest start of the string the text so far ends with. Each character costs amortised
    O(1), so a long stop string cannot make a token's text expensive to check."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.back = [0] * len(stop)  # back[i]: the longest proper start of stop[:i+1] that also ends it
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.back[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.back[i] = k
        self.state = 0

    def feed(self, ch: str) -> bool:
        """Take the next character; True when the stop string ends with it."""
        k, stop = self.state, self.stop
        while k and ch != stop[k]:
            k = self.back[k - 1]
        if ch == stop[k]:
            k += 1
        if k == len(stop):
            self.state = self.back[k - 1]
            return True
        self.state = k
        return False


class StopText:
    """The answer's text with the first stop string and what follows cut off.

    Text that could be the start of a stop string is held back until the next piece decides.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [_StopMatcher(s) for s in stops if s]
        self.raw = ""  # every piece so far
        self.sent = 0  # characters of `raw` handed out
        self.cut: int | None = None  # where the first stop string begins, once one appeared
        self.matched: str | None = None  # that stop string

    @property
    def text(self) -> str:
        return self.raw if self.cut is None else self.raw[:self.cut]

    def push(self, piece: str) -> str:
        """Add a piece; returns the text that can be handed out now."""
        if self.cut is not None:
            return ""
        start = len(self.raw)
        self.raw += piece
        # a stop string cannot begin in text handed out: its start would have been held back; of the
        # stop strings that appear in this piece, the one that begins first cuts
        for m in self.stops:
            for i, ch in enumerate(piece):
                if m.feed(ch):
                    begins = start + i + 1 - len(m.stop)
                    if self.cut is None or begins < self.cut:
                        self.cut, self.matched = begins, m.stop
                    break
        if self.cut is not None:
            end = self.cut
        else:
            hold = max((m.state for m in self.stops), default=0)
            end = max(self.sent, len(self.raw) - hold)
        out, self.sent = self.raw[self.sent:end], end
        return out

    def flush(self) -> str:
        """The generation ended: what was held back is the answer's after all."""
        if self.cut is not None:
            return ""
        out, self.sent = self.raw[self.sent:], len(self.raw)
        return out


class TextStream:
    """Token pieces → text, holding back a partial UTF-8 sequence until it completes."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, piece: bytes) -> str:
        return self._dec.decode(piece)

    def finish(self) -> str:
        return self._dec.decode(b"", final=True)


@dataclass
class Slot:
    """One KV sequence and exactly what it holds: its tokens in order and, for a chat, the
    conversation they render (its last answer included)."""

    seq: int
    kv_tokens: list[int] = field(default_factory=list)
    messages: list[Turn] = field(default_factory=list)
    busy: bool = False
    used: float = 0.0  # when a generation last ended here (the least recent is reused first)
    lossy: bool = False  # its KV was computed with lossy routing: a lossless request does not reuse it

    def extends(self, messages: Sequence[Turn], lossless: bool = False) -> bool:
        """Whether `messages` continue this slot's conversation (that conversation, then more), in KV
        a lossless request may reuse."""
        n = len(self.messages)
        return (0 < n < len(messages) and [_as_kept(t) for t in messages[:n]] == [_as_kept(t) for t in self.messages]
                and not (lossless and self.lossy))


def _as_kept(turn: Mapping[str, Any]) -> dict[str, Any]:
    """A turn as compared when a conversation goes on: without its reasoning (a client may send it back
    or not) and with its tool calls' arguments as JSON values (a client may send them back
    re-serialized, as Anthropic's clients send a tool_use's input object). The KV kept is still only
    the tokens both prompts share."""
    calls = turn.get("tool_calls")
    out = {k: v for k, v in turn.items() if k not in ("reasoning_content", "tool_calls")}
    if isinstance(calls, list):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _json(c["function"]["arguments"])}}
                             for c in calls]
    return out


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


OnEnd = Callable[[telemetry.Tally, str, int, int, int, float, "ReadAheadCounts | None", bool], GenerationStats]


class Generation:
    """`req` on `slot`: `begin` prefills, `take` adds each decoded token, `finish` ends it.

    Only the driver (bmoe.generation.driver) calls these. A chat that extends the slot's conversation
    prefills only the tokens past the prefix the KV already holds. Afterwards the KV holds the
    prompt and the answer; a cancelled generation is rolled back to the reused prefix, one cut by
    a stop string to its prompt. `on_end` hears the stats of every generation that finishes.
    """

    def __init__(self, engine: Engine, slot: Slot, req: Request, on_chunk: Callable[[Chunk], None] | None,
                 on_end: OnEnd, cache: PromptKV | None = None) -> None:
        self.engine, self.slot, self.req = engine, slot, req
        self.cache = cache  # a prompt cache: an emptied sequence starts from a kept prefix
        self.on_chunk = on_chunk
        self.on_end = on_end
        self.seq: EngineSequence | None = None
        self.cancelled = False  # asked to stop (Driver.cancel); it ends at the next token or step
        self.finished = False  # `finish` has run: nothing more happens to it
        self.ended: BaseException | None = None  # why it is done before its last token: a stop string, a cancel
        self.done = False
        self.tokens = list(req.tokens)
        self.ids: list[int] = []
        self.keep = 0
        self.cached = (0, 0.0)  # tokens decoded and seconds spent by the prompt cache's part of the prefill
        self.utf8 = TextStream()
        self.text = StopText(req.stop)
        self.calls = req.reading.call_end(req.max_tokens) if req.reading is not None else None
        self.tally = telemetry.Tally(req.max_tokens, engine.streaming and engine.settings.streaming.overlap,
                                     engine.cache_active)
        self.lossy = engine.is_lossy and not req.lossless
        self.logits: np.ndarray | None = None  # with req.logits: the distribution the next token comes from
        self.spans = (None if req.logprobs is None else
                      TokenSpans(req.logprobs, lambda t: engine.vocab.piece(t, t in req.specials)))
        self.logprobs: list[TokenLogprob] = []  # handed out so far
        self.t0 = time.perf_counter()

    @property
    def begun(self) -> EngineSequence:
        """The engine's sequence, once `begin` made it."""
        assert self.seq is not None
        return self.seq

    def begin(self) -> None:
        """Keep the prefix of the KV this request can reuse and prefill the rest."""
        from bmoe.chat.template import common_prefix

        e, slot, req = self.engine, self.slot, self.req
        slot.busy = True
        reuse = req.messages is not None and slot.extends(req.messages, req.lossless)
        self.keep = e.kv_keep(min(common_prefix(slot.kv_tokens, self.tokens), len(self.tokens) - 1)
                              if reuse else 0, slot.seq)
        slot.kv_tokens = slot.kv_tokens[:self.keep]
        if not reuse:
            slot.messages = []
        slot.lossy = (slot.lossy and self.keep > 0) or self.lossy
        if self.cancelled:
            raise Cancelled()
        if self.cache is not None and self.keep == 0:
            self.keep, decoded, spent = self.cache.prefill(slot.seq, self.tokens, req.cache_prefix)
            slot.kv_tokens, self.cached = self.tokens[:self.keep], (decoded, spent)
        self.seq = e.begin(slot.seq, self.tokens[self.keep:], req.max_tokens, req.sampler, grammar=req.grammar,
                           lossless=req.lossless, forced=list(req.forced),
                           keep_logits=req.logits or req.logprobs is not None)
        self.logits = self.seq.logits

    def take(self, decoded: tuple[int, telemetry.TokenStat] | None) -> None:
        """The engine's step for this generation: the token it decoded and its stat, or None when
        it had sampled end-of-generation. Sets `done` when this was its last token."""
        if decoded is None:
            self.done = True
            return
        tok, stat = decoded
        self.ids.append(tok)
        line = self.tally.add(stat)
        raw = self.engine.vocab.piece(tok, tok in self.req.specials)
        chars, at = self.utf8.push(raw), len(self.text.raw)
        new = self.text.push(chars)
        logits, self.logits = self.logits, self.begun.logits
        released: tuple[TokenLogprob, ...] = ()
        if self.spans is not None:
            assert logits is not None, "a request for logprobs keeps each step's logits"
            self.spans.add(tok, raw, chars, at, logits)
            released = self.spans.release(self.text.sent, self.text.cut)
            self.logprobs += released
        if self.on_chunk:
            self.on_chunk(Chunk(new, line, logits=logits if self.req.logits else None, logprobs=released))
        if self.text.cut is not None or (self.calls is not None and self.calls.push(new, len(self.ids))):
            self.ended, self.done = _Stopped(), True
        elif self.cancelled:
            self.ended, self.done = Cancelled(), True
        elif len(self.ids) >= self.req.max_tokens:
            self.done = True

    def finish(self, error: BaseException | None = None) -> Completion:
        """End it: the KV, the slot's conversation, the stats and the last chunk. An error other
        than a cancel or a stop string is raised again after the KV is rolled back."""
        e, slot, tokens, text = self.engine, self.slot, self.tokens, self.text
        self.finished = True
        error = error or self.ended
        ahead = e.end(self.seq) if self.seq is not None else None
        slot.busy, slot.used = False, time.monotonic()
        if isinstance(error, Cancelled):
            finish, kv = "cancelled", tokens[:e.kv_keep(self.keep, slot.seq)]
        elif isinstance(error, _Stopped):
            finish, kv = "stop", tokens[:e.kv_keep(len(tokens), slot.seq)]
        elif error is not None:
            slot.kv_tokens = tokens[:e.kv_keep(self.keep, slot.seq)]
            self._check_kv()
            raise error
        else:
            rest = self.utf8.finish()
            tail = text.push(rest) + text.flush()
            released: tuple[TokenLogprob, ...] = ()
            if self.spans is not None:
                self.spans.finish_text(rest)
                released = self.spans.release(text.sent, text.cut, final=True)
                self.logprobs += released
            if (tail or released) and self.on_chunk:
                self.on_chunk(Chunk(tail, logprobs=released))
            finish = "stop" if text.cut is not None or len(self.ids) < self.req.max_tokens else "length"
            kv = tokens + self.ids
        slot.kv_tokens = kv
        if finish != "cancelled" and self.req.messages is not None:
            r = self.req.reading
            slot.messages = [*self.req.messages,
                             r.turn(text.text) if r else {"role": "assistant", "content": text.text}]
        self._check_kv()
        prefill_s = self.cached[1] + (self.seq.prefill_s if self.seq is not None else time.perf_counter() - self.t0)
        stats = self.on_end(self.tally, finish, len(tokens), len(tokens) - self.keep + self.cached[0],
                            len(slot.kv_tokens), prefill_s, ahead, self.lossy)
        if self.on_chunk:
            self.on_chunk(Chunk("", finish_reason=finish, stats=stats, stop=text.matched))
        return Completion(text.text, stats, tuple(self.ids), tuple(self.tally.lines), tuple(self.logprobs))

    def _check_kv(self) -> None:
        """The token list must describe the KV exactly; if not (a bug), start clean rather than lie."""
        e, slot = self.engine, self.slot
        n = e.kv_len(slot.seq)
        if n != len(slot.kv_tokens):
            e.notice(f"KV of sequence {slot.seq} holds {n} tokens but {len(slot.kv_tokens)} were tracked; clearing it")
            e.clear_kv(slot.seq)
            slot.kv_tokens, slot.messages = [], []
