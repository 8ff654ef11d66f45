"""The one answer loop of every generation route (bmoe.server.app's, llama-server's native ones): a request's
jobs queued, answered whole once they end or streamed as they go, in an API's shapes (bmoe.server.answer_shape).

A request is one job, or several (`Choices`): OpenAI's and llama-server's `n` (each choice its own generation,
its seed the request's plus its index, as llama-server seeds its copies) and several prompts in one completions
request. Each job's answer is its own shape's (its choice's index in it); the API's `Join` makes one answer of
them: llama-server's native answer a list, OpenAI's one object with every choice. Streamed, each job's events
go out as they come, interleaved, each in its own shape; the stream is closed once, after the last. A shape's end
(streamed or whole) is made off the event loop: the Responses API's keeps the answer in its store there, which in
a shared store can wait seconds for another replica's write, and must be done before its last event goes out (a
client that goes on from the answer at once finds it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from bmoe.api import Chunk, GenerationStats, Request
from bmoe.server.answer_shape import AnswerShape, Finished
from bmoe.server.connections import ClosingStream
from bmoe.server.http_errors import ServeError, serve_error, shutting_down
from bmoe.server.job_events import Tagged, answered, enqueue
from bmoe.server.scheduler import Job, Position, Scheduler


class Join(Protocol):
    """How the answers of several jobs make one answer in an API's shapes."""

    def whole(self, parts: list[dict[str, Any]]) -> Any:
        """The whole answer of every job's (in index order)."""

    def close(self, first: AnswerShape, stats: Sequence[GenerationStats]) -> bytes:
        """A stream's end, after every job ended (`first`: the first job's shape)."""


class Listed:
    """llama-server's native answer: one job's object, or a list of them (and any API's single answer)."""

    def whole(self, parts: list[dict[str, Any]]) -> Any:
        return parts[0] if len(parts) == 1 else parts

    def close(self, first: AnswerShape, stats: Sequence[GenerationStats]) -> bytes:
        return first.close()


LISTED = Listed()


@dataclass(frozen=True)
class Choices:
    """What one HTTP request asks the engine for: each job's Request and AnswerShape, in index order, and how
    their answers make one (`join`)."""

    reqs: Sequence[Request]
    shapes: Sequence[AnswerShape]
    join: Join = LISTED


def choice_requests(req: Request, n: int) -> list[Request]:
    """`n` choices of `req`: the first is `req`, choice i is `req` seeded with its seed plus i (as llama-server seeds
    its copies of a task, on 32 bits), so each is what plain llama.cpp gives for the prompt with that seed; only the
    first keeps a KV sequence it asked for (llama-server's copies take any slot). Choices decoded in one batch
    (`--parallel`) are that batch's, as any requests decoded together are."""
    return [req] + [replace(req, sampler=replace(req.sampler, seed=(req.sampler.seed + i) & 0xFFFFFFFF), slot=None)
                    for i in range(1, n)]


class AnswerLoop:
    """Queues a request's jobs on `sched` and answers them."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched

    async def answer(self, request: HttpRequest, choices: Choices, stream: bool, param: str = "n") -> Response:
        """Queue the jobs and answer them: streamed, or whole once every one ends (`param`: the field that asks for
        several, named when there are more than the server can hold)."""
        jobs, events, ahead = enqueue(self.sched, choices.reqs, param)
        headers = {"X-Queue-Position": str(ahead)}
        if stream:
            return ClosingStream(self.stream(jobs, events, choices, ahead), media_type=choices.shapes[0].media_type,
                                 headers=headers)
        done = await self.whole(request, jobs, events, choices.reqs, ahead)
        answer = await asyncio.to_thread(lambda: choices.join.whole([s.whole(f) for s, f in zip(choices.shapes, done)]))
        return JSONResponse(answer, headers=headers)

    async def whole(self, request: HttpRequest, jobs: Sequence[Job], events: asyncio.Queue[Tagged],
                    reqs: Sequence[Request], ahead: int) -> list[Finished]:
        """Every job's whole answer: its text, stats, the stop string that ended it (if one did), every chunk."""
        chunks: list[list[Chunk]] = [[] for _ in jobs]
        done: list[Finished | None] = [None] * len(jobs)

        def took(i: int, item: object) -> list[Finished] | None:
            if not isinstance(item, Chunk):
                return None
            chunks[i].append(item)
            if item.stats is not None:
                text = "".join(c.text for c in chunks[i])
                done[i] = Finished(reqs[i], text, _ended(item.stats), item.stop, chunks[i], ahead)
            return [d for d in done if d is not None] if all(d is not None for d in done) else None

        return await answered(request, self.sched, jobs, events, took)

    async def stream(self, jobs: Sequence[Job], events: asyncio.Queue[Tagged], choices: Choices, ahead: int
                     ) -> AsyncIterator[bytes]:
        """The jobs' events in their shapes as they come, a chat answer read as it comes (reasoning, content, tool
        calls); queue positions are the first job's. A failure ends the stream; a client that leaves cancels
        every job."""
        shapes = choices.shapes
        readers = [r.reading.parser() if r.reading is not None else None for r in choices.reqs]
        ended: list[GenerationStats | None] = [None] * len(jobs)
        first = shapes[0]
        try:
            if ahead and (out := first.comment(f"queue position {ahead}")):
                yield out
            for shape in shapes:
                if out := shape.start():
                    yield out
            while any(s is None for s in ended):
                i, item = await events.get()
                shape, reader = shapes[i], readers[i]
                if isinstance(item, Position):
                    text = f"queue position {item.ahead}" if item.ahead else "running"
                    if i == 0 and (out := shape.comment(text)):
                        yield out
                    continue
                if isinstance(item, Exception):
                    yield shape.error(serve_error(item))
                    break
                assert isinstance(item, Chunk)
                if item.progress is not None:
                    if out := shape.progress(item):
                        yield out
                    continue
                if item.stats is None:  # a token
                    if out := shape.token(item, reader.push(item.text) if reader is not None else None):
                        yield out
                    continue
                if reader is not None and (out := shape.finish(reader.finish())):
                    yield out
                try:
                    ended[i] = stats = _ended(item.stats)
                    yield await asyncio.to_thread(shape.end, stats, item.stop, ahead)
                except ServeError as e:
                    yield shape.error(e)
                    break
            done = [s for s in ended if s is not None]
            if out := (choices.join.close(first, done) if len(done) == len(jobs) else first.close()):
                yield out
        finally:
            for job in jobs:
                self.sched.cancel(job)  # the client left mid-stream (nothing happens to a job that ended)


def _ended(s: GenerationStats) -> GenerationStats:
    if s.finish_reason == "cancelled":  # only a shutdown cancels a request whose client is there
        raise shutting_down()
    return s
