"""The Python API: load a model once, then generate, stream and chat in-process.

    import bmoe

    with bmoe.load("model.gguf", cache_mb=2000) as m:         # no path: the demo model
        print(m.generate("Why is the sky blue?", max_tokens=64))
        for chunk in m.stream("Once upon a time", max_tokens=32):
            print(chunk.text, end="", flush=True)              # chunk.token: the token's telemetry
        print(m.chat([{"role": "user", "content": "Hi"}]))
        print(m.stats)

Settings are the keywords of bmoe.settings' dataclasses, so the API, `bmoe-cli`'s flags and
`bmoe-server` reach the same run: a top-level field (`n_ctx=4096`, `threads=4`), a whole group
(`cache=CacheSettings(mb=500)` or `cache={"mb": 500}`) or one field of a group as
`GROUP_FIELD` (`cache_mb=500`, `streaming_io_threads=4`, `speculation_prefetch=1`,
`sampler_temp=0.7`); `setting_names()` lists them.

`Model.run` is the one generation path: the session (bmoe.session) and the server (bmoe.server)
drive it too. It tracks exactly which tokens the KV holds. A chat whose messages extend the
previous call's conversation (that conversation and its answer, then more) prefills only what
the KV does not hold yet, as the session does with `clear_kv:false`; anything else starts from
an empty KV, so `generate` gives what `bmoe-cli` gives for the same prompt and settings.

Importing this module loads no llama.cpp; `load` does.
"""

from __future__ import annotations

import argparse
import queue
import threading
import time
import weakref
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from bmoe import console, flags, telemetry
from bmoe.settings import ConfigError, SamplerSettings, Settings
from bmoe.units import MiB

if TYPE_CHECKING:
    from bmoe.chat import Renderer
    from bmoe.coordinator import Engine
    from bmoe.readahead import Speculation

__all__ = ["Chunk", "Completion", "ConfigError", "GenerationStats", "Model", "ModelStats", "Request", "load",
           "setting_names", "settings_for"]

Message = dict[str, str]
FIX = "shorten the prompt, lower max_tokens, or load the model with a larger n_ctx"
RELOAD_FIX = "load it again with bmoe.load"

# ---- settings from keywords ------------------------------------------------------------------------


def _groups() -> dict[str, type]:
    """Settings' group fields (cache, streaming, ...) and their dataclasses."""
    return {f.name: type(f.default_factory()) for f in fields(Settings) if f.default_factory is not MISSING}


def _top_level() -> list[str]:
    return [f.name for f in fields(Settings) if f.name != "model" and f.name not in _groups()]


def setting_names() -> list[str]:
    """Every keyword `load` takes for a setting: top-level fields, groups, and GROUP_FIELD leaves."""
    groups = _groups()
    leaves = [f"{g}_{f.name}" for g, cls in groups.items() for f in fields(cls)]
    return _top_level() + list(groups) + leaves


def settings_for(path: str, **kw: Any) -> Settings:
    """Settings for the model at `path` from keywords named after the Settings dataclasses.

    A group may be given whole (a dataclass or a dict of its fields) and single fields of it as
    GROUP_FIELD; a single field wins over the same field in a whole group.
    """
    groups = _groups()
    given: dict[str, dict[str, Any]] = {g: {} for g in groups}
    leaves: dict[str, dict[str, Any]] = {g: {} for g in groups}
    top: dict[str, Any] = {}
    for key, value in kw.items():
        group, _, leaf = key.partition("_")
        if key in groups:
            cls = groups[key]
            if isinstance(value, cls):
                value = {f.name: getattr(value, f.name) for f in fields(cls)}
            elif not isinstance(value, Mapping):
                raise TypeError(f"{key}= takes a {cls.__name__} or a dict of its fields, not {type(value).__name__}")
            given[key] = dict(value)
        elif key in _top_level():
            top[key] = value
        elif group in groups and leaf in {f.name for f in fields(groups[group])}:
            leaves[group][leaf] = value
        else:
            raise TypeError(f"unknown setting {key!r}; the settings are: {', '.join(setting_names())}")
    base = Settings(model=str(path))
    try:
        return replace(base, **top, **{g: replace(getattr(base, g), **{**given[g], **leaves[g]}) for g in groups})
    except TypeError as e:
        raise TypeError(f"{e}; the settings are: {', '.join(setting_names())}") from None


