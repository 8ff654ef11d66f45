"""`GET /v1/bmoe/events`: a server-sent-events stream of what bmoe is doing, for the chat page's
live panel and any other watcher.

Two kinds of event, each a JSON object (shapes in docs/server.md):

- `generation`, once per finished generation (any client's): the numbers of that answer's `bmoe`
  field (bmoe.api.GenerationStats), plus the flash read rate;
- `snapshot`, at once on connecting, then every `busy_s` while something generates and every
  `idle_s` otherwise: the running generations' figures so far, the queue, the cache's resident
  bytes, budget and the tightest memory limit, and which experts of each layer are resident, all
  read from the one stats object the engine hands out (`Model.stats`).

A watcher holds no scheduler slot and reads nothing the generation loop waits for; it ends when
its client goes (Starlette cancels the stream) or when the server shuts down (`close`, which the
scheduler calls as it closes), so an open panel never holds a shutdown up.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.sse import format_sse_event

from bmoe.api import GenerationStats, Model
from bmoe.base import MiB
from bmoe.server.connections import ClosingStream
from bmoe.server.scheduler import Scheduler

EVENTS = "/v1/bmoe/events"  # the route
BACKLOG = 64  # generation events a slow watcher may fall behind by; older ones are dropped


def flash_mib_s(read_mib: float, io_s: float) -> float:
    """The flash read rate the contract's moe-stream line prints: MiB read over the time spent reading."""
    return read_mib / io_s if io_s > 0 else 0.0


def generation_event(s: GenerationStats) -> dict[str, Any]:
    """A finished generation: the fields of its answer's `bmoe` object, and its flash MiB/s."""
    return {**dataclasses.asdict(s), "flash_mib_s": flash_mib_s(s.read_mib, s.io_s_per_token * s.completion_tokens)}


class Feed:
    """The events of one server: generation events fanned out to every watcher, snapshots per watcher."""

    def __init__(self, model: Model, sched: Scheduler, busy_s: float = 1.0, idle_s: float = 5.0) -> None:
        self.model, self.sched = model, sched
        self.busy_s, self.idle_s = busy_s, idle_s
        self.watchers: set[asyncio.Queue[tuple[str, dict[str, Any]]]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closing: asyncio.Event | None = None
        self.closed = False

    def generation(self, s: GenerationStats) -> None:
        """A generation ended (on the scheduler's thread): tell every watcher."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            event = generation_event(s)
            with contextlib.suppress(RuntimeError):  # the loop closed in between: nobody is watching
                loop.call_soon_threadsafe(self._publish, "generation", event)

    def _publish(self, kind: str, event: dict[str, Any]) -> None:
        for q in self.watchers:
            if q.full():
                q.get_nowait()
            q.put_nowait((kind, event))

    def close(self) -> None:
        """From any thread: end every stream (the server is shutting down); later ones end at once."""
        self.closed = True
        loop, closing = self.loop, self.closing
        if loop is not None and closing is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(closing.set)

    def snapshot(self) -> dict[str, Any]:
        """What bmoe holds and does now (see the module notes)."""
        e = self.model.stats.engine
        running = []
        for job in list(self.sched.active):
            gen = job.gen
            if gen is None or not gen.tally.lines:
                continue
            t = gen.tally.totals()
            running.append({"tokens": t.tokens, "tok_s": t.tokens / t.wall_s if t.wall_s > 0 else 0.0,
                            "mib_per_token": t.per_tok(t.read_bytes / MiB), "cache_hit_pct": gen.tally.hit_pct,
                            "flash_mib_s": flash_mib_s(t.read_bytes / MiB, t.io_s)})
        return {
            "time": time.time(), "model": self.model.name, "generating": len(self.sched.active),
            "waiting": len(self.sched.waiting), "parallel": self.sched.capacity, "running": running,
            "cache": {"streaming": e.streaming, "resident_mib": e.resident_bytes / MiB,
                      "budget_mib": e.budget_bytes / MiB, "full_mib": e.full_bytes / MiB,
                      "holds_every_expert": e.holds_every_expert},
            "memory": {"room_mib": e.memory.bytes / MiB, "limit": e.memory.name,
                       "limit_mib": e.memory.cgroup_limit / MiB if e.memory.cgroup_limit else None},
            "residency": [{"layer": layer, "experts": experts} for layer, experts in e.residency],
        }

    async def route(self) -> ClosingStream:
        """GET /v1/bmoe/events (behind the API key, as every API route)."""
        return ClosingStream(self.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def stream(self) -> AsyncIterator[bytes]:
        """One watcher's events, until its client goes or the server closes."""
        if self.loop is None:
            self.loop, self.closing = asyncio.get_running_loop(), asyncio.Event()
        assert self.closing is not None
        if self.closed:
            self.closing.set()
        q: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue(BACKLOG)
        self.watchers.add(q)
        closing = asyncio.ensure_future(self.closing.wait())
        get: asyncio.Future[tuple[str, dict[str, Any]]] | None = None
        try:
            yield _event("snapshot", self.snapshot())
            sent = time.monotonic()
            check = sent + self.busy_s  # idle, it looks every busy_s and sends every idle_s
            while not closing.done():
                get = asyncio.ensure_future(q.get())
                await asyncio.wait((get, closing), timeout=max(0.0, check - time.monotonic()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    kind, event = get.result()
                    yield _event(kind, event)
                    if kind == "generation":  # what it left: the cache, the queue
                        yield _event("snapshot", self.snapshot())
                        sent = time.monotonic()
                    continue
                get.cancel()
                if closing.done():
                    break
                now = time.monotonic()
                check = now + self.busy_s
                if self.sched.active or self.sched.waiting or now - sent >= self.idle_s:
                    yield _event("snapshot", self.snapshot())
                    sent = now
        finally:
            for task in (get, closing):
                if task is not None:
                    task.cancel()
            self.watchers.discard(q)


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return format_sse_event(event=kind, data_str=json.dumps(data, ensure_ascii=False))
