"""One request's life on a KV sequence (Generation on a Slot).

A Generation is one request from prefill to its last chunk: the KV prefix it can reuse, its
tokens as text (bmoe.generation.answer_text: UTF-8 held back until whole, stop strings cut), its
telemetry, its finish reason and the KV it leaves; what it takes and gives back are
bmoe.generation.records'. bmoe.generation.driver's Driver, the one loop, decides when: it calls a
Generation's `begin` (which keeps the reusable KV prefix and prefills the rest through Engine.begin),
decodes its tokens with others in one Engine.step, and calls its `finish` (Engine.end, the KV kept),
for every caller.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from bmoe.base import telemetry
from bmoe.base.errors import Cancelled
from bmoe.generation.answer_text import StopStrings, TextStream
from bmoe.generation.logprobs import TokenLogprob, TokenSpans
from bmoe.generation.records import Chunk, Completion, GenerationStats, PrefillProgress, Request, Turn

if TYPE_CHECKING:
    from bmoe.coordinator import Engine
    from bmoe.engine.sequence import EngineSequence
    from bmoe.generation.prompt_cache import PromptKV
    from bmoe.streaming.readahead import ReadAheadCounts


class _Stopped(Exception):
    """A stop string appeared, or the answer's tool calls end here (bmoe.chat.output.CallEnd)."""


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
        self.text = StopStrings(req.stop)
        self.calls = req.reading.call_end(req.max_tokens) if req.reading is not None else None
        self.tally = telemetry.Tally(req.max_tokens, engine.streaming and engine.settings.streaming.overlap,
                                     engine.cache_active, engine.settings.draft.mode != "none")
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
                           keep_logits=req.logits or req.logprobs is not None, kept=req.post_sampling,
                           on_call=self._reporter(), held=self.tokens[:self.keep])
        self.logits = self.seq.logits

    def _reporter(self) -> Callable[[int, float], None] | None:
        """With Request.progress, the prefill's reports: one now (nothing decoded yet), then the returned callable's,
        after each of Engine.begin's calls (the tokens it decoded so far, its seconds)."""
        report = self.on_chunk
        if not self.req.progress or report is None:
            return None
        total, held, spent = len(self.tokens), self.keep, self.cached[1]
        report(Chunk("", progress=PrefillProgress(total, held, held, 0.0)))

        def after_call(decoded: int, seconds: float) -> None:
            report(Chunk("", progress=PrefillProgress(total, held, held + decoded, spent + seconds)))
        return after_call

    def take(self, decoded: list[tuple[int, telemetry.TokenStat]] | None) -> None:
        """The engine's step for this generation: the tokens it generated (one, or more with drafts) and
        their stats, or None when it had sampled end-of-generation. Sets `done` when one was its last token
        (the rest are dropped; the KV is cut back when it finishes)."""
        if decoded is None:
            self.done = True
            return
        for tok, stat in decoded:
            self._take(tok, stat)
            if self.done:
                return

    def _take(self, tok: int, stat: telemetry.TokenStat) -> None:
        """One generated token: its text, telemetry and chunk; whether it ends the generation."""
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
            self.on_chunk(Chunk(new, line, logits=logits if self.req.logits else None, logprobs=released, token_id=tok,
                                prefill=self.prefilled() if len(self.ids) == 1 else None))
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
        decoded, prefill_s = self.prefilled()
        stats = self.on_end(self.tally, finish, len(tokens), decoded, len(slot.kv_tokens), prefill_s, ahead, self.lossy)
        if self.on_chunk:
            self.on_chunk(Chunk("", finish_reason=finish, stats=stats, stop=text.matched))
        return Completion(text.text, stats, tuple(self.ids), tuple(self.tally.lines), tuple(self.logprobs))

    def prefilled(self) -> tuple[int, float]:
        """The prompt's tokens decoded (the KV prefix reused left out) and the seconds its prefill took."""
        seconds = self.cached[1] + (self.seq.prefill_s if self.seq is not None else time.perf_counter() - self.t0)
        return len(self.tokens) - self.keep + self.cached[0], seconds

    def _check_kv(self) -> None:
        """The token list must describe the KV exactly; if not (a bug), start clean rather than lie."""
        e, slot = self.engine, self.slot
        n = e.kv_len(slot.seq)
        if n != len(slot.kv_tokens):
            e.notice(f"KV of sequence {slot.seq} holds {n} tokens but {len(slot.kv_tokens)} were tracked; clearing it")
            e.clear_kv(slot.seq)
            slot.kv_tokens, slot.messages = [], []
