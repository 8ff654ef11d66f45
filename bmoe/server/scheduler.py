"""Many clients, one engine: a worker thread admits requests into the model's KV sequences
(`--parallel N`, bmoe.generation.request_life.Slot) and decodes them step by step, batched or in turns,
while a bounded queue waits behind (bmoe-server's requests).

Each step either decodes every running request together in one llama.cpp batch (each layer
reads the union of their experts once) or lets the oldest go alone, the others waiting their
turn. Which one pays depends on the regime: when every expert is cached a step is compute-bound
and a batch shares its fixed costs; when decode is flash-bound a batch's union of experts
overflows the cache and reads more per generated token. `Batching` decides from what it
measures (see there). A request is prefilled alone when a sequence frees up for it.

An embeddings request (`EmbedAsk`, bmoe-server --embedding) queues with the generations and takes a
free KV sequence as they do; once admitted its inputs are decoded one after another (bmoe.api's
Model.embed, between the running generations' steps) and it ends with one `Embedded`.

A job's events go to its `deliver` callable, from the worker thread: each Chunk as it comes,
its Position in the queue when that changes (0: it runs), an embeddings job's Embedded, or an
exception that ends it (ConfigError: the request cannot run; ShuttingDown; GenerationFailed: the
engine failed, the scheduler has stopped). No HTTP here: bmoe.server turns events into responses.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bmoe.api import Chunk, GenerationStats, Model, Request
from bmoe.base import Cancelled, ConfigError
from bmoe.generation import Generation, Slot
from bmoe.server.http_errors import GenerationFailed, QueueFull, ShuttingDown

MODES = ("auto", "batch", "turns")


@dataclass(frozen=True)
class Position:
    """How many requests are ahead of a job; 0: it runs."""

    ahead: int


@dataclass(frozen=True)
class EmbedAsk:
    """An embeddings request: its inputs as token ids (each checked to fit one decode) and llama-server's
    embd_normalize."""

    inputs: list[list[int]]
    norm: int


@dataclass(frozen=True)
class Embedded:
    """An embeddings job's answer: per input, its vector (pooled) or its tokens' rows (pooling none)."""

    vectors: list[np.ndarray]


JobEvent = Chunk | Position | Embedded | Exception


class Job:
    """One admitted request, where its events go, and (once it runs) its Generation (with its slot);
    an embeddings job has no Generation; `cancelled` stops it (Driver.decode_alone)."""

    def __init__(self, req: Request | EmbedAsk, deliver: Callable[[JobEvent], None]) -> None:
        self.req = req
        self.deliver = deliver
        self.gen: Generation | None = None
        self.cancelled = False

    @property
    def running(self) -> Generation:
        """Its Generation, once it runs."""
        assert self.gen is not None
        return self.gen


class Batching:
    """Per step with two or more requests running: `batch` them, or take `turns` (the oldest alone).

    `auto` works in phases of `phase` steps in one mode. A phase's cost is the median seconds per
    generated token of its steps, leaving out the first `settle` (they pay for what the other
    mode left in the cache); each mode's cost is a moving average over its phases. Its incumbent is
    `batch` when every expert is cached (nothing to read: compute-bound), `turns` otherwise; the
    first phase tries the other mode, the second the incumbent; from then on it keeps the
    incumbent unless the other is cheaper by `margin`, and tries the other for one phase after
    every `explore_every` phases, so a regime change (a budget that adapts, other prompts, more
    requests) is noticed.
    """

    def __init__(self, mode: str, all_cached: Callable[[], bool], phase: int = 16, settle: int = 2,
                 explore_every: int = 8, margin: float = 0.05, weight: float = 0.5) -> None:
        if mode not in MODES:
            raise ConfigError(f"--batching {mode!r}: choose one of {', '.join(MODES)}")
        self.mode = mode
        self.all_cached = all_cached
        self.phase, self.settle, self.explore_every = phase, settle, explore_every
        self.margin, self.weight = margin, weight
        self.cost: dict[str, float | None] = {"batch": None, "turns": None}
        self.steps = {"batch": 0, "turns": 0}  # steps taken with two or more running
        self.incumbent: str | None = None
        self.current = ""
        self.left = 0  # steps left in the current phase
        self.since = 0  # phases since the other mode was last tried
        self.sample: list[float] = []
        self.seen = 0  # steps of the current phase recorded so far

    def best(self) -> str:
        """The mode to stay with: the incumbent unless the other is cheaper by the margin."""
        if self.incumbent is None:
            self.incumbent = "batch" if self.all_cached() else "turns"
        other = _other(self.incumbent)
        mine, theirs = self.cost[self.incumbent], self.cost[other]
        if mine is not None and theirs is not None and theirs < mine * (1 - self.margin):
            self.incumbent = other
        return self.incumbent

    def choose(self) -> str:
        if self.mode != "auto":
            return self.mode
        if self.left <= 0:
            self._next_phase()
        self.left -= 1
        return self.current

    def _next_phase(self) -> None:
        if self.sample:
            per = statistics.median(self.sample)
            old = self.cost[self.current]
            self.cost[self.current] = per if old is None else old + self.weight * (per - old)
        self.sample, self.seen = [], 0
        best = self.best()
        other = _other(best)
        if self.cost[other] is None or self.since >= self.explore_every:
            self.current, self.since = other, 0
        else:
            self.current, self.since = best, self.since + 1
        self.left = self.phase

    def record(self, mode: str, tokens: int, wall_s: float) -> None:
        """A step of `mode` generated `tokens` in `wall_s`."""
        self.steps[mode] += 1
        if mode != self.current or tokens < 1:
            return
        self.seen += 1
        if self.seen > self.settle:
            self.sample.append(wall_s / tokens)


def _other(mode: str) -> str:
    return "turns" if mode == "batch" else "batch"


class Scheduler:
    """Runs admitted jobs on a worker thread, up to one per KV sequence of the model at once;
    up to `size` more wait in the queue.

    `on_fatal` hears of an engine failure (after which the scheduler is closed), `on_generation`
    of each generation's stats (before its client hears it ended), both on the worker thread;
    `on_close` of every `close`, on the thread that closes it; `on_idle`, every half second with nothing
    queued or running, on the worker thread (by default an adaptive cache budget follows the room;
    bmoe.server.sleep's Sleep.idle also puts the model to sleep).
    """

    def __init__(self, model: Model, size: int, on_fatal: Callable[[BaseException], None],
                 on_generation: Callable[[GenerationStats], None] = lambda s: None,
                 reload_fix: str = "restart to load it again", batching: str = "auto") -> None:
        self.model = model
        self.size = size
        self.on_fatal = on_fatal
        self.on_generation = on_generation
        self.on_close: Callable[[], None] = lambda: None
        self.on_idle: Callable[[], None] = model.follow_memory
        self.reload_fix = reload_fix
        self.batching = Batching(batching, self._all_cached)
        self.cond = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []  # admitted and prefilled (or being prefilled), oldest first
        self.prefills = 0  # requests prefilled, and embeddings inputs decoded (one decode each)
        self.embedded_tokens, self.embedded_s = 0, 0.0  # embeddings inputs' tokens decoded, and their time
        self.decodes = 0  # decode steps run (one llama.cpp batch each)
        self.decoding = 0  # the sequences those steps decoded, together
        self.closed = False
        self.thread = threading.Thread(target=self._work, name="bmoe-generate", daemon=True)

    @property
    def capacity(self) -> int:
        return len(self.model.slots)

    def _all_cached(self) -> bool:
        return self.model.holds_every_expert

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> int:
        """Queue `job`; returns how many requests are ahead of it. QueueFull or ShuttingDown otherwise."""
        with self.cond:
            if self.closed:
                raise ShuttingDown()
            ahead = len(self.waiting) + len(self.active)
            if ahead >= self.capacity + self.size:
                raise QueueFull(ahead, self.size)
            self.waiting.append(job)
            self.cond.notify()
            return ahead if ahead >= self.capacity else 0

    def cancel(self, job: Job) -> None:
        """The client is gone: take `job` out of the queue, or end its generation (mid-prefill at
        once, mid-decode after the step in flight unless it decodes alone)."""
        with self.cond:
            if job in self.waiting:
                self.waiting.remove(job)
                self._positions()
                return
        job.cancelled = True
        if job.gen is not None:
            self.model.driver.cancel(job.gen)
        else:  # an embeddings job: its decode in flight stops too
            self.model.driver.interrupt_alone()

    def close(self) -> None:
        """Stop: what waits ends with ShuttingDown, what runs is cancelled; idempotent."""
        with self.cond:
            self.closed = True
            for job in self.waiting:
                job.deliver(ShuttingDown())
            self.waiting.clear()
            running = [job.gen for job in self.active if job.gen is not None]
            for job in self.active:
                job.cancelled = True
            self.cond.notify_all()
        for gen in running:
            self.model.driver.cancel(gen)
        self.model.driver.interrupt_alone()
        self.on_close()

    def join(self) -> None:
        if self.thread.is_alive():
            self.thread.join()

    def _positions(self) -> None:
        base = len(self.active)
        for i, job in enumerate(self.waiting):
            job.deliver(Position(base + i))

    def _work(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException as e:  # noqa: BLE001 - a lane or the model file failed: stop serving
            with self.cond:
                jobs, self.active = self.active, []
            for job in jobs:
                if job.gen is not None and not job.gen.finished:
                    try:
                        job.gen.finish(e)  # rolls its KV back, then raises e again
                    except BaseException:  # noqa: BLE001, S110 - e is what every job hears
                        pass
                job.deliver(GenerationFailed(f"{type(e).__name__}: {e}"))
            self.on_fatal(e)
            self.close()

    def _turn(self) -> bool:
        """Admit what fits, prefill it, then one decode step; False once closed and drained."""
        with self.cond:
            idle = not self.cond.wait_for(lambda: self.waiting or self.active or self.closed, timeout=0.5)
        if idle:  # outside the lock: a sleep takes a while, and submits must not wait for it
            self.on_idle()
            return True
        with self.cond:
            if self.closed and not self.active:
                return False
            admitted: list[tuple[Job, Slot]] = []
            while self.waiting and not self.closed and (slot := self._slot_for(self.waiting[0].req)):
                job = self.waiting.popleft()
                slot.busy = True  # taken now: the next slot_for must not offer it again
                if isinstance(job.req, Request):
                    job.gen = self.model.generation(job.req, self._delivering(job), slot)
                admitted.append((job, slot))
                self.active.append(job)
                job.deliver(Position(0))
            if admitted:
                self._positions()
        for job, slot in admitted:
            if isinstance(job.req, EmbedAsk):
                self._embed(job, job.req, slot)
            else:
                self._begin(job)
        if any(job.gen is not None for job in self.active):
            self._step()
        return True

    def _slot_for(self, req: Request | EmbedAsk) -> Slot | None:
        """A free slot: a generation's (Model.slot_for); for embeddings, which empty the KV sequence they use, the
        least recently used of those that hold no conversation, else of all."""
        if isinstance(req, Request):
            return self.model.slot_for(req)
        return min((s for s in self.model.slots if not s.busy), key=lambda s: (bool(s.kv_tokens), s.used), default=None)

    def _embed(self, job: Job, ask: EmbedAsk, slot: Slot) -> None:
        """An embeddings job, whole, on `slot`: its answer, or why it cannot run (ConfigError); a job cancelled
        (its client left, a shutdown) stops mid-decode (`cancel`, `close`: Driver.interrupt_alone)."""
        try:
            self.model.check_unchanged(self.reload_fix)
            t0 = time.perf_counter()
            vectors = self.model.embed(ask.inputs, ask.norm, slot, lambda: job.cancelled)
        except Cancelled:
            job.deliver(ShuttingDown())  # a client that left hears nothing; a shutdown is why the others end
        except ConfigError as e:
            job.deliver(e)
        else:  # counted before the client hears of it, as a generation's end is
            self.prefills += len(ask.inputs)
            self.embedded_tokens += sum(len(tokens) for tokens in ask.inputs)
            self.embedded_s += time.perf_counter() - t0
            job.deliver(Embedded(vectors))
        finally:
            slot.busy = False
            self._drop(job)

    def _delivering(self, job: Job) -> Callable[[Chunk], None]:
        """`job`'s chunks to its client, a generation's end counted (on_generation) before the client hears
        of it: a scrape of /metrics after an answer counts that answer."""
        def deliver(chunk: Chunk) -> None:
            if chunk.stats is not None:
                self.on_generation(chunk.stats)
            job.deliver(chunk)
        return deliver

    def _begin(self, job: Job) -> None:
        """Prefill `job`; a request that cannot run hears why (ConfigError) and the rest go on."""
        try:
            self.model.check_unchanged(self.reload_fix)
            done = self.model.driver.begin(job.running)
        except ConfigError as e:  # checked at admission; the request's all the same
            job.running.slot.busy = False
            self._drop(job)
            job.deliver(e)
            return
        self.prefills += 1
        if done is not None:  # cancelled during its prefill
            self._drop(job)

    def _step(self) -> None:
        jobs = [j for j in self.active if j.gen is not None]
        mode = self.batching.choose() if len(jobs) > 1 else "turns"
        if mode == "turns":
            jobs = jobs[:1]
        t0 = time.perf_counter()
        before = sum(len(j.running.ids) for j in jobs)
        ended = self.model.driver.step([j.running for j in jobs])
        self.decodes += 1
        self.decoding += len(jobs)
        if len(self.active) > 1:
            self.batching.record(mode, sum(len(j.running.ids) for j in jobs) - before, time.perf_counter() - t0)
        of = {id(j.gen): j for j in jobs}
        for gen, _ in ended:
            self._drop(of[id(gen)])

    def _drop(self, job: Job) -> None:
        with self.cond:
            if job in self.active:
                self.active.remove(job)
                self._positions()
