"""The Python API: load a model once, then generate, stream and chat in-process.

    import bmoe

    with bmoe.load("model.gguf", cache_mb=2000) as m:         # no path: the demo model
        print(m.generate("Why is the sky blue?", max_tokens=64))
        for chunk in m.stream("Once upon a time", max_tokens=32):
            print(chunk.text, end="", flush=True)              # chunk.token: the token's telemetry
        print(m.chat([{"role": "user", "content": "Hi"}]))
        print(m.stats)

    with bmoe.load("model.gguf", parallel=4) as m:             # four KV sequences
        done = m.batch([m.prepare(Ask(p, max_tokens=64)) for p in prompts])   # decoded together

Settings are keywords named after their `bmoe-cli` flags (`--cache-mb` is `cache_mb=500`,
`--io-threads` is `io_threads=4`, `--no-stream` is `stream=False`, `-c` is `n_ctx=4096`), declared
once in bmoe.base.settings, so the API, `bmoe-cli` and `bmoe-server` reach the same run; a value may
also be given as its flag's text (`cache_mb="auto"`). `setting_names()` lists them. Errors name
the keywords; notices go to the `bmoe` logger.

Every generation is a bmoe.generation.request_life.Generation: `Model.run` drives one on the first KV sequence
(the CLI and the session use it), `Model.batch` several in one llama.cpp batch per step (load with
`parallel=N`), bmoe.server.scheduler the server's. Each tracks exactly which tokens its KV sequence
holds. A chat whose messages extend the sequence's conversation (that conversation and its
answer, then more) prefills only what the KV does not hold yet, as the session does with
`clear_kv:false`; anything else starts from an empty KV, so `generate` gives what `bmoe-cli` gives
for the same prompt and settings.

Importing this module loads no llama.cpp; `load` does.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bmoe.api import source as model_source
from bmoe.api.ask import Ask
from bmoe.base import telemetry
from bmoe.base.errors import ConfigError, ContextTooLong, FieldError, ModelClosed
from bmoe.base.settings import (
    FLAGS,
    KEYWORDS,
    SAMPLING_FIELDS,
    Naming,
    SamplerSettings,
    Settings,
    check_sampling,
    from_keywords,
    logit_bias_of,
)
from bmoe.base.settings import names as setting_names
from bmoe.base.units import MiB
from bmoe.chat.grammar_check import GrammarCheck
from bmoe.chat.limits import check_stop_strings
from bmoe.generation import embedding
from bmoe.generation.driver import CLOSED, Driver
from bmoe.generation.logprobs import TOP_LOGPROBS_MAX, Alternative, ContentTokens, TokenLogprob, content_logprobs
from bmoe.generation.records import Chunk, Completion, GenerationStats, PrefillProgress, Request, Turn
from bmoe.generation.request_life import Generation, Slot

if TYPE_CHECKING:
    import numpy as np

    from bmoe.chat.output import Reply
    from bmoe.chat.request import ChatFormat
    from bmoe.chat.template import Renderer
    from bmoe.coordinator import Engine, EngineStats
    from bmoe.engine.engine_stats import EmbeddingFacts
    from bmoe.generation.prompt_cache import PromptKV
    from bmoe.streaming.readahead import ReadAheadCounts

__all__ = ["TOP_LOGPROBS_MAX", "Alternative", "Ask", "Chunk", "Completion", "ConfigError", "ContentTokens",
           "ContextTooLong", "GenerationStats", "Model", "ModelClosed", "ModelStats", "PrefillProgress", "Request",
           "TokenLogprob", "content_logprobs", "load", "open_model", "setting_names"]

log = logging.getLogger("bmoe")

RELOAD_FIX = "load it again with bmoe.load"

def load(path: str | Path | None = None, *, notice: Callable[[str], None] = log.warning, **settings: Any) -> Model:
    """Load a MoE GGUF (no path: the demo model, built on first use, as `bmoe-cli` runs it).

    `settings` are keywords of the Settings dataclasses (see the module notes); `notice` gets
    what the user should know (budget decisions, a dense model run plain, the demo's build); by
    default the `bmoe` logger, which Python shows on stderr unless logging is configured. Close
    the Model, or use it as a context manager, to stop the I/O lanes and free the shared memory.
    """
    return open_model(from_keywords("" if path is None else str(path), **settings), notice, KEYWORDS)


def open_model(settings: Settings, notice: Callable[[str], None], words: Naming = FLAGS) -> Model:
    """The one door to a loaded model, for `load` and for every edge (bmoe-cli, the session,
    bmoe-server, bmoe-bench) that has checked Settings of its own: the model file resolved (a path,
    `-hf`, or the demo model, built on first use), the engine loaded, the Model around it.
    `words` names settings in errors the edge's way (flags or keywords)."""
    from bmoe.coordinator import Engine
    from bmoe.engine.load import load_engine

    return Model(Engine(load_engine(model_source.resolve(settings, notice), notice, words)))


EXIT_WAIT_S = 10.0  # how long the interpreter's exit waits for a running generation to stop (Model.close)


def _close(driver: Driver, grammars: GrammarCheck, timeout: float | None) -> bool:
    """Model.close's work, also its finalizer's: the Model itself is not reached (it may be gone)."""
    try:
        return driver.close(timeout)
    finally:
        grammars.close()


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
    engine: EngineStats  # the load and the cache now: the figures bmoe-cli, the session and the server print


# ---- the model -------------------------------------------------------------------------------------


class Model:
    """A loaded model. `run` serves one generation at a time on the first KV sequence (calls from
    several threads take turns); `batch` decodes several prompts together, one KV sequence each
    (load with `parallel=N`), and bmoe.server.scheduler does so for a server's concurrent requests. Every
    one goes through the one loop, bmoe.generation.driver.Driver (`driver`)."""

    def __init__(self, engine: Engine) -> None:
        self.name = Path(engine.settings.model).stem
        self.notice = engine.notice
        self._generations = self._tokens = self._read_bytes = 0
        self._last: GenerationStats | None = None
        self._asleep: ModelStats | None = None  # `sleep`: the stats as they were, the engine closed
        self._attach(engine)

    def _attach(self, engine: Engine) -> None:
        """`engine` as this model's, with everything made from it: the driver, empty KV sequences, the
        prompt cache, the grammar checker (its process starts with the first grammar); the load and `wake`."""
        self.engine = engine
        self.driver = Driver(engine)
        self.slots = [Slot(i) for i in range(engine.settings.parallel)]
        self._renderer: Renderer | None = None
        self._chat_format: ChatFormat | None = None
        self.prompt_cache: PromptKV | None = None  # --prompt-cache (bmoe.generation.prompt_cache)
        if engine.settings.prompt_cache:
            from bmoe.generation.prompt_cache import PromptKV

            self.prompt_cache = PromptKV(engine, engine.settings.prompt_cache, engine.settings.prompt_cache_mb)
        self.grammars = GrammarCheck(str(engine.settings.model))
        # also at the interpreter's exit, while a daemon thread may be decoding: stopped, waited for (bounded)
        self._finalizer = weakref.finalize(self, _close, self.driver, self.grammars, EXIT_WAIT_S)

    @property
    def messages(self) -> list[Turn]:
        """The conversation the first KV sequence holds (the one `run` uses), its last answer included."""
        return self.slots[0].messages

    @property
    def kv_tokens(self) -> list[int]:
        """Exactly the tokens in the first KV sequence, in order."""
        return self.slots[0].kv_tokens

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float | None = None) -> bool:
        """Stop the running generations and wait for them, then stop the I/O lanes and free the shared
        memory and llama.cpp's objects; idempotent (a second call has nothing left to do and returns
        True). A generation the close cut short raises ModelClosed in its caller (a `stream`
        consumer's next chunk), as does any call after it.

        `timeout` bounds the wait (None: as long as it takes; the interpreter's exit waits
        EXIT_WAIT_S). A generation still stuck past it (a read that never comes) keeps llama.cpp's
        objects until the process exits, so it cannot crash; the lanes and the shared memory are
        released all the same, and False is returned."""
        if self._finalizer.detach() is None:
            return True
        return _close(self.driver, self.grammars, timeout)

    @property
    def asleep(self) -> bool:
        """Between `sleep` and `wake`: nothing of the load is held."""
        return self._asleep is not None

    def sleep(self) -> None:
        """Hand the load's memory back while nobody needs it (bmoe-server --sleep-idle-seconds): the engine
        is closed as `close` closes it (llama.cpp's objects and the KV, the I/O lanes and workers, the shared
        memory, the usage profile saved), its KV sequences emptied; `stats` answers from what it was. Only
        with nothing running; `wake` loads it again."""
        if self.asleep:
            return
        kept = self.stats
        self.close()
        self.slots = [Slot(i) for i in range(len(self.slots))]
        self._asleep = replace(kept, cache_resident_mib=0.0, kv_tokens=0, engine=replace(
            kept.engine, resident_bytes=0, lanes=(), workers=(), residency=()))

    def wake(self) -> None:
        """After `sleep`: the model loaded again with the same (resolved) settings, as a restart would load it:
        the usage profile read back, the KV sequences empty; what it has done so far (`stats`) carries on.
        A load that fails raises and leaves it asleep."""
        if not self.asleep:
            return
        from bmoe.coordinator import Engine
        from bmoe.engine.load import load_engine

        old = self.engine
        self._attach(Engine(load_engine(old.settings, old.notice, old.words)))
        self._asleep = None

    def release_now(self) -> None:
        """For a process ending at once (a second signal, a shutdown past its bound): stop the workers
        and unlink the shared memory without waiting for anything; llama.cpp's objects, and the
        mappings a decode still running may read, go with the process. Safe from a signal handler."""
        self.engine.close(in_use=True)

    # -- the simple calls --

    def generate(self, prompt: str, **options: Any) -> str:
        """The answer to a plain prompt (no chat template); options are Ask's."""
        return self.run(self._checked(prompt=prompt, **options)).text

    def stream(self, prompt: str, **options: Any) -> Iterator[Chunk]:
        """Chunks of the answer to a plain prompt as they are generated (see Chunk)."""
        return self._stream(self._checked(prompt=prompt, **options))

    def chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        """The assistant's answer to a conversation ([{"role", "content"}, ...]) rendered with the
        model's own chat template; reuses the KV of a conversation it extends. With
        `response_format` it is the JSON document; a thinking model's reasoning is left out (see
        `chat_message`)."""
        req = self._checked(messages=messages, **options)
        done = self.run(req)
        return done.text if req.reading is None else req.reading.read(done.text).content

    def chat_message(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> Reply:
        """`chat`'s answer as a message: content, reasoning and tool calls (pass `tools`, as OpenAI's)."""
        from bmoe.chat.output import Reply

        req = self._checked(messages=messages, **options)
        text = self.run(req).text
        return req.reading.read(text) if req.reading else Reply(text, "", ())

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> Iterator[Chunk]:
        """`chat`, as chunks while they are generated."""
        return self._stream(self._checked(messages=messages, **options))

    def _checked(self, **kw: Any) -> Request:
        self.check_unchanged(RELOAD_FIX)
        return self.prepare(Ask(**kw))

    def _stream(self, req: Request) -> Iterator[Chunk]:
        """Run `req` on a thread of its own and hand its chunks over; leaving early cancels it."""
        items: queue.SimpleQueue[Chunk | BaseException | None] = queue.SimpleQueue()
        gen = self.generation(req, items.put)

        def work() -> None:
            try:
                self.run(gen)
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
            self.driver.cancel(gen)
            worker.join()

    # -- the one generation path --

    def sampler(self, **fields: Any) -> SamplerSettings:
        """The load's sampler with a request's overrides, by their request names (SAMPLING_FIELDS:
        temperature, top_p, ..., logit_bias; None keeps the load's value); temperature 0 is greedy.
        ConfigError names a value out of its bound, or a biased token the vocab does not have."""
        base = self.engine.settings.sampler
        kinds = {f.name: type(getattr(base, f.name)) for f in dataclass_fields(base)}
        changes: dict[str, Any] = {}
        for name, v in fields.items():
            if name not in SAMPLING_FIELDS:
                raise TypeError(f"unknown sampling option {name!r} (the options are: {', '.join(SAMPLING_FIELDS)})")
            if v is not None:
                setting = SAMPLING_FIELDS[name]
                changes[setting] = logit_bias_of(v) if name == "logit_bias" else kinds[setting](v)
        s = replace(base, **changes)
        for name, setting in SAMPLING_FIELDS.items():
            check_sampling(name, getattr(s, setting))
        n_vocab = self.engine.vocab.n_tokens
        for tok, _ in s.logit_bias:
            if not 0 <= tok < n_vocab:
                raise FieldError(f"logit_bias: token {tok} is not in the model's vocabulary (0 to {n_vocab - 1})",
                                 "logit_bias")
        return s

    def prepare(self, ask: Ask, verify: bool = True) -> Request:
        """What `ask` asks as a Request ready to run; ConfigError when it cannot run, ModelClosed once closed.
        `verify` False leaves llama.cpp's parse of the request's grammar (a GrammarCheck's `check(req.grammar)`)
        to the caller: bmoe-server runs it on threads of its own (bmoe.server.grammar_pool)."""
        if self.driver.closed:
            raise ModelClosed(CLOSED)
        if (ask.prompt is None) == (ask.messages is None):
            raise TypeError("give a prompt or messages, not both or neither")
        max_tokens = ask.max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(f"max_tokens {max_tokens!r}: it is a whole number of tokens, 1 or more")
        stop_strings = check_stop_strings(ask.stop)
        sampler = self.sampler(**{name: getattr(ask, name) for name in SAMPLING_FIELDS})
        if ask.ignore_eos:
            sampler = replace(sampler, logit_bias=sampler.logit_bias + tuple((t, -math.inf) for t in self.eogs))
        logprobs = ask.logprobs
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= TOP_LOGPROBS_MAX):
            raise ConfigError(f"logprobs {logprobs!r}: it is how many alternatives to list per token, "
                              f"0 to {TOP_LOGPROBS_MAX}")
        e, f = self.engine, self.chat_format
        if ask.lossless:
            e.check_lossless("load it without one of them for lossless requests")
        forced = tuple(int(t) for t in ask.forced)
        if forced:
            max_tokens = len(forced)
        extra: dict[str, Any] = dict(lossless=bool(ask.lossless), forced=forced, logits=bool(ask.logits),
                                     logprobs=logprobs, progress=bool(ask.progress),
                                     post_sampling=bool(ask.post_sampling) and logprobs is not None,
                                     slot=ask.slot)
        if ask.slot is not None and not 0 <= ask.slot < len(self.slots):
            raise ConfigError(f"slot {ask.slot}: an index of the model's KV sequences, 0 to {len(self.slots) - 1}")
        if ask.messages is not None:
            parts = f.parts(ask.messages, ask.think, response_format=ask.response_format, grammar=ask.grammar,
                            tools=ask.tools, tool_choice=ask.tool_choice, parallel_tool_calls=ask.parallel_tool_calls,
                            verify=verify, prompt=ask.add_generation_prompt, continued=ask.continue_final_message)
            tokens = e.tokenize(parts.text)
            max_tokens = self._fitted(len(tokens), max_tokens, ask)
            prefix = (f.stable_prefix(parts.messages, ask.think, parts.tools, tokens, e.tokenize)
                      if self.prompt_cache else 0)
            return Request(tuple(tokens), max_tokens, sampler, stop_strings, parts.messages, grammar=parts.grammar,
                           specials=parts.specials, reading=parts.reading, cache_prefix=prefix, **extra)
        if ask.tools is not None or ask.tool_choice is not None:
            raise ConfigError("tools: a plain prompt has no tools; send messages (a chat) to use them")
        tokens = e.tokenize(ask.prompt) if isinstance(ask.prompt, str) else self.token_ids(ask.prompt)
        g = f.check_grammar(ask.response_format, ask.grammar)
        if g is not None and verify:
            f.verify(g)
        max_tokens = self._fitted(len(tokens), max_tokens, ask)
        return Request(tuple(tokens), max_tokens, sampler, stop_strings, None, grammar=g, cache_prefix=len(tokens),
                       **extra)

    @functools.cached_property
    def eogs(self) -> tuple[int, ...]:
        """The vocabulary's end-of-generation tokens (read once: it walks the vocabulary)."""
        return self.engine.vocab.eog_tokens()

    def _fitted(self, n_tokens: int, max_tokens: int, ask: Ask) -> int:
        """`max_tokens` for a prompt of `n_tokens`, checked against the context (ContextTooLong); with
        `ask.clip`, cut to the room the prompt leaves (one token at least)."""
        if ask.clip and not ask.forced:
            max_tokens = max(1, min(max_tokens, self.engine.n_ctx - n_tokens))
        self.engine.check_fits(n_tokens, max_tokens, ask.fix)
        return max_tokens

    @property
    def renderer(self) -> Renderer:
        if self._renderer is None:
            from bmoe.chat.template import Renderer

            s = self.settings
            self._renderer = Renderer(self.engine.vocab, self.engine.chat_template(), s.jinja, s.reasoning)
        return self._renderer

    @property
    def chat_format(self) -> ChatFormat:
        """The chat template's syntax for tools and reasoning (bmoe.chat.request)."""
        if self._chat_format is None:
            from bmoe.chat.request import ChatFormat

            self._chat_format = ChatFormat(self.renderer, self.engine.vocab, self.grammars)
        return self._chat_format

    def generation(self, req: Request, on_chunk: Callable[[Chunk], None] | None = None,
                   slot: Slot | None = None) -> Generation:
        """`req` as a Generation on `slot` (default: the first KV sequence), for `run` or a driver of
        several (bmoe.server.scheduler); `cancel` reaches it from now until it finishes."""
        gen = Generation(self.engine, slot or self.slots[0], req, on_chunk, self._stats, self.prompt_cache)
        self.driver.track(gen)
        return gen

    def cancel(self, req: Request | None = None) -> None:
        """Stop the generations made and not finished (only `req`'s, when given); safe from any thread.

        Each ends with finish_reason "cancelled" and its KV rolled back to what it held before; a
        generation running alone stops mid-token, one in a batch after the step in flight.
        """
        for g in self.driver.live():
            if req is None or g.req is req:
                self.driver.cancel(g)

    def extends(self, messages: Sequence[Turn]) -> bool:
        """Whether `messages` continue the conversation the first KV sequence holds."""
        return self.slots[0].extends(messages)

    def slot_for(self, req: Request) -> Slot | None:
        """A free slot for `req`: its own (`Request.slot`), else the one whose conversation it extends, else the
        least recently used (keeping other conversations' KV for longer); None when none it may take is free."""
        if req.slot is not None:
            mine = self.slots[req.slot]
            return None if mine.busy else mine
        free = [s for s in self.slots if not s.busy]
        if req.messages is not None:
            for s in free:
                if s.extends(req.messages, req.lossless):
                    return s
        return min(free, key=lambda s: s.used, default=None)

    def run(self, req: Request | Generation, on_chunk: Callable[[Chunk], None] | None = None) -> Completion:
        """Generate for `req` on the first KV sequence (or run a Generation made by `generation`),
        handing each Chunk to `on_chunk` as it comes (on this thread). A chat that extends that
        sequence's conversation prefills only what the KV does not hold yet (see Generation)."""
        gen = req if isinstance(req, Generation) else self.generation(req, on_chunk)
        return self.driver.run([gen])[0]

    def batch(self, requests: Sequence[Request]) -> list[Completion]:
        """Decode `requests` together, one KV sequence each: prefill each in order, then one
        llama.cpp batch per step until every one ends. Load with `parallel` at least len(requests)."""
        if not 0 < len(requests) <= len(self.slots):
            raise ConfigError(f"a batch of {len(requests)} needs as many KV sequences (1 or more); "
                              f"this model was loaded with parallel={len(self.slots)}")
        return self.driver.run([self.generation(r, slot=s) for r, s in zip(requests, self.slots)])

    def embed(self, inputs: Sequence[str | Sequence[int]], normalize: int = 2, slot: Slot | None = None,
              cancelled: Callable[[], bool] = lambda: False) -> list[np.ndarray]:
        """Each input's embedding (load with `embedding=True`; text tokenized with its special tokens, token ids
        as they are), computed as llama-server --embedding does (bmoe.generation.embedding): pooled by the
        load's `pooling`, one float32 vector normalized by `normalize` (llama-server's embd_normalize: 2 is
        L2, -1 none); pooling none, one row per token. On `slot`'s KV sequence (default: the first), whose
        KV it leaves empty."""
        ids = [self.tokenize(x) if isinstance(x, str) else self.token_ids(x) for x in inputs]
        return embedding.embed(self.driver, self.engine, slot or self.slots[0], ids, normalize, cancelled)

    def _stats(self, tally: telemetry.Tally, finish: str, n_prompt: int, n_prefill: int, kv_tokens: int,
               prefill_s: float, ahead: ReadAheadCounts | None, lossy: bool) -> GenerationStats:
        t = tally.totals()
        verify_steps, per_pos = telemetry.verify_counts(tally.lines, self.engine.settings.draft.most)
        self._generations += 1
        self._tokens += t.tokens
        self._read_bytes += t.read_bytes
        self._last = GenerationStats(
            finish_reason=finish, prompt_tokens=n_prompt, prefill_tokens=n_prefill, completion_tokens=t.tokens,
            kv_tokens=kv_tokens, prefill_s=prefill_s,
            tok_s=t.tokens / t.wall_s if t.wall_s > 0 else 0.0, read_mib=t.read_bytes / MiB,
            mib_per_token=t.per_tok(t.read_bytes / MiB), cache_hit_pct=tally.hit_pct,
            stall_s_per_token=t.per_tok(t.stall_s), mgmt_s_per_token=t.per_tok(t.mgmt_s),
            io_s_per_token=t.per_tok(t.io_s), speculative_mib=ahead.bytes / MiB if ahead else 0.0,
            prefetched_experts=ahead.prefetched if ahead else 0, useful_experts=ahead.useful if ahead else 0,
            lossy=lossy, experts_per_token=self.engine.experts_per_token if lossy else self.engine.top_k,
            dropped_per_token=t.per_tok(t.dropped), substituted_per_token=t.per_tok(t.substituted),
            weight_changed_pct=t.per_tok(t.weight_changed_pct), page_cache_mib=t.page_cache_bytes / MiB,
            drafted=t.drafted, accepted=t.accepted, draft_extra_mib=t.draft_extra_bytes / MiB,
            verify_steps=verify_steps, accepted_per_pos=per_pos)
        return self._last

    @property
    def stats(self) -> ModelStats:
        if self._asleep is not None:
            return replace(self._asleep, generations=self._generations, generated_tokens=self._tokens,
                           read_mib=self._read_bytes / MiB, last=self._last)
        e = self.engine.stats()
        return ModelStats(
            model=self.name, arch=e.arch, n_ctx=e.n_ctx, load_s=e.load_s, streaming=e.streaming,
            cache_budget_mib=e.budget_bytes / MiB, cache_resident_mib=e.resident_bytes / MiB,
            kv_tokens=sum(len(s.kv_tokens) for s in self.slots), generations=self._generations,
            generated_tokens=self._tokens,
            read_mib=self._read_bytes / MiB, last=self._last, engine=e)

    # -- what an edge asks of the load, besides generations --

    def check_unchanged(self, fix: str) -> None:
        """ModelError when the model file changed since the load (what bmoe reads would be another's);
        ModelClosed once the model is closed."""
        if self.driver.closed:
            raise ModelClosed(CLOSED)
        self.engine.check_unchanged(fix)

    def check_lossless(self, fix: str) -> None:
        """ConfigError when this load cannot give a lossless generation (see Engine.check_lossless)."""
        self.engine.check_lossless(fix)

    def follow_memory(self) -> None:
        """Between generations: an adaptive cache budget follows the room (see Engine.follow_memory);
        nothing once closed. It holds the driver's turn, so a close waits for it."""
        with self.driver.turn:
            if not self.driver.closed:
                self.engine.follow_memory()

    def tokenize(self, text: str) -> list[int]:
        """Text as the model's tokens, with the special tokens (BOS) the vocab asks for."""
        return self.engine.tokenize(text)

    def token_ids(self, tokens: Any) -> list[int]:
        """`tokens` as the model's token ids, each checked against the vocabulary (ConfigError naming the first
        that is not one of its ids)."""
        if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
            raise ConfigError(f"the prompt is a string or a list of token ids, not {type(tokens).__name__}")
        n = self.n_vocab
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n:
                raise ConfigError(f"prompt[{i}]: {t!r} is not a token id of this model (0 to {n - 1})")
        return list(tokens)

    def vocab_tokens(self, text: str, add_special: bool) -> list[int]:
        """Text as token ids, the special tokens (BOS) added only when `add_special` (llama-server's /tokenize)."""
        return self.engine.vocab.tokenize(text, add_special=add_special)

    def piece(self, token: int) -> bytes:
        """A token's bytes as detokenizing writes them, a special token's text included."""
        return self.engine.vocab.piece(token, special=True)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Token ids as text: their pieces joined, special tokens' too (llama-server's /detokenize)."""
        return b"".join(self.piece(t) for t in tokens).decode(errors="replace")

    def marker_texts(self) -> tuple[str, str]:
        """The BOS and EOS tokens' text ("" where the vocabulary has none), as llama-server's /props tells them."""
        v = self.engine.vocab
        bos, eos = (self.piece(t).decode(errors="replace") if t >= 0 else "" for t in (v.bos, v.eos))
        return bos, eos

    def check_embedding(self, inputs: Sequence[Sequence[int]], normalize: int, name: str = "input") -> None:
        """ConfigError when `embed` would refuse these token lists (named `name`[i]) or `normalize`."""
        embedding.check(self.engine, inputs, normalize, name)

    @property
    def embedding_facts(self) -> EmbeddingFacts | None:
        """How `embed` computes (pooling, vector size, tokens per input at most); None: loaded without them."""
        return self.engine.embedding_facts()

    @property
    def n_vocab(self) -> int:
        return self.engine.vocab.n_tokens

    @property
    def holds_every_expert(self) -> bool:
        """Every expert is in memory for good (no reads to share among requests: bmoe.server.scheduler)."""
        return self.engine.holds_every_expert

    @property
    def settings(self) -> Settings:
        """What it was loaded with: its file, the sampler's defaults, the context (bmoe-server's Ollama facts)."""
        return self.engine.settings