def load(path: str | Path | None = None, *, notice: Callable[[str], None] = console.notice, **settings: Any) -> Model:
    """Load a MoE GGUF (no path: the demo model, built on first use, as `bmoe-cli` runs it).

    `settings` are keywords of the Settings dataclasses (see the module notes); `notice` gets
    what the user should know (budget decisions, a dense model run plain). Close the Model, or
    use it as a context manager, to stop the I/O lanes and free the shared memory.
    """
    from bmoe.coordinator import Engine

    s = settings_for("" if path is None else str(path), **settings)
    s = flags.resolve_model(argparse.Namespace(model=None if path is None else str(path)), s)
    return Model(Engine(s, notice=notice))


# ---- what a generation gives back ------------------------------------------------------------------


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
class ModelStats:
    """The loaded model and what it has done since the load."""

    model: str
    arch: str
    n_ctx: int
    load_s: float
    streaming: bool
    cache_budget_mib: float  # 0 when not streaming
    cache_resident_mib: float
    kv_tokens: int
    generations: int
    generated_tokens: int
    read_mib: float
    last: GenerationStats | None


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


def _messages(messages: Sequence[Mapping[str, Any]]) -> tuple[Message, ...]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(f"messages[{i}] needs a 'role' and a 'content', both strings")
        out.append({"role": m["role"], "content": m["content"]})
    if not out:
        raise ConfigError("messages is empty; give at least one message")
    return tuple(out)


# ---- the model -------------------------------------------------------------------------------------


