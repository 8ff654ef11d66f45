"""One request from prefill to its last chunk (Generation), and what it gives back.

A Generation runs on a Slot: one llama.cpp KV sequence and exactly the tokens (and, for a chat,
the conversation) it holds. `Model.run` drives one Generation alone; a scheduler of several
(bmoe.scheduler) steps many together in one batch (Engine.step). Either way the same code
decides the prefix to reuse, the chunks, the stop strings, the finish reason and the KV after.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from bmoe import telemetry
from bmoe.settings import SamplerSettings

if TYPE_CHECKING:
    from bmoe.coordinator import Engine
    from bmoe.coordinator import Sequence as EngineSequence
    from bmoe.readahead import Speculation

Message = dict[str, str]


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


@dataclass(frozen=True)
class Completion:
    text: str
    stats: GenerationStats

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
    messages: tuple[Message, ...] | None = None  # a chat's conversation; None: a plain prompt


class _Stopped(Exception):
    """A stop string appeared: the generation ends here."""


class StopText:
    """The answer's text with the first stop string and what follows cut off.

    Text that could be the start of a stop string is held back until the next piece decides.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.raw = ""  # every piece so far
        self.sent = 0  # characters of `raw` handed out
        self.cut: int | None = None  # where the first stop string begins, once one appeared

    @property
    def text(self) -> str:
        return self.raw if self.cut is None else self.raw[:self.cut]

    def push(self, piece: str) -> str:
        """Add a piece; returns the text that can be handed out now."""
        if self.cut is not None:
            return ""
        self.raw += piece
        # a stop string cannot begin in text handed out: its start would have been held back
        hits = [i for s in self.stops if (i := self.raw.find(s, self.sent)) >= 0]
        if hits:
            self.cut = min(hits)
            end = self.cut
        else:
            hold = max((k for s in self.stops for k in range(1, len(s)) if self.raw.endswith(s[:k])), default=0)
            end = max(self.sent, len(self.raw) - hold)
        out, self.sent = self.raw[self.sent:end], end
        return out

    def flush(self) -> str:
        """The generation ended: what was held back is the answer's after all."""
        if self.cut is not None:
            return ""
        out, self.sent = self.raw[self.sent:], len(self.raw)
        return out


def cancelled() -> Exception:
    """The engine's Cancelled, imported when needed: importing bmoe.api loads no llama.cpp."""
    from bmoe.coordinator import Cancelled

    return Cancelled()


@dataclass
class Slot:
    """One KV sequence and exactly what it holds: its tokens in order and, for a chat, the
    conversation they render (its last answer included)."""

    seq: int
    kv_tokens: list[int] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    busy: bool = False
    used: float = 0.0  # when a generation last ended here (the least recent is reused first)

    def extends(self, messages: Sequence[Message]) -> bool:
        """Whether `messages` continue this slot's conversation (that conversation, then more)."""
        n = len(self.messages)
        return 0 < n < len(messages) and list(messages[:n]) == self.messages


class Generation:
    """`req` on `slot`: `begin` prefills, Engine.step decodes `seq`, `finish` ends it.

    A chat that extends the slot's conversation prefills only the tokens past the prefix the KV
    already holds. Afterwards the KV holds the prompt and the answer; a cancelled generation is
    rolled back to the reused prefix, one cut by a stop string to its prompt. `on_end` hears the
    stats of every generation that finishes.
    """

    def __init__(self, engine: Engine, slot: Slot, req: Request, on_chunk: Callable[[Chunk], None] | None,
                 on_end: Callable[[telemetry.Tally, str, int, int, int, float, Speculation | None], GenerationStats]) -> None:
        self.engine, self.slot, self.req = engine, slot, req
        self.on_chunk = on_chunk
        self.on_end = on_end
        self.seq: EngineSequence | None = None
        self.cancelled = False
        self.tokens = list(req.tokens)
        self.keep = 0
        self.text = StopText(req.stop)
        self.tally = telemetry.Tally(req.max_tokens, engine.streaming and engine.settings.streaming.overlap,
                                     engine.cache_active)
        self.t0 = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.seq is not None and self.seq.done

    def cancel(self) -> None:
        """End it after the token being decoded (with finish_reason "cancelled")."""
        self.cancelled = True

    def begin(self) -> None:
        """Keep the prefix of the KV this request can reuse and prefill the rest."""
        from bmoe.chat import common_prefix

        e, slot, req = self.engine, self.slot, self.req
        slot.busy = True
        reuse = req.messages is not None and slot.extends(req.messages)
        self.keep = e.kv_keep(min(common_prefix(slot.kv_tokens, self.tokens), len(self.tokens) - 1)
                              if reuse else 0, slot.seq)
        slot.kv_tokens = slot.kv_tokens[:self.keep]
        if not reuse:
            slot.messages = []
        if self.cancelled:
            raise cancelled()
        self.seq = e.begin(slot.seq, self.tokens[self.keep:], req.max_tokens, self._on_piece, sampler=req.sampler)

    def _on_piece(self, _i: int, piece: str, stat: telemetry.TokenStat) -> None:
        line = self.tally.add(stat)
        new = self.text.push(piece)
        if self.on_chunk:
            self.on_chunk(Chunk(new, line))
        if self.text.cut is not None:
            raise _Stopped()
        if self.cancelled:
            raise cancelled()

    def run(self) -> Completion:
        """Drive it alone to its end (Model.run)."""
        try:
            self.begin()
            while not self.seq.done:
                self.engine.step([self.seq])
        except Exception as e:  # noqa: BLE001 - finish decides what each ending means
            return self.finish(e)
        return self.finish()

    def finish(self, error: BaseException | None = None) -> Completion:
        """End it: the KV, the slot's conversation, the stats and the last chunk. An error other
        than a cancel or a stop string is raised again after the KV is rolled back."""
        from bmoe.coordinator import Cancelled

        e, slot, tokens, text = self.engine, self.slot, self.tokens, self.text
        seq = self.seq
        if seq is not None:
            e.end(seq)
            error = error or seq.error
        res = seq.result if seq is not None else None
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
            tail = text.push(res.text[len(text.raw):]) + text.flush()
            if tail and self.on_chunk:
                self.on_chunk(Chunk(tail))
            finish = "stop" if text.cut is not None or len(res.ids) < self.req.max_tokens else "length"
            kv = tokens + res.ids
        slot.kv_tokens = kv
        if finish != "cancelled" and self.req.messages is not None:
            slot.messages = [*self.req.messages, {"role": "assistant", "content": text.text}]
        self._check_kv()
        prefill_s = res.prefill_s if res is not None else time.perf_counter() - self.t0  # cancelled mid-prefill
        stats = self.on_end(self.tally, finish, len(tokens), len(tokens) - self.keep, len(slot.kv_tokens), prefill_s,
                            res.speculation if res is not None else None)
        if self.on_chunk:
            self.on_chunk(Chunk("", finish_reason=finish, stats=stats))
        return Completion(text.text, stats)

    def _check_kv(self) -> None:
        """The token list must describe the KV exactly; if not (a bug), start clean rather than lie."""
        e, slot = self.engine, self.slot
        n = e.kv_len(slot.seq)
        if n != len(slot.kv_tokens):
            e.notice(f"KV of sequence {slot.seq} holds {n} tokens but {len(slot.kv_tokens)} were tracked; clearing it")
            e.clear_kv(slot.seq)
            slot.kv_tokens, slot.messages = [], []
