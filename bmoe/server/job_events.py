"""A job's way through the scheduler as the event loop sees it: submitted with a queue its events arrive on
(`enqueue`), and awaited until it answers or its client leaves (`answered`). The generation routes' whole
answers and the embeddings routes take this one path."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request as HttpRequest

from bmoe.api import Request
from bmoe.server.http_errors import QueueFull, ServeError, ShuttingDown, serve_error
from bmoe.server.scheduler import EmbedAsk, Job, JobEvent, Scheduler

_T = TypeVar("_T")


def enqueue(sched: Scheduler, req: Request | EmbedAsk) -> tuple[Job, asyncio.Queue[JobEvent], int]:
    """`req` submitted as a job: the job, the queue its events arrive on (from the scheduler's thread), and
    the requests ahead; a full queue or a shutdown as its ServeError."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[JobEvent] = asyncio.Queue()

    def deliver(item: JobEvent) -> None:  # on the scheduler's thread
        loop.call_soon_threadsafe(events.put_nowait, item)

    job = Job(req, deliver)
    try:
        return job, events, sched.submit(job)
    except (QueueFull, ShuttingDown) as e:
        raise serve_error(e) from None


async def answered(request: HttpRequest, sched: Scheduler, job: Job, events: asyncio.Queue[JobEvent],
                   took: Callable[[JobEvent], _T | None]) -> _T:
    """`job`'s events handed to `took` until it returns its answer; a failure as its ServeError, and a client
    that leaves cancels the job (a 499)."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            get = asyncio.ensure_future(events.get())
            await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                sched.cancel(job)
                raise ServeError(499, "the client closed the connection", code="client_gone")
            item = get.result()
            if isinstance(item, Exception):
                raise serve_error(item)
            if (answer := took(item)) is not None:
                return answer
    finally:
        gone.cancel()


async def _disconnected(request: HttpRequest) -> None:
    """Returns when the client has gone (the body is read: nothing else comes before that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