class Model:
    """A loaded model: one generation at a time (calls from several threads take turns)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = Path(engine.settings.model).stem
        self.messages: list[Message] = []  # the conversation the KV holds, its last answer included
        self.kv_tokens: list[int] = []  # exactly the tokens in the KV, in order
        self.notice = engine.notice
        self._renderer: Renderer | None = None
        self._turn = threading.Lock()  # one generation at a time
        self._lock = threading.Lock()  # guards _running and the engine's cancel flag
        self._running: Request | None = None
        self._generations = self._tokens = self._read_bytes = 0
        self._last: GenerationStats | None = None
        self._finalizer = weakref.finalize(self, engine.close)

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the I/O lanes and free the shared memory and llama.cpp's objects; idempotent."""
        self._finalizer()

    # -- the simple calls --

    def generate(self, prompt: str, **options: Any) -> str:
        """The answer to a plain prompt (no chat template); options as `prepare`."""
        return self.run(self._checked(prompt=prompt, **options)).text

    def stream(self, prompt: str, **options: Any) -> Iterator[Chunk]:
        """Chunks of the answer to a plain prompt as they are generated (see Chunk)."""
        return self._stream(self._checked(prompt=prompt, **options))

    def chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        """The assistant's answer to a conversation ([{"role", "content"}, ...]) rendered with the
        model's own chat template; reuses the KV of a conversation it extends."""
        return self.run(self._checked(messages=messages, **options)).text

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> Iterator[Chunk]:
        """`chat`, as chunks while they are generated."""
        return self._stream(self._checked(messages=messages, **options))

    def _checked(self, **kw: Any) -> Request:
        self.engine.check_model_unchanged(RELOAD_FIX)
        return self.prepare(**kw)

    def _stream(self, req: Request) -> Iterator[Chunk]:
        """Run `req` on a thread of its own and hand its chunks over; leaving early cancels it."""
        items: queue.SimpleQueue[Chunk | BaseException | None] = queue.SimpleQueue()

        def work() -> None:
            try:
                self.run(req, items.put)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                items.put(e)
            finally:
                items.put(None)

        worker = threading.Thread(target=work, name="bmoe-generate", daemon=True)
        worker.start()
        try:
            while (item := items.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel(req)
            worker.join()

    # -- the one generation path --

    def sampler(self, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                seed: int | None = None) -> SamplerSettings:
        """The load's sampler with these overrides (None keeps the load's value); temperature 0 is greedy."""
        base = self.engine.settings.sampler
        s = replace(base, temp=base.temp if temperature is None else float(temperature),
                    top_p=base.top_p if top_p is None else float(top_p),
                    top_k=base.top_k if top_k is None else int(top_k),
                    seed=base.seed if seed is None else int(seed))
        if not s.temp >= 0:
            raise ConfigError(f"temperature {s.temp:g}: it is 0 (greedy) or more")
        if not 0 < s.top_p <= 1:
            raise ConfigError(f"top_p {s.top_p:g}: it is above 0 and at most 1")
        if s.top_k < 0:
            raise ConfigError(f"top_k {s.top_k}: it is 0 (off) or more")
        return s

    def prepare(self, prompt: str | None = None, messages: Sequence[Mapping[str, Any]] | None = None, *,
                max_tokens: int = flags.N_PREDICT, temperature: float | None = None, top_p: float | None = None,
                top_k: int | None = None, seed: int | None = None, stop: str | Sequence[str] | None = None,
                think: bool = True, fix: str = FIX) -> Request:
        """A prompt or a conversation as a Request; ConfigError when it cannot run.

        Sampling options left None keep the load's (greedy by default). `stop` strings end the
        answer where one first appears (it is not part of the text). `think` False renders the
        conversation with `enable_thinking=False` for templates that read it. `fix` ends the
        message of a prompt too long for the context.
        """
        if (prompt is None) == (messages is None):
            raise TypeError("give a prompt or messages, not both or neither")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(f"max_tokens {max_tokens!r}: it is a whole number of tokens, 1 or more")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if not all(isinstance(s, str) for s in stops):
            raise ConfigError("stop is a string or a list of strings")
        sampler = self.sampler(temperature, top_p, top_k, seed)
        e = self.engine
        if messages is not None:
            msgs = _messages(messages)
            tokens = e.tokenize(self.renderer.render(list(msgs), think))
        else:
            if not isinstance(prompt, str):
                raise ConfigError(f"the prompt is a string, not {type(prompt).__name__}")
            msgs = None
            tokens = e.tokenize(prompt)
        e.check_fits(len(tokens), max_tokens, fix)
        return Request(tuple(tokens), max_tokens, sampler, stops, msgs)

    @property
    def renderer(self) -> Renderer:
        if self._renderer is None:
            from bmoe.chat import Renderer

            self._renderer = Renderer(self.engine.vocab, self.engine.chat_template())
        return self._renderer

    def cancel(self, req: Request | None = None) -> None:
        """Stop the generation in flight (only if it is `req`, when given); safe from any thread.

        It ends with finish_reason "cancelled" and the KV rolled back to what it held before.
        """
        with self._lock:
            if self._running is not None and (req is None or req is self._running):
                self.engine.cancel()

    def extends(self, messages: Sequence[Message]) -> bool:
        """Whether `messages` continue the conversation the KV holds (that conversation, then more)."""
        n = len(self.messages)
        return 0 < n < len(messages) and list(messages[:n]) == self.messages

    def run(self, req: Request, on_chunk: Callable[[Chunk], None] | None = None) -> Completion:
        """Generate for `req`, handing each Chunk to `on_chunk` as it comes (on this thread).

        A chat that extends the KV's conversation prefills only the tokens past the prefix the
        KV already holds. Afterwards the KV holds the prompt and the answer; a cancelled
        generation is rolled back to the reused prefix, one cut by a stop string to its prompt.
        """
        from bmoe.chat import common_prefix
        from bmoe.coordinator import Cancelled

        with self._turn:
            e = self.engine
            tokens = list(req.tokens)
            reuse = req.messages is not None and self.extends(req.messages)
            keep = e.kv_keep(min(common_prefix(self.kv_tokens, tokens), len(tokens) - 1) if reuse else 0)
            self.kv_tokens = self.kv_tokens[:keep]
            before = self.messages if reuse else []
            self.messages = before
            tally = telemetry.Tally(req.max_tokens, e.streaming and e.settings.streaming.overlap, e.cache_active)
            text = StopText(req.stop)
            t0 = time.perf_counter()
            prefill_s: float | None = None

            def on_piece(_i: int, piece: str, stat: telemetry.TokenStat) -> None:
                nonlocal prefill_s
                if prefill_s is None:
                    prefill_s = max(0.0, time.perf_counter() - t0 - stat.wall_ns / 1e9)
                line = tally.add(stat)
                new = text.push(piece)
                if on_chunk:
                    on_chunk(Chunk(new, line))
                if text.cut is not None:
                    raise _Stopped()

            with self._lock:
                self._running = req
            try:
                res = e.generate(tokens[keep:], req.max_tokens, on_piece, sampler=req.sampler)
            except Cancelled:
                finish, kv, res = "cancelled", tokens[:e.kv_keep(keep)], None
            except _Stopped:
                finish, kv, res = "stop", tokens[:e.kv_keep(len(tokens))], None
            except Exception:
                self.kv_tokens = tokens[:e.kv_keep(keep)]
                self._check_kv()
                raise
            else:
                tail = text.push(res.text[len(text.raw):]) + text.flush()
                if tail and on_chunk:
                    on_chunk(Chunk(tail))
                finish = "stop" if text.cut is not None or len(res.ids) < req.max_tokens else "length"
                prefill_s = res.prefill_s
                kv = tokens + res.ids
            finally:
                with self._lock:
                    self._running = None
                    e.reset_cancel()
            self.kv_tokens = kv
            if finish != "cancelled" and req.messages is not None:
                self.messages = [*req.messages, {"role": "assistant", "content": text.text}]
            self._check_kv()
            if prefill_s is None:  # cancelled before the first token
                prefill_s = time.perf_counter() - t0
            stats = self._stats(tally, finish, len(tokens), len(tokens) - keep, prefill_s,
                                res.speculation if res is not None else None)
            if on_chunk:
                on_chunk(Chunk("", finish_reason=finish, stats=stats))
            return Completion(text.text, stats)

    def _check_kv(self) -> None:
        """The token list must describe the KV exactly; if not (a bug), start clean rather than lie."""
        n = self.engine.kv_len()
        if n != len(self.kv_tokens):
            self.notice(f"KV holds {n} tokens but {len(self.kv_tokens)} were tracked; clearing it")
            self.engine.clear_kv()
            self.kv_tokens, self.messages = [], []

    def _stats(self, tally: telemetry.Tally, finish: str, n_prompt: int, n_prefill: int,
               prefill_s: float, ahead: Speculation | None) -> GenerationStats:
        t = tally.totals()
        self._generations += 1
        self._tokens += t.tokens
        self._read_bytes += t.read_bytes
        self._last = GenerationStats(
            finish_reason=finish, prompt_tokens=n_prompt, prefill_tokens=n_prefill, completion_tokens=t.tokens,
            kv_tokens=len(self.kv_tokens), prefill_s=prefill_s,
            tok_s=t.tokens / t.wall_s if t.wall_s > 0 else 0.0, read_mib=t.read_bytes / MiB,
            mib_per_token=t.per_tok(t.read_bytes / MiB), cache_hit_pct=tally.hit_pct,
            stall_s_per_token=t.per_tok(t.stall_s), mgmt_s_per_token=t.per_tok(t.mgmt_s),
            io_s_per_token=t.per_tok(t.io_s), speculative_mib=ahead.bytes / MiB if ahead else 0.0,
            prefetched_experts=ahead.prefetched if ahead else 0, useful_experts=ahead.useful if ahead else 0)
        return self._last

    @property
    def stats(self) -> ModelStats:
        e = self.engine
        return ModelStats(
            model=self.name, arch=e.arch, n_ctx=e.n_ctx, load_s=e.load_s, streaming=e.streaming,
            cache_budget_mib=e.budget / MiB if e.streaming else 0.0, cache_resident_mib=e.resident_bytes() / MiB,
            kv_tokens=len(self.kv_tokens), generations=self._generations, generated_tokens=self._tokens,
            read_mib=self._read_bytes / MiB, last=self._last)
